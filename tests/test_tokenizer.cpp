// Tokenizers: pre-tokenizer splits against hand-traced regex semantics, BPE encodings against
// expected ids for tiny hand-made vocabularies of both kinds (byte-level and byte-fallback),
// round trips on hard text, and refusal of unsupported tokenizer.json features.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <regex>

#include "lockstep/core/error.h"
#include "lockstep/data/pretokenizer.h"
#include "lockstep/data/tokenizer.h"
#include "lockstep/data/unicode.h"
#include "testing.h"
#include "tokenizer_fixtures.h"

namespace lockstep {
namespace {

using nlohmann::json;
using testing::TempDir;

std::vector<std::string> split(SplitPattern p, std::string_view text) {
  std::vector<std::string_view> v;
  pre_tokenize(p, text, v);
  return {v.begin(), v.end()};
}

// Hard text: multi-byte UTF-8, emoji with a skin-tone modifier, a combining accent, long runs of
// mixed whitespace, digits, and bytes that are not UTF-8 at all.
const std::string kHard =
    "naïve café — 日本語のテキスト 🙂👍🏽 e\xCC\x81 x\t\t   \n\n\n    end 12345 it's IT'S "
    "\xFF\xFE\xC3( \xE2\x82 tail   ";

TEST(PreTokenizer, Gpt2PatternSplits) {
  EXPECT_EQ(split(SplitPattern::gpt2, "Hello world's  test 123 !!\n\n x"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " test", " 123", " !!", "\n\n", " x"}));
  // GPT-2's contractions are case-sensitive: "'S" is punctuation then a letter.
  EXPECT_EQ(split(SplitPattern::gpt2, "IT'S"), (std::vector<std::string>{"IT", "'", "S"}));
  EXPECT_EQ(split(SplitPattern::gpt2, "a  "), (std::vector<std::string>{"a", "  "}));
  EXPECT_EQ(split(SplitPattern::gpt2, "\nb"), (std::vector<std::string>{"\n", "b"}));
  EXPECT_EQ(split(SplitPattern::gpt2, "é1 ü"), (std::vector<std::string>{"é", "1", " ü"}));
}

TEST(PreTokenizer, Llama3PatternSplits) {
  EXPECT_EQ(split(SplitPattern::llama3, "Hello world's 1234567 (x)\n\n  y"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", "123", "456", "7", " (", "x", ")\n\n", " ", " y"}));
  EXPECT_EQ(split(SplitPattern::llama3, "IT'S"), (std::vector<std::string>{"IT", "'S"}));
  EXPECT_EQ(split(SplitPattern::llama3, "a \n b"), (std::vector<std::string>{"a", " \n", " b"}));
  EXPECT_EQ(split(SplitPattern::llama3, "(abc"), (std::vector<std::string>{"(abc"}));
  EXPECT_EQ(split(SplitPattern::qwen2, "x 123"), (std::vector<std::string>{"x", " ", "1", "2", "3"}));
}

TEST(PreTokenizer, PiecesCoverAnyBytesExactly) {
  for (SplitPattern p : {SplitPattern::gpt2, SplitPattern::llama3, SplitPattern::qwen2}) {
    std::string joined;
    for (const std::string& s : split(p, kHard)) {
      EXPECT_FALSE(s.empty());
      joined += s;
    }
    EXPECT_EQ(joined, kHard);
  }
  EXPECT_FALSE(unicode::is_valid_utf8(kHard));
  EXPECT_TRUE(unicode::is_valid_utf8("naïve 🙂"));
  EXPECT_FALSE(unicode::is_valid_utf8("\xC0\x80"));      // overlong NUL
  EXPECT_FALSE(unicode::is_valid_utf8("\xED\xA0\x80"));  // surrogate
}

// Differential check of the hand-written scanners against std::regex (leftmost-first
// alternation with backtracking, like Oniguruma) on random ASCII text from an alphabet that hits
// every alternative: for ASCII, \p{L} is [A-Za-z] and \p{N} is [0-9], and the case-insensitive
// contractions can be spelled out.
TEST(PreTokenizer, MatchesRegexReferenceOnRandomAscii) {
  const std::regex gpt2(R"('s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+)");
  const std::string contractions = R"('[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
  const std::string rest =
      R"(|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::regex llama3(contractions + rest);
  std::string qwen2_rest = rest;
  qwen2_rest.replace(qwen2_rest.find("[0-9]{1,3}"), 10, "[0-9]");
  const std::regex qwen2(contractions + qwen2_rest);
  auto reference = [](const std::regex& re, const std::string& text) {
    std::vector<std::string> out;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
      out.push_back(it->str());
    return out;
  };
  const std::string alphabet = "aZs0 9 '\t\n\r!.eElLdDtTrRvVmM  ";
  const std::vector<int32_t> r = testing::random_ints(400 * 24, static_cast<int64_t>(alphabet.size()), 7, "pretok");
  for (int n = 0; n < 400; ++n) {
    std::string text;
    for (int i = 0; i < 24; ++i) text += alphabet[static_cast<size_t>(r[n * 24 + i])];
    EXPECT_EQ(split(SplitPattern::gpt2, text), reference(gpt2, text)) << "gpt2: '" << text << "'";
    EXPECT_EQ(split(SplitPattern::llama3, text), reference(llama3, text)) << "llama3: '" << text << "'";
    EXPECT_EQ(split(SplitPattern::qwen2, text), reference(qwen2, text)) << "qwen2: '" << text << "'";
  }
}

TEST(PreTokenizer, RecognisesExactPatternStrings) {
  for (SplitPattern p : {SplitPattern::gpt2, SplitPattern::llama3, SplitPattern::qwen2})
    EXPECT_EQ(split_pattern_from_regex(split_pattern_regex(p)), p);
  EXPECT_EQ(split_pattern_from_regex(R"(\s+|\w+)"), SplitPattern::none);
}

// GPT-2's byte -> printable character map, as the vocabulary files spell bytes.
std::string byte_char(int b) {
  int extra = 256;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    const int cp = printable ? x : extra++;
    if (x == b) {
      std::string s;
      unicode::append_utf8(s, static_cast<char32_t>(cp));
      return s;
    }
  }
  return "";
}

// A tiny byte-level BPE: ids 0..255 are the bytes, then merged tokens from 256.
struct ByteLevelFixture {
  json vocab = json::object();
  std::vector<std::pair<std::string, std::string>> merges;
  ByteLevelFixture() {
    for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
    const std::string G = byte_char(' ');  // "Ġ"
    for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{{"h", "e"},
                                                                        {"l", "l"},
                                                                        {"he", "ll"},
                                                                        {"hell", "o"},
                                                                        {G, "w"},
                                                                        {G + "w", "o"},
                                                                        {"b", "c"},
                                                                        {"a", "b"},
                                                                        {"a", "a"}}) {
      merges.emplace_back(a, b);
      if (!vocab.contains(a + b)) vocab[a + b] = 256 + static_cast<int>(merges.size()) - 1;
    }
    vocab["<|endoftext|>"] = 300;
  }
  std::string merges_txt() const {
    std::string s = "#version: 0.2\n";
    for (const auto& [a, b] : merges) s += a + " " + b + "\n";
    return s;
  }
};

TEST(Tokenizer, Gpt2ByteLevelBpeEncodesExpectedIds) {
  TempDir dir;
  ByteLevelFixture fx;
  const std::string v = dir.write("vocab.json", fx.vocab.dump()), m = dir.write("merges.txt", fx.merges_txt());
  const auto tok = make_tokenizer("gpt2:" + v + "," + m);
  std::vector<int32_t> ids;
  tok->encode("hello world", ids);
  // hello: he, ll, hell, hello (ranks 0-3) -> 259; " world": Ġw, Ġwo (ranks 4, 5) -> 261, r, l, d.
  EXPECT_EQ(ids, (std::vector<int32_t>{259, 261, 'r', 'l', 'd'}));
  ids.clear();
  // Lowest rank first, not left to right: "b c" (rank 6) beats "a b" (rank 7).
  tok->encode("abc", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{'a', 262}));
  ids.clear();
  // Equal ranks: leftmost first.
  tok->encode("aaa", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{264, 'a'}));
  EXPECT_EQ(tok->eod(), 300);
  EXPECT_EQ(tok->vocab_size(), 301);
}

TEST(Tokenizer, RoundTripsHardText) {
  TempDir dir;
  ByteLevelFixture fx;
  const std::string v = dir.write("vocab.json", fx.vocab.dump()), m = dir.write("merges.txt", fx.merges_txt());
  for (const std::string& spec : {std::string("byte"), "gpt2:" + v + "," + m}) {
    const auto tok = make_tokenizer(spec);
    for (const std::string& text : {kHard, std::string(""), std::string(1000, ' '), std::string("   lead")}) {
      std::vector<int32_t> ids;
      tok->encode(text, ids);
      EXPECT_EQ(tok->decode(ids), text) << spec;
    }
  }
  const auto byte = make_tokenizer("byte");
  EXPECT_EQ(byte->vocab_size(), 259);
  EXPECT_EQ(byte->eod(), 256);
  EXPECT_EQ(byte->decode({104, 105, 256}), "hi<|endoftext|>");
}

using testing::byte_fallback_json;

TEST(Tokenizer, HfByteFallbackEncodesExpectedIds) {
  TempDir dir;
  const auto tok = make_tokenizer("hf:" + dir.write("tokenizer.json", byte_fallback_json().dump()));
  std::vector<int32_t> ids;
  // "▁hi▁there": ▁h, ▁hi, ▁t, he, ▁the, re; then é is not in the vocabulary -> bytes C3 A9.
  tok->encode("hi thereé", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{266, 269, 270, 3 + 0xC3, 3 + 0xA9}));
  ids.clear();
  tok->encode("</s>hi", ids);  // the added token is matched in the text; no "▁" after it
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 260, 261}));
  EXPECT_EQ(tok->eod(), 2);
  EXPECT_EQ(tok->bos(), 1);
  for (const std::string& text : {kHard, std::string("  two leading"), std::string("x")}) {
    ids.clear();
    tok->encode(text, ids);
    EXPECT_EQ(tok->decode(ids), text);
  }
}

// GPT-2's own tokenizer.json: ByteLevel pre-tokenizer with its built-in regex; here with
// add_prefix_space on, which puts a space before the text.
TEST(Tokenizer, HfByteLevelGpt2StyleWithPrefixSpace) {
  TempDir dir;
  ByteLevelFixture fx;
  json j;
  json merges = json::array();
  for (const auto& [a, b] : fx.merges) merges.push_back(a + " " + b);
  j["model"] = {{"type", "BPE"}, {"vocab", fx.vocab}, {"merges", merges}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const auto tok = make_tokenizer("hf:" + dir.write("tokenizer.json", j.dump()));
  std::vector<int32_t> ids;
  tok->encode("hello world", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{' ', 259, 261, 'r', 'l', 'd'}));
  EXPECT_EQ(tok->decode(ids), " hello world");
}

// Mistral-style tokenizer.json of newer versions: no normalizer, a Metaspace pre-tokenizer that
// prepends "▁" and splits before each "▁".
TEST(Tokenizer, HfMetaspacePreTokenizerSplits) {
  TempDir dir;
  json j = byte_fallback_json();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", true}};
  // The best-ranked merge would join across the split, which must not happen.
  j["model"]["vocab"]["i▁"] = 300;
  j["model"]["merges"].insert(j["model"]["merges"].begin(), "i ▁");
  const auto tok = make_tokenizer("hf:" + dir.write("tokenizer.json", j.dump()));
  std::vector<int32_t> ids;
  tok->encode("hi there", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{266, 269, 270}));
  EXPECT_EQ(tok->decode(ids), "hi there");
}

// Llama-3-style tokenizer.json: Split(llama3 pattern) + ByteLevel(use_regex false), ignore_merges.
TEST(Tokenizer, HfByteLevelWithSplitAndIgnoreMerges) {
  TempDir dir;
  ByteLevelFixture fx;
  const std::string G = byte_char(' ');
  fx.vocab[G + "world"] = 280;  // reachable only through ignore_merges
  json j;
  json merges = json::array();
  for (const auto& [a, b] : fx.merges) merges.push_back(json::array({a, b}));
  j["model"] = {{"type", "BPE"}, {"ignore_merges", true}, {"vocab", fx.vocab}, {"merges", merges}};
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", split_pattern_regex(SplitPattern::llama3)}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  j["added_tokens"] = {{{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}}};
  const auto tok = make_tokenizer("hf:" + dir.write("tokenizer.json", j.dump()));
  std::vector<int32_t> ids;
  tok->encode("hello world<|endoftext|>1234", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{259, 280, 300, '1', '2', '3', '4'}));
  EXPECT_EQ(tok->eod(), 300);
  ids.clear();
  tok->encode(kHard, ids);
  EXPECT_EQ(tok->decode(ids), kHard);
}

constexpr auto error_of = testing::user_error_of;

TEST(Tokenizer, RefusesUnsupportedFeaturesByName) {
  TempDir dir;
  auto refuse = [&](json j, const std::string& expect) {
    const std::string path = dir.write("t.json", j.dump());
    const std::string msg = error_of([&] { make_tokenizer("hf:" + path); });
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  json j = byte_fallback_json();
  j["model"]["type"] = "WordPiece";
  refuse(j, "model type 'WordPiece'");
  j = byte_fallback_json();
  j["normalizer"] = {{"type", "NFKC"}};
  refuse(j, "normalizer NFKC");
  j = byte_fallback_json();
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  refuse(j, "Split pattern");
  j = byte_fallback_json();
  j["pre_tokenizer"] = {{"type", "Digits"}};
  refuse(j, "pre_tokenizer Digits");
  j = byte_fallback_json();
  j["added_tokens"][0]["lstrip"] = true;
  refuse(j, "lstrip");
  j = byte_fallback_json();
  j["model"]["merges"].push_back("x y");
  refuse(j, "missing from the vocabulary");

  EXPECT_NE(error_of([&] { make_tokenizer("hf:" + dir.path("absent.json")); }).find("absent.json"), std::string::npos);
  EXPECT_NE(error_of([&] { make_tokenizer("hf:" + dir.write("bad.json", "{not json")); }).find("bad.json"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_tokenizer("sentencepiece:x"); }).find("expected byte"), std::string::npos);
  const std::string v = dir.write("v.json", "{\"a\": 0}");
  EXPECT_NE(
      error_of([&] { make_tokenizer("gpt2:" + v + "," + dir.write("m.txt", "#version: 0.2\nab\n")); }).find("line 2"),
      std::string::npos);
}

}  // namespace
}  // namespace lockstep
