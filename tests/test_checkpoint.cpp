// Checkpoints (train/checkpoint.h): the format and resharding between layouts, bitwise resume of
// every model flavour, atomic commits under SIGKILL and write errors, one clear error per kind of
// damage, asynchronous saves, and the ckpt tools with the safetensors round trip.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/hash.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/data_parallel.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/safetensors.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using testing::quiet_train;
using testing::read_file;
using testing::TempDir;
using testing::train_ranks;
using testing::user_error_of;

Config job(const std::string& file, const std::string& out_dir, std::vector<std::string> extra = {}) {
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + file, extra);
}

int64_t count_lines(const std::string& path) {
  const std::string text = read_file(path);
  return std::count(text.begin(), text.end(), '\n');
}

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The loss of each step in a run directory's metrics.jsonl.
std::vector<double> losses_of(const std::string& run_dir) {
  std::vector<double> out;
  std::istringstream in(read_file(run_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

// ---- format and resharding ----

// A (6, 10) tensor and a (7) vector with known values.
std::vector<float> iota(int64_t n, float base) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i);
  return v;
}

// The (6, 10) matrix cut into 2 TP-style row boxes, then each box's flattening split in two flat
// ranges (4 ranks' worth of pieces) saved by 2 ranks; read back whole, as column boxes, and as flat
// ranges of another split: the same bits everywhere.
TEST(CheckpointFormat, PiecesOfAnyLayoutReassembleBitwise) {
  TempDir dir;
  const std::vector<float> w = iota(60, 0.5f), b = iota(7, 100.0f);
  run_threads(2, 60, [&](Communicator& comm) {
    const int r = comm.rank();
    // Rank r holds rows [3r, 3r+3) of w: its two flat halves; the vector as flat halves too.
    std::vector<float> wbox(w.begin() + 30 * r, w.begin() + 30 * (r + 1));
    std::vector<StateShard> state;
    for (int half = 0; half < 2; ++half) {
      StateShard s = whole_tensor("param/w", Shape{6, 10}, wbox.data() + 15 * half, true);
      s.box_offset = {3 * r, 0};
      s.box_shape = Shape{3, 10};
      s.flat_begin = 15 * half;
      s.flat_end = 15 * half + 15;
      state.push_back(s);
    }
    std::vector<float> bpart(b.begin() + 4 * r, r == 0 ? b.begin() + 4 : b.end());
    state.push_back(flat_range("buffer/b", Shape{7}, 4 * r, r == 0 ? 4 : 7, bpart.data(), true));
    CheckpointSaver saver(dir.path("ckpt"), 0, false, comm);
    CheckpointInfo info;
    info.step = 5;
    info.layout.world = 2;
    info.layout.tp = 2;
    saver.save(info, state);
  });
  const std::string step = checkpoint_dir(dir.path("ckpt"), 5);
  ASSERT_EQ(latest_checkpoint(dir.path("ckpt")), step);
  EXPECT_TRUE(fs::exists(step + "/rank-00000.bin") && fs::exists(step + "/rank-00001.bin"));
  verify_checkpoint(step);

  // Whole.
  std::vector<float> w1(60), b1(7);
  load_checkpoint(step, {whole_tensor("param/w", Shape{6, 10}, w1.data(), true),
                         whole_tensor("buffer/b", Shape{7}, b1.data(), true)});
  EXPECT_TRUE(testing::bitwise_equal(w1, w));
  EXPECT_TRUE(testing::bitwise_equal(b1, b));
  // Column boxes (a TP split along the other dimension) and flat ranges of one of them.
  std::vector<float> left(6 * 4), right_a(10), right_b(26);
  StateShard l = whole_tensor("param/w", Shape{6, 10}, left.data(), true);
  l.box_shape = Shape{6, 4};
  l.flat_end = 24;
  StateShard ra = l, rb = l;
  ra.box_offset = rb.box_offset = {0, 4};
  ra.box_shape = rb.box_shape = Shape{6, 6};
  ra.data = right_a.data(), ra.flat_begin = 0, ra.flat_end = 10;
  rb.data = right_b.data(), rb.flat_begin = 10, rb.flat_end = 36;
  load_checkpoint(step, {l, ra, rb});
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 10; ++j) {
      const int64_t k = i * 6 + (j - 4);
      const float got = j < 4 ? left[i * 4 + j] : k < 10 ? right_a[k] : right_b[k - 10];
      EXPECT_EQ(got, w[i * 10 + j]) << i << "," << j;
    }
}

TEST(CheckpointFormat, MetadataRecordsStepLayoutAndEveryShard) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=2", "train.save_interval=2"}));
  const std::string step = checkpoint_dir(dir.path("run/checkpoints"), 2);
  const std::string text = read_file(step + "/metadata.json");
  const auto j = nlohmann::json::parse(text)["metadata"];
  EXPECT_EQ(j["format_version"], kCheckpointFormatVersion);
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["samples_consumed"], 16);  // 2 steps x global batch 8
  EXPECT_EQ(j["tokens_consumed"], 16 * 64);
  EXPECT_EQ(j["rng"]["seed"], 1234);
  EXPECT_EQ(j["lr_scheduler"]["schedule"], "cosine");
  EXPECT_EQ(j["layout"]["world"], 1);
  EXPECT_NE(j["config"].get<std::string>().find("hidden_size = 64"), std::string::npos);
  const CheckpointMetadata meta = read_checkpoint_metadata(step);
  const CheckpointTensor* wte = meta.find("param/embedding.word.weight");
  ASSERT_NE(wte, nullptr);
  EXPECT_EQ(wte->global_shape, (Shape{256, 64}));
  ASSERT_EQ(wte->pieces.size(), 1u);
  EXPECT_EQ(wte->pieces[0].file, "rank-00000.bin");
  EXPECT_EQ(wte->pieces[0].bytes, 256 * 64 * 4);
  EXPECT_NE(meta.find("optim/exp_avg/layers.1.mlp.fc.weight"), nullptr);
  EXPECT_NE(meta.find("optim/exp_avg_sq/final_norm.bias"), nullptr);
  // The stored parameters are the trained model's: its hash is the last fingerprint's.
  GPT model(load_config(step + "/../../config.toml", {}).model, 4);
  std::vector<StateShard> state;
  model.state_shards(state, true, true);
  load_checkpoint(step, state);
  const std::string fp = read_file(fingerprint_path(dir.path("run"), 0));
  const std::string last = fp.substr(fp.rfind("{\"step\":2"));
  EXPECT_NE(last.find("\"params\":\"" + hex64(model.state_hash()) + "\""), std::string::npos);
}

// ---- bitwise resume ----

struct ResumeCase {
  const char* name;
  const char* file;
  std::vector<std::string> keys;
};

// Uninterrupted to step 6, against: stop at step 3 (exit_interval), resume "auto", continue to 6.
void expect_bitwise_resume(const ResumeCase& c, const std::string& threads, const TempDir& dir) {
  SCOPED_TRACE(std::string(c.name) + ", " + threads + " threads");
  const std::vector<std::string> keys =
      plus(c.keys, {"train.steps=6", "train.threads=" + threads, "train.eval_interval=2"});
  const std::string whole = dir.path(std::string(c.name) + threads + "-whole"),
                    cut = dir.path(std::string(c.name) + threads + "-cut");
  quiet_train(job(c.file, whole, keys));
  quiet_train(job(c.file, cut, plus(keys, {"train.save_interval=3", "train.exit_interval=3"})));
  EXPECT_EQ(count_lines(fingerprint_path(cut, 0)), 3);
  quiet_train(job(c.file, cut, plus(keys, {"train.save_interval=3", "train.resume=auto"})));
  EXPECT_EQ(read_file(fingerprint_path(whole, 0)), read_file(fingerprint_path(cut, 0)));
  EXPECT_EQ(latest_checkpoint(cut + "/checkpoints"), checkpoint_dir(cut + "/checkpoints", 6));
}

void expect_bitwise_resume(const ResumeCase& c) {
  TempDir dir;
  for (const char* threads : {"1", "2"}) expect_bitwise_resume(c, threads, dir);
}

TEST(CheckpointResume, DenseResumesBitwiseWithOneAndTwoThreads) { expect_bitwise_resume({"dense", "debug.toml", {}}); }

TEST(CheckpointResume, MoeWithExpertBiasResumesBitwiseWithOneAndTwoThreads) {
  expect_bitwise_resume({"moe-bias",
                         "moe-debug.toml",
                         {"moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
                          "moe.router_bias_update_rate=0.01"}});
}

TEST(CheckpointResume, MtpResumesBitwiseWithOneAndTwoThreads) {
  expect_bitwise_resume({"mtp", "debug.toml", {"model.mtp_num_layers=1"}});
}

TEST(CheckpointResume, Bf16WeightsResumeBitwiseWithOneAndTwoThreads) {
  expect_bitwise_resume({"bf16", "debug.toml", {"precision.params=bf16"}});
}

// Delayed scaling's amax histories and scales are part of the state (the history is longer than
// the steps before the cut, so a resume without them would change the scales).
TEST(CheckpointResume, Fp8DelayedScalingResumesBitwiseWithOneAndTwoThreads) {
  expect_bitwise_resume(
      {"fp8", "debug.toml", {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=8"}});
}

TEST(CheckpointResume, LlamaResumesBitwiseWithOneAndTwoThreads) {
  expect_bitwise_resume({"llama", "debug.toml", {"model.preset=llama", "model.num_query_groups=2"}});
}

// The expert bias is part of the checkpoint: without it the resumed routing would differ.
TEST(CheckpointResume, ExpertBiasIsSaved) {
  TempDir dir;
  quiet_train(job("moe-debug.toml", dir.path("run"),
                  {"train.steps=2", "train.save_interval=2", "moe.router_score_function=sigmoid",
                   "moe.router_enable_expert_bias=true", "moe.router_bias_update_rate=0.01"}));
  const CheckpointMetadata meta = read_checkpoint_metadata(checkpoint_dir(dir.path("run/checkpoints"), 2));
  std::vector<float> v(8);
  for (int l = 0; l < 2; ++l) {
    const CheckpointTensor* bias = meta.find("buffer/layers." + std::to_string(l) + ".moe.router.expert_bias");
    ASSERT_NE(bias, nullptr);
    ASSERT_EQ(bias->global_shape, Shape{4});
    std::memcpy(v.data() + 4 * l, read_checkpoint_tensor(meta, *bias).data(), 16);
  }
  EXPECT_TRUE(std::any_of(v.begin(), v.end(), [](float x) { return x != 0; }));
}

// Resuming from an older checkpoint in the same run directory cuts metrics.jsonl and the
// fingerprints back to its step: the continued files equal the uninterrupted run's.
TEST(CheckpointResume, ResumeFromAnOlderStepCutsTheLogsBack) {
  TempDir dir;
  const std::vector<std::string> keys = {"train.steps=5", "train.eval_interval=2"};
  quiet_train(job("debug.toml", dir.path("whole"), keys));
  quiet_train(job("debug.toml", dir.path("run"), plus(keys, {"train.save_interval=2"})));
  const std::string metrics = read_file(dir.path("run/metrics.jsonl"));
  quiet_train(job("debug.toml", dir.path("run"),
                  plus(keys, {"train.resume=" + checkpoint_dir(dir.path("run/checkpoints"), 2)})));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("whole"), 0)), read_file(fingerprint_path(dir.path("run"), 0)));
  // metrics.jsonl: the same lines (steps and evaluations), in the same order.
  auto steps_of = [](const std::string& text) {
    std::vector<std::string> keys;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      keys.push_back(line.substr(0, line.find(',')) + (line.find("eval_loss") != std::string::npos ? "e" : ""));
    return keys;
  };
  EXPECT_EQ(steps_of(read_file(dir.path("run/metrics.jsonl"))), steps_of(metrics));
  EXPECT_FALSE(fs::exists(dir.path("run/metrics.jsonl.tmp")));
}

TEST(CheckpointResume, AutoWithoutCheckpointsStartsFresh) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("a"), {"train.steps=2"}));
  quiet_train(job("debug.toml", dir.path("b"), {"train.steps=2", "train.resume=auto"}));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("a"), 0)), read_file(fingerprint_path(dir.path("b"), 0)));
  EXPECT_NE(user_error_of([&] {
              quiet_train(job("debug.toml", dir.path("c"), {"train.resume=" + dir.path("a")}));
            }).find("holds no complete step-NNNNNNNN checkpoint"),
            std::string::npos);
}

// ---- data parallelism: resume and resharding ----

std::vector<std::string> dp_keys(int ranks, bool distributed) {
  return {"train.threads=1",
          "train.micro_batch=2",
          "train.eval_interval=0",
          "train.steps=4",
          std::string("optimizer.distributed=") + (distributed ? "true" : "false"),
          "ddp.bucket_size=20000",
          "train.out_dir=unused" + std::to_string(ranks)};
}

// Two thread ranks uninterrupted (RUN-whole) against stopped and saved at step 2, then resumed
// ("auto") in RUN, which keeps the step-2 checkpoint: both ranks' fingerprints equal.
void expect_two_ranks_resume_bitwise(const char* file, const std::vector<std::string>& keys, const TempDir& dir,
                                     const std::string& run) {
  train_ranks(2, job(file, dir.path(run + "-whole"), keys));
  train_ranks(2, job(file, dir.path(run), plus(keys, {"train.save_interval=2", "train.exit_interval=2"})));
  train_ranks(2, job(file, dir.path(run), plus(keys, {"train.resume=auto"})));
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(read_file(fingerprint_path(dir.path(run + "-whole"), r)), read_file(fingerprint_path(dir.path(run), r)))
        << r;
}

// DP = 2 with the replicated and the distributed optimizer: stop at 2, resume, continue to 4: both
// ranks' fingerprints equal the uninterrupted run's. The distributed optimizer's moments are written
// by both ranks, each its own flat ranges.
TEST(CheckpointDataParallel, TwoRanksResumeBitwiseWithEitherOptimizer) {
  for (const char* mode : {"replicated", "distributed", "distributed+overlap"}) {
    SCOPED_TRACE(mode);
    const bool distributed = mode != std::string("replicated");
    TempDir dir;
    std::vector<std::string> keys = dp_keys(2, distributed);
    // Overlapped parameter gathers: a step's parameters are complete only once the next forward
    // needs them; a save waits for them.
    keys.push_back(std::string("ddp.overlap_param_gather=") +
                   (mode == std::string("distributed+overlap") ? "true" : "false"));
    expect_two_ranks_resume_bitwise("debug.toml", keys, dir, "cut");
    const CheckpointMetadata meta = read_checkpoint_metadata(checkpoint_dir(dir.path("cut/checkpoints"), 2));
    EXPECT_EQ(meta.info.layout.dp, 2);
    EXPECT_EQ(meta.info.layout.distributed_optimizer, distributed);
    EXPECT_EQ(meta.files.size(), distributed ? 2u : 1u);
    const CheckpointTensor* m = meta.find("optim/exp_avg/layers.0.mlp.fc.weight");
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->pieces.size(), distributed ? 2u : 1u);  // the bucket of 20000 elements cuts it between the ranks
  }
}

// The state a rank of a DP x TP layout holds, as the trainer builds it, loaded from a checkpoint,
// then saved again under that layout.
void load_and_resave(int ranks, int tp_size, bool distributed, const std::string& from, const std::string& to_root) {
  const Config c =
      job("debug.toml", "unused", plus(dp_keys(ranks, distributed), {"parallel.tensor=" + std::to_string(tp_size)}));
  run_threads(ranks, 60, [&](Communicator& comm) {
    const Mesh mesh(comm.size(), {tp_size, 1, 1, 1, 1});
    Communicator dense = comm.split_groups(mesh.groups(MeshGroup::dp_cp));
    Communicator expert = comm.split_groups(mesh.groups(MeshGroup::edp));
    Communicator tp_group = comm.split_groups(mesh.groups(MeshGroup::tp));
    GPT model(c.model, c.train.micro_batch, c.moe, c.precision, TensorParallel(&tp_group, false));
    DataParallel dp(model.params(), dense, expert, c.ddp, distributed);
    Optimizer opt(model.params(), c.optimizer, dp.optimizer_ranges());
    std::vector<StateShard> state;
    const MeshCoordinates at = mesh.coordinates(comm.rank());
    model.state_shards(state, at.dp == 0, at.tp == 0, at.edp == 0);
    opt.state_shards(model.params(), state, at.dp == 0 || distributed, at.tp == 0, at.edp == 0 || distributed);
    const CheckpointInfo info = load_checkpoint(from, state);
    CheckpointSaver saver(to_root, 0, false, comm);
    saver.save(info, state);
  });
}

// Every tensor of checkpoint a equals checkpoint b's after reassembly, bit for bit.
void expect_same_tensors(const std::string& a, const std::string& b) {
  const CheckpointMetadata ma = read_checkpoint_metadata(a), mb = read_checkpoint_metadata(b);
  ASSERT_EQ(ma.tensors.size(), mb.tensors.size());
  for (const CheckpointTensor& t : ma.tensors) {
    const CheckpointTensor* u = mb.find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(read_checkpoint_tensor(ma, t), read_checkpoint_tensor(mb, *u)) << t.name;
  }
}

// DP 2 (distributed optimizer) -> DP 1 and DP 1 -> DP 2: the state loaded under the other layout
// and saved again reassembles to the same bits, and training continues from it.
TEST(CheckpointDataParallel, ReshardsBetweenDpTwoAndDpOne) {
  TempDir dir;
  train_ranks(2, job("debug.toml", dir.path("dp2"),
                     plus(dp_keys(2, true), {"train.save_interval=2", "train.exit_interval=2"})));
  train_ranks(1, job("debug.toml", dir.path("dp1"),
                     plus(dp_keys(1, false), {"train.save_interval=2", "train.exit_interval=2"})));
  const std::string dp2 = checkpoint_dir(dir.path("dp2/checkpoints"), 2),
                    dp1 = checkpoint_dir(dir.path("dp1/checkpoints"), 2);
  ASSERT_EQ(read_checkpoint_metadata(dp2).files.size(), 2u);

  load_and_resave(1, 1, false, dp2, dir.path("dp2-as-dp1"));
  expect_same_tensors(dp2, checkpoint_dir(dir.path("dp2-as-dp1"), 2));
  EXPECT_EQ(read_checkpoint_metadata(checkpoint_dir(dir.path("dp2-as-dp1"), 2)).files.size(), 1u);
  load_and_resave(2, 1, true, dp1, dir.path("dp1-as-dp2"));
  expect_same_tensors(dp1, checkpoint_dir(dir.path("dp1-as-dp2"), 2));
  EXPECT_EQ(read_checkpoint_metadata(checkpoint_dir(dir.path("dp1-as-dp2"), 2)).files.size(), 2u);

  // Training continues under the other layout.
  train_ranks(1, job("debug.toml", dir.path("dp2to1"),
                     plus(dp_keys(1, false), {"train.save_interval=4", "train.resume=" + dp2})));
  train_ranks(2, job("debug.toml", dir.path("dp1to2"),
                     plus(dp_keys(2, true), {"train.save_interval=4", "train.resume=" + dp1})));
  for (const char* run : {"dp2to1", "dp1to2"}) {
    const std::string fp = read_file(fingerprint_path(dir.path(run), 0));
    EXPECT_EQ(std::count(fp.begin(), fp.end(), '\n'), 2) << run;  // steps 3 and 4
    verify_checkpoint(checkpoint_dir(dir.path(std::string(run) + "/checkpoints"), 4));
  }
}

// ---- tensor parallelism: resume and resharding ----

// Checkpoints a and b hold the same tensors (names and global shapes), whatever their pieces.
void expect_same_global_tensors(const CheckpointMetadata& a, const CheckpointMetadata& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const CheckpointTensor& t : a.tensors) {
    ASSERT_NE(b.find(t.name), nullptr) << t.name;
    EXPECT_EQ(t.global_shape, b.find(t.name)->global_shape) << t.name;
  }
}

// TP 2 (with sequence parallelism) resumes bitwise on both ranks; its pieces are boxes of the
// global tensors (QKV: one box per section), which reassemble to the same bits under TP 1 and back,
// and training continues under the other layout.
TEST(CheckpointTensorParallel, ResumesBitwiseAndReshardsBetweenTpTwoAndOne) {
  TempDir dir;
  const std::vector<std::string> tp2 =
      plus(dp_keys(2, false), {"parallel.tensor=2", "parallel.sequence_parallel=true"});
  expect_two_ranks_resume_bitwise("debug.toml", tp2, dir, "tp2");

  train_ranks(1, job("debug.toml", dir.path("tp1"),
                     plus(dp_keys(1, false), {"train.save_interval=2", "train.exit_interval=2"})));
  const std::string at2 = checkpoint_dir(dir.path("tp2/checkpoints"), 2),
                    at1 = checkpoint_dir(dir.path("tp1/checkpoints"), 2);
  const CheckpointMetadata m2 = read_checkpoint_metadata(at2), m1 = read_checkpoint_metadata(at1);
  EXPECT_EQ(m2.info.layout.tp, 2);
  EXPECT_EQ(m2.files.size(), 2u);
  expect_same_global_tensors(m2, m1);
  EXPECT_EQ(m2.find("param/layers.0.attn.qkv.weight")->pieces.size(), 6u);   // 2 ranks x [Q | K | V]
  EXPECT_EQ(m2.find("param/layers.0.attn_norm.weight")->pieces.size(), 1u);  // replicated: written once

  load_and_resave(1, 1, false, at2, dir.path("tp2-as-tp1"));
  expect_same_tensors(at2, checkpoint_dir(dir.path("tp2-as-tp1"), 2));
  load_and_resave(2, 2, false, at1, dir.path("tp1-as-tp2"));
  expect_same_tensors(at1, checkpoint_dir(dir.path("tp1-as-tp2"), 2));

  train_ranks(1, job("debug.toml", dir.path("tp2to1"), plus(dp_keys(1, false), {"train.resume=" + at2})));
  train_ranks(2, job("debug.toml", dir.path("tp1to2"), plus(tp2, {"train.resume=" + at1})));
  for (const char* run : {"tp2to1", "tp1to2"}) EXPECT_EQ(count_lines(fingerprint_path(dir.path(run), 0)), 2) << run;
}

// ---- context parallelism: resume and resharding ----

// CP 2 resumes bitwise on both ranks. Its ranks hold whole replicas (the cp ranks split tokens, not
// parameters), so cp rank 0 alone writes them: the checkpoint has the single process's tensors, in
// one file, and continues under CP 1 and back.
TEST(CheckpointContextParallel, ResumesBitwiseAndReshardsBetweenCpTwoAndOne) {
  TempDir dir;
  const std::vector<std::string> cp2 = plus(dp_keys(2, false), {"parallel.context=2"});
  expect_two_ranks_resume_bitwise("debug.toml", cp2, dir, "cp2");
  train_ranks(1, job("debug.toml", dir.path("cp1"),
                     plus(dp_keys(1, false), {"train.save_interval=2", "train.exit_interval=2"})));
  const std::string at2 = checkpoint_dir(dir.path("cp2/checkpoints"), 2),
                    at1 = checkpoint_dir(dir.path("cp1/checkpoints"), 2);
  const CheckpointMetadata m2 = read_checkpoint_metadata(at2), m1 = read_checkpoint_metadata(at1);
  EXPECT_EQ(m2.info.layout.cp, 2);
  EXPECT_EQ(m2.info.layout.dp, 1);
  EXPECT_EQ(m2.files.size(), 1u);
  expect_same_global_tensors(m2, m1);
  for (const CheckpointTensor& t : m2.tensors) EXPECT_EQ(t.pieces.size(), 1u) << t.name;
  train_ranks(1, job("debug.toml", dir.path("cp2to1"), plus(dp_keys(1, false), {"train.resume=" + at2})));
  train_ranks(2, job("debug.toml", dir.path("cp1to2"), plus(cp2, {"train.resume=" + at1})));
  for (const char* run : {"cp2to1", "cp1to2"}) EXPECT_EQ(count_lines(fingerprint_path(dir.path(run), 0)), 2) << run;
  // CP 2's state continues under CP 1 as CP 2 itself continues, to rounding.
  const auto whole = testing::trajectory(dir.path("cp2-whole")), moved = testing::trajectory(dir.path("cp2to1"));
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(moved.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_NEAR(moved[s].first, whole[s + 2].first, 1e-6 * whole[s + 2].first) << s;
}

// ---- expert tensor parallelism: resume and resharding ----

// TP 2 + SP with ETP 2 (the MoE preset on 2 ranks) resumes bitwise on both ranks; each expert's
// pieces are boxes of the global tensors (fc: one per expert and rank, proj.bias from etp rank 0
// only), and a checkpoint continues under the other layout (ETP 2 -> 1 process, 1 -> ETP 2) with
// the losses of the uninterrupted run in that layout, to rounding.
TEST(CheckpointExpertTensorParallel, ResumesBitwiseAndReshardsBetweenEtpTwoAndOne) {
  TempDir dir;
  const std::vector<std::string> etp2 =
      plus(dp_keys(2, false), {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"});
  const std::vector<std::string> one = dp_keys(1, false);
  expect_two_ranks_resume_bitwise("moe-debug.toml", etp2, dir, "etp2");
  // Rank 1 holds the second half of each expert's hidden units: its fingerprints say so.
  EXPECT_NE(read_file(fingerprint_path(dir.path("etp2"), 1)).find("\"tp\":1,\"pp\":0,\"ep\":0,\"cp\":0,\"etp\":1,"),
            std::string::npos);

  train_ranks(1, job("moe-debug.toml", dir.path("whole1"), one));
  train_ranks(1,
              job("moe-debug.toml", dir.path("etp1"), plus(one, {"train.save_interval=2", "train.exit_interval=2"})));
  const std::string at2 = checkpoint_dir(dir.path("etp2/checkpoints"), 2),
                    at1 = checkpoint_dir(dir.path("etp1/checkpoints"), 2);
  const CheckpointMetadata m2 = read_checkpoint_metadata(at2), m1 = read_checkpoint_metadata(at1);
  EXPECT_EQ(m2.info.layout.etp, 2);
  ASSERT_EQ(m2.tensors.size(), m1.tensors.size());
  for (const CheckpointTensor& t : m2.tensors) {
    ASSERT_NE(m1.find(t.name), nullptr) << t.name;
    EXPECT_EQ(t.global_shape, m1.find(t.name)->global_shape) << t.name;
  }
  EXPECT_EQ(m2.find("param/layers.0.moe.experts.fc.weight")->pieces.size(), 8u);    // 2 ranks x 4 experts
  EXPECT_EQ(m2.find("param/layers.0.moe.experts.proj.weight")->pieces.size(), 2u);  // columns of each rank's units
  EXPECT_EQ(m2.find("param/layers.0.moe.experts.proj.bias")->pieces.size(), 1u);    // etp rank 0's
  EXPECT_EQ(m2.find("param/layers.0.moe.router.weight")->pieces.size(), 1u);        // replicated: written once

  train_ranks(1, job("moe-debug.toml", dir.path("etp2to1"), plus(one, {"train.resume=" + at2})));
  train_ranks(2, job("moe-debug.toml", dir.path("etp1to2"), plus(etp2, {"train.resume=" + at1})));
  auto losses = [&](const std::string& run) { return losses_of(dir.path(run)); };
  const std::vector<double> w1 = losses("whole1"), w2 = losses("etp2-whole"), r1 = losses("etp2to1"),
                            r2 = losses("etp1to2");
  ASSERT_EQ(w1.size(), 4u);
  ASSERT_EQ(r1.size(), 2u);  // steps 3 and 4
  ASSERT_EQ(r2.size(), 2u);
  for (size_t s = 2; s < 4; ++s) {
    EXPECT_NEAR(r1[s - 2], w1[s], 1e-6 * w1[s]) << "ETP 2 -> 1, step " << s + 1;
    EXPECT_NEAR(r2[s - 2], w2[s], 1e-6 * w2[s]) << "1 -> ETP 2, step " << s + 1;
  }
}

// ---- expert parallelism: resume and resharding ----

// EP 2 with the all-to-all dispatcher (the MoE preset on 2 ranks, 2 experts each) resumes bitwise on
// both ranks, and its checkpoint continues as one process (both ranks' experts reassembled) with the
// losses of the uninterrupted one-process run, to rounding.
TEST(CheckpointExpertParallel, ResumesBitwiseAndReshardsFromEpTwoToOne) {
  TempDir dir;
  const std::vector<std::string> ep2 = plus(dp_keys(2, false), {"parallel.expert=2", "moe.token_dispatcher=alltoall"});
  const std::vector<std::string> one = dp_keys(1, false);
  expect_two_ranks_resume_bitwise("moe-debug.toml", ep2, dir, "ep2");

  const std::string at2 = checkpoint_dir(dir.path("ep2/checkpoints"), 2);
  const CheckpointMetadata m2 = read_checkpoint_metadata(at2);
  EXPECT_EQ(m2.info.layout.ep, 2);
  EXPECT_EQ(m2.files.size(), 2u);  // each rank's experts
  train_ranks(1, job("moe-debug.toml", dir.path("whole1"), one));
  train_ranks(1, job("moe-debug.toml", dir.path("ep2to1"), plus(one, {"train.resume=" + at2})));
  const std::vector<double> whole = losses_of(dir.path("whole1")), resumed = losses_of(dir.path("ep2to1"));
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(resumed.size(), 2u);  // steps 3 and 4
  for (size_t s = 2; s < 4; ++s) EXPECT_NEAR(resumed[s - 2], whole[s], 1e-6 * whole[s]) << "EP 2 -> 1, step " << s + 1;
}

// Run mode's delayed-scaling histories are the same on every rank holding a tensor, so they are
// saved as whole tensors by global name (an expert by its index in the layer): an EP 2 run resumes
// bitwise on EP 2 and continues on one process (before, (world, history) rows named by the rank's
// expert index, which only the same world size could read).
TEST(CheckpointExpertParallel, DelayedScalingHistoriesReshardFromEpTwoToOne) {
  TempDir dir;
  const std::vector<std::string> delayed = {"precision.params=bf16", "precision.fp8=delayed",
                                            "precision.fp8_amax_history_len=4"};
  const std::vector<std::string> one = plus(dp_keys(1, false), delayed);
  const std::vector<std::string> ep2 = plus(plus(dp_keys(2, false), delayed), {"parallel.expert=2"});
  expect_two_ranks_resume_bitwise("moe-debug.toml", ep2, dir, "ep2");

  const CheckpointMetadata m2 = read_checkpoint_metadata(checkpoint_dir(dir.path("ep2/checkpoints"), 2));
  // moe-debug's 4 experts: 2 and 3 live on rank 1.
  for (const char* name : {"buffer/fp8.layers.0.attn.qkv.weight.grad.amax_history",
                           "buffer/fp8.layers.1.moe.experts.fc.weight.3.input.amax_history"}) {
    const CheckpointTensor* h = m2.find(name);
    ASSERT_NE(h, nullptr) << name;
    EXPECT_EQ(h->global_shape, Shape{4}) << name;
  }
  // One process reads every history back (each expert's from the rank that held it) ...
  const std::string at2 = checkpoint_dir(dir.path("ep2/checkpoints"), 2);
  const Config c = load_config(dir.path("ep2/config.toml"), {});
  GPT model(c.model, c.train.micro_batch, c.moe, c.precision);
  std::vector<StateShard> state;
  model.state_shards(state, true, true);
  load_checkpoint(at2, state);
  int compared = 0;
  for (const Precision::NamedHistory& h : model.params().precision().amax_histories()) {
    const CheckpointTensor* saved = m2.find("buffer/fp8." + h.global_name + ".amax_history");
    ASSERT_NE(saved, nullptr) << h.global_name;
    const std::vector<char> bytes = read_checkpoint_tensor(m2, *saved);
    ASSERT_EQ(bytes.size(), 4 * sizeof(float)) << h.global_name;
    std::vector<float> v(4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    EXPECT_TRUE(testing::bitwise_equal(v.data(), h.history->amax.data(), 4)) << h.global_name;
    compared += std::any_of(v.begin(), v.end(), [](float a) { return a != 0; });
  }
  EXPECT_GT(compared, 0);
  // ... and the job continues there.
  train_ranks(1, job("moe-debug.toml", dir.path("ep2to1"), plus(one, {"train.resume=" + at2})));
  EXPECT_EQ(losses_of(dir.path("ep2to1")).size(), 2u);  // steps 3 and 4
}

// ---- atomic commits ----

TEST(CheckpointAtomic, KeepLastPrunesOlderAndKeepsTheNewest) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=5", "train.save_interval=1", "train.keep_last=2"}));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path("run/checkpoints")))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-00000004", "step-00000005"}));
}

// Partial checkpoints of saves a crash interrupted (step-NNNNNNNN.tmp, of any step) are removed by
// the next save; other entries stay.
TEST(CheckpointAtomic, LeftoverTmpDirectoriesAreRemovedOnTheNextSave) {
  TempDir dir;
  const std::string root = dir.path("run/checkpoints");
  for (const char* name : {"step-00000001.tmp", "step-00000009.tmp", "step-0009.tmp", "notes.tmp"}) {
    fs::create_directories(root + "/" + name);
    std::ofstream(root + "/" + name + "/rank-00000.bin") << "partial";
  }
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=2", "train.save_interval=2", "train.eval_interval=0"}));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"notes.tmp", "step-00000002", "step-0009.tmp"}));
}

TEST(CheckpointAtomic, AWriteErrorFailsCleanlyAndKeepsThePreviousCheckpoint) {
  TempDir dir;
  const std::vector<std::string> keys = {"train.steps=4", "train.save_interval=2"};
  quiet_train(job("debug.toml", dir.path("run"), plus(keys, {"train.exit_interval=2"})));
  const std::string previous = checkpoint_dir(dir.path("run/checkpoints"), 2);
  inject_checkpoint_write_fault(100000, ENOSPC);  // the disk fills up inside the next data file
  const std::string err =
      user_error_of([&] { quiet_train(job("debug.toml", dir.path("run"), plus(keys, {"train.resume=auto"}))); });
  inject_checkpoint_write_fault(-1, 0);
  EXPECT_NE(err.find("checkpoint at step 4 failed: cannot write checkpoint file '"), std::string::npos) << err;
  EXPECT_NE(err.find("rank-00000.bin': No space left on device"), std::string::npos) << err;
  EXPECT_NE(err.find("the latest complete checkpoint is " + previous), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(checkpoint_dir(dir.path("run/checkpoints"), 4)));
  EXPECT_FALSE(fs::exists(checkpoint_dir(dir.path("run/checkpoints"), 4) + ".tmp"));
  EXPECT_EQ(latest_checkpoint(dir.path("run/checkpoints")), previous);
  verify_checkpoint(previous);
  // The same failure in metadata.json (after every data file is written).
  inject_checkpoint_write_fault(static_cast<int64_t>(fs::file_size(previous + "/rank-00000.bin")) + 10, ENOSPC);
  const std::string err2 =
      user_error_of([&] { quiet_train(job("debug.toml", dir.path("run"), plus(keys, {"train.resume=auto"}))); });
  inject_checkpoint_write_fault(-1, 0);
  EXPECT_NE(err2.find("metadata.json': No space left on device"), std::string::npos) << err2;
  EXPECT_EQ(latest_checkpoint(dir.path("run/checkpoints")), previous);
}

// A training process killed (SIGKILL) at random moments while it saves every step: the newest
// complete checkpoint always verifies and loads, and training resumes from it.
TEST(CheckpointAtomic, SigkillAtRandomMomentsLeavesALoadableLatestCheckpoint) {
  TempDir dir;
  const std::string run = dir.path("run");
  // ~2.4M parameters and one sequence per step: each checkpoint is ~29 MB, so most of a step is spent
  // writing it.
  const std::vector<std::string> args = {"train",
                                         "-c",
                                         std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml",
                                         "train.out_dir=" + run,
                                         "train.steps=1000",
                                         "train.save_interval=1",
                                         "train.keep_last=2",
                                         "train.resume=auto",
                                         "train.threads=1",
                                         "model.hidden_size=256",
                                         "model.num_layers=3",
                                         "train.eval_interval=0",
                                         "train.global_batch=1",
                                         "train.micro_batch=1"};
  std::mt19937 rng(12345);
  int partial = 0;
  int64_t committed = 0;
  auto latest_step = [&]() -> int64_t {
    const std::string latest = latest_checkpoint(run + "/checkpoints");
    return latest.empty() ? 0 : std::stoll(latest.substr(latest.size() - 8));
  };
  for (int trial = 0; trial < 4; ++trial) {
    const pid_t pid = testing::spawn_cli(args);
    ASSERT_GE(pid, 0);
    // Once this process has committed a checkpoint of its own, kill it at a random moment of the
    // following steps, each of which trains and then saves.
    const auto t0 = std::chrono::steady_clock::now();
    while (latest_step() <= committed && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) usleep(5000);
    usleep(static_cast<useconds_t>(std::uniform_int_distribution<int>(0, 300)(rng)) * 1000);
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the trainer ended before it was killed";
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(run + "/checkpoints", ec))
      if (e.path().extension() == ".tmp") ++partial;
    const std::string latest = latest_checkpoint(run + "/checkpoints");
    ASSERT_GT(latest_step(), committed) << "no checkpoint within a minute";
    committed = latest_step();
    SCOPED_TRACE(latest);
    verify_checkpoint(latest);
    const CheckpointMetadata meta = read_checkpoint_metadata(latest);
    EXPECT_GE(count_lines(fingerprint_path(run, 0)), meta.info.step);
  }
  std::printf("[ info ] %d of 4 kills left a checkpoint being written (step-N.tmp)\n", partial);
  // The run continues from the newest checkpoint: its fingerprints equal a run that was never killed.
  const std::string latest = latest_checkpoint(run + "/checkpoints");
  const int64_t step = read_checkpoint_metadata(latest).info.step;
  const std::vector<std::string> keys = {"train.steps=" + std::to_string(step + 1),
                                         "train.threads=1",
                                         "model.hidden_size=256",
                                         "model.num_layers=3",
                                         "train.eval_interval=0",
                                         "train.global_batch=1",
                                         "train.micro_batch=1"};
  Config resumed = job("debug.toml", run, plus(keys, {"train.resume=auto"}));
  Config fresh = job("debug.toml", dir.path("fresh"), keys);
  // The killed run's LR schedule spans 1000 steps: give the comparison run the same.
  resumed.train.steps = fresh.train.steps = 1000;
  resumed.train.exit_interval = fresh.train.exit_interval = step + 1;
  quiet_train(fresh);
  quiet_train(resumed);
  EXPECT_EQ(read_file(fingerprint_path(dir.path("fresh"), 0)), read_file(fingerprint_path(run, 0)));
}

// ---- damaged checkpoints: one clear error each ----

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    quiet_train(job("debug.toml", dir.path("run"), {"train.steps=2", "train.save_interval=2"}));
    step = checkpoint_dir(dir.path("run/checkpoints"), 2);
    data = step + "/rank-00000.bin";
  }
  std::string load_error(std::vector<std::string> keys = {}) {
    return user_error_of([&] {
      quiet_train(job("debug.toml", dir.path("resumed"), plus({"train.steps=3", "train.resume=" + step}, keys)));
    });
  }
  // Rewrites metadata.json's body through edit and re-frames it with a valid checksum.
  void edit_metadata(const std::function<void(nlohmann::ordered_json&)>& edit) {
    auto j = nlohmann::ordered_json::parse(read_file(step + "/metadata.json"));
    edit(j["metadata"]);
    const std::string body = j["metadata"].dump(1);
    std::ofstream(step + "/metadata.json", std::ios::binary)
        << "{\"xxh3\":\"" << hex64(hash_bytes(body.data(), body.size())) << "\",\"metadata\":" << body << "}\n";
  }
  TempDir dir;
  std::string step, data;
};

TEST_F(CheckpointErrors, FlippedByteNamesTheFileAndTensor) {
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    char c = 0;
    f.read(&c, 1);
    f.seekp(1000);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  const std::string err = load_error();
  EXPECT_EQ(err.find("checkpoint file '" + data +
                     "' is corrupt: the shard of tensor 'param/embedding.word.weight' at bytes 0..65536"),
            0u)
      << err;
  EXPECT_EQ(user_error_of([&] { verify_checkpoint(step); }), err);
}

TEST_F(CheckpointErrors, TruncatedFileNamesTheFileAndTensor) {
  fs::resize_file(data, fs::file_size(data) - 100);
  const std::string err = load_error();
  EXPECT_EQ(err.find("checkpoint file '" + data + "' is truncated: "), 0u) << err;
  EXPECT_NE(err.find("but tensor 'optim/exp_avg_sq/final_norm.bias' has a shard at bytes"), std::string::npos) << err;
}

TEST_F(CheckpointErrors, MissingShardFileAndMissingShardEntry) {
  fs::rename(data, data + ".moved");
  EXPECT_EQ(load_error(),
            "checkpoint file '" + data + "' is missing (a shard of tensor 'param/embedding.word.weight' is in it)");
  fs::rename(data + ".moved", data);
  edit_metadata([](nlohmann::ordered_json& m) {
    for (auto& t : m["tensors"])
      if (t["name"] == "param/layers.0.attn.qkv.weight") {
        // Split the one shard's record in two halves and drop the second.
        auto& s = t["shards"][0];
        s["flat"][1] = s["flat"][1].get<int64_t>() / 2;
        s["bytes"] = s["bytes"].get<int64_t>() / 2;
      }
  });
  EXPECT_EQ(load_error(), "checkpoint file '" + step +
                              "/metadata.json': tensor 'param/layers.0.attn.qkv.weight' is "
                              "incomplete: its shards hold 6144 of 12288 elements (a shard is missing)");
}

TEST_F(CheckpointErrors, WrongFormatVersionAndCorruptMetadata) {
  edit_metadata([](nlohmann::ordered_json& m) { m["format_version"] = 99; });
  EXPECT_EQ(load_error(),
            "checkpoint file '" + step + "/metadata.json' has format version 99; this lockstep reads version 1");
  edit_metadata([](nlohmann::ordered_json& m) { m["format_version"] = 1; });
  EXPECT_EQ(load_error(), "(no error)");
  std::string text = read_file(step + "/metadata.json");
  text[text.find("\"step\": 2") + 8] = '3';
  std::ofstream(step + "/metadata.json", std::ios::binary) << text;
  EXPECT_EQ(load_error().find("checkpoint file '" + step + "/metadata.json' is corrupt: its xxh3 is "), 0u);
}

TEST_F(CheckpointErrors, AnotherModelCannotBeReshardedInto) {
  EXPECT_EQ(load_error({"model.hidden_size=32"}),
            "checkpoint file '" + step +
                "/metadata.json': tensor 'param/embedding.word.weight' is f32 (256, 64), this run "
                "has f32 (256, 32): it cannot be resharded into this run (compare the config in metadata.json)");
  EXPECT_EQ(load_error({"model.num_layers=3"})
                .find("checkpoint file '" + step + "/metadata.json' has no tensor 'param/layers.2."),
            0u);
}

// ---- asynchronous saves ----

TEST(CheckpointAsync, WritesTheSameBytesAsSyncAndResumesBitwise) {
  TempDir dir;
  const std::vector<std::string> keys = {"train.steps=6", "train.save_interval=2"};
  quiet_train(job("debug.toml", dir.path("sync"), keys));
  quiet_train(job("debug.toml", dir.path("async"), plus(keys, {"train.async_save=true"})));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("sync"), 0)), read_file(fingerprint_path(dir.path("async"), 0)));
  for (int64_t s : {2, 4, 6}) {
    const std::string a = checkpoint_dir(dir.path("sync/checkpoints"), s),
                      b = checkpoint_dir(dir.path("async/checkpoints"), s);
    verify_checkpoint(b);
    EXPECT_EQ(read_file(a + "/rank-00000.bin"), read_file(b + "/rank-00000.bin")) << s;
  }
  // Resume from the async run's step-4 checkpoint: bitwise the uninterrupted run.
  quiet_train(
      job("debug.toml", dir.path("async"),
          plus(keys, {"train.async_save=true", "train.resume=" + checkpoint_dir(dir.path("async/checkpoints"), 4)})));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("sync"), 0)), read_file(fingerprint_path(dir.path("async"), 0)));
}

// ---- tools and safetensors ----

TEST(CheckpointTools, InspectVerifyExportAndInitFromRoundTrip) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=2", "train.save_interval=2"}));
  const std::string step = checkpoint_dir(dir.path("run/checkpoints"), 2);
  testing::CliResult r = testing::run_cli(dir, "ckpt inspect run");  // a run directory: its newest
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("step 2, 16 samples"), std::string::npos) << r.out;
  r = testing::run_cli(dir, "ckpt inspect run/checkpoints");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("step 2, 16 samples"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("param/embedding.word.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(256, 64)"), std::string::npos) << r.out;
  r = testing::run_cli(dir, "ckpt verify " + step);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, step + ": ok\n");
  r = testing::run_cli(dir, "ckpt export " + step + " w.safetensors");
  ASSERT_EQ(r.status, 0) << r.err;

  // The exported weights are the checkpoint's parameters, bit for bit (padding included).
  const Config c = load_config(dir.path("run/config.toml"), {});
  GPT from_ckpt(c.model, 4), from_file(c.model, 4);
  std::vector<StateShard> state;
  from_ckpt.state_shards(state, true, true);
  load_checkpoint(step, state);
  load_safetensors(dir.path("w.safetensors"), from_file.params());
  EXPECT_TRUE(
      testing::bitwise_equal(from_ckpt.params().values(), from_file.params().values(), from_ckpt.params().total()));
  // The header: 8-byte little-endian length, JSON with dtype, shape and offsets.
  const std::string file = read_file(dir.path("w.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::json::parse(file.substr(8, n));
  EXPECT_EQ(header["embedding.word.weight"]["dtype"], "F32");
  EXPECT_EQ(header["embedding.word.weight"]["shape"], nlohmann::json::parse("[256, 64]"));

  // init_from: weights drawn with model.init_std = 0.05, written as safetensors, then loaded into a
  // run with the default init_std, train exactly like a run that drew them itself.
  Config wide = c;
  wide.model.init_std = 0.05;
  GPT drawn(wide.model, 4);
  drawn.params().init(wide.train.seed);
  std::vector<SafetensorsTensor> tensors;
  for (int i = 0; i < static_cast<int>(drawn.params().specs().size()); ++i)
    tensors.push_back(
        {drawn.params().specs()[i].name, DType::f32, drawn.params().specs()[i].shape, drawn.params().value(i)});
  write_safetensors(dir.path("wide.safetensors"), tensors, {});
  quiet_train(
      job("debug.toml", dir.path("init"), {"train.steps=3", "train.init_from=" + dir.path("wide.safetensors")}));
  quiet_train(job("debug.toml", dir.path("drawn"), {"train.steps=3", "model.init_std=0.05"}));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("init"), 0)), read_file(fingerprint_path(dir.path("drawn"), 0)));
  const std::string bad = user_error_of([&] {
    quiet_train(job("debug.toml", dir.path("bad"),
                    {"train.steps=1", "model.num_heads=2", "model.hidden_size=32",
                     "train.init_from=" + dir.path("w.safetensors")}));
  });
  EXPECT_EQ(bad, "'" + dir.path("w.safetensors") +
                     "': tensor 'embedding.word.weight' has shape (256, 64), the model's is (256, 32)");
}

// Weights exported from a one-rank run initialise a TP 2 run (each rank cuts its boxes out of the
// whole tensors), which trains with the losses of the one-rank run initialised from the same file.
TEST(CheckpointTools, InitFromUnderTensorParallelTwo) {
  TempDir dir;
  const std::vector<std::string> one = dp_keys(1, false);
  train_ranks(1, job("debug.toml", dir.path("run"), plus(one, {"train.steps=2", "train.save_interval=2"})));
  const testing::CliResult r = testing::run_cli(dir, "ckpt export run w.safetensors");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string init = "train.init_from=" + dir.path("w.safetensors");
  train_ranks(1, job("debug.toml", dir.path("init1"), plus(one, {init})));
  train_ranks(2, job("debug.toml", dir.path("init2"), plus(dp_keys(2, false), {init, "parallel.tensor=2"})));
  const std::vector<double> a = losses_of(dir.path("init1")), b = losses_of(dir.path("init2"));
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t s = 0; s < 4; ++s) EXPECT_NEAR(b[s], a[s], 1e-6 * a[s]) << "step " << s + 1;
  // Not the random init's losses: the file's weights were used.
  train_ranks(1, job("debug.toml", dir.path("fresh"), one));
  EXPECT_NE(losses_of(dir.path("fresh"))[0], a[0]);
}

TEST(CheckpointTools, VerifyExitsOneOnABadCheckpoint) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=1", "train.save_interval=1"}));
  const std::string data = checkpoint_dir(dir.path("run/checkpoints"), 1) + "/rank-00000.bin";
  fs::resize_file(data, 1000);
  const testing::CliResult r = testing::run_cli(dir, "ckpt verify run/checkpoints");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lockstep: ckpt verify: checkpoint file '"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is truncated"), std::string::npos) << r.err;
  EXPECT_EQ(testing::run_cli(dir, "ckpt verify nowhere").status, 1);
}

// Every metadata field verify and load read is checked for its exact type, naming the file and the
// field: each row rewrites one field (and the header hash, so only the type is wrong).
TEST(CheckpointTools, VerifyNamesTheFieldOfAWrongTypedMetadataValue) {
  TempDir dir;
  quiet_train(job("debug.toml", dir.path("run"), {"train.steps=1", "train.save_interval=1"}));
  const std::string ckpt = checkpoint_dir(dir.path("run/checkpoints"), 1);
  const std::string file = ckpt + "/metadata.json";
  const std::string original = read_file(file);
  struct Row {
    const char* pointer;
    nlohmann::ordered_json value;
    const char* message;
  };
  const Row rows[] = {
      {"/layout/world", "2", "field 'layout.world' is \"2\", not an integer"},
      {"/layout/tp", true, "field 'layout.tp' is true, not an integer"},
      {"/layout/dp", 1.5, "field 'layout.dp' is 1.5, not an integer"},
      {"/layout/distributed_optimizer", 0, "field 'layout.distributed_optimizer' is 0, not true or false"},
      {"/step", "1", "field 'step' is \"1\", not an integer"},
      {"/rng/seed", -1, "field 'rng.seed' is -1, not an unsigned integer"},
      {"/lr_scheduler/last_lr", "0.001", "field 'lr_scheduler.last_lr' is \"0.001\", not a number"},
      {"/config", 7, "field 'config' is 7, not a string"},
      {"/files/0/bytes", 1.0, "field 'files[0].bytes' is 1.0, not an integer"},
      {"/tensors/0/shape", nlohmann::ordered_json::array({"a"}),
       "field 'tensors[0].shape' is [\"a\"], not an array of integers"},
      {"/tensors/0/shards/0/byte_offset", false, "field 'tensors[0].shards[0].byte_offset' is false, not an integer"},
  };
  const std::string head = "{\"xxh3\":\"";
  for (const Row& row : rows) {
    SCOPED_TRACE(row.pointer);
    nlohmann::ordered_json wrapper = nlohmann::ordered_json::parse(original);
    wrapper["metadata"][nlohmann::ordered_json::json_pointer(row.pointer)] = row.value;
    const std::string body = wrapper["metadata"].dump(1);
    std::ofstream(file, std::ios::binary)
        << (head + hex64(hash_bytes(body.data(), body.size())) + "\",\"metadata\":" + body + "}\n");
    EXPECT_EQ(testing::user_error_of([&] { verify_checkpoint(ckpt); }),
              str("checkpoint file '", file, "': ", row.message));
    EXPECT_EQ(testing::user_error_of([&] { read_checkpoint_metadata(ckpt); }),
              str("checkpoint file '", file, "': ", row.message));
  }
  const testing::CliResult r = testing::run_cli(dir, "ckpt verify run/checkpoints");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("byte_offset' is false, not an integer"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace lockstep
