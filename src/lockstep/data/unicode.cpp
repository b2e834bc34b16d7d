#include "lockstep/data/unicode.h"

#include <algorithm>
#include <array>

namespace lockstep::unicode {
namespace {

struct CodeRange {
  char32_t lo, hi;
};
#include "lockstep/data/unicode_tables.inc"

template <size_t N>
bool in_ranges(const CodeRange (&r)[N], char32_t cp) {
  const CodeRange* it = std::upper_bound(r, r + N, cp, [](char32_t c, const CodeRange& x) { return c < x.lo; });
  return it != r && cp <= (it - 1)->hi;
}

// ASCII answers from a table: most text is ASCII and this is the tokenizers' inner loop.
enum : uint8_t { kLetter = 1, kNumber = 2, kSpace = 4 };
constexpr std::array<uint8_t, 128> ascii_classes() {
  std::array<uint8_t, 128> t{};
  for (int c = 'a'; c <= 'z'; ++c) t[c] = kLetter;
  for (int c = 'A'; c <= 'Z'; ++c) t[c] = kLetter;
  for (int c = '0'; c <= '9'; ++c) t[c] = kNumber;
  for (int c : {' ', '\t', '\n', '\v', '\f', '\r'}) t[c] = kSpace;
  return t;
}
constexpr std::array<uint8_t, 128> kAscii = ascii_classes();

}  // namespace

bool is_letter(char32_t cp) { return cp < 128 ? (kAscii[cp] & kLetter) : in_ranges(kLetterRanges, cp); }
bool is_number(char32_t cp) { return cp < 128 ? (kAscii[cp] & kNumber) : in_ranges(kNumberRanges, cp); }

bool is_space(char32_t cp) {
  if (cp < 128) return kAscii[cp] & kSpace;
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Decoded d = decode(s, i);
    if (!d.valid) return false;
    i += d.len;
  }
  return true;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace lockstep::unicode
