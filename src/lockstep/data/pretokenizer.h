// Pre-tokenizers: split text into the pieces that BPE encodes one by one.
//
// Each recognised Split pattern of Hugging Face tokenizer.json files is matched by a hand-written
// scanner that reproduces the regex's leftmost-first alternation and backtracking exactly
// (no regex engine on the hot path); any other pattern string is refused by name.
//
//   gpt2    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   llama3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ qwen2   the llama3 pattern with \p{N} in place of \p{N}{1,3}
//
// Every character matches one of the alternatives, so the pieces cover the text with no gaps
// (Split's "Isolated" behaviour then equals the list of matches). Invalid UTF-8 bytes count as
// characters of class "other" (unicode.h).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace lockstep {

enum class SplitPattern { none, gpt2, llama3, qwen2 };

// The pattern for an exact regex string from a tokenizer.json; `none` when it is not one we know.
SplitPattern split_pattern_from_regex(std::string_view regex);
const char* split_pattern_regex(SplitPattern p);

// Appends the pieces of `text` to `out` (views into text). `none` gives the whole text.
void pre_tokenize(SplitPattern p, std::string_view text, std::vector<std::string_view>& out);

}  // namespace lockstep
