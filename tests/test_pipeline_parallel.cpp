// Pipeline parallelism (parallel.pipeline, parallel/pipeline/): the schedules on their own (every
// micro-batch's forward and backward once per chunk, in order; in-flight micro-batches; the
// simulated bubble against (p - 1) / (v m + p - 1)), the layer split and its errors, and whole
// runs on the threads backend against the single process: PP 2 and 4, interleaved, all-forward-
// all-backward and an uneven split, on the dense and MoE debug models, alone and with TP, EP and DP,
// plus checkpoints (PP 2 and PP 2 x CP 2 resume bitwise; PP 2 <-> PP 1 resharding).
//
// What is bitwise and what is not: a micro-batch's arithmetic is the single process's on every
// stage, but sums over stages are folded stage by stage (the gradient norm, the MoE aux loss, the
// tied embedding's two gradient halves), so the runs agree with one process to rounding (the
// largest relative loss difference is printed). Run to run and 1 vs 2 threads they are bitwise
// (tests/test_determinism_matrix.cpp rows pp*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/config/config.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/pipeline/pipeline.h"
#include "lockstep/parallel/pipeline/schedule.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::largest_loss_difference;
using testing::read_file;
using testing::TempDir;
using testing::train_ranks;
using testing::trajectory;
using testing::user_error_of;

// 4 layers, 16 sequences of 2 per step: 8 micro-batches on one pipeline.
Config job(const std::string& config, const std::string& out_dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"train.steps=4",
                                "train.eval_interval=0",
                                "train.threads=1",
                                "train.micro_batch=2",
                                "train.global_batch=16",
                                "model.num_layers=4",
                                "data.synthetic_bytes=65536",
                                "dist.timeout_s=30",
                                "train.out_dir=" + out_dir};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + config, o);
}

TEST(PipelineSchedule, EveryChunkRunsEveryMicroBatchOnceInOrder) {
  for (const auto& [kind, p, v, m] :
       std::vector<std::tuple<std::string, int, int, int64_t>>{{"1f1b", 2, 1, 8},
                                                               {"1f1b", 4, 1, 3},
                                                               {"1f1b", 4, 1, 8},
                                                               {"all_forward_all_backward", 3, 1, 5},
                                                               {"1f1b", 2, 2, 4},
                                                               {"1f1b", 4, 2, 8},
                                                               {"1f1b", 2, 3, 2},
                                                               {"1f1b", 3, 2, 9}}) {
    for (int s = 0; s < p; ++s) {
      const auto actions = pipeline_schedule(kind, p, v, m, s);
      std::map<std::pair<bool, int>, int64_t> next;  // (forward, chunk) -> next micro-batch
      for (const PipelineAction& a : actions) {
        int64_t& want = next[{a.forward, a.chunk}];
        EXPECT_EQ(a.micro, want) << kind << " p " << p << " v " << v << " stage " << s;
        ++want;
        const int64_t forwards_done = next[std::make_pair(true, a.chunk)];
        if (!a.forward) {
          EXPECT_GE(forwards_done, a.micro + 1) << "backward before its forward";
        }
      }
      for (const auto& [key, n] : next) EXPECT_EQ(n, m);
      EXPECT_EQ(actions.size(), static_cast<size_t>(2 * m * v));
    }
  }
}

TEST(PipelineSchedule, InFlightMicroBatches) {
  // 1F1B: stage s holds at most p - s micro-batches (m when fewer); all-forward-all-backward: m.
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(max_in_flight(pipeline_schedule("1f1b", 4, 1, 8, s)), 4 - s);
    EXPECT_EQ(max_in_flight(pipeline_schedule("1f1b", 4, 1, 2, s)), std::min(2, 4 - s));
    EXPECT_EQ(max_in_flight(pipeline_schedule("all_forward_all_backward", 4, 1, 8, s)), 8);
  }
  // Interleaved: the warm-up of (p - s - 1) x 2 + (v - 1) x p chunk forwards reaches more
  // micro-batches than plain 1F1B's p - s (a micro-batch stays until its chunk-0 backward), but
  // fewer than m.
  for (int s = 0; s < 4; ++s) {
    const int64_t n = max_in_flight(pipeline_schedule("1f1b", 4, 2, 16, s));
    EXPECT_GT(n, 4 - s);
    EXPECT_LT(n, 16);
  }
}

TEST(PipelineSchedule, SimulatedBubbleIsTheAnalyticOne) {
  // Uniform times: the idle fraction is (p - 1) / (v m + p - 1) for every schedule, whatever the
  // forward / backward ratio.
  for (const auto& [kind, p, v, m] :
       std::vector<std::tuple<std::string, int, int, int64_t>>{{"1f1b", 2, 1, 8},
                                                               {"1f1b", 4, 1, 8},
                                                               {"1f1b", 4, 1, 16},
                                                               {"all_forward_all_backward", 4, 1, 8},
                                                               {"1f1b", 2, 2, 8},
                                                               {"1f1b", 4, 2, 8},
                                                               {"1f1b", 4, 4, 16}}) {
    for (const double tb : {1.0, 2.0})
      EXPECT_NEAR(simulated_bubble(kind, p, v, m, 1.0, tb), analytic_bubble(p, v, m), 1e-12)
          << kind << " p " << p << " v " << v << " m " << m << " tb " << tb;
  }
  EXPECT_NEAR(analytic_bubble(4, 1, 8), 3.0 / 11.0, 1e-15);
  EXPECT_NEAR(analytic_bubble(4, 2, 8), 3.0 / 19.0, 1e-15);
}

TEST(PipelineLayout, StagesSplitTheLayersAndNameTheKeysWhenTheyDoNotAddUp) {
  Config c = job("debug.toml", "unused", {"parallel.pipeline=3", "parallel.pipeline_layers=[1, 2,1]"});
  const StagePart first = pipeline_part(c.parallel, 4, 0), middle = pipeline_part(c.parallel, 4, 1),
                  last = pipeline_part(c.parallel, 4, 2);
  EXPECT_TRUE(first.first && !first.last && first.chunks == (std::vector<std::pair<int64_t, int64_t>>{{0, 1}}));
  EXPECT_TRUE(!middle.first && !middle.last && middle.chunks == (std::vector<std::pair<int64_t, int64_t>>{{1, 3}}));
  EXPECT_TRUE(!last.first && last.last && last.chunks == (std::vector<std::pair<int64_t, int64_t>>{{3, 4}}));
  c = job("debug.toml", "unused", {"parallel.pipeline=2", "parallel.virtual_pipeline=2"});
  EXPECT_EQ(pipeline_part(c.parallel, 4, 1).chunks, (std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {3, 4}}));

  auto error = [](std::vector<std::string> o) { return user_error_of([&] { job("debug.toml", "unused", o); }); };
  EXPECT_NE(error({"parallel.pipeline=3"})
                .find("model.num_layers = 4 is not divisible by parallel.pipeline x "
                      "parallel.virtual_pipeline = 3 x 1"),
            std::string::npos);
  EXPECT_NE(error({"parallel.pipeline=2", "parallel.pipeline_layers=[1,2]"})
                .find("adds up to 3 layers, model.num_layers = 4"),
            std::string::npos);
  EXPECT_NE(error({"parallel.pipeline=2", "parallel.pipeline_layers=[1,1,2]"}).find("has 3 entries"),
            std::string::npos);
  EXPECT_NE(error({"parallel.pipeline=2", "parallel.pipeline_layers=[4,0]"}).find("expected positive layer counts"),
            std::string::npos);
  EXPECT_NE(error({"parallel.virtual_pipeline=2"}).find("needs parallel.pipeline > 1"), std::string::npos);
  EXPECT_NE(error({"parallel.pipeline=2", "parallel.virtual_pipeline=2",
                   "parallel.pipeline_schedule=all_forward_all_backward"})
                .find("has no virtual stages"),
            std::string::npos);
  EXPECT_EQ(error({"parallel.pipeline=2", "precision.params=bf16", "precision.fp8=tensorwise"}), "(no error)")
      << "every low-precision recipe runs under pipeline parallelism";
  // Interleaving needs the micro-batches per rank (12 / 2 = 6 here) to be a multiple of pp.
  TempDir dir;
  const Config odd =
      job("debug.toml", dir.path("odd"),
          {"parallel.pipeline=4", "parallel.virtual_pipeline=2", "train.global_batch=12", "model.num_layers=8"});
  std::string msg;
  try {
    train_ranks(4, odd);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("must be a multiple of parallel.pipeline = 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parallel.virtual_pipeline = 2"), std::string::npos) << msg;
}

TEST(PipelineLayout, EachStageHoldsOnlyItsLayersAndTheLastACopyOfTheTiedEmbedding) {
  const Config c = job("debug.toml", "unused", {"parallel.pipeline=2", "model.mtp_num_layers=1"});
  const GPT first(c.model, 2, c.moe, c.precision, TensorParallel{}, nullptr, nullptr, pipeline_part(c.parallel, 4, 0));
  const GPT last(c.model, 2, c.moe, c.precision, TensorParallel{}, nullptr, nullptr, pipeline_part(c.parallel, 4, 1));
  const GPT whole(c.model, 2, c.moe, c.precision);
  EXPECT_GE(first.params().find("layers.1.attn.qkv.weight"), 0);
  EXPECT_LT(first.params().find("layers.2.attn.qkv.weight"), 0);
  EXPECT_LT(first.params().find("final_norm.weight"), 0);
  EXPECT_GE(last.params().find("layers.3.mlp.fc.weight"), 0);
  EXPECT_LT(last.params().find("layers.0.mlp.fc.weight"), 0);
  EXPECT_GE(last.params().find("mtp.layers.0.eh_proj.weight"), 0);
  // gpt2 ties the head to the word embedding, and MTP with learned positions reads both tables.
  const int wte = last.params().find("embedding.word.weight"), wpe = last.params().find("embedding.position.weight");
  ASSERT_GE(wte, 0);
  ASSERT_GE(wpe, 0);
  EXPECT_TRUE(last.params().specs()[wte].role.stage_copy && last.params().specs()[wpe].role.stage_copy);
  EXPECT_FALSE(first.params().specs()[first.params().find("embedding.word.weight")].role.stage_copy);
  // Every parameter once, except the copies.
  EXPECT_EQ(first.params().total() + last.params().total() - 256 * 64 - 64 * 64, whole.params().total());
  EXPECT_LT(first.slot_activation_bytes(), whole.slot_activation_bytes());
}

struct Layout {
  const char* name;
  int ranks;
  std::vector<std::string> overrides;
};

// Trains `config` on the reference layout (by default one rank) and on each layout; every layout's
// losses within `tol` (relative) of the reference's, and the largest difference printed.
void expect_layouts_match(const std::string& config, const std::vector<std::string>& common,
                          const std::vector<Layout>& layouts, double tol,
                          const Layout& reference = {"one process", 1, {}}) {
  TempDir dir;
  std::vector<std::string> o = common;
  o.insert(o.end(), reference.overrides.begin(), reference.overrides.end());
  train_ranks(reference.ranks, job(config, dir.path("reference"), o));
  const auto ref = trajectory(dir.path("reference"));
  for (const Layout& l : layouts) {
    o = common;
    o.insert(o.end(), l.overrides.begin(), l.overrides.end());
    train_ranks(l.ranks, job(config, dir.path(l.name), o));
    const double d = largest_loss_difference(trajectory(dir.path(l.name)), ref);
    std::printf("  %s %-24s largest relative loss difference vs %s: %.3g\n", config.c_str(), l.name, reference.name, d);
    EXPECT_LE(d, tol) << l.name;
  }
}

TEST(PipelineParallel, DenseLayoutsReproduceOneProcess) {
  expect_layouts_match("debug.toml", {"model.preset=llama"},
                       {{"pp2", 2, {"parallel.pipeline=2"}},
                        {"pp4", 4, {"parallel.pipeline=4"}},
                        {"pp2_interleaved", 2, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                        {"pp2_afab", 2, {"parallel.pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward"}},
                        {"pp3_uneven_1_2_1", 3, {"parallel.pipeline=3", "parallel.pipeline_layers=[1,2,1]"}}},
                       1e-6);
}

TEST(PipelineParallel, TiedEmbeddingAndMtpAcrossFirstAndLastStage) {
  expect_layouts_match("debug.toml", {"model.mtp_num_layers=1", "model.num_layers=8"},
                       {{"pp2_gpt2_tied_mtp", 2, {"parallel.pipeline=2"}},
                        {"pp4_interleaved", 4, {"parallel.pipeline=4", "parallel.virtual_pipeline=2"}}},
                       1e-6);
}

TEST(PipelineParallel, MoeLayoutsReproduceOneProcess) {
  const std::vector<std::string> moe = {"moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss",
                                        "moe.input_jitter_eps=0.01"};
  expect_layouts_match("moe-debug.toml", moe,
                       {{"pp2", 2, {"parallel.pipeline=2"}},
                        {"pp4", 4, {"parallel.pipeline=4"}},
                        {"pp2_interleaved", 2, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}}},
                       1e-6);
  // Expert parallelism splits the micro-batches over its data-parallel ranks: the reference is EP
  // on the same ranks of one stage.
  expect_layouts_match(
      "moe-debug.toml", moe,
      {{"pp2_ep2_alltoall", 4, {"parallel.pipeline=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}}}, 1e-6,
      {"ep2 alltoall", 2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}});
  // MoE under tensor parallelism (the experts' tokens split over tp) and expert tensor parallelism.
  expect_layouts_match(
      "moe-debug.toml", moe,
      {{"pp2_tp2_sp_etp2",
        4,
        {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}}},
      1e-6, {"tp2 sp etp2", 2, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}});
}

TEST(PipelineParallel, ComposesWithTensorSequenceAndDataParallel) {
  expect_layouts_match(
      "debug.toml", {"model.preset=llama"},
      {{"pp2_tp2_sp", 4, {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
       {"pp2_dp2_distributed",
        4,
        {"parallel.pipeline=2", "optimizer.distributed=true", "ddp.overlap_param_gather=true"}}},
      1e-6);
  expect_layouts_match("debug.toml", {"model.preset=llama", "precision.params=bf16"},
                       {{"pp2_interleaved_dp2_bf16", 4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}}}, 1e-6);
}

TEST(PipelineParallel, StagesHoldTheActivationsTheScheduleKeepsInFlight) {
  TempDir dir;
  std::map<std::string, double> first_stage_mb;
  for (const std::string schedule : {"1f1b", "all_forward_all_backward"}) {
    train_ranks(4, job("debug.toml", dir.path(schedule),
                       {"parallel.pipeline=4", "parallel.pipeline_schedule=" + schedule, "train.steps=1"}));
    const nlohmann::json j = nlohmann::json::parse(read_file(dir.path(schedule) + "/metrics.jsonl"));
    for (int s = 0; s < 4; ++s)
      EXPECT_EQ(j["pp." + std::to_string(s) + ".in_flight"].get<int64_t>(), schedule == "1f1b" ? 4 - s : 8)
          << schedule << " stage " << s;
    first_stage_mb[schedule] = j["pp.0.activation_mb"].get<double>();
  }
  EXPECT_LT(first_stage_mb["1f1b"], first_stage_mb["all_forward_all_backward"]);
}

// `ranks` ranks training with `keys` (which save at step 2) uninterrupted in dir/full, and stopped
// after step 2 and resumed ("auto") in dir/resumed: every rank's fingerprints are equal. The step-2
// checkpoint read by one process (`single` keys): its steps 3 and 4 follow the ranks' to rounding.
void expect_resumes_bitwise_and_in_one_process(const char* config, int ranks, const std::vector<std::string>& keys,
                                               std::vector<std::string> single, const TempDir& dir) {
  train_ranks(ranks, job(config, dir.path("full"), keys));
  std::vector<std::string> cut = keys;
  cut.push_back("train.exit_interval=2");
  train_ranks(ranks, job(config, dir.path("resumed"), cut));
  cut.back() = "train.resume=auto";
  train_ranks(ranks, job(config, dir.path("resumed"), cut));
  for (int r = 0; r < ranks; ++r)
    EXPECT_EQ(read_file(fingerprint_path(dir.path("full"), r)), read_file(fingerprint_path(dir.path("resumed"), r)))
        << "rank " << r;
  single.push_back("train.resume=" + dir.path("full") + "/checkpoints/step-00000002");
  testing::quiet_train(job(config, dir.path("one"), single));
  const auto full = trajectory(dir.path("full")), one = trajectory(dir.path("one"));
  ASSERT_EQ(full.size(), 4u);
  ASSERT_EQ(one.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_NEAR(one[s].first, full[s + 2].first, 1e-6 * full[s + 2].first);
}

TEST(PipelineParallel, ResumesBitwiseAndReshardsBetweenTwoStagesAndOne) {
  TempDir dir;
  expect_resumes_bitwise_and_in_one_process("moe-debug.toml", 2,
                                            {"parallel.pipeline=2", "model.mtp_num_layers=1", "train.save_interval=2"},
                                            {"model.mtp_num_layers=1"}, dir);
  // And back: a one-process checkpoint read by two stages (the last stage's embedding copy and its
  // moments come from the single tensor the one process wrote).
  testing::quiet_train(job("moe-debug.toml", dir.path("single"), {"model.mtp_num_layers=1", "train.save_interval=2"}));
  train_ranks(2, job("moe-debug.toml", dir.path("two"),
                     {"parallel.pipeline=2", "model.mtp_num_layers=1",
                      "train.resume=" + dir.path("single") + "/checkpoints/step-00000002"}));
  const auto single = trajectory(dir.path("single")), two = trajectory(dir.path("two"));
  ASSERT_EQ(two.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_NEAR(two[s].first, single[s + 2].first, 1e-6 * single[s + 2].first);
}

// Pipeline x context parallelism (PP 2 x CP 2 on 4 ranks, tied head and MTP on the last stage)
// resumes bitwise; its checkpoint (each stage's cp rank 0 writes the stage's tensors, whole)
// continues in one process.
TEST(PipelineParallel, WithContextParallelResumesBitwise) {
  TempDir dir;
  expect_resumes_bitwise_and_in_one_process(
      "debug.toml", 4, {"parallel.pipeline=2", "parallel.context=2", "model.mtp_num_layers=1", "train.save_interval=2"},
      {"model.mtp_num_layers=1"}, dir);
}

}  // namespace
}  // namespace lockstep
