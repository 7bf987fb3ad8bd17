#include "text/tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace kvlm::utf8 {

Decoded decode(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return {c, 1, true};
  int need;
  char32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2, cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;  // no overlongs
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3, cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return {0xFFFD, 1, false};
  }
  int k = 1;
  for (; k <= need; ++k) {
    if (i + size_t(k) >= s.size()) return {0xFFFD, k, false};
    const uint8_t x = b(i + size_t(k));
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (x < l || x > h) return {0xFFFD, k, false};
    cp = (cp << 6) | (x & 0x3F);
  }
  return {cp, need + 1, true};
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Decoded d = decode(s, i);
    if (d.valid)
      out.append(s.substr(i, size_t(d.len)));
    else
      out.append(kReplacement);
    i += size_t(d.len);
  }
  return out;
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const Decoded d = decode(s, i);
    if (!d.valid) return false;
    i += size_t(d.len);
  }
  return true;
}

size_t incomplete_tail(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the lead byte of the last sequence.
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const uint8_t c = static_cast<uint8_t>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    if (c < 0xC2 || c > 0xF4) return 0;  // ASCII or a byte that never starts a sequence
    const int len = c < 0x80 ? 1 : (c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1);
    if (len > int(back)) {
      const Decoded d = decode(s.substr(n - back), 0);
      // Still a viable prefix of a valid sequence: wait for more bytes.
      return d.len == int(back) && !d.valid ? back : 0;
    }
    return 0;
  }
  return 0;
}

std::string normalize(std::string_view s, Form f) {
  int options = UTF8PROC_STABLE;
  switch (f) {
    case Form::NFC: options |= UTF8PROC_COMPOSE; break;
    case Form::NFD: options |= UTF8PROC_DECOMPOSE; break;
    case Form::NFKC: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case Form::NFKD: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  // ASCII is already in every normal form: skip the library for the common case.
  bool ascii = true;
  for (char c : s) ascii &= static_cast<uint8_t>(c) < 0x80;
  if (ascii) return std::string(s);
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()), &out,
                                          utf8proc_option_t(options));
  if (n < 0) throw Error(std::string("unicode normalization failed: ") + utf8proc_errmsg(n));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> hold(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), size_t(n));
}

bool is_whitespace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_alphanumeric(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

namespace {
struct ByteMap {
  std::array<std::string, 256> chars;
  std::array<int, 324> back;  // code point -> byte for the alphabet (all code points < 324)
  ByteMap() {
    back.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const char32_t cp = printable ? char32_t(b) : char32_t(256 + extra++);
      append(chars[size_t(b)], cp);
      back[size_t(cp)] = b;
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}
}  // namespace

const std::array<std::string, 256>& byte_chars() { return byte_map().chars; }

int char_to_byte(char32_t cp) { return cp < 324 ? byte_map().back[cp] : -1; }

}  // namespace kvlm::utf8
