// Packed variable-length samples (data.packing = "thd": Megatron's packed sequences with cu_seqlens,
// Transformer Engine's THD layout) from an indexed dataset.
//
// A sample is a budget of seq_length tokens filled with whole documents: the split's documents in the
// epoch's shuffled order (Philox(seed, "data/docs/<split>", e), GptSampler's stream), each placed by
// first fit into the earliest of the last kOpenSamples samples with room for it, else into a new one.
// A document longer than the budget is cut into budget-sized pieces (each a sample of its own, the
// last one packed like a document). Every
// document ends with data.eod_token (one is appended when the document does not end with it), which
// is how the model finds the boundaries (data/documents.h: positions restart and attention stays
// inside each document). Each document is padded to a multiple of `pad_multiple` (2 x context
// parallel, x tensor parallel under sequence parallelism, as Megatron and Transformer Engine pad
// THD sequences) with EOD tokens, and the sample's tail with EOD tokens too.
//
// Targets are the next token inside the document: the document's last token (its EOD) and every
// padding token get -1 (no loss), so no position predicts across documents. The loss is the mean
// over the global batch's tokens with a target (train/step.cpp).
//
// The epoch's samples are visited in the order Philox(seed, "data/rows/<split>", e) shuffles them;
// sample j of the split is sample j - (samples of the earlier epochs) of epoch e. Everything is a pure
// function of (files, seed, split, sample index), so resumption and every guarantee hold.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/data/gpt_dataset.h"
#include "lockstep/data/indexed_dataset.h"

namespace lockstep {

class PackedSampler {
 public:
  static constexpr int64_t kOpenSamples = 64;  // samples first fit may still add to

  PackedSampler(std::shared_ptr<const IndexedDataset> data, DocRange docs, int64_t seq_length, int64_t vocab_size,
                int32_t eod, int64_t pad_multiple, uint64_t seed, const std::string& split_name);

  // tokens, targets: seq_length each, sample j of the split.
  void sample(int32_t* tokens, int32_t* targets, uint64_t j) const;

  // A piece of a document placed in a sample: tokens [offset, offset + length) of the document (with
  // its appended EOD at index `tokens` when `appended`), padded to `padded`.
  struct Piece {
    int64_t doc, offset, length, padded;
    bool appended;       // the document's EOD is appended (its last token is not EOD)
    int64_t doc_length;  // the document's tokens, with the appended EOD
  };
  struct Epoch {
    uint64_t index;
    std::vector<Piece> pieces;   // in stream order
    std::vector<int64_t> rows;   // first piece of each sample, plus the total
    std::vector<int64_t> order;  // sample visit order
  };
  std::shared_ptr<const Epoch> epoch(uint64_t e) const;

 private:
  std::shared_ptr<const IndexedDataset> data_;
  DocRange docs_;
  int64_t T_, vocab_, pad_;
  int32_t eod_;
  uint64_t seed_, doc_purpose_, row_purpose_;
  std::string split_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<const Epoch> cached_;
  mutable std::vector<uint64_t> first_row_;  // the split's first sample of each epoch built so far, plus the next
};

}  // namespace lockstep
