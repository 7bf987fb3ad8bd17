#include "text/jinja/lexer.h"

#include <charconv>
#include <cstdio>
#include <stdexcept>
#include <tuple>

#include "core/error.h"
#include "text/jinja/unicode.h"
#include "text/jinja/value.h"

namespace kvlm::jinja {

std::string normalize_template_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

uint32_t parse_hex(std::string_view s) {
  uint32_t v = 0;
  for (char c : s) v = v * 16 + static_cast<uint32_t>(is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
  return v;
}

}  // namespace

std::string decode_string_literal(std::string_view body) {
  std::string out;
  out.reserve(body.size());
  for (size_t i = 0; i < body.size();) {
    if (body[i] != '\\' || i + 1 >= body.size()) {
      out.push_back(body[i++]);
      continue;
    }
    const char c = body[i + 1];
    i += 2;
    switch (c) {
      case '\n': break;
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'v': out.push_back('\v'); break;
      case 'x':
      case 'u':
      case 'U': {
        const size_t n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        if (i + n > body.size()) throw std::runtime_error(std::string("truncated \\") + c + " escape");
        for (size_t k = 0; k < n; ++k)
          if (!is_hex(body[i + k])) throw std::runtime_error(std::string("truncated \\") + c + " escape");
        const uint32_t cp = parse_hex(body.substr(i, n));
        if (cp > 0x10FFFF) throw std::runtime_error("illegal Unicode character in \\U escape");
        unicode::append(out, cp);
        i += n;
        break;
      }
      case 'N': throw std::runtime_error("\\N{...} escapes are not supported");
      default:
        if (c >= '0' && c <= '7') {
          uint32_t cp = static_cast<uint32_t>(c - '0');
          for (int k = 0; k < 2 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++k)
            cp = cp * 8 + static_cast<uint32_t>(body[i++] - '0');
          unicode::append(out, cp);
        } else if (static_cast<unsigned char>(c) >= 0x80) {
          // jinja2 first turns non-ASCII characters into backslash escapes, so a backslash
          // before one reads as an escaped backslash followed by the escape's letters.
          size_t j = i - 1;
          const char32_t cp = unicode::decode(body, j);
          i = j;
          char buf[16];
          if (cp < 0x100) std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(cp));
          else if (cp < 0x10000) std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
          else std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(cp));
          out += buf;
        } else {
          out.push_back('\\');
          out.push_back(c);
        }
    }
  }
  return out;
}

std::string describe(const Token& t) {
  switch (t.type) {
    case Tok::Data: return "template text";
    case Tok::VarBegin: return "'{{'";
    case Tok::VarEnd: return "'}}'";
    case Tok::BlockBegin: return "'{%'";
    case Tok::BlockEnd: return "'%}'";
    case Tok::Name: return "'" + t.text + "'";
    case Tok::String: return "string " + py_str_repr(t.text);
    case Tok::Integer: return "integer " + std::to_string(t.ival);
    case Tok::Float: return "number";
    case Tok::Op: return "'" + t.text + "'";
    case Tok::Eof: return "end of template";
  }
  return "token";
}

namespace {

class Lexer {
 public:
  Lexer(std::string_view src, const std::string& name) : s_(src), name_(name) {}

  std::vector<Token> run() {
    const size_t n = s_.size();
    while (pos_ < n) {
      const size_t p = find_tag(pos_);
      if (p == std::string_view::npos) {
        emit_data(s_.substr(pos_), pos_);
        pos_ = n;
        break;
      }
      const char kind = s_[p + 1];
      const char sign = (p + 2 < n && (s_[p + 2] == '-' || s_[p + 2] == '+')) ? s_[p + 2] : 0;
      size_t raw_end = 0;
      const bool raw = kind == '%' && match_raw_begin(p, &raw_end);
      emit_data(strip(s_.substr(pos_, p - pos_), sign, kind != '{'), pos_);
      if (raw) {
        lex_raw(p, raw_end);
      } else if (kind == '#') {
        lex_comment(p, p + 2 + (sign ? 1 : 0));
      } else {
        push(kind == '%' ? Tok::BlockBegin : Tok::VarBegin, p);
        pos_ = p + 2 + (sign ? 1 : 0);
        lex_tag(kind == '%');
      }
    }
    push(Tok::Eof, n);
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(size_t p, const std::string& msg) {
    const auto [line, col] = locate(p);
    throw Error(name_ + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + msg);
  }

  // line and column (in code points, 1-based) of byte offset p; p never decreases.
  std::pair<int, int> locate(size_t p) {
    if (p < scan_) scan_ = 0, line_ = 1, line_start_ = 0;
    for (; scan_ < p && scan_ < s_.size(); ++scan_) {
      if (s_[scan_] == '\n') {
        ++line_;
        line_start_ = scan_ + 1;
      }
    }
    int col = 1;
    for (size_t i = line_start_; i < p && i < s_.size(); ++i)
      if ((static_cast<unsigned char>(s_[i]) & 0xC0) != 0x80) ++col;
    return {line_, col};
  }

  Token& push(Tok type, size_t p, std::string text = {}) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    std::tie(t.line, t.col) = locate(p);
    out_.push_back(std::move(t));
    return out_.back();
  }

  void emit_data(std::string_view text, size_t p) {
    if (!text.empty()) push(Tok::Data, p, std::string(text));
  }

  size_t find_tag(size_t from) const {
    for (size_t p = s_.find('{', from); p != std::string_view::npos; p = s_.find('{', p + 1))
      if (p + 1 < s_.size() && (s_[p + 1] == '{' || s_[p + 1] == '%' || s_[p + 1] == '#')) return p;
    return std::string_view::npos;
  }

  bool starts(size_t p, std::string_view what) const { return s_.substr(p, what.size()) == what; }

  size_t skip_space(size_t p) const {
    while (p < s_.size()) {
      size_t q = p;
      if (!unicode::is_space(unicode::decode(s_, q))) break;
      p = q;
    }
    return p;
  }

  bool ends_line(size_t end) const { return end > 0 && s_[end - 1] == '\n'; }

  // The text before a tag, after whitespace control: "-" strips all whitespace before the
  // tag; otherwise lstrip_blocks strips the spaces that alone precede a block or comment
  // tag on its line.
  std::string_view strip(std::string_view text, char sign, bool lstrip_applies) const {
    if (sign == '-') {
      size_t end = 0;
      for (size_t i = 0; i < text.size();) {
        const char32_t c = unicode::decode(text, i);
        if (!unicode::is_space(c)) end = i;
      }
      return text.substr(0, end);
    }
    if (sign == '+' || !lstrip_applies) return text;
    const size_t nl = text.rfind('\n');
    const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting_) return text;
    if (l_pos == text.size()) return text;
    for (size_t i = l_pos; i < text.size();)
      if (!unicode::is_space(unicode::decode(text, i))) return text;
    return text.substr(0, l_pos);
  }

  // {% raw %} / {%- raw -%}: "{%" [-+]? \s* "raw" \s* ("-%}" \s* | "%}")
  bool match_raw_begin(size_t p, size_t* end) const {
    size_t q = p + 2;
    if (q < s_.size() && (s_[q] == '-' || s_[q] == '+')) ++q;
    q = skip_space(q);
    if (!starts(q, "raw")) return false;
    q = skip_space(q + 3);
    if (starts(q, "-%}")) q = skip_space(q + 3);
    else if (starts(q, "%}")) q += 2;
    else return false;
    *end = q;
    return true;
  }

  void lex_raw(size_t begin, size_t content_start) {
    line_starting_ = ends_line(content_start);
    for (size_t q = s_.find("{%", content_start); q != std::string_view::npos; q = s_.find("{%", q + 1)) {
      size_t r = q + 2;
      const char sign = (r < s_.size() && (s_[r] == '-' || s_[r] == '+')) ? s_[r] : 0;
      if (sign) ++r;
      r = skip_space(r);
      if (!starts(r, "endraw")) continue;
      r = skip_space(r + 6);
      if (starts(r, "+%}")) r += 3;
      else if (starts(r, "-%}")) r = skip_space(r + 3);
      else if (starts(r, "%}")) r += (r + 2 < s_.size() && s_[r + 2] == '\n') ? 3 : 2;
      else continue;
      emit_data(strip(s_.substr(content_start, q - content_start), sign, true), content_start);
      pos_ = r;
      line_starting_ = ends_line(r);
      return;
    }
    if (content_start >= s_.size()) {
      pos_ = s_.size();
      return;
    }
    fail(begin, "missing {% endraw %} for this {% raw %}");
  }

  void lex_comment(size_t begin, size_t from) {
    for (size_t q = from; q < s_.size(); ++q) {
      size_t end = 0;
      if ((s_[q] == '-' || s_[q] == '+') && starts(q + 1, "#}")) {
        end = s_[q] == '-' ? skip_space(q + 3) : q + 3;
      } else if (starts(q, "#}")) {
        end = q + 2;
        if (end < s_.size() && s_[end] == '\n') ++end;  // trim_blocks
      } else {
        continue;
      }
      pos_ = end;
      line_starting_ = ends_line(end);
      return;
    }
    if (from >= s_.size()) {  // jinja2 quietly ends a template that ends with the opener
      pos_ = s_.size();
      return;
    }
    fail(begin, "missing end of comment tag '#}'");
  }

  void lex_tag(bool block) {
    std::vector<char> balance;
    const size_t n = s_.size();
    while (pos_ < n) {
      if (balance.empty()) {
        size_t end = 0;
        if (block && starts(pos_, "+%}")) end = pos_ + 3;
        else if (block && starts(pos_, "-%}")) end = skip_space(pos_ + 3);
        else if (block && starts(pos_, "%}")) end = pos_ + 2 + ((pos_ + 2 < n && s_[pos_ + 2] == '\n') ? 1 : 0);
        else if (!block && starts(pos_, "-}}")) end = skip_space(pos_ + 3);
        else if (!block && starts(pos_, "}}")) end = pos_ + 2;
        if (end) {
          push(block ? Tok::BlockEnd : Tok::VarEnd, pos_);
          pos_ = end;
          line_starting_ = ends_line(end);
          return;
        }
      }
      const char c = s_[pos_];
      if (const size_t after = skip_space(pos_); after != pos_) {
        pos_ = after;
      } else if (is_digit(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t q = pos_;
        while (q < n && is_name_char(s_[q])) ++q;
        push(Tok::Name, pos_, std::string(s_.substr(pos_, q - pos_)));
        pos_ = q;
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        lex_operator(balance);
      }
    }
  }

  // (\d+_)*\d+ starting at q; returns the end or npos when no digit is there.
  size_t digits(size_t q) const {
    if (q >= s_.size() || !is_digit(s_[q])) return std::string_view::npos;
    while (q < s_.size()) {
      if (is_digit(s_[q])) ++q;
      else if (s_[q] == '_' && q + 1 < s_.size() && is_digit(s_[q + 1])) ++q;
      else break;
    }
    return q;
  }

  size_t exponent(size_t q) const {  // e[+-]?digits
    if (q >= s_.size() || (s_[q] != 'e' && s_[q] != 'E')) return std::string_view::npos;
    ++q;
    if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
    return digits(q);
  }

  void lex_number() {
    constexpr size_t npos = std::string_view::npos;
    const size_t start = pos_;
    const size_t int_end = digits(start);
    size_t float_end = npos;
    if (start == 0 || s_[start - 1] != '.') {
      const size_t frac_end = (int_end < s_.size() && s_[int_end] == '.') ? digits(int_end + 1) : npos;
      if (frac_end != npos && exponent(frac_end) != npos) float_end = exponent(frac_end);
      else if (exponent(int_end) != npos) float_end = exponent(int_end);
      else float_end = frac_end;
    }
    auto clean = [&](size_t end) {
      std::string t;
      for (size_t i = start; i < end; ++i)
        if (s_[i] != '_') t.push_back(s_[i]);
      return t;
    };
    if (float_end != npos) {
      const std::string t = clean(float_end);
      double v = 0;
      std::from_chars(t.data(), t.data() + t.size(), v);
      push(Tok::Float, start).fval = v;
      pos_ = float_end;
      return;
    }
    int base = 10;
    size_t q = start;
    if (s_[start] == '0' && start + 1 < s_.size()) {
      const char p = static_cast<char>(s_[start + 1] | 0x20);
      base = p == 'b' ? 2 : p == 'o' ? 8 : p == 'x' ? 16 : 10;
    }
    auto ok = [&](char c) { return base == 2 ? (c == '0' || c == '1') : base == 8 ? (c >= '0' && c <= '7') : is_hex(c); };
    std::string t;
    if (base != 10) {
      q = start + 2;
      while (q < s_.size()) {
        if (ok(s_[q])) t.push_back(s_[q++]);
        else if (s_[q] == '_' && q + 1 < s_.size() && ok(s_[q + 1])) ++q;
        else break;
      }
      if (t.empty()) base = 10, q = start;
    }
    if (base == 10) {
      const bool zero = s_[start] == '0';
      q = start;
      t.clear();
      while (q < s_.size()) {
        const bool digit_ok = zero ? s_[q] == '0' : is_digit(s_[q]);
        if (digit_ok) t.push_back(s_[q++]);
        else if (s_[q] == '_' && q + 1 < s_.size() && (zero ? s_[q + 1] == '0' : is_digit(s_[q + 1]))) ++q;
        else break;
      }
    }
    int64_t v = 0;
    const auto res = std::from_chars(t.data(), t.data() + t.size(), v, base);
    if (res.ec != std::errc()) fail(start, "integer literal " + std::string(s_.substr(start, q - start)) + " is too large (kvlm integers are 64-bit)");
    push(Tok::Integer, start).ival = v;
    pos_ = q;
  }

  void lex_string(char quote) {
    const size_t start = pos_;
    size_t q = start + 1;
    while (q < s_.size() && s_[q] != quote) q += s_[q] == '\\' ? 2 : 1;
    if (q >= s_.size()) fail(start, "unterminated string literal");
    std::string value;
    try {
      value = decode_string_literal(s_.substr(start + 1, q - start - 1));
    } catch (const std::runtime_error& e) {
      fail(start, std::string("bad escape in string literal: ") + e.what());
    }
    push(Tok::String, start, std::move(value));
    pos_ = q + 1;
  }

  void lex_operator(std::vector<char>& balance) {
    static constexpr std::string_view two[] = {"//", "**", "==", "!=", ">=", "<="};
    for (std::string_view op : two) {
      if (starts(pos_, op)) {
        push(Tok::Op, pos_, std::string(op));
        pos_ += 2;
        return;
      }
    }
    const char c = s_[pos_];
    if (std::string_view("+-/*%~[](){}<>=.:|,;").find(c) == std::string_view::npos) {
      size_t q = pos_;
      std::string ch;
      unicode::append(ch, unicode::decode(s_, q));
      fail(pos_, "unexpected character " + py_str_repr(ch));
    }
    if (c == '{' || c == '(' || c == '[') {
      balance.push_back(c == '{' ? '}' : c == '(' ? ')' : ']');
    } else if (c == '}' || c == ')' || c == ']') {
      if (balance.empty()) fail(pos_, std::string("unexpected '") + c + "'");
      if (balance.back() != c) fail(pos_, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    push(Tok::Op, pos_, std::string(1, c));
    ++pos_;
  }

  std::string_view s_;
  const std::string& name_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  size_t scan_ = 0, line_start_ = 0;
  int line_ = 1;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const std::string& name) { return Lexer(source, name).run(); }

}  // namespace kvlm::jinja
