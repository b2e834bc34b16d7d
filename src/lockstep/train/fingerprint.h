// Per-step fingerprints: the exact bits of the step's scalars and 64-bit XXH3 hashes of the
// state, one JSON line per step per rank in RUN/fingerprints/rank-NNNNN.jsonl. Two runs agree
// bit for bit exactly when their fingerprint files are identical.
//
//   {"step":1,"rank":0,"dp":0,"tp":0,"pp":0,"ep":0,"cp":0,
//    "loss":"<hex of the fp64 bits>","lm_loss":"...","aux_loss":"...","mtp_loss":"...",
//    "grad_norm":"...","lr":"...",
//    "params":"<xxh3>","grads":"<xxh3>","optimizer":"<xxh3 of Adam m then v>","rng":"<xxh3>"}
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

struct Fingerprint {
  int64_t step = 0;
  int rank = 0, dp = 0, tp = 0, pp = 0, ep = 0, cp = 0;
  double loss = 0, lm_loss = 0, aux_loss = 0, mtp_loss = 0, grad_norm = 0, lr = 0;
  uint64_t params = 0, grads = 0, optimizer = 0, rng = 0;

  std::string json() const;
};

std::string fingerprint_path(const std::string& run_dir, int rank);

}  // namespace lockstep
