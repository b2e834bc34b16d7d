// Per-step fingerprints: the exact bits of the step's scalars and 64-bit XXH3 hashes of the
// state, one JSON line per step per rank in RUN/fingerprints/rank-NNNNN.jsonl. Two runs agree
// bit for bit exactly when their fingerprint files are identical; `lockstep diff` (train/run_diff.h)
// names the first step, rank and field where they are not.
//
//   {"step":1,"rank":0,"dp":0,"tp":0,"pp":0,"ep":0,"cp":0,"etp":0,
//    "loss":"<hex of the fp64 bits>","lm_loss":"...","aux_loss":"...","mtp_loss":"...",
//    "grad_norm":"...","lr":"...",
//    "params":"<xxh3>","grads":"<xxh3>","optimizer":"<xxh3 of Adam m then v>","rng":"<xxh3>",
//    "format":2}
//
// "format" says how the state hashes cut their buffers into BlockHasher blocks (core/hash.h):
//   2  every parameter's values, gradient and moments on the parameter's own grid of 1 MiB blocks
//      from its element 0 (BlockHasher::update_elements), whichever part of it a rank holds;
//   1  (files without "format", written before 2026-12-04) the parameters as one buffer, the whole
//      table on one grid, and the gradients and moments on a grid from each shard range's first
//      element.
// Hashes of different formats do not compare; lockstep diff leaves them out and says so.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/trace.h"

namespace lockstep {

inline constexpr int kFingerprintFormat = 2;

struct Fingerprint {
  int64_t step = 0;
  // The rank's mesh coordinates (comm/mesh.h): ep and etp say which experts and which part of each
  // expert's hidden units the rank holds. Files written before etp was added lack it; lockstep diff
  // reads both.
  int rank = 0, dp = 0, tp = 0, pp = 0, ep = 0, cp = 0, etp = 0;
  double loss = 0, lm_loss = 0, aux_loss = 0, mtp_loss = 0, grad_norm = 0, lr = 0;
  uint64_t params = 0, grads = 0, optimizer = 0, rng = 0;

  std::string json() const;
};

std::string fingerprint_path(const std::string& run_dir, int rank);
// RUN/trace/rank-NNNNN.jsonl: the module trace (debug.trace = "modules", core/trace.h), one line
// per traced module output or input gradient, in execution order:
//   {"step":3,"micro":0,"module":"layers.1.attn.qkv","kind":"out","hash":"<xxh3 of the exact bits>"}
// with "chunk":C (the model chunk) and "pass":"forward" or "backward" (the pipeline action that
// recorded it) after "micro" under pipeline parallelism.
std::string trace_path(const std::string& run_dir, int rank);
// Those lines for a micro-batch's records, each ending in '\n'.
std::string trace_lines(const std::vector<ModuleTrace::Record>& records);

// The state hashes whose values depend on the file's "format".
bool is_state_hash_field(const std::string& key);

// The fields holding the exact bits of an fp64 value (hex), as opposed to hashes: the quantities
// every rank records with the same value (global ones), which runs of different layouts share.
bool is_fingerprint_scalar(const std::string& key);

// One line of a fingerprint (or trace) file read back: "step" and the other fields in file order,
// each value as its text (strings without quotes, numbers as written). Reading keeps fields it does
// not know, so files from a newer writer still compare.
struct FingerprintLine {
  int64_t step = 0;
  std::vector<std::pair<std::string, std::string>> fields;
  const std::string* find(const std::string& key) const;
};

// The lines of one JSONL file; UserError naming the file and line when one is not a JSON object
// with an integer "step", or a field this writer types (the hex64 scalars and hashes, the integer
// coordinates) holds a value of another type.
std::vector<FingerprintLine> read_fingerprint_lines(const std::string& path);

}  // namespace lockstep
