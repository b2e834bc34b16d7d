// The BPE engine shared by the gpt2: and hf: tokenizers, configured by what their files say.
//
// Encoding a text: split it on added tokens (they become their own ids), normalise the rest
// (byte-fallback kind: spaces to "▁", "▁" prepended), pre-tokenize it (pretokenizer.h), and BPE
// each piece: start from one symbol per byte (byte-level) or per character (byte-fallback:
// characters missing from the vocabulary become <0xNN> byte tokens, or unk), then repeatedly
// merge the adjacent pair with the lowest merge rank, leftmost first, until no pair has a merge.
// Merging uses a heap over a linked list of symbols: O(n log n) in the piece length, which
// matters for byte-fallback tokenizers whose pieces are whole documents.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/data/pretokenizer.h"
#include "lockstep/data/tokenizer.h"

namespace lockstep {

struct BpeSpec {
  enum class Kind { byte_level, byte_fallback } kind = Kind::byte_level;
  std::string source;  // the file(s), for error messages
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::vector<std::pair<std::string, int32_t>> added;       // matched in the text before anything else
  SplitPattern split = SplitPattern::none;
  bool add_prefix_space = false;   // byte-level: a space before text that does not start with one
  bool metaspace = false;          // byte-fallback: spaces become "▁"
  bool prepend_metaspace = false;  // byte-fallback: "▁" before the text
  bool split_metaspace = false;    // byte-fallback: each "▁" starts a new piece
  bool ignore_merges = false;      // a piece that is itself in the vocabulary is one token
  bool byte_fallback = false;
  bool fuse_unk = false;
  std::string unk_token;                        // empty: none
  std::string eod_token, bos_token, pad_token;  // empty or absent from the vocabulary: none
};

class BpeTokenizer : public Tokenizer {
 public:
  BpeTokenizer(BpeSpec spec, std::string name);
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(decoded_.size()); }

 private:
  void encode_normal(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_uncached(std::string_view piece, std::vector<int32_t>& out) const;
  void merge(std::vector<int32_t>& symbols) const;
  int32_t find(const std::string& token) const;

  BpeSpec::Kind kind_;
  SplitPattern split_;
  bool add_prefix_space_, metaspace_, prepend_metaspace_, split_metaspace_, ignore_merges_, byte_fallback_, fuse_unk_;
  int32_t unk_ = -1;
  uint64_t serial_;  // tells instances apart in the per-thread piece cache
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left << 32 | right) -> (rank, merged)
  std::vector<int32_t> byte_ids_;     // byte-level: the id of each byte's character; byte-fallback: <0xNN>
  std::vector<std::string> decoded_;  // id -> the bytes it stands for
  std::vector<bool> is_byte_token_;   // byte-fallback: id is a <0xNN> token
  std::vector<std::pair<std::string, int32_t>> added_;  // longest first
  bool added_first_byte_[256] = {};
};

}  // namespace lockstep
