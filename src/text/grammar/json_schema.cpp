#include "text/grammar/json_schema.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <optional>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "text/grammar/regex.h"

namespace kvlm::grammar {

namespace {

using Json = nlohmann::ordered_json;

constexpr int kMaxIndent = 24;  // tabs or spaces after a line break
constexpr int kMaxDepth = 64;

// Keywords that only describe.
const std::set<std::string> kAnnotations = {"title", "description", "default", "examples", "$schema", "$id",
                                            "$comment", "deprecated", "readOnly", "writeOnly", "strict", "$defs",
                                            "definitions", "name", "format_description"};

// Formats as regexes (whole-string). A date's day is checked against its month (February
// stops at 28: the 29th exists only in leap years, which a grammar does not count).
const std::unordered_map<std::string, std::string>& formats() {
  static const std::unordered_map<std::string, std::string> f = [] {
    const std::string date =
        "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))";
    const std::string time = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    const std::string octet = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
    const std::string label = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?";
    // A hostname of at most 4 labels of at most 62 characters: within RFC 1123's 253.
    const std::string short_label = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,60}[a-zA-Z0-9])?";
    // IPv6 in RFC 4291's text forms: 8 groups, or fewer around one "::" (no embedded IPv4, no zone).
    const std::string h = "[0-9a-fA-F]{1,4}";
    const std::string ipv6 = "((" + h + ":){7}" + h + "|(" + h + ":){1,7}:|(" + h + ":){1,6}:" + h + "|(" + h + ":){1,5}(:" + h +
                             "){1,2}|(" + h + ":){1,4}(:" + h + "){1,3}|(" + h + ":){1,3}(:" + h + "){1,4}|(" + h + ":){1,2}(:" +
                             h + "){1,5}|" + h + ":(:" + h + "){1,6}|:((:" + h + "){1,7}|:))";
    // RFC 3339's duration (appendix A): P with date parts and/or T time parts, or weeks; at most
    // 9 digits a part.
    const std::string n = "[0-9]{1,9}";
    const std::string sec = n + "S", mins = n + "M(" + sec + ")?", hour = n + "H(" + mins + ")?";
    const std::string dtime = "T(" + hour + "|" + mins + "|" + sec + ")";
    const std::string day = n + "D", month = n + "M(" + day + ")?", year = n + "Y(" + month + ")?";
    const std::string duration = "P((" + day + "|" + month + "|" + year + ")(" + dtime + ")?|" + dtime + "|" + n + "W)";
    return std::unordered_map<std::string, std::string>{
        {"hostname", short_label + "(\\." + short_label + "){0,3}"},
        {"ipv6", ipv6},
        {"duration", duration},
        {"date", date},
        {"time", time},
        {"date-time", date + "T" + time},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"email", "[a-zA-Z0-9_+-]+(\\.[a-zA-Z0-9_+-]+)*@" + label + "(\\." + label + ")+"},
        {"ipv4", "(" + octet + "\\.){3}" + octet},
    };
  }();
  return f;
}

class SchemaConverter {
 public:
  explicit SchemaConverter(const Json& root) : root_(root) {}

  Grammar convert() {
    ws_ = make_ws();
    const uint32_t start = g_.add_rule("root");
    // The reply is the value itself, as vLLM's engines give it: no leading whitespace (every
    // vocabulary holds the bare "{" and "[", if only as byte tokens).
    g_.add_alt(start, {Symbol::ref(value(root_, "", "value", 0))});
    g_.set_root(start);
    g_.validate();
    return std::move(g_);
  }

  Grammar any_object() {
    ws_ = make_ws();
    const uint32_t start = g_.add_rule("root");
    g_.add_alt(start, {Symbol::ref(any_object_rule())});
    g_.set_root(start);
    g_.validate();
    return std::move(g_);
  }

 private:
  [[noreturn]] static void fail(const std::string& path, const std::string& what) {
    throw Error("JSON schema at '" + (path.empty() ? std::string("#") : "#" + path) + "': " + what);
  }

  // Between tokens: nothing, one space, or a line break and an indentation — what compact
  // and pretty-printed JSON write. Runs of blank lines or spaces, which a model sampling at a
  // high temperature can spin in until max_tokens cuts its JSON short, are not allowed.
  uint32_t make_ws() {
    const uint32_t r = g_.add_rule("ws");
    g_.add_alt(r, {});
    g_.add_alt(r, lit(" "));
    Sequence nl = lit("\n");
    g_.append_repeat(nl, {Symbol::chars({{'\t', '\t'}, {' ', ' '}})}, 0, kMaxIndent, "indent");
    g_.add_alt(r, std::move(nl));
    return r;
  }
  Symbol ws() const { return Symbol::ref(ws_); }

  uint32_t rule(std::string_view hint, std::vector<Sequence> alts) {
    const uint32_t r = g_.add_rule(hint);
    for (auto& a : alts) g_.add_alt(r, std::move(a));
    return r;
  }
  static Sequence lit(std::string_view s) {
    Sequence q;
    Grammar::append_literal(q, s);
    return q;
  }

  uint32_t string_char() {
    if (char_) return *char_;
    // Any character but '"', '\' and the controls, or an escape.
    Sequence esc = lit("\\");
    Sequence hex4 = lit("u");
    for (int i = 0; i < 4; ++i) hex4.push_back(Symbol::chars({{'0', '9'}, {'A', 'F'}, {'a', 'f'}}));
    g_.append_group(esc, {{Symbol::chars({{'"', '"'}, {'/', '/'}, {'\\', '\\'}, {'b', 'b'}, {'f', 'f'}, {'n', 'n'}, {'r', 'r'}, {'t', 't'}})}, hex4},
                    "escape");
    char_ = rule("char", {{Symbol::chars({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}}, true)}, esc});
    return *char_;
  }

  uint32_t string_rule(int min_len, int max_len) {
    Sequence s = lit("\"");
    g_.append_repeat(s, {Symbol::ref(string_char())}, min_len, max_len, "string");
    Grammar::append_literal(s, "\"");
    return rule("string", {s});
  }

  uint32_t number_rule() {
    if (number_) return *number_;
    // -? (0 | [1-9][0-9]{0,15}) (. [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?: a double's
    // precision and range, so that a model cannot write digits until max_tokens.
    Sequence s;
    Sequence minus = lit("-");
    g_.append_repeat(s, minus, 0, 1, "number");
    Sequence digits{Symbol::chars({{'1', '9'}})};
    g_.append_repeat(digits, {Symbol::chars({{'0', '9'}})}, 0, 15, "digits");
    g_.append_group(s, {lit("0"), digits}, "integral");
    Sequence frac = lit(".");
    g_.append_repeat(frac, {Symbol::chars({{'0', '9'}})}, 1, 16, "fraction");
    g_.append_repeat(s, frac, 0, 1, "fraction");
    Sequence exp{Symbol::chars({{'E', 'E'}, {'e', 'e'}})};
    g_.append_repeat(exp, {Symbol::chars({{'+', '+'}, {'-', '-'}})}, 0, 1, "exponent");
    g_.append_repeat(exp, {Symbol::chars({{'0', '9'}})}, 1, 3, "exponent");
    g_.append_repeat(s, exp, 0, 1, "exponent");
    number_ = rule("number", {s});
    return *number_;
  }

  // ---- integers in a range ----
  static Symbol digit_range(char a, char b) { return Symbol::chars({{uint32_t(a), uint32_t(b)}}); }

  // Decimal strings of the same length from a to b (a <= b), no leading zeros beyond a's.
  void same_length(std::vector<Sequence>& out, Sequence prefix, const std::string& a, const std::string& b) {
    if (a.empty()) {
      out.push_back(std::move(prefix));
      return;
    }
    const std::string ra = a.substr(1), rb = b.substr(1);
    if (ra.find_first_not_of('0') == std::string::npos && rb.find_first_not_of('9') == std::string::npos) {
      prefix.push_back(digit_range(a[0], b[0]));
      for (size_t i = 0; i < ra.size(); ++i) prefix.push_back(digit_range('0', '9'));
      out.push_back(std::move(prefix));
      return;
    }
    if (a[0] == b[0]) {
      prefix.push_back(digit_range(a[0], a[0]));
      same_length(out, std::move(prefix), ra, rb);
      return;
    }
    Sequence p1 = prefix;
    p1.push_back(digit_range(a[0], a[0]));
    same_length(out, std::move(p1), ra, std::string(ra.size(), '9'));
    if (a[0] + 1 <= b[0] - 1) {
      Sequence mid = prefix;
      mid.push_back(digit_range(char(a[0] + 1), char(b[0] - 1)));
      for (size_t i = 0; i < ra.size(); ++i) mid.push_back(digit_range('0', '9'));
      out.push_back(std::move(mid));
    }
    Sequence p3 = std::move(prefix);
    p3.push_back(digit_range(b[0], b[0]));
    same_length(out, std::move(p3), std::string(rb.size(), '0'), rb);
  }

  static uint64_t pow10(size_t n) {
    uint64_t v = 1;
    while (n--) v *= 10;
    return v;
  }

  // Non-negative decimals in [lo, hi], after `prefix`.
  void nonneg(std::vector<Sequence>& out, const Sequence& prefix, uint64_t lo, uint64_t hi) {
    const size_t lo_len = std::to_string(lo).size(), hi_len = std::to_string(hi).size();
    for (size_t len = lo_len; len <= hi_len; ++len) {
      const uint64_t a = std::max(lo, len == 1 ? 0 : pow10(len - 1));
      const uint64_t b = std::min(hi, pow10(len) - 1);
      if (a <= b) same_length(out, prefix, std::to_string(a), std::to_string(b));
    }
  }

  // The schema's numeric keyword `key` (minimum, ...), if any: a finite number.
  static std::optional<double> numeric_bound(const Json& s, const char* key, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end()) return std::nullopt;
    if (!it->is_number()) fail(path + "/" + key, "must be a number");
    const double v = it->get<double>();
    if (!std::isfinite(v)) fail(path + "/" + key, "must be finite");
    return v;
  }

  uint32_t integer_rule(const Json& s, const std::string& path) {
    const auto bound = [&](const char* key) {
      const auto v = numeric_bound(s, key, path);
      if (v && std::fabs(*v) > 1e18) fail(path + "/" + key, "must be within +-1e18");
      return v;
    };
    std::optional<int64_t> lo, hi;
    if (auto v = bound("minimum")) lo = int64_t(std::ceil(*v));
    if (auto v = bound("exclusiveMinimum")) lo = std::max(lo.value_or(INT64_MIN), int64_t(std::floor(*v)) + 1);
    if (auto v = bound("maximum")) hi = int64_t(std::floor(*v));
    if (auto v = bound("exclusiveMaximum")) hi = std::min(hi.value_or(INT64_MAX), int64_t(std::ceil(*v)) - 1);
    if (lo && hi && *lo > *hi) fail(path, "no integer lies between its minimum and maximum");
    // Unbounded sides stop at 18 digits, so that a model cannot write digits until
    // max_tokens (the numbers any int64 reader takes).
    constexpr int64_t kLargest = 999999999999999999;
    if (!lo) lo = -kLargest;
    if (!hi) hi = kLargest;
    if (*lo > kLargest || *hi < -kLargest) fail(path, "bounds beyond +-10^18 are not supported");
    std::vector<Sequence> alts;
    const Sequence minus = lit("-");
    // Negative part: -k for k in [max(1, -hi), -lo].
    if (*lo < 0) nonneg(alts, minus, *hi < 0 ? uint64_t(-*hi) : 1, uint64_t(-std::max(*lo, -kLargest)));
    if (*hi >= 0) nonneg(alts, {}, *lo > 0 ? uint64_t(*lo) : 0, uint64_t(std::min(*hi, kLargest)));
    return rule("integer", std::move(alts));
  }

  // ---- numbers in a range ----
  // A bounded 'number' is written without an exponent: an optional minus, an integer part of
  // at most 16 digits and an optional fraction, whose decimal value lies in [lo, hi]. The
  // bounds are the shortest decimals that read back as the schema's doubles, with an exclusive
  // bound moved to the next double inwards; reading is monotone, so every decimal the grammar
  // allows reads back (as a double, as any JSON validator compares) within the bounds.
  static constexpr int kFracDigits = 16;  // fraction digits beyond the bounds' own
  static constexpr int kMaxFracDigits = 32;

  struct Dec {  // a non-negative decimal: integer part, fraction digits without trailing zeros
    uint64_t ip = 0;
    std::string frac;
  };
  // |v| as a decimal, |v| < 1e16; a fraction longer than kMaxFracDigits is cut there, rounded
  // up (`up`) or down.
  static void to_dec(double v, bool up, Dec& d) {
    char buf[512];  // the fixed form of the smallest double has 324 fraction digits
    const auto r = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::fixed);
    const std::string t(buf, r.ptr);
    const size_t dot = t.find('.');
    d.ip = std::stoull(t.substr(0, dot));
    d.frac = dot == std::string::npos ? "" : t.substr(dot + 1);
    if (int(d.frac.size()) > kMaxFracDigits) {
      d.frac.resize(kMaxFracDigits);
      if (up) {  // + 10^-kMaxFracDigits, carrying into the integer part
        int i = kMaxFracDigits - 1;
        while (i >= 0 && d.frac[i] == '9') d.frac[i--] = '0';
        if (i >= 0) ++d.frac[i];
        else ++d.ip;
      }
    }
    while (!d.frac.empty() && d.frac.back() == '0') d.frac.pop_back();
  }
  static bool dec_less(const Dec& a, const Dec& b) {
    if (a.ip != b.ip) return a.ip < b.ip;
    for (size_t i = 0; i < std::max(a.frac.size(), b.frac.size()); ++i) {  // missing digits are zeros
      const char x = i < a.frac.size() ? a.frac[i] : '0', y = i < b.frac.size() ? b.frac[i] : '0';
      if (x != y) return x < y;
    }
    return false;
  }

  // Fraction digit strings s (the digits after the point) of at most n digits, at least one
  // when `need`, compared as 0.s: any; all zeros; 0.s >= 0.r (r has no trailing zeros and is
  // not empty); 0.s <= 0.r; 0.a <= 0.s <= 0.b (0.a < 0.b).
  uint32_t frac_any(int n, bool need) {
    const int key = 2 * n + need;
    if (auto it = frac_any_.find(key); it != frac_any_.end()) return it->second;
    std::vector<Sequence> alts;
    if (!need) alts.push_back({});
    if (n > 0) alts.push_back({digit_range('0', '9'), Symbol::ref(frac_any(n - 1, false))});
    return frac_any_[key] = rule("frac", std::move(alts));
  }
  uint32_t frac_ge(std::string_view r, int n) {
    std::vector<Sequence> alts;
    const char d = r[0];
    if (d < '9') alts.push_back({digit_range(char(d + 1), '9'), Symbol::ref(frac_any(n - 1, false))});
    alts.push_back({digit_range(d, d), Symbol::ref(r.size() > 1 ? frac_ge(r.substr(1), n - 1) : frac_any(n - 1, false))});
    return rule("frac-ge", std::move(alts));
  }
  uint32_t frac_le(std::string_view r, int n, bool need) {
    std::vector<Sequence> alts;
    if (!need) alts.push_back({});  // 0.s ends here: the rest are zeros, <= 0.r
    if (n > 0) {
      if (r.empty()) {
        alts.push_back({digit_range('0', '0'), Symbol::ref(frac_le(r, n - 1, false))});
      } else {
        if (r[0] > '0') alts.push_back({digit_range('0', char(r[0] - 1)), Symbol::ref(frac_any(n - 1, false))});
        alts.push_back({digit_range(r[0], r[0]), Symbol::ref(frac_le(r.substr(1), n - 1, false))});
      }
    }
    return rule("frac-le", std::move(alts));
  }
  uint32_t frac_between(std::string_view a, std::string_view b, int n, bool need) {
    if (a.empty()) return frac_le(b, n, need);
    if (a[0] == b[0]) return rule("frac-in", {{digit_range(a[0], a[0]), Symbol::ref(frac_between(a.substr(1), b.substr(1), n - 1, false))}});
    std::vector<Sequence> alts;
    alts.push_back({digit_range(a[0], a[0]), Symbol::ref(a.size() > 1 ? frac_ge(a.substr(1), n - 1) : frac_any(n - 1, false))});
    if (a[0] + 1 < b[0]) alts.push_back({digit_range(char(a[0] + 1), char(b[0] - 1)), Symbol::ref(frac_any(n - 1, false))});
    alts.push_back({digit_range(b[0], b[0]), Symbol::ref(frac_le(b.substr(1), n - 1, false))});
    return rule("frac-in", std::move(alts));
  }

  // Integer part `ip` (a rule or a literal), then the fraction: none (value ip) or "." and at
  // least one digit, bounded below by a (0.a, "" = none) and above by b (nullopt: no bound).
  void with_fraction(std::vector<Sequence>& out, Sequence ip, const std::string& a, const std::optional<std::string>& b,
                     int n) {
    if (!a.empty()) {  // a fraction is needed: the integer alone is below the bound
      Grammar::append_literal(ip, ".");
      ip.push_back(Symbol::ref(b ? frac_between(a, *b, n, true) : frac_ge(a, n)));
      out.push_back(std::move(ip));
      return;
    }
    Sequence frac = lit(".");
    frac.push_back(Symbol::ref(b ? frac_le(*b, n, true) : frac_any(n, true)));
    g_.append_repeat(ip, frac, 0, 1, "fraction");
    out.push_back(std::move(ip));
  }

  // Non-negative decimals from lo to hi (nullopt: up to 16 integer digits), after `prefix`.
  void nonneg_decimals(std::vector<Sequence>& out, const Sequence& prefix, const Dec& lo, const std::optional<Dec>& hi, int n) {
    constexpr uint64_t kMaxInt = 9999999999999999;  // 16 digits
    const auto with = [&](const std::string& digits) {
      Sequence q = prefix;
      Grammar::append_literal(q, digits);
      return q;
    };
    if (hi && hi->ip == lo.ip) {
      with_fraction(out, with(std::to_string(lo.ip)), lo.frac, hi->frac, n);
      return;
    }
    with_fraction(out, with(std::to_string(lo.ip)), lo.frac, std::nullopt, n);
    const uint64_t mid_hi = hi ? hi->ip - 1 : kMaxInt;
    if (lo.ip + 1 <= mid_hi) {
      std::vector<Sequence> ints;
      nonneg(ints, {}, lo.ip + 1, mid_hi);
      Sequence q = prefix;
      q.push_back(Symbol::ref(rule("integral", std::move(ints))));
      with_fraction(out, std::move(q), "", std::nullopt, n);
    }
    if (hi) with_fraction(out, with(std::to_string(hi->ip)), "", hi->frac, n);
  }

  uint32_t bounded_number_rule(const Json& s, const std::string& path) {
    const auto bound = [&](const char* key) { return numeric_bound(s, key, path); };
    double lo = -INFINITY, hi = INFINITY;  // inclusive; infinite: no bound
    if (auto v = bound("minimum")) lo = *v;
    if (auto v = bound("exclusiveMinimum")) lo = std::max(lo, std::nextafter(*v, INFINITY));
    if (auto v = bound("maximum")) hi = *v;
    if (auto v = bound("exclusiveMaximum")) hi = std::min(hi, std::nextafter(*v, -INFINITY));
    constexpr double kLimit = 1e16;  // 16 integer digits
    if (lo >= kLimit) fail(path, "a minimum of 1e16 or more is not supported (numbers have up to 16 integer digits)");
    if (hi <= -kLimit) fail(path, "a maximum of -1e16 or less is not supported (numbers have up to 16 integer digits)");
    if (lo <= -kLimit) lo = -INFINITY;
    if (hi >= kLimit) hi = INFINITY;
    if (lo > hi) fail(path, "no number lies between its minimum and maximum");
    const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
    // Magnitudes: [a, b] on each side of zero, the fraction cut (inwards) at 32 digits.
    std::vector<Sequence> alts;
    Dec lo_d, hi_d;
    if (has_lo) to_dec(lo, lo >= 0, lo_d);
    if (has_hi) to_dec(hi, hi < 0, hi_d);
    const int n = std::max({kFracDigits, int(lo_d.frac.size()), int(hi_d.frac.size())});
    const auto side = [&](const Sequence& sign, const Dec& from, const std::optional<Dec>& to) {
      if (to && dec_less(*to, from)) fail(path, "no number kvlm can write (32 fraction digits) lies between its bounds");
      nonneg_decimals(alts, sign, from, to, n);
    };
    // Negatives: -m for m in [max(0, -hi), -lo]; non-negatives in [max(0, lo), hi].
    if (lo < 0) side(lit("-"), hi < 0 ? hi_d : Dec{}, has_lo ? std::optional<Dec>(lo_d) : std::nullopt);
    if (hi >= 0) side({}, lo >= 0 ? lo_d : Dec{}, has_hi ? std::optional<Dec>(hi_d) : std::nullopt);
    return rule("number", std::move(alts));
  }

  uint32_t any_value() {
    if (any_) return *any_;
    any_ = g_.add_rule("any");
    const uint32_t obj = any_object_rule();
    // array ::= "[" ws ( any ws ( "," ws any ws )* )? "]"
    Sequence item{Symbol::ref(*any_), ws()};
    Sequence more = lit(",");
    more.push_back(ws());
    more.insert(more.end(), item.begin(), item.end());
    Sequence items = item;
    g_.append_repeat(items, more, 0, -1, "array");
    Sequence arr = lit("[");
    arr.push_back(ws());
    g_.append_repeat(arr, items, 0, 1, "array");
    Grammar::append_literal(arr, "]");
    const uint32_t array = rule("array", {arr});
    g_.add_alt(*any_, {Symbol::ref(obj)});
    g_.add_alt(*any_, {Symbol::ref(array)});
    g_.add_alt(*any_, {Symbol::ref(string_rule(0, -1))});
    g_.add_alt(*any_, {Symbol::ref(number_rule())});
    for (const char* k : {"true", "false", "null"}) g_.add_alt(*any_, lit(k));
    return *any_;
  }

  // "{" ws ( key ws ":" ws value ws ( "," ws key ws ":" ws value ws )* )? "}"
  uint32_t generic_object(uint32_t value_rule) {
    Sequence kv{Symbol::ref(string_rule(0, -1)), ws()};
    Grammar::append_literal(kv, ":");
    kv.push_back(ws());
    kv.push_back(Symbol::ref(value_rule));
    kv.push_back(ws());
    Sequence more = lit(",");
    more.push_back(ws());
    more.insert(more.end(), kv.begin(), kv.end());
    Sequence members = kv;
    g_.append_repeat(members, more, 0, -1, "object");
    Sequence obj = lit("{");
    obj.push_back(ws());
    g_.append_repeat(obj, members, 0, 1, "object");
    Grammar::append_literal(obj, "}");
    return rule("object", {obj});
  }

  uint32_t any_object_rule() {
    if (!any_) any_value();  // creates the object rule with the value rule
    if (!any_object_) any_object_ = generic_object(*any_);
    return *any_object_;
  }

  // ---- schemas ----
  uint32_t value(const Json& s, const std::string& path, std::string_view hint, int depth) {
    if (depth > kMaxDepth) fail(path, "nests deeper than " + std::to_string(kMaxDepth) + " levels");
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail(path, "the schema 'false' matches nothing");
      return any_value();
    }
    if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
    if (auto it = s.find("$ref"); it != s.end()) return ref(*it, path, depth);

    static const std::set<std::string> kUnsupported = {
        "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
        "uniqueItems", "multipleOf", "minProperties", "maxProperties", "contentEncoding", "contentMediaType"};
    for (auto it = s.begin(); it != s.end(); ++it)
      if (kUnsupported.count(it.key()))
        fail(path + "/" + it.key(), "the keyword '" + it.key() + "' is not supported by kvlm's structured outputs");

    std::vector<uint32_t> alts;
    if (auto it = s.find("const"); it != s.end()) {
      alts.push_back(rule("const", {lit(it->dump())}));
    } else if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) fail(path + "/enum", "must be a non-empty list");
      std::vector<Sequence> lits;
      for (const Json& v : *it) lits.push_back(lit(v.dump()));
      alts.push_back(rule("enum", std::move(lits)));
    } else if (s.contains("anyOf") || s.contains("oneOf")) {
      const char* key = s.contains("anyOf") ? "anyOf" : "oneOf";
      const Json& list = s.at(key);
      if (!list.is_array() || list.empty()) fail(path + "/" + key, "must be a non-empty list of schemas");
      for (size_t i = 0; i < list.size(); ++i)
        alts.push_back(value(merged(s, list[i], key), path + "/" + key + "/" + std::to_string(i), hint, depth + 1));
    } else if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1)
        fail(path + "/allOf", "allOf is supported with one schema only (merge the schemas into one)");
      alts.push_back(value(merged(s, (*it)[0], "allOf"), path + "/allOf/0", hint, depth + 1));
    } else {
      std::vector<std::string> types;
      if (auto t = s.find("type"); t != s.end()) {
        if (t->is_string()) {
          types.push_back(t->get<std::string>());
        } else if (t->is_array() && !t->empty()) {
          for (const Json& x : *t) {
            if (!x.is_string()) fail(path + "/type", "must be a string or a list of strings");
            types.push_back(x.get<std::string>());
          }
        } else {
          fail(path + "/type", "must be a string or a list of strings");
        }
      } else if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) {
        types.push_back("object");
      } else if (s.contains("items") || s.contains("prefixItems")) {
        types.push_back("array");
      } else if (s.contains("pattern") || s.contains("format") || s.contains("minLength") || s.contains("maxLength")) {
        types.push_back("string");
      } else {
        return any_value();
      }
      for (const std::string& t : types) alts.push_back(typed(s, t, path, hint, depth));
    }
    if (const auto nullable = s.find("nullable"); nullable != s.end()) {  // OpenAPI's spelling of "or null"
      if (!nullable->is_boolean()) fail(path + "/nullable", "must be true or false");
      if (nullable->get<bool>()) alts.push_back(rule("null", {lit("null")}));
    }
    if (alts.size() == 1) return alts[0];
    std::vector<Sequence> seqs;
    for (uint32_t a : alts) seqs.push_back({Symbol::ref(a)});
    return rule(hint, std::move(seqs));
  }

  // A branch of anyOf/oneOf/allOf with the keywords of its parent that apply to it (a parent
  // {"type": "object", "anyOf": [...]} constrains each branch).
  static Json merged(const Json& parent, const Json& branch, const char* key) {
    if (!branch.is_object()) return branch;
    Json m = branch;
    for (auto it = parent.begin(); it != parent.end(); ++it)
      if (it.key() != key && it.key() != "nullable" && !kAnnotations.count(it.key()) && !m.contains(it.key()))
        m[it.key()] = it.value();
    return m;
  }

  uint32_t ref(const Json& r, const std::string& path, int depth) {
    if (!r.is_string()) fail(path + "/$ref", "must be a string");
    const std::string target = r.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    if (!target.starts_with("#")) fail(path + "/$ref", "only references into the same document ('#/$defs/...') are supported");
    const std::string pointer = target.substr(1);
    const Json* node = nullptr;
    try {
      node = &root_.at(Json::json_pointer(pointer));
    } catch (const std::exception&) {
      fail(path + "/$ref", "'" + target + "' points at nothing in the schema");
    }
    // The rule exists before its body, so recursive schemas refer to it.
    const uint32_t r0 = g_.add_rule("ref");
    refs_[target] = r0;
    g_.add_alt(r0, {Symbol::ref(value(*node, pointer, "ref", depth + 1))});
    return r0;
  }

  uint32_t typed(const Json& s, const std::string& t, const std::string& path, std::string_view hint, int depth) {
    if (t == "null") return rule("null", {lit("null")});
    if (t == "boolean") return rule("boolean", {lit("true"), lit("false")});
    if (t == "integer") return integer_rule(s, path);
    if (t == "number") {
      for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        if (s.contains(k)) return bounded_number_rule(s, path);
      return number_rule();
    }
    if (t == "string") return string_schema(s, path);
    if (t == "array") return array_schema(s, path, depth);
    if (t == "object") return object_schema(s, path, hint, depth);
    fail(path + "/type", "unknown type '" + t + "'");
  }

  static int length_field(const Json& s, const char* key, const std::string& path, int dflt) {
    auto it = s.find(key);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 10000)
      fail(path + "/" + key, "must be an integer from 0 to 10000");
    return int(it->get<int64_t>());
  }

  uint32_t string_schema(const Json& s, const std::string& path) {
    const int min = length_field(s, "minLength", path, 0), max = length_field(s, "maxLength", path, -1);
    if (max >= 0 && max < min) fail(path, "maxLength is below minLength");
    const bool lengths = s.contains("minLength") || s.contains("maxLength");
    std::string pattern;
    if (auto it = s.find("pattern"); it != s.end()) {
      if (!it->is_string()) fail(path + "/pattern", "must be a string");
      pattern = it->get<std::string>();
    } else if (auto f = s.find("format"); f != s.end()) {
      if (!f->is_string()) fail(path + "/format", "must be a string");
      const auto known = formats().find(f->get<std::string>());
      if (known == formats().end())
        fail(path + "/format", "the format '" + f->get<std::string>() +
                                   "' is not supported (supported: date, time, date-time, duration, uuid, email, hostname, "
                                   "ipv4, ipv6); use a pattern");
      pattern = known->second;
    } else {
      return string_rule(min, max);
    }
    if (lengths) fail(path, "a pattern or format together with minLength/maxLength is not supported; fold the lengths into the pattern");
    uint32_t body;
    try {
      body = add_regex(g_, pattern, "pattern", true);
    } catch (const Error& e) {
      fail(path + "/pattern", e.what());
    }
    Sequence q = lit("\"");
    q.push_back(Symbol::ref(body));
    Grammar::append_literal(q, "\"");
    return rule("string", {q});
  }

  uint32_t array_schema(const Json& s, const std::string& path, int depth) {
    const int min = length_field(s, "minItems", path, 0), max = length_field(s, "maxItems", path, -1);
    if (max >= 0 && max < min) fail(path, "maxItems is below minItems");
    std::vector<uint32_t> prefix;
    if (auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array()) fail(path + "/prefixItems", "must be a list of schemas");
      for (size_t i = 0; i < it->size(); ++i)
        prefix.push_back(value((*it)[i], path + "/prefixItems/" + std::to_string(i), "item", depth + 1));
    }
    std::optional<uint32_t> rest;  // items after the prefix; nullopt = none allowed
    if (auto it = s.find("items"); it != s.end()) {
      if (!(it->is_boolean() && !it->get<bool>())) rest = value(*it, path + "/items", "item", depth + 1);
    } else {
      rest = any_value();
    }
    const int np = int(prefix.size());
    if (!rest && min > np) fail(path, "minItems asks for more items than prefixItems allows");
    const int hi = rest ? max : std::min(max < 0 ? np : max, np);
    // Element i's rule: prefix[i] or rest.
    const auto elem = [&](int i) { return i < np ? prefix[size_t(i)] : *rest; };
    // Items 0..k-1 where k in [min, hi]: written as nested choices that stop after any count
    // >= min. The tail past the prefix repeats `rest`.
    // tail(i): items i.. given i items written (i >= 1), with the "," before each.
    const auto comma_item = [&](uint32_t r) {
      Sequence q = lit(",");
      q.push_back(ws());
      q.push_back(Symbol::ref(r));
      q.push_back(ws());
      return q;
    };
    Sequence items;  // what follows "[" ws
    if (hi != 0) {
      // Item 0, then items 1 .. fixed_end - 1 one by one (the prefix, and enough to reach
      // minItems), then a repetition of `rest` up to maxItems.
      const int fixed_end = std::max(np, min);
      const int limit = hi < 0 ? INT_MAX : hi;
      const int tail_start = std::max(fixed_end, 1);
      std::optional<uint32_t> after;  // the items after the ones written so far
      if (rest && limit > tail_start) {
        Sequence tail;
        g_.append_repeat(tail, comma_item(*rest), 0, hi < 0 ? -1 : limit - tail_start, "items");
        after = rule("items", {tail});
      }
      for (int k = std::min(fixed_end, limit) - 1; k >= 1; --k) {
        Sequence q = comma_item(elem(k));
        if (after) q.push_back(Symbol::ref(*after));
        std::vector<Sequence> a{q};
        if (k >= min) a.push_back({});  // may stop before item k
        after = rule("items", std::move(a));
      }
      Sequence first{Symbol::ref(elem(0)), ws()};
      if (after) first.push_back(Symbol::ref(*after));
      if (min == 0) {
        g_.append_repeat(items, first, 0, 1, "items");
      } else {
        items = first;
      }
    }
    Sequence q = lit("[");
    q.push_back(ws());
    q.insert(q.end(), items.begin(), items.end());
    Grammar::append_literal(q, "]");
    return rule("array", {q});
  }

  uint32_t object_schema(const Json& s, const std::string& path, std::string_view hint, int depth) {
    std::vector<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) fail(path + "/required", "must be a list of property names");
      for (const Json& r : *it) {
        if (!r.is_string()) fail(path + "/required", "must be a list of property names");
        required.push_back(r.get<std::string>());
      }
    }
    const auto props = s.find("properties");
    if (props == s.end() || props->empty()) {
      if (!required.empty()) fail(path + "/required", "names properties that 'properties' does not define");
      auto ap = s.find("additionalProperties");
      if (ap != s.end() && ap->is_boolean() && !ap->get<bool>()) return rule("object", {[&] {
                                                                               Sequence q = lit("{");
                                                                               q.push_back(ws());
                                                                               Grammar::append_literal(q, "}");
                                                                               return q;
                                                                             }()});
      if (ap == s.end() || ap->is_boolean()) return any_object_rule();
      return generic_object(value(*ap, path + "/additionalProperties", "value", depth + 1));
    }
    if (!props->is_object()) fail(path + "/properties", "must be an object");
    for (const std::string& r : required)
      if (!props->contains(r)) fail(path + "/required", "names '" + r + "', which 'properties' does not define");
    struct Prop {
      Sequence member;  // "key" ws ":" ws value ws
      bool required;
    };
    std::vector<Prop> ps;
    for (auto it = props->begin(); it != props->end(); ++it) {
      Sequence m = lit(Json(it.key()).dump());
      m.push_back(ws());
      Grammar::append_literal(m, ":");
      m.push_back(ws());
      m.push_back(Symbol::ref(value(it.value(), path + "/properties/" + it.key(), it.key(), depth + 1)));
      m.push_back(ws());
      ps.push_back({std::move(m), std::find(required.begin(), required.end(), it.key()) != required.end()});
    }
    // first[i] / more[i]: the properties from i on, none / some written before them.
    const size_t n = ps.size();
    std::vector<uint32_t> first(n + 1), more(n + 1);
    first[n] = rule(std::string(hint) + "-end", {{}});
    more[n] = first[n];
    for (size_t i = n; i-- > 0;) {
      Sequence f = ps[i].member;
      f.push_back(Symbol::ref(more[i + 1]));
      Sequence m = lit(",");
      m.push_back(ws());
      m.insert(m.end(), ps[i].member.begin(), ps[i].member.end());
      m.push_back(Symbol::ref(more[i + 1]));
      std::vector<Sequence> fa{f}, ma{m};
      if (!ps[i].required) {
        fa.push_back({Symbol::ref(first[i + 1])});
        ma.push_back({Symbol::ref(more[i + 1])});
      }
      first[i] = rule(std::string(hint) + "-props", std::move(fa));
      more[i] = rule(std::string(hint) + "-more", std::move(ma));
    }
    Sequence q = lit("{");
    q.push_back(ws());
    q.push_back(Symbol::ref(first[0]));
    Grammar::append_literal(q, "}");
    return rule(hint.empty() ? "object" : hint, {q});
  }

  const Json& root_;
  Grammar g_;
  uint32_t ws_ = 0;
  std::optional<uint32_t> char_, number_, any_, any_object_;
  std::unordered_map<int, uint32_t> frac_any_;  // frac_any(n, need) by 2n + need
  std::unordered_map<std::string, uint32_t> refs_;
};

}  // namespace

Grammar json_schema_grammar(const nlohmann::ordered_json& schema) { return SchemaConverter(schema).convert(); }

Grammar json_object_grammar() {
  const Json empty = Json::object();
  return SchemaConverter(empty).any_object();
}

}  // namespace kvlm::grammar
