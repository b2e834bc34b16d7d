#include "lockstep/data/dataset.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"
#include "lockstep/data/synthetic_corpus.h"

namespace lockstep {

ByteDataset::ByteDataset(const DataConfig& data, int64_t seq_length, uint64_t seed)
    : T_(seq_length), seed_(seed) {
  if (data.source == "synthetic") {
    train_ = synthetic_corpus(seed, "train", data.synthetic_bytes);
    eval_ = synthetic_corpus(seed, "eval", std::max<int64_t>(data.synthetic_bytes / 16, 4 * (T_ + 1)));
    description_ = str("synthetic corpus, ", train_.size(), " + ", eval_.size(), " bytes");
  } else {
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
}

void ByteDataset::batch(int32_t* tokens, int32_t* targets, Split split, uint64_t first,
                        int64_t batch) const {
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

}  // namespace lockstep
