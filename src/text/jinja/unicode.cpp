#include "text/jinja/unicode.h"

#include "text/tokenizer/unicode.h"

namespace kvlm::jinja::unicode {

char32_t decode(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  auto raw = [&]() {  // surrogateescape for a byte that does not start valid UTF-8
    ++i;
    return static_cast<char32_t>(0xDC00 + b0);
  };
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  int n = 0;
  char32_t c = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) n = 1, c = b0 & 0x1F;
  else if (b0 >= 0xE0 && b0 <= 0xEF) n = 2, c = b0 & 0x0F;
  else if (b0 >= 0xF0 && b0 <= 0xF4) n = 3, c = b0 & 0x07;
  else return raw();
  for (int k = 1; k <= n; ++k) {
    if (i + k >= s.size()) return raw();
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return raw();
    c = (c << 6) | (b & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not valid UTF-8.
  if ((n == 2 && c < 0x800) || (n == 3 && (c < 0x10000 || c > 0x10FFFF)) || (c >= 0xD800 && c <= 0xDFFF))
    return raw();
  i += n + 1;
  return c;
}

void append(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // an escaped raw byte
    out.push_back(static_cast<char>(c - 0xDC00));
  } else {
    utf8::append(out, c);
  }
}

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) out.push_back(decode(s, i));
  return out;
}

std::string to_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append(out, c);
  return out;
}

size_t length(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) decode(s, i);
  return n;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_printable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (is_space(c)) return false;  // Zs, Zl, Zp other than the ASCII space
  if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x8E2 || c == 0x180E) return false;
  if ((c >= 0x200B && c <= 0x200F) || (c >= 0x202A && c <= 0x202E) || (c >= 0x2060 && c <= 0x206F)) return false;
  if (c >= 0xD800 && c <= 0xF8FF) return false;  // surrogates, private use
  if ((c >= 0xFDD0 && c <= 0xFDEF) || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  if ((c & 0xFFFE) == 0xFFFE) return false;  // noncharacters
  if ((c >= 0x1D173 && c <= 0x1D17A) || c == 0xE0001 || (c >= 0xE0020 && c <= 0xE007F)) return false;
  if (c >= 0xF0000) return false;
  return true;
}

namespace {

// Pairs where the uppercase letter is even and the lowercase the next code point.
bool in_even_pair_block(char32_t c) {
  return (c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177) ||
         (c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F) ||
         (c >= 0x1E00 && c <= 0x1E95) || (c >= 0x1EA0 && c <= 0x1EFF);
}
// Pairs where the uppercase letter is odd.
bool in_odd_pair_block(char32_t c) {
  return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E) || (c >= 0x4C1 && c <= 0x4CE);
}

}  // namespace

char32_t simple_lower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0x80) return c;
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
  if (c == 0x178) return 0xFF;
  if (in_even_pair_block(c)) return (c % 2 == 0) ? c + 1 : c;
  if (in_odd_pair_block(c)) return (c % 2 == 1) ? c + 1 : c;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if ((c >= 0x391 && c <= 0x3A1) || (c >= 0x3A3 && c <= 0x3AB)) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c == 0x4C0) return 0x4CF;
  if (c >= 0x531 && c <= 0x556) return c + 48;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
  return c;
}

char32_t simple_upper(char32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0x80) return c;
  if (c == 0xB5) return 0x39C;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c == 0x131) return 'I';
  if (c == 0x17F) return 'S';
  if (in_even_pair_block(c)) return (c % 2 == 1) ? c - 1 : c;
  if (in_odd_pair_block(c)) return (c % 2 == 0) ? c - 1 : c;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 37;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 63;
  if (c == 0x3C2) return 0x3A3;  // final sigma
  if ((c >= 0x3B1 && c <= 0x3C1) || (c >= 0x3C3 && c <= 0x3CB)) return c - 32;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  if (c == 0x4CF) return 0x4C0;
  if (c >= 0x561 && c <= 0x586) return c - 48;
  if (c >= 0xFF41 && c <= 0xFF5A) return c - 32;
  return c;
}

bool is_lower(char32_t c) { return simple_upper(c) != c || c == 0xDF; }
bool is_upper(char32_t c) { return simple_lower(c) != c || c == 0x130; }
bool is_cased(char32_t c) { return is_lower(c) || is_upper(c); }

bool is_alpha(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (is_cased(c) || c == 0xAA || c == 0xBA || c == 0x138) return true;
  return (c >= 0x3040 && c <= 0x30FF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) ||
         (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A);
}

bool is_digit(char32_t c) { return (c >= '0' && c <= '9') || (c >= 0xFF10 && c <= 0xFF19); }

namespace {

// Python's final-sigma rule: capital sigma lowers to ς when it ends a word (a cased
// letter before it, none after it).
bool final_sigma(const std::u32string& s, size_t i) {
  bool before = false;
  for (size_t j = i; j-- > 0;) {
    if (is_cased(s[j])) {
      before = true;
      break;
    }
    if (s[j] != 0x27 && s[j] != 0x2019 && s[j] != 0xAD) break;
  }
  if (!before) return false;
  for (size_t j = i + 1; j < s.size(); ++j) {
    if (is_cased(s[j])) return false;
    if (s[j] != 0x27 && s[j] != 0x2019 && s[j] != 0xAD) break;
  }
  return true;
}

void append_lower(std::string& out, const std::u32string& s, size_t i) {
  const char32_t c = s[i];
  if (c == 0x130) {  // İ -> i + combining dot above
    append(out, 'i');
    append(out, 0x307);
  } else if (c == 0x3A3 && final_sigma(s, i)) {
    append(out, 0x3C2);
  } else {
    append(out, simple_lower(c));
  }
}

void append_upper(std::string& out, char32_t c) {
  if (c == 0xDF) {
    out += "SS";
  } else {
    append(out, simple_upper(c));
  }
}

}  // namespace

std::string lower(std::string_view s) {
  const std::u32string u = to_u32(s);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < u.size(); ++i) append_lower(out, u, i);
  return out;
}

std::string upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) append_upper(out, decode(s, i));
  return out;
}

std::string title(std::string_view s) {
  const std::u32string u = to_u32(s);
  std::string out;
  out.reserve(s.size());
  bool previous_cased = false;
  for (size_t i = 0; i < u.size(); ++i) {
    if (previous_cased) {
      append_lower(out, u, i);
    } else if (u[i] == 0xDF) {
      out += "Ss";
    } else {
      append(out, simple_upper(u[i]));
    }
    previous_cased = is_cased(u[i]);
  }
  return out;
}

std::string capitalize(std::string_view s) {
  const std::u32string u = to_u32(s);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < u.size(); ++i) {
    if (i == 0) {
      if (u[0] == 0xDF) out += "Ss";
      else append(out, simple_upper(u[0]));
    } else {
      append_lower(out, u, i);
    }
  }
  return out;
}

}  // namespace kvlm::jinja::unicode
