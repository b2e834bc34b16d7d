#include "lockstep/data/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"

namespace lockstep {

// Fisher-Yates driven by Philox: position i swaps with a draw in [0, i] from the 64-bit number
// at counters (2i, 2i+1). The modulo bias (< n / 2^64) is irrelevant; what matters is that the
// permutation is a pure function of (seed, purpose, n).
void shuffle(std::vector<int64_t>& v, uint64_t seed, uint64_t purpose) {
  const RandomStream rng(seed, purpose);
  for (size_t i = v.size(); i-- > 1;) {
    const uint64_t r = (static_cast<uint64_t>(rng.bits(2 * i)) << 32) | rng.bits(2 * i + 1);
    std::swap(v[i], v[r % (i + 1)]);
  }
}

std::vector<DocRange> split_documents(const std::string& split, int64_t documents) {
  std::vector<double> w;
  const char* p = split.c_str();
  for (;;) {
    char* end = nullptr;
    const double x = std::strtod(p, &end);
    if (end == p || !(x >= 0) || !std::isfinite(x))
      user_error("data.split = \"", split,
                 "\": expected 2 or 3 comma-separated non-negative weights (train,valid[,test])");
    w.push_back(x);
    while (*end == ' ') ++end;
    if (*end == 0) break;
    if (*end != ',') user_error("data.split = \"", split, "\": expected weights separated by commas");
    p = end + 1;
  }
  if (w.size() < 2 || w.size() > 3)
    user_error("data.split = \"", split, "\": expected 2 or 3 weights (train,valid[,test]), got ", w.size());
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  if (!(total > 0)) user_error("data.split = \"", split, "\": the weights sum to zero");
  std::vector<int64_t> idx{0};
  for (double x : w) idx.push_back(idx.back() + std::llround(x / total * static_cast<double>(documents)));
  const int64_t diff = idx.back() - documents;
  for (size_t k = 1; k < idx.size(); ++k) idx[k] -= diff;
  std::vector<DocRange> out;
  for (size_t k = 0; k + 1 < idx.size(); ++k) out.push_back({idx[k], idx[k + 1]});
  return out;
}

GptSampler::GptSampler(std::shared_ptr<const IndexedDataset> data, DocRange docs, int64_t seq_length,
                       int64_t vocab_size, uint64_t seed, const std::string& split_name)
    : data_(std::move(data)),
      docs_(docs),
      T_(seq_length),
      vocab_(vocab_size),
      seed_(seed),
      doc_purpose_(purpose_id("data/docs/" + split_name)),
      sample_purpose_(purpose_id("data/samples/" + split_name)) {
  tokens_ = data_->document_begin(docs.end) - data_->document_begin(docs.begin);
  samples_per_epoch_ = tokens_ > 0 ? (tokens_ - 1) / T_ : 0;
  if (samples_per_epoch_ < 1)
    user_error("indexed dataset '", data_->prefix(), "': its ", split_name, " split (documents ", docs.begin, "..",
               docs.end, " of ", data_->documents(), ", see data.split) has ", tokens_,
               " tokens; one sample needs model.seq_length + 1 = ", T_ + 1);
}

std::shared_ptr<const GptSampler::Epoch> GptSampler::epoch(uint64_t e) const {
  {
    std::lock_guard lock(mu_);
    if (cached_ && cached_->index == e) return cached_;
  }
  auto ep = std::make_shared<Epoch>();
  ep->index = e;
  ep->docs.resize(static_cast<size_t>(docs_.end - docs_.begin));
  std::iota(ep->docs.begin(), ep->docs.end(), docs_.begin);
  shuffle(ep->docs, seed_, mix_purpose(doc_purpose_, e));
  ep->starts.resize(ep->docs.size() + 1);
  ep->starts[0] = 0;
  for (size_t k = 0; k < ep->docs.size(); ++k)
    ep->starts[k + 1] = ep->starts[k] + data_->document_begin(ep->docs[k] + 1) - data_->document_begin(ep->docs[k]);
  ep->order.resize(static_cast<size_t>(samples_per_epoch_));
  std::iota(ep->order.begin(), ep->order.end(), 0);
  shuffle(ep->order, seed_, mix_purpose(sample_purpose_, e));
  std::lock_guard lock(mu_);
  cached_ = std::move(ep);
  return cached_;
}

void GptSampler::sample(int32_t* out, uint64_t j) const {
  const auto S = static_cast<uint64_t>(samples_per_epoch_);
  const std::shared_ptr<const Epoch> ep = epoch(j / S);
  int64_t pos = ep->order[j % S] * T_;  // first token in the epoch's stream
  int64_t need = T_ + 1;
  // The document holding token `pos`: the last start <= pos.
  auto k = static_cast<size_t>(std::upper_bound(ep->starts.begin(), ep->starts.end(), pos) - ep->starts.begin() - 1);
  while (need > 0) {
    const int64_t doc = ep->docs[k];
    const int64_t in_doc = pos - ep->starts[k];
    const int64_t n = std::min(need, ep->starts[k + 1] - pos);
    data_->read(out, data_->document_begin(doc) + in_doc, n, vocab_);
    out += n;
    need -= n;
    pos += n;
    ++k;
  }
}

BlendSchedule::BlendSchedule(std::vector<double> weights) : w_(std::move(weights)) {
  const double total = std::accumulate(w_.begin(), w_.end(), 0.0);
  LOCKSTEP_CHECK(total > 0);
  for (double& x : w_) x /= total;
  counts_.assign(w_.size(), 0);
  snapshots_.push_back(counts_);
}

int BlendSchedule::pick(uint64_t i, uint64_t* local) const {
  std::lock_guard lock(mu_);
  if (i < pos_) {  // seek back: restart from the last snapshot at or before i
    const uint64_t s = i / kSnapshotEvery;
    counts_ = snapshots_[s];
    pos_ = s * kSnapshotEvery;
  }
  for (;;) {
    int best = 0;
    double best_err = -1e300;
    for (size_t d = 0; d < w_.size(); ++d) {
      const double err = w_[d] * static_cast<double>(pos_ + 1) - static_cast<double>(counts_[d]);
      if (err > best_err) best_err = err, best = static_cast<int>(d);
    }
    const uint64_t mine = counts_[best]++;
    if (++pos_ % kSnapshotEvery == 0 && pos_ / kSnapshotEvery == snapshots_.size()) snapshots_.push_back(counts_);
    if (pos_ - 1 == i) {
      *local = mine;
      return best;
    }
  }
}

}  // namespace lockstep
