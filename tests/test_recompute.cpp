// Activation recompute (train.recompute_granularity = "full", model/gpt.h Recompute): a recomputed
// group's forward runs again in backward and must give the same bits, so every gradient, loss and
// fingerprint equals the run without recompute, in every layout and precision, while the arena
// keeps fewer activations. Also the config rules (Megatron's) and what alloc_peak_mb reports.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "lockstep/config/config.h"
#include "lockstep/core/hash.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;

// One micro-batch's loss, aux loss and gradients (hash) of c's model under `recompute`, and the
// floats its activations take (the slot, the scratch and the recompute region).
struct MicroBatch {
  double loss, aux;
  uint64_t grads;
  int64_t slot_floats, activation_bytes;
};

MicroBatch micro_batch(const Config& c, const Recompute& recompute) {
  GPT model(c.model, c.train.micro_batch, c.moe, c.precision, TensorParallel{}, nullptr, nullptr, StagePart{},
            ContextParallel{}, nullptr, recompute);
  ParamStore& ps = model.params();
  ps.init(c.train.seed);
  const int64_t N = c.train.micro_batch * c.model.seq_length;
  const std::vector<int32_t> tokens = testing::random_ints(N, c.model.vocab_size, 3, "tokens");
  const std::vector<int32_t> targets = testing::random_ints(N, c.model.vocab_size, 3, "targets");
  ps.zero_grads();
  model.begin_step(c.train.seed, 1);
  const double loss = model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N));
  return {loss, model.aux_loss(), hash_floats(ps.grads(), ps.total()), model.slot_activation_bytes() / 4,
          model.activation_bytes()};
}

Config preset(const std::string& name, std::vector<std::string> keys = {}) {
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + name + ".toml", keys);
}

TEST(Recompute, OneMicroBatchHasTheSameBitsAndKeepsFewerActivations) {
  for (const auto& [name, keys] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"debug", {"model.num_layers=4"}},
           {"moe-debug",
            {"model.num_layers=4", "model.preset=llama", "moe.router_score_function=sigmoid",
             "moe.router_enable_expert_bias=true", "moe.aux_loss_coeff=0.01", "moe.input_jitter_eps=0.1",
             "model.mtp_num_layers=1"}},
           {"deepseek-tiny", {}},
           {"debug", {"model.num_layers=4", "precision.params=bf16", "precision.fp8=delayed"}},
       }) {
    const Config c = preset(name, keys);
    const MicroBatch kept = micro_batch(c, Recompute{});
    Recompute selective;
    selective.mlp = selective.moe = true;
    for (const Recompute& r : {Recompute{"uniform", 1}, Recompute{"uniform", 2}, Recompute{"block", 3}, selective}) {
      const MicroBatch re = micro_batch(c, r);
      const std::string what =
          name + " " + (r.method.empty() ? "selective" : r.method) + " " + std::to_string(r.num_layers);
      EXPECT_EQ(std::bit_cast<uint64_t>(re.loss), std::bit_cast<uint64_t>(kept.loss)) << what;
      EXPECT_EQ(std::bit_cast<uint64_t>(re.aux), std::bit_cast<uint64_t>(kept.aux)) << what;
      EXPECT_EQ(re.grads, kept.grads) << what;
      EXPECT_LT(re.slot_floats, kept.slot_floats) << what;
      EXPECT_LT(re.activation_bytes, kept.activation_bytes) << what;
    }
  }
}

// A job of `name` with 3 steps and 2 micro-batches per rank and step.
Config job(const std::string& name, const std::string& out, std::vector<std::string> keys) {
  keys.insert(keys.end(), {"train.out_dir=" + out, "train.steps=3", "train.eval_interval=0"});
  return preset(name, keys);
}

// Every rank's fingerprints of the job with each recompute setting equal the job's without.
void recompute_keeps_fingerprints(const std::string& name, int ranks, const std::vector<std::string>& keys) {
  TempDir dir;
  testing::train_ranks(ranks, job(name, dir.path("kept"), keys));
  int k = 0;
  for (const std::vector<std::string>& r :
       {std::vector<std::string>{"train.recompute_granularity=full", "train.recompute_method=uniform",
                                 "train.recompute_num_layers=1"},
        std::vector<std::string>{"train.recompute_granularity=full", "train.recompute_method=block",
                                 "train.recompute_num_layers=1"},
        std::vector<std::string>{"train.recompute_granularity=selective", "train.recompute_modules=mlp,moe"}}) {
    std::vector<std::string> with = keys;
    with.insert(with.end(), r.begin(), r.end());
    const std::string out = dir.path("re" + std::to_string(k++));
    testing::train_ranks(ranks, job(name, out, with));
    for (int rank = 0; rank < ranks; ++rank) {
      const std::string a = testing::read_file(fingerprint_path(dir.path("kept"), rank));
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(testing::read_file(fingerprint_path(out, rank)), a)
          << name << " " << ranks << " ranks " << with.back() << " " << with[with.size() - 2] << ": rank " << rank;
    }
  }
}

TEST(Recompute, FingerprintsAreTheSameInEveryLayout) {
  const std::vector<std::string> four = {"model.num_layers=4", "train.global_batch=8", "train.micro_batch=2"};
  auto plus = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), four.begin(), four.end());
    return extra;
  };
  recompute_keeps_fingerprints("debug", 1, plus({}));
  recompute_keeps_fingerprints("debug", 2, plus({"parallel.pipeline=2"}));
  recompute_keeps_fingerprints("debug", 2, plus({"parallel.pipeline=2", "parallel.virtual_pipeline=2"}));
  recompute_keeps_fingerprints("debug", 2, plus({"parallel.tensor=2", "parallel.sequence_parallel=true"}));
  recompute_keeps_fingerprints("debug", 2, plus({"parallel.context=2", "model.preset=llama"}));
  recompute_keeps_fingerprints("debug", 2, plus({"optimizer.distributed=true"}));
  recompute_keeps_fingerprints("moe-debug", 2, plus({"parallel.expert=2", "moe.token_dispatcher=alltoall"}));
  recompute_keeps_fingerprints("moe-debug", 2,
                               plus({"parallel.tensor=2", "parallel.expert=2", "moe.aux_loss_coeff=0.01",
                                     "moe.router_load_balancing_type=global_aux_loss"}));
  recompute_keeps_fingerprints("debug", 1, plus({"precision.params=bf16", "precision.fp8=delayed"}));
  recompute_keeps_fingerprints("moe-debug", 1, plus({"precision.params=bf16", "precision.fp4=nvfp4"}));
  recompute_keeps_fingerprints("deepseek-tiny", 2, plus({"parallel.tensor=2", "parallel.sequence_parallel=true"}));
  // Layout mode: the same bits as well.
  recompute_keeps_fingerprints("moe-debug", 2,
                               plus({"determinism=layout", "parallel.pipeline=2", "model.mtp_num_layers=1"}));
  recompute_keeps_fingerprints("debug", 2,
                               plus({"determinism=layout", "layout_token_segments=true", "parallel.context=2"}));
  recompute_keeps_fingerprints(
      "moe-debug", 2,
      plus({"determinism=layout", "parallel.expert=2", "moe.token_dispatcher=alltoall", "parallel.tensor=1"}));
  recompute_keeps_fingerprints("moe-debug", 2, plus({"determinism=layout", "parallel.tensor=2"}));
}

// alloc_peak_mb, what the metrics report, falls with recompute.
TEST(Recompute, AllocPeakFalls) {
  TempDir dir;
  auto peak = [&](const std::string& out, std::vector<std::string> keys) {
    keys.insert(keys.end(), {"model.num_layers=4", "train.steps=1"});
    testing::quiet_train(job("debug", dir.path(out), keys));
    const std::string metrics = testing::read_file(dir.path(out + "/metrics.jsonl"));
    const nlohmann::json line = nlohmann::json::parse(metrics.substr(0, metrics.find('\n')));
    return line["alloc_peak_mb"].get<double>();
  };
  const double kept = peak("kept", {});
  const double uniform = peak("uniform", {"train.recompute_granularity=full", "train.recompute_method=uniform",
                                          "train.recompute_num_layers=1"});
  EXPECT_LT(uniform, kept);
}

TEST(Recompute, ConfigFollowsMegatronsRules) {
  auto error = [](std::vector<std::string> keys) { return testing::user_error_of([&] { load_config("", keys); }); };
  EXPECT_EQ(error({"train.recompute_granularity=full", "train.recompute_num_layers=1"}),
            "config: train.recompute_granularity = \"full\" needs train.recompute_method (\"uniform\" or \"block\")");
  EXPECT_EQ(error({"train.recompute_granularity=full", "train.recompute_method=uniform"}),
            "config: train.recompute_granularity = \"full\" needs train.recompute_num_layers >= 1, got 0");
  EXPECT_EQ(error({"train.recompute_method=block"}),
            "config: train.recompute_method is for train.recompute_granularity = \"full\" (it is \"none\")");
  EXPECT_EQ(error({"train.recompute_num_layers=2"}),
            "config: train.recompute_num_layers is for train.recompute_granularity = \"full\" (it is \"none\")");
  EXPECT_EQ(error({"train.recompute_granularity=selective"}),
            "config: train.recompute_modules = \"core_attn\": \"core_attn\" is not implemented yet (lockstep "
            "recomputes \"mlp\" and \"moe\")");
  EXPECT_EQ(error({"train.recompute_granularity=selective", "train.recompute_modules=mlp,attention"}),
            "config: train.recompute_modules = \"mlp,attention\": \"attention\" is not a module name (lockstep "
            "recomputes \"mlp\" and \"moe\")");
  EXPECT_EQ(error({"train.recompute_modules=mlp"}),
            "config: train.recompute_modules is for train.recompute_granularity = \"selective\" (it is \"none\")");
  EXPECT_EQ(error({"train.recompute_granularity=selective", "train.recompute_modules=moe,mlp"}), "(no error)");
  EXPECT_EQ(
      error({"train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"}),
      "(no error)");
}

}  // namespace
}  // namespace lockstep
