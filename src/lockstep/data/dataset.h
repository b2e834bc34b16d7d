// The trainer's data: batches of (tokens, targets) for a training and a held-out split, where
// batch contents are a pure function of (config, seed, split, first sample index).
//
//   data.source = "synthetic"   - the built-in corpus (synthetic_corpus.h), generated from the
//                                 seed; bytes, vocabulary 256
//   data.source = "text:PATH"   - the bytes of a file; the trailing data.eval_fraction is held out
//   data.source = "indexed:PREFIX[:WEIGHT],indexed:PREFIX2[:WEIGHT2],..."
//                               - Megatron indexed datasets (PREFIX.bin/.idx), blended by weight,
//                                 documents split into train/valid by data.split; GPT-style
//                                 samples crossing document boundaries (gpt_dataset.h), or with
//                                 data.packing = "thd" whole documents packed (packed_dataset.h)
//
// Byte sources: sample i of a split is the window of seq_length + 1 tokens starting at an offset
// drawn from Philox(seed, purpose "data/<split>", i).
//
// Either way, the training batch of optimizer step s (counting from 1) holds samples
// (s-1)*global_batch ... s*global_batch - 1, whatever the micro-batch split, so a run restarted
// at any step draws exactly what it would have drawn: the loader's state is the step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/config/config.h"

namespace lockstep {

enum class Split { train, eval };

class Dataset {
 public:
  virtual ~Dataset() = default;
  // tokens, targets: (batch, seq_length) each; samples first .. first + batch - 1 of the split.
  // Safe to call from several threads at once.
  virtual void batch(int32_t* tokens, int32_t* targets, Split split, uint64_t first, int64_t batch) const = 0;
  const std::string& description() const { return description_; }

 protected:
  std::string description_;
};

// Opens data.source. Throws UserError naming the source, file or value at fault (a missing or
// broken file, a split too short for one sample, a token id >= vocab_size when it is read).
// pad_multiple: data.packing = "thd" pads each document to a multiple of it (packed_dataset.h).
std::unique_ptr<Dataset> open_dataset(const DataConfig& data, int64_t seq_length, int64_t vocab_size, uint64_t seed,
                                      int64_t pad_multiple = 1);
// The files data.source reads (text: the file; indexed: each PREFIX.bin and PREFIX.idx); none for
// the synthetic corpus, which the binary generates.
std::vector<std::string> data_files(const DataConfig& data);

}  // namespace lockstep
