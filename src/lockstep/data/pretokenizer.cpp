#include "lockstep/data/pretokenizer.h"

#include "lockstep/data/unicode.h"

namespace lockstep {
namespace {

constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

enum Class : uint8_t { kOther, kLetter, kNumber, kSpace };

// The text as a sequence of characters with their class and byte offsets: the scanners below
// look ahead and backtrack by characters.
struct Chars {
  std::vector<uint32_t> begin;  // byte offset of each character, plus the end
  std::vector<char32_t> cp;
  std::vector<uint8_t> cls;

  explicit Chars(std::string_view s) {
    begin.reserve(s.size() + 1);
    cp.reserve(s.size());
    cls.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      const unicode::Decoded d = unicode::decode(s, i);
      begin.push_back(static_cast<uint32_t>(i));
      cp.push_back(d.valid ? d.cp : 0xFFFD);
      cls.push_back(!d.valid                   ? kOther
                    : unicode::is_letter(d.cp) ? kLetter
                    : unicode::is_number(d.cp) ? kNumber
                    : unicode::is_space(d.cp)  ? kSpace
                                               : kOther);
      i += d.len;
    }
    begin.push_back(static_cast<uint32_t>(s.size()));
  }
  size_t size() const { return cp.size(); }
};

char32_t fold(char32_t c, bool ignore_case) {
  if (!ignore_case) return c;
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c == 0x17F) return 's';  // LATIN SMALL LETTER LONG S folds to 's' under Unicode case folding
  return c;
}

// 's 't 're 've 'm 'll 'd at i: returns the length in characters, 0 when none matches.
size_t contraction(const Chars& c, size_t i, bool ignore_case) {
  if (c.cp[i] != '\'' || i + 1 >= c.size()) return 0;
  const char32_t a = fold(c.cp[i + 1], ignore_case);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= c.size()) return 0;
  const char32_t b = fold(c.cp[i + 2], ignore_case);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

size_t run(const Chars& c, size_t i, uint8_t cls) {
  while (i < c.size() && c.cls[i] == cls) ++i;
  return i;
}

// \s+(?!\S) then \s+ at a whitespace character i, with [i, j) the maximal whitespace run: at
// the end of the text the run is taken whole; before a non-space, \s+(?!\S) backtracks one
// character (the last space goes with the next piece) and when that leaves nothing, \s+ takes
// the single character.
size_t trailing_space(const Chars& c, size_t i) {
  const size_t j = run(c, i, kSpace);
  if (j == c.size()) return j;
  return j - 1 > i ? j - 1 : j;
}

size_t next_gpt2(const Chars& c, size_t i) {
  if (size_t n = contraction(c, i, false)) return i + n;
  const bool sp = c.cp[i] == ' ' && i + 1 < c.size();
  const size_t k = sp ? i + 1 : i;  // after the optional leading space
  if (c.cls[i] == kLetter || (sp && c.cls[k] == kLetter)) return run(c, k, kLetter);
  if (c.cls[i] == kNumber || (sp && c.cls[k] == kNumber)) return run(c, k, kNumber);
  if (c.cls[i] == kOther || (sp && c.cls[k] == kOther)) return run(c, k, kOther);
  return trailing_space(c, i);
}

bool is_newline(char32_t cp) { return cp == '\r' || cp == '\n'; }

size_t next_llama3(const Chars& c, size_t i, size_t max_digits) {
  if (size_t n = contraction(c, i, true)) return i + n;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (c.cls[i] == kLetter) return run(c, i, kLetter);
  if (c.cls[i] != kNumber && !is_newline(c.cp[i]) && i + 1 < c.size() && c.cls[i + 1] == kLetter)
    return run(c, i + 1, kLetter);
  // \p{N}{1,3}
  if (c.cls[i] == kNumber) {
    size_t j = i;
    while (j < c.size() && j - i < max_digits && c.cls[j] == kNumber) ++j;
    return j;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const size_t k = c.cp[i] == ' ' && i + 1 < c.size() ? i + 1 : i;
  if (c.cls[k] == kOther) {
    size_t j = run(c, k, kOther);
    while (j < c.size() && is_newline(c.cp[j])) ++j;
    return j;
  }
  // Only whitespace starts here. \s*[\r\n]+: up to and including the run's last newline.
  const size_t j = run(c, i, kSpace);
  for (size_t q = j; q-- > i;)
    if (is_newline(c.cp[q])) return q + 1;
  return trailing_space(c, i);
}

}  // namespace

SplitPattern split_pattern_from_regex(std::string_view regex) {
  if (regex == kGpt2) return SplitPattern::gpt2;
  if (regex == kLlama3) return SplitPattern::llama3;
  if (regex == kQwen2) return SplitPattern::qwen2;
  return SplitPattern::none;
}

const char* split_pattern_regex(SplitPattern p) {
  switch (p) {
    case SplitPattern::gpt2:
      return kGpt2;
    case SplitPattern::llama3:
      return kLlama3;
    case SplitPattern::qwen2:
      return kQwen2;
    default:
      return "";
  }
}

void pre_tokenize(SplitPattern p, std::string_view text, std::vector<std::string_view>& out) {
  if (text.empty()) return;
  if (p == SplitPattern::none) {
    out.push_back(text);
    return;
  }
  const Chars c(text);
  for (size_t i = 0; i < c.size();) {
    const size_t j = p == SplitPattern::gpt2 ? next_gpt2(c, i) : next_llama3(c, i, p == SplitPattern::llama3 ? 3 : 1);
    out.push_back(text.substr(c.begin[i], c.begin[j] - c.begin[i]));
    i = j;
  }
}

}  // namespace lockstep
