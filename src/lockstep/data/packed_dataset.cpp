#include "lockstep/data/packed_dataset.h"

#include <algorithm>
#include <numeric>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"

namespace lockstep {

PackedSampler::PackedSampler(std::shared_ptr<const IndexedDataset> data, DocRange docs, int64_t seq_length,
                             int64_t vocab_size, int32_t eod, int64_t pad_multiple, uint64_t seed,
                             const std::string& split_name)
    : data_(std::move(data)),
      docs_(docs),
      T_(seq_length),
      vocab_(vocab_size),
      pad_(pad_multiple),
      eod_(eod),
      seed_(seed),
      doc_purpose_(purpose_id("data/docs/" + split_name)),
      row_purpose_(purpose_id("data/rows/" + split_name)),
      split_(split_name) {
  LOCKSTEP_CHECK(pad_ >= 1 && T_ % pad_ == 0, "packed samples: ", T_, " tokens are not a multiple of ", pad_);
  if (docs.end - docs.begin < 1 || data_->document_begin(docs.end) == data_->document_begin(docs.begin))
    user_error("indexed dataset '", data_->prefix(), "': its ", split_name, " split (documents ", docs.begin, "..",
               docs.end, " of ", data_->documents(), ", see data.split) has no tokens to pack");
  first_row_.push_back(0);
}

std::shared_ptr<const PackedSampler::Epoch> PackedSampler::epoch(uint64_t e) const {
  {
    std::lock_guard lock(mu_);
    if (cached_ && cached_->index == e) return cached_;
  }
  auto ep = std::make_shared<Epoch>();
  ep->index = e;
  std::vector<int64_t> docs(static_cast<size_t>(docs_.end - docs_.begin));
  std::iota(docs.begin(), docs.end(), docs_.begin);
  shuffle(docs, seed_, mix_purpose(doc_purpose_, e));
  // First fit in stream order: a piece goes into the earliest of the last kOpenSamples samples with room
  // for its padded length, else opens a new sample (the oldest open one is then closed).
  std::vector<int64_t> row_of;  // each piece's sample
  std::vector<int64_t> used;    // each sample's tokens so far
  for (const int64_t d : docs) {
    const int64_t begin = data_->document_begin(d), n = data_->document_begin(d + 1) - begin;
    if (n == 0) continue;
    int32_t last = 0;
    data_->read(&last, begin + n - 1, 1, vocab_);
    const bool appended = last != eod_;
    const int64_t L = n + (appended ? 1 : 0);
    for (int64_t off = 0; off < L; off += T_) {
      const int64_t len = std::min(T_, L - off), padded = (len + pad_ - 1) / pad_ * pad_;
      const auto open_from = static_cast<int64_t>(used.size()) - std::min<int64_t>(kOpenSamples, used.size());
      int64_t row = open_from;
      while (row < static_cast<int64_t>(used.size()) && used[static_cast<size_t>(row)] + padded > T_) ++row;
      if (row == static_cast<int64_t>(used.size())) used.push_back(0);
      used[static_cast<size_t>(row)] += padded;
      row_of.push_back(row);
      ep->pieces.push_back({d, off, len, padded, appended, L});
    }
  }
  // The pieces grouped by sample, each sample's in stream order.
  std::vector<int64_t> by_row(ep->pieces.size());
  std::iota(by_row.begin(), by_row.end(), 0);
  std::stable_sort(by_row.begin(), by_row.end(), [&](int64_t a, int64_t b) {
    return row_of[static_cast<size_t>(a)] < row_of[static_cast<size_t>(b)];
  });
  std::vector<Piece> sorted;
  sorted.reserve(by_row.size());
  for (size_t k = 0; k < by_row.size(); ++k) {
    const int64_t row = row_of[static_cast<size_t>(by_row[k])];
    if (k == 0 || row != row_of[static_cast<size_t>(by_row[k - 1])]) ep->rows.push_back(static_cast<int64_t>(k));
    sorted.push_back(ep->pieces[static_cast<size_t>(by_row[k])]);
  }
  ep->pieces = std::move(sorted);
  ep->rows.push_back(static_cast<int64_t>(ep->pieces.size()));
  ep->order.resize(ep->rows.size() - 1);
  std::iota(ep->order.begin(), ep->order.end(), 0);
  shuffle(ep->order, seed_, mix_purpose(row_purpose_, e));
  std::lock_guard lock(mu_);
  cached_ = std::move(ep);
  return cached_;
}

void PackedSampler::sample(int32_t* tokens, int32_t* targets, uint64_t j) const {
  // The epoch of sample j: epochs hold different numbers of samples, counted as they are built.
  uint64_t e = 0;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      while (e + 1 < first_row_.size() && first_row_[e + 1] <= j) ++e;
      if (e + 1 < first_row_.size()) break;
    }
    const std::shared_ptr<const Epoch> ep = epoch(first_row_.size() - 1);
    std::lock_guard lock(mu_);
    if (first_row_.size() - 1 == ep->index) first_row_.push_back(first_row_.back() + ep->order.size());
  }
  std::shared_ptr<const Epoch> ep = epoch(e);
  const int64_t row = ep->order[static_cast<size_t>(j - first_row_[e])];
  std::fill(tokens, tokens + T_, eod_);
  std::fill(targets, targets + T_, -1);
  int64_t at = 0;
  std::vector<int32_t> buf;
  for (int64_t k = ep->rows[static_cast<size_t>(row)]; k < ep->rows[static_cast<size_t>(row) + 1]; ++k) {
    const Piece& p = ep->pieces[static_cast<size_t>(k)];
    // The piece's tokens and the one after it (its last target), from the document with its EOD.
    const int64_t real = p.doc_length - (p.appended ? 1 : 0), want = std::min(p.length + 1, p.doc_length - p.offset);
    buf.assign(static_cast<size_t>(want), eod_);
    const int64_t from_file = std::max<int64_t>(0, std::min(want, real - p.offset));
    if (from_file > 0) data_->read(buf.data(), data_->document_begin(p.doc) + p.offset, from_file, vocab_);
    std::copy_n(buf.begin(), p.length, tokens + at);
    for (int64_t i = 0; i + 1 < want; ++i) targets[at + i] = buf[static_cast<size_t>(i) + 1];
    at += p.padded;
  }
}

}  // namespace lockstep
