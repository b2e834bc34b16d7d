// The few Unicode facts the tokenizers need: UTF-8 decoding that never fails, and the classes
// \p{L} (letter), \p{N} (number) and \s (White_Space) of the pre-tokenizer patterns.
//
// Invalid UTF-8 is not an error here: a byte that does not start a well-formed sequence decodes
// as one "code point" of its own (class: other, not letter, number or space) one byte long, so
// byte-level tokenizers split and encode any byte string and decode it back exactly.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace lockstep::unicode {

struct Decoded {
  char32_t cp;  // the code point, or 0xFFFD for an invalid byte
  int len;      // bytes consumed: 1..4
  bool valid;
};

// Decodes the code point at s[i] (i < s.size()). Overlong forms, surrogates and values above
// U+10FFFF are invalid (each of their bytes decodes alone).
inline Decoded decode(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return {b0, 1, true};
  int n;
  char32_t cp, min;
  if ((b0 & 0xE0) == 0xC0)
    n = 2, cp = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0)
    n = 3, cp = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0)
    n = 4, cp = b0 & 0x07, min = 0x10000;
  else
    return {0xFFFD, 1, false};
  if (i + n > s.size()) return {0xFFFD, 1, false};
  for (int k = 1; k < n; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if ((b & 0xC0) != 0x80) return {0xFFFD, 1, false};
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {0xFFFD, 1, false};
  return {cp, n, true};
}

bool is_valid_utf8(std::string_view s);
void append_utf8(std::string& out, char32_t cp);

bool is_letter(char32_t cp);  // general category L*
bool is_number(char32_t cp);  // general category N*
bool is_space(char32_t cp);   // White_Space property (what \s matches in the patterns)

}  // namespace lockstep::unicode
