// Tokenizers: text <-> token ids, for `lockstep preprocess` and for inspecting data.
//
//   byte                      ids 0..255 are the bytes; 256 <|endoftext|> (end of document),
//                             257 <|bos|>, 258 <|pad|>: vocabulary 259
//   gpt2:VOCAB_JSON,MERGES_TXT  GPT-2 byte-level BPE (vocab.json + merges.txt); end of document
//                             is <|endoftext|>
//   hf:TOKENIZER_JSON         a Hugging Face tokenizer.json with a BPE model: byte-level
//                             (GPT-2, Llama 3, Qwen2) or byte-fallback (Llama 2, Mistral);
//                             tokenizer_hf.cpp lists what is supported, the rest is refused
//                             by name
//
// Byte-level tokenizers encode any byte string, invalid UTF-8 included, and decode it back
// exactly. Byte-fallback tokenizers do too when the vocabulary has all 256 <0xNN> tokens; the
// leading "▁" they prepend is removed again by decode.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text`.
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // One more than the largest id.
  virtual int64_t vocab_size() const = 0;

  // Special tokens; -1 when the tokenizer has none.
  int32_t eod() const { return eod_; }
  int32_t bos() const { return bos_; }
  int32_t pad() const { return pad_; }
  const std::string& name() const { return name_; }

 protected:
  int32_t eod_ = -1, bos_ = -1, pad_ = -1;
  std::string name_;
};

// "byte", "gpt2:VOCAB_JSON,MERGES_TXT" or "hf:TOKENIZER_JSON". Throws UserError naming the file
// and what is wrong with it, or the unsupported feature.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

}  // namespace lockstep
