// Tokenizer fixtures shared by the tests (tests/test_tokenizer.cpp, tests/test_hf_checkpoint.cpp).
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace lockstep::testing {

// Llama-2-style tokenizer.json: Prepend("▁") + Replace(" ", "▁") normalizer, no pre-tokenizer,
// byte_fallback with <0xNN> tokens, special tokens <unk> <s> </s>: 271 tokens.
inline nlohmann::json byte_fallback_json() {
  using nlohmann::json;
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    vocab[buf] = 3 + b;
  }
  int next = 259;
  for (const char* t : {"▁", "h", "i", "t", "e", "r", "▁h", "▁hi", "▁t", "he", "▁the", "re"}) vocab[t] = next++;
  json j;
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", "<unk>"},
                {"byte_fallback", true},
                {"fuse_unk", true},
                {"vocab", vocab},
                {"merges", {"▁ h", "▁h i", "▁ t", "h e", "▁t he", "r e"}}};
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Prepend"}, {"prepend", "▁"}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}};
  j["pre_tokenizer"] = nullptr;
  j["added_tokens"] = json::array();
  for (auto [c, id] : std::vector<std::pair<const char*, int>>{{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}})
    j["added_tokens"].push_back({{"id", id},
                                 {"content", c},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  return j;
}

}  // namespace lockstep::testing
