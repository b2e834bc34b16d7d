#include "lockstep/data/dataset.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"
#include "lockstep/data/gpt_dataset.h"
#include "lockstep/data/packed_dataset.h"
#include "lockstep/data/synthetic_corpus.h"

namespace lockstep {
namespace {

class ByteDataset : public Dataset {
 public:
  ByteDataset(const DataConfig& data, int64_t seq_length, uint64_t seed) : T_(seq_length), seed_(seed) {
    if (data.source == "synthetic") {
      train_ = synthetic_corpus(seed, "train", data.synthetic_bytes);
      eval_ = synthetic_corpus(seed, "eval", std::max<int64_t>(data.synthetic_bytes / 16, 4 * (T_ + 1)));
      description_ = str("synthetic corpus, ", train_.size(), " + ", eval_.size(), " bytes");
      return;
    }
    const std::string path = data.source.substr(5);
    std::ifstream f(path, std::ios::binary);
    if (!f) user_error("data.source = \"", data.source, "\": cannot open '", path, "': ", std::strerror(errno));
    std::vector<uint8_t> all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const auto held = static_cast<size_t>(static_cast<double>(all.size()) * data.eval_fraction);
    const size_t need = static_cast<size_t>(T_ + 1);
    if (all.size() - held < need || held < need)
      user_error("data.source = \"", data.source, "\": '", path, "' has ", all.size(),
                 " bytes; with data.eval_fraction = ", data.eval_fraction, " and model.seq_length = ", T_,
                 " both splits need at least ", need, " bytes");
    eval_.assign(all.end() - static_cast<std::ptrdiff_t>(held), all.end());
    all.resize(all.size() - held);
    train_ = std::move(all);
    description_ = str("text '", path, "', ", train_.size(), " + ", eval_.size(), " bytes");
  }

  void batch(int32_t* tokens, int32_t* targets, Split split, uint64_t first, int64_t batch) const override {
    const std::vector<uint8_t>& src = split == Split::train ? train_ : eval_;
    const RandomStream rng(seed_, purpose_id(split == Split::train ? "data/train" : "data/eval"));
    const uint64_t windows = src.size() - static_cast<uint64_t>(T_);  // starts with T+1 tokens left
    for (int64_t b = 0; b < batch; ++b) {
      const uint64_t i = first + static_cast<uint64_t>(b);
      const uint64_t r = (static_cast<uint64_t>(rng.bits(2 * i)) << 32) | rng.bits(2 * i + 1);
      const uint64_t off = r % windows;
      for (int64_t t = 0; t < T_; ++t) {
        tokens[b * T_ + t] = src[off + t];
        targets[b * T_ + t] = src[off + t + 1];
      }
    }
  }

 private:
  std::vector<uint8_t> train_, eval_;
  int64_t T_;
  uint64_t seed_;
};

// The entries of an indexed data.source: (PREFIX, WEIGHT) each, weight 1 when not given.
std::vector<std::pair<std::string, double>> indexed_entries(const std::string& src) {
  std::vector<std::pair<std::string, double>> out;
  for (size_t p = 0; p <= src.size();) {
    const size_t comma = std::min(src.find(',', p), src.size());
    std::string entry = src.substr(p, comma - p);
    p = comma + 1;
    if (entry.rfind("indexed:", 0) != 0 || entry.size() == 8)
      user_error("data.source = \"", src, "\": entry '", entry, "' is not indexed:PREFIX or indexed:PREFIX:WEIGHT");
    std::string prefix = entry.substr(8);
    double w = 1;
    if (const size_t colon = prefix.rfind(':'); colon != std::string::npos) {
      const std::string ws = prefix.substr(colon + 1);
      char* end = nullptr;
      w = std::strtod(ws.c_str(), &end);
      if (ws.empty() || *end != 0 || !(w > 0) || !std::isfinite(w))
        user_error("data.source = \"", src, "\": weight '", ws, "' of '", prefix.substr(0, colon),
                   "' is not a positive number");
      prefix.resize(colon);
    }
    out.emplace_back(std::move(prefix), w);
    if (comma == src.size()) break;
  }
  return out;
}

// One split of one indexed dataset: GPT-style windows (gpt_dataset.h) or packed documents
// (data.packing = "thd", packed_dataset.h).
struct SplitSampler {
  std::unique_ptr<GptSampler> windows;
  std::unique_ptr<PackedSampler> packed;
  void sample(int32_t* tokens, int32_t* targets, uint64_t j, std::vector<int32_t>& buf) const {
    if (packed) return packed->sample(tokens, targets, j);
    windows->sample(buf.data(), j);
    std::copy(buf.begin(), buf.end() - 1, tokens);
    std::copy(buf.begin() + 1, buf.end(), targets);
  }
};

class IndexedBlend : public Dataset {
 public:
  IndexedBlend(const DataConfig& data, int64_t seq_length, int64_t vocab_size, uint64_t seed, int64_t pad_multiple)
      : T_(seq_length) {
    std::vector<double> weights;
    const std::string& src = data.source;
    description_ = data.packing == "thd" ? "indexed, packed (thd)" : "indexed";
    for (const auto& [prefix, w] : indexed_entries(src)) {
      auto ds = std::make_shared<const IndexedDataset>(prefix);
      const std::vector<DocRange> parts = split_documents(data.split, ds->documents());
      for (int k = 0; k < 2; ++k) {
        const char* name = k == 0 ? "train" : "valid";
        SplitSampler s;
        if (data.packing == "thd")
          s.packed = std::make_unique<PackedSampler>(ds, parts[static_cast<size_t>(k)], T_, vocab_size,
                                                     static_cast<int32_t>(data.eod_token), pad_multiple, seed, name);
        else
          s.windows = std::make_unique<GptSampler>(ds, parts[static_cast<size_t>(k)], T_, vocab_size, seed, name);
        (k == 0 ? train_ : eval_).push_back(std::move(s));
      }
      weights.push_back(w);
      description_ += str(weights.size() > 1 ? " + " : " ", "'", prefix, "' (", ds->documents(), " documents, ",
                          ds->tokens(), " tokens, weight ", w, ")");
    }
    description_ += str(", split ", data.split);
    blend_train_ = std::make_unique<BlendSchedule>(weights);
    blend_eval_ = std::make_unique<BlendSchedule>(weights);
  }

  void batch(int32_t* tokens, int32_t* targets, Split split, uint64_t first, int64_t batch) const override {
    const std::vector<SplitSampler>& samplers = split == Split::train ? train_ : eval_;
    const BlendSchedule& blend = split == Split::train ? *blend_train_ : *blend_eval_;
    std::vector<int32_t> buf(static_cast<size_t>(T_ + 1));
    for (int64_t b = 0; b < batch; ++b) {
      uint64_t local = first + static_cast<uint64_t>(b);
      const int d = samplers.size() == 1 ? 0 : blend.pick(local, &local);
      samplers[static_cast<size_t>(d)].sample(tokens + b * T_, targets + b * T_, local, buf);
    }
  }

 private:
  int64_t T_;
  std::vector<SplitSampler> train_, eval_;
  std::unique_ptr<BlendSchedule> blend_train_, blend_eval_;
};

}  // namespace

std::vector<std::string> data_files(const DataConfig& data) {
  if (data.source.rfind("indexed:", 0) == 0) {
    std::vector<std::string> files;
    for (const auto& [prefix, w] : indexed_entries(data.source)) {
      files.push_back(prefix + ".bin");
      files.push_back(prefix + ".idx");
    }
    return files;
  }
  if (data.source.rfind("text:", 0) == 0) return {data.source.substr(5)};
  return {};
}

std::unique_ptr<Dataset> open_dataset(const DataConfig& data, int64_t seq_length, int64_t vocab_size, uint64_t seed,
                                      int64_t pad_multiple) {
  if (data.source.rfind("indexed:", 0) == 0)
    return std::make_unique<IndexedBlend>(data, seq_length, vocab_size, seed, pad_multiple);
  return std::make_unique<ByteDataset>(data, seq_length, seed);
}

}  // namespace lockstep
