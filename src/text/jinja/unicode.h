// UTF-8 and the slice of Python's str semantics that chat templates reach: code-point
// iteration and length, str.isspace(), case mapping, str.isprintable() (for repr).
//
// Bytes that are not valid UTF-8 decode as U+DC80..U+DCFF (Python's "surrogateescape")
// and encode back to the same byte, so no input byte is ever lost or altered.
//
// Case mapping covers ASCII, Latin-1, Latin Extended-A and Additional, Greek (with the
// final-sigma rule of str.lower()), Cyrillic, Armenian and fullwidth Latin, plus the
// special cases ß -> SS and İ -> i̇. Scripts outside those have no case in kvlm; Python
// would map a few more (Georgian, Cherokee, Deseret...).
#pragma once

#include <string>
#include <string_view>

namespace kvlm::jinja::unicode {

// Decodes the code point at s[i] and advances i past it.
char32_t decode(std::string_view s, size_t& i);
void append(std::string& out, char32_t c);
std::u32string to_u32(std::string_view s);
std::string to_utf8(std::u32string_view s);
size_t length(std::string_view s);  // in code points, as Python's len()

bool is_space(char32_t c);      // str.isspace()
bool is_printable(char32_t c);  // str.isprintable(), approximated outside the BMP letters
bool is_lower(char32_t c);      // has an uppercase mapping
bool is_upper(char32_t c);      // has a lowercase mapping
bool is_cased(char32_t c);
bool is_alpha(char32_t c);      // letters of the scripts above plus CJK and kana
bool is_digit(char32_t c);      // ASCII and fullwidth digits
char32_t simple_lower(char32_t c);
char32_t simple_upper(char32_t c);

std::string lower(std::string_view s);  // str.lower()
std::string upper(std::string_view s);  // str.upper()
std::string title(std::string_view s);  // str.title()
std::string capitalize(std::string_view s);  // str.capitalize()

}  // namespace kvlm::jinja::unicode
