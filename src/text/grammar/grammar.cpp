#include "text/grammar/grammar.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "text/tokenizer/unicode.h"

namespace kvlm::grammar {

Symbol Symbol::chars(std::vector<CharRange> ranges, bool negated) {
  Symbol s;
  s.kind = Kind::Chars;
  s.negated = negated;
  s.ranges = std::move(ranges);
  return s;
}

Symbol Symbol::ref(uint32_t rule) {
  Symbol s;
  s.kind = Kind::Ref;
  s.rule = rule;
  return s;
}

uint32_t Grammar::add_rule(std::string_view name) {
  if (rules_.size() >= kMaxRules)
    throw Error("the grammar needs more than " + std::to_string(kMaxRules) +
                " rules; simplify it (large repetition counts such as {0,100000} expand into rules)");
  std::string n(name.empty() ? "rule" : name);
  const auto taken = [&](const std::string& x) { return by_name_.count(x) > 0; };
  if (taken(n)) {
    // Helper rules share a few hints; numbering from the count keeps this linear in practice.
    for (size_t k = rules_.size() + 1;; ++k) {
      std::string c = n + "-" + std::to_string(k);
      if (!taken(c)) {
        n = std::move(c);
        break;
      }
    }
  }
  by_name_.emplace(n, uint32_t(rules_.size()));
  rules_.push_back({std::move(n), {}});
  return uint32_t(rules_.size() - 1);
}

void Grammar::count_symbols(size_t n) {
  symbols_ += n;
  if (symbols_ > kMaxSymbols)
    throw Error("the grammar is larger than " + std::to_string(kMaxSymbols) +
                " symbols (characters and rule references); simplify it (long literals and choice lists add one per "
                "character)");
}

uint32_t Grammar::rule_named(std::string_view name) {
  if (auto it = by_name_.find(std::string(name)); it != by_name_.end()) return it->second;
  return add_rule(name);
}

void Grammar::append_literal(Sequence& s, std::string_view utf8) {
  // Checked as the symbols are made: the sequence joins a grammar, which counts it then.
  for (size_t i = 0; i < utf8.size();) {
    if (s.size() >= kMaxSymbols)
      throw Error("a literal of the grammar is longer than " + std::to_string(kMaxSymbols) + " characters");
    s.push_back(Symbol::ch(next_code_point(utf8, i, "a literal")));
  }
}

void Grammar::append_group(Sequence& s, std::vector<Sequence> alts, std::string_view hint) {
  const uint32_t r = add_rule(hint);
  for (const Sequence& a : alts) count_symbols(a.size());
  rules_[r].alts = std::move(alts);
  s.push_back(Symbol::ref(r));
}

uint32_t Grammar::add_text_until(std::string_view tag, const Sequence& then, std::string_view hint) {
  KVLM_CHECK(!tag.empty(), "add_text_until: empty tag");
  for (char c : tag) KVLM_CHECK(uint8_t(c) < 0x80, "add_text_until: the tag must be ASCII");
  const size_t n = tag.size();
  // fail[i]: the longest proper border of tag[0, i).
  std::vector<size_t> fail(n + 1, 0);
  for (size_t i = 1; i < n; ++i) {
    size_t k = fail[i];
    while (k > 0 && tag[i] != tag[k]) k = fail[k];
    fail[i + 1] = tag[i] == tag[k] ? k + 1 : 0;
  }
  const auto next = [&](size_t i, char c) {  // matched i characters, read c
    while (i > 0 && tag[i] != c) i = fail[i];
    return tag[i] == c ? i + 1 : 0;
  };
  std::vector<uint32_t> q;
  for (size_t i = 0; i < n; ++i) q.push_back(add_rule(std::string(hint) + "-" + std::to_string(i)));
  const uint32_t done = add_rule(std::string(hint) + "-after");
  add_alt(done, then);
  std::string chars;  // the tag's distinct characters
  for (char c : tag)
    if (chars.find(c) == std::string::npos) chars += c;
  std::vector<CharRange> in_tag;
  for (char c : chars) in_tag.push_back({uint32_t(uint8_t(c)), uint32_t(uint8_t(c))});
  for (size_t i = 0; i < n; ++i) {
    for (char c : chars) {
      const size_t j = next(i, c);
      add_alt(q[i], {Symbol::ch(uint8_t(c)), Symbol::ref(j == n ? done : q[j])});
    }
    add_alt(q[i], {Symbol::chars(in_tag, /*negated=*/true), Symbol::ref(q[0])});
  }
  return q[0];
}

void Grammar::append_repeat(Sequence& s, const Sequence& item, int min, int max, std::string_view hint) {
  KVLM_CHECK(min >= 0 && (max < 0 || max >= min), "append_repeat: bad bounds");
  if (max == 0) return;
  // One symbol per repetition: a multi-symbol item becomes a rule of its own.
  Symbol one;
  if (item.size() == 1) {
    one = item[0];
  } else {
    const uint32_t r = add_rule(hint);
    add_alt(r, item);
    one = Symbol::ref(r);
  }
  if (s.size() + size_t(min) > kMaxSymbols) count_symbols(s.size() + size_t(min));  // throws
  for (int i = 0; i < min; ++i) s.push_back(one);
  if (max < 0) {
    // star ::= one star | ε  (right recursion: the matcher's stacks do not grow with it)
    const uint32_t star = add_rule(std::string(hint) + "-star");
    add_alt(star, {one, Symbol::ref(star)});
    add_alt(star, {});
    s.push_back(Symbol::ref(star));
    return;
  }
  // opt_k ::= one opt_(k-1) | ε, nested so that the count stays bounded.
  uint32_t inner = UINT32_MAX;
  for (int k = 0; k < max - min; ++k) {
    const uint32_t r = add_rule(std::string(hint) + "-opt");
    Sequence alt{one};
    if (inner != UINT32_MAX) alt.push_back(Symbol::ref(inner));
    add_alt(r, std::move(alt));
    add_alt(r, {});
    inner = r;
  }
  if (inner != UINT32_MAX) s.push_back(Symbol::ref(inner));
}

uint32_t Grammar::embed(const Grammar& other, std::string_view prefix) {
  std::vector<uint32_t> ids(other.rules_.size());
  for (size_t i = 0; i < other.rules_.size(); ++i) ids[i] = add_rule(std::string(prefix) + other.rules_[i].name);
  std::vector<uint32_t> specials;  // other's special code points in this grammar
  for (const std::string& t : other.specials_) specials.push_back(special_token(t));
  for (size_t i = 0; i < other.rules_.size(); ++i)
    for (Sequence alt : other.rules_[i].alts) {
      for (Symbol& s : alt) {
        if (s.kind == Symbol::Kind::Ref) s.rule = ids[s.rule];
        else
          for (CharRange& r : s.ranges)  // special tokens are single code points
            if (r.lo >= kSpecialTokenBase) r.lo = r.hi = specials[r.lo - kSpecialTokenBase];
      }
      add_alt(ids[i], std::move(alt));
    }
  return ids[other.root_];
}

uint32_t Grammar::special_token(std::string_view text) {
  for (size_t i = 0; i < specials_.size(); ++i)
    if (specials_[i] == text) return kSpecialTokenBase + uint32_t(i);
  specials_.emplace_back(text);
  return kSpecialTokenBase + uint32_t(specials_.size() - 1);
}

std::vector<char> Grammar::nullable_rules() const {
  // A worklist, not a fixed point over all rules: a chain of N rules each nullable through
  // the next would take N passes of N rules (a 60,000-rule chain: minutes).
  const size_t n = rules_.size();
  std::vector<char> nullable(n, 0);
  std::vector<uint32_t> left;                                     // per alternative: references not yet nullable
  std::vector<uint32_t> alt_rule;                                 // per alternative: its rule
  std::vector<std::vector<uint32_t>> users(n);                    // per rule: alternatives that reference it
  std::vector<uint32_t> work;
  for (uint32_t r = 0; r < n; ++r)
    for (const Sequence& alt : rules_[r].alts) {
      const bool only_refs = std::all_of(alt.begin(), alt.end(), [](const Symbol& s) { return s.kind == Symbol::Kind::Ref; });
      if (!only_refs) continue;  // a character is never empty
      const uint32_t a = uint32_t(left.size());
      left.push_back(uint32_t(alt.size()));
      alt_rule.push_back(r);
      for (const Symbol& s : alt) users[s.rule].push_back(a);
      if (alt.empty() && !nullable[r]) {
        nullable[r] = 1;
        work.push_back(r);
      }
    }
  while (!work.empty()) {
    const uint32_t b = work.back();
    work.pop_back();
    for (uint32_t a : users[b])  // (a rule twice in one alternative is listed, and counted, twice)
      if (--left[a] == 0 && !nullable[alt_rule[a]]) {
        nullable[alt_rule[a]] = 1;
        work.push_back(alt_rule[a]);
      }
  }
  return nullable;
}

void Grammar::validate() const {
  if (rules_.empty()) throw Error("the grammar has no rules");
  for (const Rule& r : rules_)
    if (r.alts.empty()) throw Error("the grammar's rule '" + r.name + "' is used but never defined");
  const size_t n = rules_.size();
  const std::vector<char> nullable = nullable_rules();
  // Edges A -> B where B can start A without a character consumed; a cycle is left recursion.
  std::vector<std::vector<uint32_t>> first(n);
  for (size_t i = 0; i < n; ++i)
    for (const Sequence& alt : rules_[i].alts)
      for (const Symbol& s : alt) {
        if (s.kind != Symbol::Kind::Ref) break;
        first[i].push_back(s.rule);
        if (!nullable[s.rule]) break;
      }
  std::vector<uint8_t> state(n, 0);  // 0 new, 1 on the path, 2 done
  std::vector<std::pair<uint32_t, size_t>> path;
  for (uint32_t start = 0; start < n; ++start) {
    if (state[start]) continue;
    path.push_back({start, 0});
    state[start] = 1;
    while (!path.empty()) {
      auto& [v, k] = path.back();
      if (k == first[v].size()) {
        state[v] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t w = first[v][k++];
      if (state[w] == 1)
        throw Error("the grammar's rule '" + rules_[w].name +
                    "' is left-recursive (it can reach itself without matching a character); rewrite it with repetition, "
                    "e.g. list ::= item (\",\" item)*");
      if (state[w] == 0) {
        state[w] = 1;
        path.push_back({w, 0});
      }
    }
  }
}

namespace {
void gbnf_char(std::string& out, uint32_t c, bool in_class) {
  switch (c) {
    case '\n': out += "\\n"; return;
    case '\r': out += "\\r"; return;
    case '\t': out += "\\t"; return;
    case '\\': out += "\\\\"; return;
    case '"': out += in_class ? "\"" : "\\\""; return;
    case ']': out += in_class ? "\\]" : "]"; return;
    case '-': out += in_class ? "\\-" : "-"; return;
    case '^': out += in_class ? "\\^" : "^"; return;
    default: break;
  }
  if (c < 0x20 || c == 0x7f) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02X", c);
    out += buf;
  } else {
    append_utf8(out, c);
  }
}
}  // namespace

std::string Grammar::to_gbnf() const {
  std::string out;
  for (const Rule& r : rules_) {
    out += r.name + " ::=";
    for (size_t a = 0; a < r.alts.size(); ++a) {
      if (a) out += " |";
      if (r.alts[a].empty()) out += " \"\"";
      for (const Symbol& s : r.alts[a]) {
        out += ' ';
        if (s.kind == Symbol::Kind::Ref) {
          out += rules_[s.rule].name;
        } else if (!s.negated && s.ranges.size() == 1 && s.ranges[0].lo >= kSpecialTokenBase &&
                   s.ranges[0].lo == s.ranges[0].hi && s.ranges[0].lo - kSpecialTokenBase < specials_.size()) {
          out += "<special " + specials_[s.ranges[0].lo - kSpecialTokenBase] + ">";  // not GBNF: for messages
        } else if (!s.negated && s.ranges.size() == 1 && s.ranges[0].lo == s.ranges[0].hi) {
          out += '"';
          gbnf_char(out, s.ranges[0].lo, false);
          out += '"';
        } else {
          out += s.negated ? "[^" : "[";
          for (const CharRange& c : s.ranges) {
            gbnf_char(out, c.lo, true);
            if (c.hi != c.lo) {
              out += '-';
              gbnf_char(out, c.hi, true);
            }
          }
          out += ']';
        }
      }
    }
    out += '\n';
  }
  return out;
}

uint32_t next_code_point(std::string_view s, size_t& i, std::string_view what) {
  const auto d = utf8::decode(s, i);
  if (!d.valid) throw Error(std::string(what) + " is not valid UTF-8 (byte " + std::to_string(i) + ")");
  i += size_t(d.len);
  return uint32_t(d.cp);
}

void append_utf8(std::string& out, uint32_t cp) { utf8::append(out, char32_t(cp)); }

std::optional<Repeat> parse_repeat(std::string_view t, size_t& pos, int max_count, bool brace_needs_digit, const Fail& fail) {
  const auto die = [&](const std::string& what) {
    fail(what);
    throw Error(what);  // `fail` throws; this keeps the compiler sure of it
  };
  const auto number = [&] {
    const size_t b = pos;
    long v = 0;
    while (pos < t.size() && t[pos] >= '0' && t[pos] <= '9') {
      v = v * 10 + (t[pos++] - '0');
      if (v > max_count) die("a repetition count above " + std::to_string(max_count));
    }
    if (b == pos) die("expected a number");
    return int(v);
  };
  if (pos >= t.size()) return std::nullopt;
  Repeat r;
  switch (t[pos]) {
    case '*': ++pos; return r;
    case '+': ++pos; r.min = 1; return r;
    case '?': ++pos; r.max = 1; return r;
    case '{': break;
    default: return std::nullopt;
  }
  if (brace_needs_digit && !(pos + 1 < t.size() && t[pos + 1] >= '0' && t[pos + 1] <= '9')) return std::nullopt;
  ++pos;
  r.min = r.max = number();
  if (pos < t.size() && t[pos] == ',') {
    ++pos;
    r.max = pos < t.size() && t[pos] == '}' ? -1 : number();
  }
  if (pos >= t.size() || t[pos] != '}') die("expected '}' to close a repetition");
  ++pos;
  if (r.max >= 0 && r.max < r.min) die("a repetition {m,n} needs m <= n");
  return r;
}

uint32_t parse_hex(std::string_view t, size_t& pos, int digits, const Fail& fail) {
  uint32_t v = 0;
  for (int i = 0; i < digits; ++i) {
    if (pos >= t.size()) {
      fail("a truncated escape");
      throw Error("a truncated escape");
    }
    const char c = t[pos++];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) {
      fail("a bad hex digit in an escape");
      throw Error("a bad hex digit in an escape");
    }
    v = v * 16 + uint32_t(d);
  }
  if (v > 0x10FFFF) {
    fail("an escape beyond U+10FFFF");
    throw Error("an escape beyond U+10FFFF");
  }
  if (v >= 0xD800 && v <= 0xDFFF) {  // half of a UTF-16 pair: no UTF-8 text holds one
    fail("an escape of a UTF-16 surrogate (U+D800..U+DFFF), which UTF-8 text cannot hold; escape the character itself");
    throw Error("an escape of a UTF-16 surrogate");
  }
  return v;
}

Grammar choice_grammar(const std::vector<std::string>& choices) {
  if (choices.empty()) throw Error("a choice needs at least one string");
  // The choices as code points, sorted and unique: a trie node is a range of them sharing a
  // prefix; where they part (or one ends) the node becomes a rule with one alternative per
  // next character (and an empty one where a choice ends there).
  std::vector<std::u32string> cs;
  size_t total = 0;
  for (const std::string& c : choices) {
    total += c.size();
    if (total > kMaxSymbols)
      throw Error("the choices hold more than " + std::to_string(kMaxSymbols) + " characters in all; send fewer or shorter ones");
    std::u32string u;
    for (size_t i = 0; i < c.size();) u.push_back(char32_t(next_code_point(c, i, "a choice")));
    cs.push_back(std::move(u));
  }
  std::sort(cs.begin(), cs.end());
  cs.erase(std::unique(cs.begin(), cs.end()), cs.end());
  Grammar g;
  const uint32_t root = g.add_rule("root");
  g.set_root(root);
  struct Node {
    uint32_t rule;
    size_t begin, end, depth;  // choices [begin, end) agree on their first `depth` code points
  };
  std::vector<Node> work{{root, 0, cs.size(), 0}};
  while (!work.empty()) {
    const Node nd = work.back();
    work.pop_back();
    for (size_t i = nd.begin; i < nd.end;) {
      Sequence alt;
      if (cs[i].size() == nd.depth) {  // a choice that ends here (sorted first)
        g.add_alt(nd.rule, {});
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < nd.end && cs[j].size() > nd.depth && cs[j][nd.depth] == cs[i][nd.depth]) ++j;
      // The characters every choice of [i, j) shares from here, then a rule where they part.
      size_t d = nd.depth;
      while (d < cs[i].size() && cs[j - 1].size() > d && cs[i][d] == cs[j - 1][d]) alt.push_back(Symbol::ch(uint32_t(cs[i][d++])));
      if (j - i > 1 || d < cs[i].size()) {
        const uint32_t r = g.add_rule("choice");
        alt.push_back(Symbol::ref(r));
        work.push_back({r, i, j, d});
      }
      g.add_alt(nd.rule, std::move(alt));
      i = j;
    }
  }
  return g;
}

// ---- GBNF -------------------------------------------------------------------------------

namespace {

class GbnfParser {
 public:
  explicit GbnfParser(std::string_view text) : t_(text) {}

  Grammar parse() {
    skip_space(true);
    while (pos_ < t_.size()) {
      const std::string name = parse_name();
      skip_space(false);
      if (t_.substr(pos_, 3) != "::=") fail("expected '::=' after the rule name '" + name + "'");
      pos_ += 3;
      const uint32_t r = g_.rule_named(name);
      if (!g_.alts(r).empty()) fail("the rule '" + name + "' is defined twice");
      for (Sequence& alt : parse_alternatives(name, false)) g_.add_alt(r, std::move(alt));
      skip_space(true);
    }
    if (!g_.has_rule("root")) throw Error("the grammar has no rule named 'root' (the start rule)");
    g_.set_root(g_.rule_named("root"));
    g_.validate();
    return std::move(g_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < t_.size(); ++i) {
      if (t_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw Error("grammar line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + what);
  }

  // Spaces and comments; newlines too when `newlines` (between rules, inside parentheses).
  void skip_space(bool newlines) {
    while (pos_ < t_.size()) {
      const char c = t_[pos_];
      if (c == '#') {
        while (pos_ < t_.size() && t_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  std::string parse_name() {
    const size_t b = pos_;
    while (pos_ < t_.size() && name_char(t_[pos_])) ++pos_;
    if (b == pos_) fail("expected a rule name");
    return std::string(t_.substr(b, pos_ - b));
  }

  // A newline ends a rule unless the next line continues it (starts with | or the
  // expression is inside parentheses): llama.cpp's rule.
  bool at_rule_end() {
    if (pos_ >= t_.size()) return true;
    if (t_[pos_] != '\n') return false;
    // Look past blank lines and comments: a following line that starts a new rule (name ::=)
    // ends this one.
    size_t p = pos_;
    while (p < t_.size()) {
      while (p < t_.size() && (t_[p] == ' ' || t_[p] == '\t' || t_[p] == '\r' || t_[p] == '\n')) ++p;
      if (p < t_.size() && t_[p] == '#') {
        while (p < t_.size() && t_[p] != '\n') ++p;
        continue;
      }
      break;
    }
    if (p >= t_.size()) return true;
    size_t q = p;
    while (q < t_.size() && name_char(t_[q])) ++q;
    while (q < t_.size() && (t_[q] == ' ' || t_[q] == '\t')) ++q;
    return q > p && t_.substr(q, 3) == "::=";
  }

  std::vector<Sequence> parse_alternatives(const std::string& rule, bool nested) {
    std::vector<Sequence> alts;
    alts.push_back(parse_sequence(rule, nested));
    for (;;) {
      skip_space(nested);
      if (!nested && pos_ < t_.size() && t_[pos_] == '\n' && !at_rule_end()) skip_space(true);
      if (pos_ < t_.size() && t_[pos_] == '|') {
        ++pos_;
        alts.push_back(parse_sequence(rule, nested));
      } else {
        break;
      }
    }
    return alts;
  }

  Sequence parse_sequence(const std::string& rule, bool nested) {
    Sequence seq;
    for (;;) {
      skip_space(nested);
      if (!nested && pos_ < t_.size() && t_[pos_] == '\n') {
        if (at_rule_end()) break;
        skip_space(true);
      }
      if (pos_ >= t_.size()) break;
      const char c = t_[pos_];
      if (c == '|' || c == ')') break;
      const size_t start = seq.size();
      if (c == '"') {
        ++pos_;
        while (pos_ < t_.size() && t_[pos_] != '"') seq.push_back(Symbol::ch(parse_char()));
        if (pos_ >= t_.size()) fail("unterminated string literal");
        ++pos_;
      } else if (c == '[') {
        seq.push_back(parse_class());
      } else if (c == '.') {
        ++pos_;
        seq.push_back(Symbol::chars({{'\n', '\n'}}, true));  // any character but a newline
      } else if (c == '(') {
        if (++depth_ > kMaxNesting) fail("groups nested deeper than " + std::to_string(kMaxNesting) + " levels");
        ++pos_;
        std::vector<Sequence> alts = parse_alternatives(rule, true);
        --depth_;
        skip_space(true);
        if (pos_ >= t_.size() || t_[pos_] != ')') fail("expected ')'");
        ++pos_;
        g_.append_group(seq, std::move(alts), rule);
      } else if (name_char(c)) {
        const std::string name = parse_name();
        seq.push_back(Symbol::ref(g_.rule_named(name)));
      } else {
        fail(std::string("unexpected character '") + c + "'");
      }
      parse_postfix(seq, start, rule);
    }
    return seq;
  }

  void parse_postfix(Sequence& seq, size_t start, const std::string& rule) {
    const Fail f = [this](const std::string& what) { fail(what); };
    while (const auto r = parse_repeat(t_, pos_, 100000, false, f)) {
      // The operator applies to the whole last element (a literal: all of it, as llama.cpp).
      Sequence item(seq.begin() + long(start), seq.end());
      seq.resize(start);
      g_.append_repeat(seq, item, r->min, r->max, rule);
    }
  }

  uint32_t hex(int digits) {
    return parse_hex(t_, pos_, digits, [this](const std::string& what) { fail(what); });
  }

  uint32_t parse_char() {
    if (t_[pos_] != '\\') return next_code_point(t_, pos_, "the grammar");
    ++pos_;
    if (pos_ >= t_.size()) fail("a truncated escape");
    const char e = t_[pos_++];
    switch (e) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '0': return 0;
      case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': return uint32_t(e);
      case 'x': return hex(2);
      case 'u': return hex(4);
      case 'U': return hex(8);
      default: fail(std::string("unknown escape '\\") + e + "'");
    }
  }

  Symbol parse_class() {
    ++pos_;  // [
    bool negated = false;
    if (pos_ < t_.size() && t_[pos_] == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CharRange> ranges;
    while (pos_ < t_.size() && t_[pos_] != ']') {
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (pos_ + 1 < t_.size() && t_[pos_] == '-' && t_[pos_ + 1] != ']') {
        ++pos_;
        hi = parse_char();
        if (hi < lo) fail("a character range with its end before its start");
      }
      ranges.push_back({lo, hi});
    }
    if (pos_ >= t_.size()) fail("unterminated character class");
    ++pos_;
    if (ranges.empty() && !negated) fail("an empty character class matches nothing");
    return Symbol::chars(std::move(ranges), negated);
  }

  std::string_view t_;
  size_t pos_ = 0;
  int depth_ = 0;  // ( groups open
  Grammar g_;
};

}  // namespace

Grammar parse_gbnf(std::string_view text) { return GbnfParser(text).parse(); }

}  // namespace kvlm::grammar
