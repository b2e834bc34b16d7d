// Distributed checkpoints: RUN/checkpoints/step-NNNNNNNN/, written in parallel by the ranks that own
// each piece of the state, committed atomically, verified on load, and readable under any parallel
// layout (resharding). The format is docs/checkpoints.md; in short:
//
//   step-00000100/metadata.json   {"xxh3": <hash of the body>, "metadata": <body>}; the body holds
//                                 the format version, the resolved config, step, samples and tokens
//                                 consumed, seed, LR-schedule state, the parallel layout, the data
//                                 files (bytes, xxh3) and every tensor: name, dtype, global shape and
//                                 its pieces (box offset and shape, flat range within the box, file,
//                                 byte offset, bytes, xxh3)
//   step-00000100/rank-00000.bin  the pieces rank 0 writes, back to back
//
// Atomic: the ranks write into step-NNNNNNNN.tmp/ (every file fsynced), rank 0 writes metadata.json,
// fsyncs the directory and renames it to step-NNNNNNNN/, then fsyncs checkpoints/. A directory named
// step-NNNNNNNN (no suffix) is therefore complete; a crash at any moment leaves the previous ones as
// they were (and a step-NNNNNNNN.tmp/, which the next save removes). keep_last prunes older complete
// checkpoints after the commit, never the newest.
//
// Resharding: a piece of a tensor is a box (tensor / expert / pipeline cuts) plus a flat range of the
// box (distributed-optimizer cuts), so pieces written under one layout are copied, run by run, into
// the pieces another layout holds (load_checkpoint); the values are bitwise the same.
//
// Determinism: a checkpoint stores exact bits and the scalars from which everything else (data
// position, LR, Philox streams) is a pure function, so resuming continues the identical trajectory.
// Requires a file system all ranks see (each rank reads the files holding the pieces it needs).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/core/state_shard.h"

namespace lockstep {

class ParamStore;

class Communicator;

constexpr int kCheckpointFormatVersion = 1;

// The parallel layout a checkpoint was written under (comm/mesh.h sizes).
struct CheckpointLayout {
  int world = 1, tp = 1, cp = 1, dp = 1, pp = 1, ep = 1, etp = 1;
  bool distributed_optimizer = false;
};

// The scalars of the training state. Data, LR and every random stream are pure functions of these
// and the config: the loader's next sample is samples_consumed, the LR of step s is
// learning_rate(config, s), Philox streams are keyed by (seed, purpose, step, element).
struct CheckpointInfo {
  int64_t step = 0;              // optimizer steps completed
  int64_t samples_consumed = 0;  // training sequences consumed (the loader's position)
  int64_t tokens_consumed = 0;
  int64_t skipped_steps = 0;  // steps the non-finite guard skipped (train.on_nonfinite): Adam's count leaves them out
  uint64_t seed = 0;
  std::string lr_schedule;  // train.lr_schedule, for the record
  double lr = 0;            // LR of the last completed step
  std::string config_toml;  // the resolved config (config_to_toml)
  CheckpointLayout layout;
};

// One piece of a tensor as metadata.json records it.
struct CheckpointPiece {
  std::vector<int64_t> box_offset;
  Shape box_shape;
  int64_t flat_begin = 0, flat_end = 0;
  std::string file;  // relative to the checkpoint directory
  int64_t byte_offset = 0, bytes = 0;
  uint64_t xxh3 = 0;
};

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape global_shape;
  std::vector<CheckpointPiece> pieces;
};

struct CheckpointFile {
  std::string name;
  int64_t bytes = 0;
  uint64_t xxh3 = 0;
};

// A checkpoint directory's metadata.json, parsed and checked (format version, its own checksum,
// every tensor's pieces in bounds and covering the tensor exactly once). UserError naming the file
// and the tensor otherwise.
struct CheckpointMetadata {
  std::string dir;
  int format_version = 0;
  CheckpointInfo info;
  std::vector<CheckpointFile> files;
  std::vector<CheckpointTensor> tensors;

  const CheckpointTensor* find(const std::string& name) const;
};
CheckpointMetadata read_checkpoint_metadata(const std::string& dir);

// "RUN/checkpoints/step-00000100" for (RUN/checkpoints, 100).
std::string checkpoint_dir(const std::string& checkpoints_root, int64_t step);
// The complete checkpoints (with metadata.json) under checkpoints_root, oldest first: (step, path).
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& checkpoints_root);
// The newest complete checkpoint directory under checkpoints_root; "" when there is none.
std::string latest_checkpoint(const std::string& checkpoints_root);
// path itself when it is a checkpoint (has metadata.json), else the newest complete checkpoint under
// it (or under path/checkpoints: a run directory); UserError when there is none.
std::string find_checkpoint(const std::string& path);
// train.resume's value: "auto" -> latest_checkpoint(root) ("" when none: start fresh); otherwise
// find_checkpoint(resume).
std::string resolve_resume(const std::string& resume, const std::string& checkpoints_root);

// Fills every shard of `state` (this rank's pieces, any layout) from the checkpoint at dir; each
// piece of the checkpoint that is read is verified against its xxh3. Returns the checkpoint's
// scalars. UserError (naming the file and tensor) on a missing, truncated or corrupt file, a tensor
// the checkpoint lacks, or a tensor whose global shape or dtype differs (a different model cannot
// be resharded into). Reads only; no collectives.
CheckpointInfo load_checkpoint(const std::string& dir, const std::vector<StateShard>& state);

// The whole tensor `name` (global shape) assembled from its pieces, verified.
std::vector<char> read_checkpoint_tensor(const CheckpointMetadata& meta, const CheckpointTensor& t);

// Copies the elements two pieces of one tensor have in common from src into dst, run by run along
// the last dimension (the resharding step); returns how many. Both must describe the same global
// tensor and dtype.
int64_t copy_overlap(const StateShard& dst, const StateShard& src);

// Sets this rank's boxes of parameter i of ps from the whole parameter (its global row-major values):
// how initial weights (train.init_from, upcycling) reach any parallel layout.
void set_param_from_whole(ParamStore& ps, int i, const float* whole);

// Verifies a checkpoint completely: metadata, every file's size and xxh3, every piece's xxh3.
// UserError on the first problem.
void verify_checkpoint(const std::string& dir);

// Saves checkpoints of one run; every rank of comm holds one and calls it at the same steps (its
// calls are collective). train.async_save: save() copies the state into a staging buffer and a
// background thread writes it while training goes on; poll() at every step boundary commits it once
// every rank's write is done (an all-reduce over comm while a save is pending, so every rank commits
// at the same step). finish() waits for and commits a pending save. A failed write (disk full, ...)
// throws UserError on every rank, removes the partial directory and leaves older checkpoints intact.
class CheckpointSaver {
 public:
  CheckpointSaver(std::string checkpoints_root, int64_t keep_last, bool async, Communicator& comm);
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // after_write (optional) runs once this rank's file is written, before the commit (fault
  // injection: train/faults.h), on the thread that writes it.
  void save(const CheckpointInfo& info, const std::vector<StateShard>& state,
            const std::function<void()>& after_write = {});
  void poll();
  void finish();
  bool pending() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Test hook: the checkpoint writer fails with errno `error` (e.g. ENOSPC) once `bytes` more bytes
// have been written in this process; a negative `bytes` turns the fault off.
void inject_checkpoint_write_fault(int64_t bytes, int error);

}  // namespace lockstep
