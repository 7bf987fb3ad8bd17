// UTF-8 and Unicode helpers for the tokenizer: decoding with the WHATWG/Unicode "maximal
// subpart" replacement (what Rust's String::from_utf8_lossy and Python's errors='replace'
// do), normalization forms through utf8proc, whitespace/alphanumeric tests, and the GPT-2
// byte <-> printable-character map of byte-level BPE.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvlm::utf8 {

// Decodes the code point starting at s[i]. On an ill-formed sequence returns valid=false
// and len = the length of its maximal subpart (>= 1), which is replaced by one U+FFFD.
struct Decoded {
  char32_t cp;
  int len;
  bool valid;
};
Decoded decode(std::string_view s, size_t i);

void append(std::string& out, char32_t cp);
// Replaces every ill-formed subsequence with U+FFFD.
std::string sanitize(std::string_view s);
bool is_valid(std::string_view s);
// Number of bytes at the end of `s` that start a UTF-8 sequence not yet complete (0..3).
size_t incomplete_tail(std::string_view s);

enum class Form { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, Form f);  // s must be valid UTF-8

bool is_whitespace(char32_t cp);    // Unicode White_Space (Rust's char::is_whitespace)
bool is_alphanumeric(char32_t cp);  // Rust's char::is_alphanumeric: L* or N*

// GPT-2's byte-level alphabet: byte b is written as the UTF-8 of byte_char(b).
const std::array<std::string, 256>& byte_chars();
int char_to_byte(char32_t cp);  // -1 when cp is not in the alphabet

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace kvlm::utf8
