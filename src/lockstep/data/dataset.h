// Training data for now: a byte-level token stream (vocabulary 256) with a training part and a
// held-out part, and a sampler whose batches are a pure function of (seed, sample index).
//
//   data.source = "synthetic"  - the built-in corpus (synthetic_corpus.h), generated from the seed
//   data.source = "text:PATH"  - the bytes of a file; the trailing eval_fraction is held out
//
// Sample i of a split is the window of seq_length + 1 tokens starting at an offset drawn from
// Philox(seed, purpose "data/<split>", i). The training batch of optimizer step s (counting from
// 1) holds samples (s-1)*global_batch ... s*global_batch - 1, whatever the micro-batch split, so a
// run can restart at any step and draw exactly what it would have drawn.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/config/config.h"

namespace lockstep {

enum class Split { train, eval };

class ByteDataset {
 public:
  // Throws UserError naming the file when it cannot be read or is too short for seq_length.
  ByteDataset(const DataConfig& data, int64_t seq_length, uint64_t seed);

  // tokens, targets: (batch, seq_length) each; samples first .. first + batch - 1 of the split.
  void batch(int32_t* tokens, int32_t* targets, Split split, uint64_t first, int64_t batch) const;

  int64_t size(Split split) const {
    return static_cast<int64_t>(split == Split::train ? train_.size() : eval_.size());
  }
  const std::string& description() const { return description_; }

 private:
  std::vector<uint8_t> train_, eval_;
  int64_t T_;
  uint64_t seed_;
  std::string description_;
};

}  // namespace lockstep
