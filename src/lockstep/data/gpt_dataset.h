// GPT-style sampling from indexed datasets (Megatron's GPTDataset and BlendedDataset, with
// Philox in place of numpy's generator), and the train/valid split of documents.
//
// One split of one indexed dataset is a contiguous range of documents. Its token stream for
// epoch e is those documents in an order shuffled by Philox(seed, "data/docs/<split>", e),
// concatenated; sample k of the epoch is the seq_length + 1 tokens starting at token k *
// seq_length of that stream (consecutive samples share one token, the last target of one being
// the first input of the next; samples cross document boundaries), and the epoch has
// (tokens - 1) / seq_length samples. The samples of an epoch are visited in an order shuffled by
// Philox(seed, "data/samples/<split>", e). Sample j of the split is sample j mod S of epoch
// j / S (S samples per epoch). Megatron shuffles the same three indices (document, sample,
// shuffle); it draws them with numpy and may merge the last epochs, so the orders differ.
//
// Blending (data.source = "indexed:A:0.7,indexed:B:0.3"): sample i of the blend goes to the
// dataset d with the largest weight_d * (i + 1) - count_d (lowest d on ties), Megatron's greedy
// rule, which keeps every prefix of the stream within one sample of the weights; it takes that
// dataset's next sample (its own index count_d).
//
// Everything is a pure function of (files, seed, split, sample index): the loader's state is the
// sample index alone, so a run resumed at any step draws exactly the samples it would have drawn.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/data/indexed_dataset.h"

namespace lockstep {

// Documents [begin, end) of each split, from "98,2" or "969,30,1" (train, valid[, test]) the way
// Megatron's get_split_indices rounds them.
struct DocRange {
  int64_t begin = 0, end = 0;
};
std::vector<DocRange> split_documents(const std::string& split, int64_t documents);

// v permuted by Philox(seed, purpose) (Fisher-Yates; a pure function of seed, purpose and v).
void shuffle(std::vector<int64_t>& v, uint64_t seed, uint64_t purpose);

class GptSampler {
 public:
  // split_name ("train", "valid") keys the shuffles and names the split in errors.
  GptSampler(std::shared_ptr<const IndexedDataset> data, DocRange docs, int64_t seq_length, int64_t vocab_size,
             uint64_t seed, const std::string& split_name);

  // out: seq_length + 1 tokens of sample j.
  void sample(int32_t* out, uint64_t j) const;
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  int64_t tokens() const { return tokens_; }

 private:
  struct Epoch {
    uint64_t index;
    std::vector<int64_t> docs;    // document ids in stream order
    std::vector<int64_t> starts;  // token offset of each in the epoch's stream, plus the total
    std::vector<int64_t> order;   // sample visit order
  };
  std::shared_ptr<const Epoch> epoch(uint64_t e) const;

  std::shared_ptr<const IndexedDataset> data_;
  DocRange docs_;
  int64_t T_, vocab_, tokens_ = 0, samples_per_epoch_ = 0;
  uint64_t seed_, doc_purpose_, sample_purpose_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<const Epoch> cached_;
};

// Which dataset and which of its samples sample i of a blend is.
class BlendSchedule {
 public:
  explicit BlendSchedule(std::vector<double> weights);  // normalised here
  // Returns the dataset of sample i and sets *local to its index within that dataset.
  int pick(uint64_t i, uint64_t* local) const;

 private:
  static constexpr uint64_t kSnapshotEvery = 1 << 16;
  std::vector<double> w_;
  mutable std::mutex mu_;
  mutable uint64_t pos_ = 0;  // counts_ hold the state before sample pos_
  mutable std::vector<uint64_t> counts_;
  mutable std::vector<std::vector<uint64_t>> snapshots_;  // counts before sample k * kSnapshotEvery
};

}  // namespace lockstep
