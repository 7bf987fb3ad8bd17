#include "text/grammar/regex.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm::grammar {

namespace {

// Characters a JSON string must escape: '"', '\' and the controls.
const std::vector<CharRange> kJsonEscaped = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};

// [lo, hi] minus the ranges in `cut` (sorted, disjoint).
std::vector<CharRange> subtract(const std::vector<CharRange>& in, const std::vector<CharRange>& cut) {
  std::vector<CharRange> out;
  for (CharRange r : in) {
    uint32_t lo = r.lo;
    bool gone = false;
    for (const CharRange& c : cut) {
      if (c.hi < lo || c.lo > r.hi) continue;
      if (c.lo > lo) out.push_back({lo, c.lo - 1});
      if (c.hi >= r.hi) {
        gone = true;
        break;
      }
      lo = c.hi + 1;
    }
    if (!gone) out.push_back({lo, r.hi});
  }
  return out;
}

class RegexParser {
 public:
  RegexParser(Grammar& g, std::string_view p, std::string_view name, bool json)
      : g_(g), p_(p), name_(name), json_(json) {}

  uint32_t parse() {
    if (pos_ < p_.size() && p_[pos_] == '^') ++pos_;
    std::vector<Sequence> alts = alternation();
    if (pos_ < p_.size()) fail(p_[pos_] == ')' ? "an unmatched ')'" : "an unexpected character");
    const uint32_t r = g_.add_rule(name_);
    for (Sequence& a : alts) g_.add_alt(r, std::move(a));
    return r;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    // The pattern is the client's: quoted whole only when short.
    const std::string shown = p_.size() <= 200 ? std::string(p_) : std::string(p_.substr(0, 200)) + "...";
    throw Error("regex '" + shown + "' at position " + std::to_string(pos_) + ": " + what);
  }

  bool at_end_anchor() const { return pos_ + 1 == p_.size() && p_[pos_] == '$'; }

  std::vector<Sequence> alternation() {
    std::vector<Sequence> alts;
    alts.push_back(concat());
    while (pos_ < p_.size() && p_[pos_] == '|') {
      ++pos_;
      alts.push_back(concat());
    }
    return alts;
  }

  Sequence concat() {
    Sequence seq;
    while (pos_ < p_.size() && p_[pos_] != '|' && p_[pos_] != ')') {
      if (at_end_anchor()) {
        ++pos_;
        break;
      }
      const size_t start = seq.size();
      atom(seq);
      quantifier(seq, start);
    }
    return seq;
  }

  void quantifier(Sequence& seq, size_t start) {
    const Fail f = [this](const std::string& what) { fail(what); };
    while (const auto r = parse_repeat(p_, pos_, 10000, true, f)) {
      if (seq.size() == start) fail("a quantifier with nothing before it");
      if (pos_ < p_.size() && p_[pos_] == '?') ++pos_;  // lazy: the same strings
      else if (pos_ < p_.size() && p_[pos_] == '+') fail("possessive quantifiers are not supported");
      Sequence item(seq.begin() + long(start), seq.end());
      seq.resize(start);
      g_.append_repeat(seq, item, r->min, r->max, name_);
    }
  }

  // A code point as it is written in the output.
  void literal(Sequence& seq, uint32_t cp) {
    if (json_ && (cp < 0x20 || cp == '"' || cp == '\\')) {
      static const char* hex = "0123456789abcdef";
      std::string esc;
      switch (cp) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\t': esc = "\\t"; break;
        case '\r': esc = "\\r"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default: esc = std::string("\\u00") + hex[cp >> 4] + hex[cp & 15];
      }
      Grammar::append_literal(seq, esc);
      return;
    }
    seq.push_back(Symbol::ch(cp));
  }

  void chars(Sequence& seq, std::vector<CharRange> ranges, bool negated) {
    std::sort(ranges.begin(), ranges.end(), [](const CharRange& a, const CharRange& b) { return a.lo < b.lo; });
    if (json_) {
      if (negated) {
        ranges.insert(ranges.end(), kJsonEscaped.begin(), kJsonEscaped.end());
      } else {
        ranges = subtract(ranges, kJsonEscaped);
        if (ranges.empty()) fail("a character class of characters JSON strings escape; write them as literals");
      }
    }
    seq.push_back(Symbol::chars(std::move(ranges), negated));
  }

  static void class_escape(char e, std::vector<CharRange>& out, bool& negated) {
    negated = e == 'D' || e == 'W' || e == 'S';
    switch (e) {
      case 'd': case 'D': out.push_back({'0', '9'}); break;
      case 'w': case 'W': out.insert(out.end(), {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); break;
      default: out.insert(out.end(), {{'\t', '\r'}, {' ', ' '}}); break;  // s, S
    }
  }

  uint32_t hex(int digits) {
    return parse_hex(p_, pos_, digits, [this](const std::string& what) { fail(what); });
  }

  // The character of a simple escape (pos_ after the backslash), or fail.
  uint32_t escaped_char() {
    const char e = p_[pos_++];
    switch (e) {
      case 'n': return '\n';
      case 't': return '\t';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0': return 0;
      case 'x': return hex(2);
      case 'u': return hex(4);
      default: break;
    }
    if (e == 'b' || e == 'B') fail("word boundaries (\\b, \\B) are not supported");
    if (e >= '1' && e <= '9') fail("backreferences are not supported");
    if (std::isalnum(static_cast<unsigned char>(e))) fail(std::string("unknown escape '\\") + e + "'");
    return uint32_t(static_cast<unsigned char>(e));
  }

  void atom(Sequence& seq) {
    const char c = p_[pos_];
    if (c == '(') {
      if (++depth_ > kMaxNesting) fail("groups nested deeper than " + std::to_string(kMaxNesting) + " levels");
      ++pos_;
      if (pos_ < p_.size() && p_[pos_] == '?') {
        ++pos_;
        if (pos_ < p_.size() && p_[pos_] == ':') {
          ++pos_;
        } else if (pos_ < p_.size() && (p_[pos_] == '<' || p_[pos_] == 'P') && pos_ + 1 < p_.size() && p_[pos_ + 1] != '=' &&
                   p_[pos_ + 1] != '!') {
          // (?<name>...) or (?P<name>...)
          if (p_[pos_] == 'P') ++pos_;
          while (pos_ < p_.size() && p_[pos_] != '>') ++pos_;
          if (pos_ >= p_.size()) fail("an unterminated group name");
          ++pos_;
        } else {
          fail("lookaround and inline flags are not supported");
        }
      }
      std::vector<Sequence> alts = alternation();
      if (pos_ >= p_.size() || p_[pos_] != ')') fail("a '(' without its ')'");
      ++pos_;
      --depth_;
      if (alts.size() == 1) {
        seq.insert(seq.end(), alts[0].begin(), alts[0].end());
        // A quantifier after the group applies to all of it: concat() passes the start.
      } else {
        g_.append_group(seq, std::move(alts), name_);
      }
      return;
    }
    if (c == '[') {
      class_(seq);
      return;
    }
    if (c == '.') {
      ++pos_;
      chars(seq, {{'\n', '\n'}}, true);
      return;
    }
    if (c == '^' || c == '$') fail("anchors are only allowed at the start and the end");
    if (c == '*' || c == '+' || c == '?') fail("a quantifier with nothing before it");
    if (c == '\\') {
      ++pos_;
      if (pos_ >= p_.size()) fail("a trailing backslash");
      const char e = p_[pos_];
      if (std::string_view("dDwWsS").find(e) != std::string_view::npos) {
        ++pos_;
        std::vector<CharRange> r;
        bool neg;
        class_escape(e, r, neg);
        chars(seq, std::move(r), neg);
        return;
      }
      literal(seq, escaped_char());
      return;
    }
    literal(seq, next_code_point(p_, pos_, "the regex"));
  }

  void class_(Sequence& seq) {
    ++pos_;  // [
    bool negated = false;
    if (pos_ < p_.size() && p_[pos_] == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CharRange> ranges;
    bool first = true;
    while (pos_ < p_.size() && (p_[pos_] != ']' || first)) {
      first = false;
      uint32_t lo;
      if (p_[pos_] == '\\') {
        ++pos_;
        if (pos_ >= p_.size()) fail("a trailing backslash");
        const char e = p_[pos_];
        if (std::string_view("dws").find(e) != std::string_view::npos) {
          ++pos_;
          bool neg;
          class_escape(e, ranges, neg);
          continue;
        }
        if (std::string_view("DWS").find(e) != std::string_view::npos) fail("\\D, \\W and \\S inside a class are not supported");
        lo = escaped_char();
      } else if (p_[pos_] == '[' && pos_ + 1 < p_.size() && p_[pos_ + 1] == ':') {
        fail("POSIX classes ([:alpha:]) are not supported");
      } else {
        lo = next_code_point(p_, pos_, "the regex");
      }
      uint32_t hi = lo;
      if (pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        if (p_[pos_] == '\\') {
          ++pos_;
          if (pos_ >= p_.size()) fail("a trailing backslash");
          hi = escaped_char();
        } else {
          hi = next_code_point(p_, pos_, "the regex");
        }
        if (hi < lo) fail("a character range with its end before its start");
      }
      ranges.push_back({lo, hi});
    }
    if (pos_ >= p_.size()) fail("a '[' without its ']'");
    ++pos_;
    if (ranges.empty()) fail("an empty character class");
    chars(seq, std::move(ranges), negated);
  }

  Grammar& g_;
  std::string_view p_;
  std::string name_;
  bool json_;
  size_t pos_ = 0;
  int depth_ = 0;  // groups open
};

}  // namespace

uint32_t add_regex(Grammar& g, std::string_view pattern, std::string_view rule_name, bool json_string) {
  return RegexParser(g, pattern, rule_name, json_string).parse();
}

Grammar regex_grammar(std::string_view pattern) {
  Grammar g;
  const uint32_t root = g.add_rule("root");
  const uint32_t r = add_regex(g, pattern, "regex");
  g.add_alt(root, {Symbol::ref(r)});
  g.set_root(root);
  g.validate();
  return g;
}

}  // namespace kvlm::grammar
