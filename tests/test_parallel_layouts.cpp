// The parallel-layout matrix: one row per layout of the dense and MoE debug models (tensor
// parallelism 1/2/4 with sequence parallelism off/on, expert parallelism 1/2/4/8 with both token
// dispatchers, expert tensor parallelism 1/2, pipeline parallelism 2 (1F1B and interleaved), context
// parallelism 2/4 (dense and MoE, with MTP and with pipeline parallelism),
// folded together and with data parallelism) on the
// threads backend, ranks as threads with one thread each. Each row trains 3 steps twice: the two
// runs give byte-identical fingerprints on every rank, and rank 0's losses and gradient norms
// reproduce those of one process training the same global batch (the row's overrides minus the
// parallel.* keys) to a relative 2e-6 (loss) and 2e-5 (grad norm); the largest differences are
// printed per row. Adding a row is one line. The mpi backend runs a few rows against the threads
// backend in tests/mpi; bitwise special cases (all-to-all EP = DP) are in test_expert_parallel.cpp.
//
// FP8 rows (per-tensor scaling): the amax behind each scale is reduced over the ranks holding the
// tensor (tensor/precision.h), so each rank quantises with the scale one process computes. Scales
// are per micro-batch, so a row with data parallelism gives each rank one micro-batch and the one
// process one micro-batch of the whole global batch (the row's `single` keys). Under bf16 a layout's
// last-bit differences (a split sum) flip bf16 roundings of activations and weight copies, so BF16
// itself reproduces one process only to ~1e-4 (the bf16 rows; FP8 codes flip the same way): those
// rows allow 5e-4. The dense model under data parallelism alone keeps 2e-6 (it splits no sum here). That each rank
// quantises its piece with the whole tensor's scale is checked bitwise in test_precision.cpp
// (PrecisionLowp.AmaxReducedOverTheGroupQuantisesEachPieceAsTheWholeTensor).
//
// The differences come from sums a layout splits: row-parallel matmuls and the vocabulary softmax
// over tp ranks, the expert proj over etp ranks, gradient sums over the ranks that hold a token.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/train/fingerprint.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

struct Row {
  const char* name;
  const char* config;  // in configs/
  int ranks;
  std::vector<std::string> overrides;
  std::vector<std::string> single = {};  // keys for the one-process run only (after the overrides)
  double tolerance = 2e-6;               // relative, of the loss; the grad norm's is 10x
};

void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

// The Llama flavour shrunk (8 heads over 4 KV groups, so that TP 4 splits both).
#define LLAMA                                                                                                          \
  "model.preset=llama", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.num_query_groups=4", \
      "model.seq_length=32"
#define SP "parallel.sequence_parallel=true"
#define A2A "moe.token_dispatcher=alltoall"
#define AG "moe.token_dispatcher=allgather"
// The Llama MoE flavour: SwiGLU experts, a gated shared expert, sigmoid scores with the expert bias.
// Multi-head latent attention (model/mla.h): 4 heads of 12 + 4 RoPE (queries, keys) and 10 (values).
#define MLA                                                                                                   \
  "model.preset=llama", "model.multi_latent_attention=true", "model.kv_lora_rank=16", "model.qk_head_dim=12", \
      "model.qk_pos_emb_head_dim=4", "model.v_head_dim=10"
#define LLAMA_MOE                                                                                  \
  "model.preset=llama", "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true", \
      "moe.router_bias_update_rate=0.01", "moe.shared_expert_intermediate_size=32", "moe.shared_expert_gate=true"
#define DELAYED "precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=4"
#define TENSORWISE "precision.params=bf16", "precision.fp8=tensorwise"
// The one process of an FP8 row with data parallelism: one micro-batch, the whole global batch of 8
// (the row gives each data-parallel rank one micro-batch).
#define WHOLE \
  { "train.micro_batch=8" }
#define BF16_NOISE 5e-4

const Row kRows[] = {
    // Dense: tensor (+ sequence) parallelism, alone and with data parallelism.
    {"gpt2_tp2", "debug.toml", 2, {"parallel.tensor=2"}},
    {"gpt2_tp2_sp", "debug.toml", 2, {"parallel.tensor=2", SP}},
    {"gpt2_tp4", "debug.toml", 4, {"parallel.tensor=4"}},
    {"gpt2_tp4_sp", "debug.toml", 4, {"parallel.tensor=4", SP}},
    {"gpt2_tp2_dp2", "debug.toml", 4, {"parallel.tensor=2"}},
    {"gpt2_tp2_sp_dp2", "debug.toml", 4, {"parallel.tensor=2", SP}},
    {"llama_qkv_bias_tp2_sp", "debug.toml", 2, {LLAMA, "model.add_qkv_bias=true", "parallel.tensor=2", SP}},
    {"llama_gqa_tp2_sp", "debug.toml", 2, {LLAMA, "parallel.tensor=2", SP}},
    {"mla_tp2_sp", "debug.toml", 2, {MLA, "parallel.tensor=2", SP}},
    {"mla_q_lora_tp2_dp2", "debug.toml", 4, {MLA, "model.q_lora_rank=24", "parallel.tensor=2"}},
    {"mla_cp2", "debug.toml", 2, {MLA, "parallel.context=2"}},
    {"mla_pp2", "debug.toml", 2, {MLA, "parallel.pipeline=2"}},
    {"llama_qk_norm_head24_tp2_sp",
     "debug.toml",
     2,
     {LLAMA, "model.qk_layernorm=true", "model.kv_channels=24", "parallel.tensor=2", SP}},

    {"llama_gqa_tp4", "debug.toml", 4, {LLAMA, "parallel.tensor=4"}},
    {"llama_gqa_tp2_dp2", "debug.toml", 4, {LLAMA, "parallel.tensor=2"}},
    {"llama_gqa_tp4_sp_dp2", "debug.toml", 8, {LLAMA, "parallel.tensor=4", SP}},
    {"gpt2_mtp_tp2_sp_dp2",
     "debug.toml",
     4,
     {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "parallel.tensor=2", SP}},
    {"gpt2_mtp_tp4",
     "debug.toml",
     4,
     {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "parallel.tensor=4"}},
    // MoE: data parallelism alone (the reference every other layout folds into).
    {"moe_dp2", "moe-debug.toml", 2, {}},
    // MoE: tensor parallelism (each tp rank routes its own share of the tokens).
    {"moe_tp2", "moe-debug.toml", 2, {"parallel.tensor=2"}},
    {"moe_tp2_sp", "moe-debug.toml", 2, {"parallel.tensor=2", SP}},
    {"moe_tp4", "moe-debug.toml", 4, {"parallel.tensor=4"}},
    {"moe_tp4_sp", "moe-debug.toml", 4, {"parallel.tensor=4", SP}},
    {"moe_tp2_dp2", "moe-debug.toml", 4, {"parallel.tensor=2"}},
    {"moe_tp2_sp_dp2", "moe-debug.toml", 4, {"parallel.tensor=2", SP}},
    // MoE: expert parallelism, both dispatchers, with expert data parallelism.
    {"moe_ep2_alltoall", "moe-debug.toml", 2, {"parallel.expert=2", A2A}},
    {"moe_ep2_allgather", "moe-debug.toml", 2, {"parallel.expert=2", AG}},
    {"moe_ep4_alltoall", "moe-debug.toml", 4, {"parallel.expert=4", A2A}},
    {"moe_ep4_allgather", "moe-debug.toml", 4, {"parallel.expert=4", AG}},
    {"moe_ep2_edp2_alltoall", "moe-debug.toml", 4, {"parallel.expert=2", A2A}},
    {"moe_ep2_edp2_allgather", "moe-debug.toml", 4, {"parallel.expert=2", AG}},
    {"moe_ep8_alltoall", "moe-debug.toml", 8, {"moe.num_experts=8", "train.micro_batch=1", "parallel.expert=8", A2A}},
    {"moe_ep8_allgather", "moe-debug.toml", 8, {"moe.num_experts=8", "train.micro_batch=1", "parallel.expert=8", AG}},
    // MoE: expert tensor parallelism, alone and folded with tp, sp, ep and dp.
    {"moe_etp2", "moe-debug.toml", 2, {"parallel.expert_tensor=2"}},
    {"moe_etp2_dp2", "moe-debug.toml", 4, {"parallel.expert_tensor=2"}},
    {"moe_tp2_etp2", "moe-debug.toml", 2, {"parallel.tensor=2", "parallel.expert_tensor=2"}},
    {"moe_tp2_sp_etp2_dp2", "moe-debug.toml", 4, {"parallel.tensor=2", SP, "parallel.expert_tensor=2"}},
    {"moe_tp2_ep2_alltoall", "moe-debug.toml", 4, {"parallel.tensor=2", "parallel.expert=2", A2A}},
    {"moe_tp2_sp_ep2_allgather", "moe-debug.toml", 4, {"parallel.tensor=2", SP, "parallel.expert=2", AG}},
    {"moe_etp2_ep2_alltoall", "moe-debug.toml", 4, {"parallel.expert_tensor=2", "parallel.expert=2", A2A}},
    {"moe_tp4_sp_etp2_ep2_alltoall",
     "moe-debug.toml",
     8,
     {"parallel.tensor=4", SP, "parallel.expert_tensor=2", "parallel.expert=2", A2A}},
    {"moe_tp2_etp2_ep2_edp2_allgather",
     "moe-debug.toml",
     8,
     {"parallel.tensor=2", "parallel.expert_tensor=2", "parallel.expert=2", AG}},
    {"moe_tp2_sp_etp1_ep4_alltoall", "moe-debug.toml", 8, {"parallel.tensor=2", SP, "parallel.expert=4", A2A}},
    // Capacity is per routing rank: with tp = 1 a rank routes a whole micro-batch, as one process does.
    {"moe_etp2_capacity_position",
     "moe-debug.toml",
     2,
     {"moe.expert_capacity_factor=0.75", "moe.token_drop_policy=position", "parallel.expert_tensor=2"}},
    {"moe_etp2_ep2_alltoall_capacity_padded",
     "moe-debug.toml",
     4,
     {"moe.expert_capacity_factor=0.75", "moe.pad_expert_input_to_capacity=true", "parallel.expert_tensor=2",
      "parallel.expert=2", A2A}},
    // The Llama MoE flavour (SwiGLU sections split per etp rank, shared expert, expert bias).
    {"llama_moe_tp2_sp", "moe-debug.toml", 2, {LLAMA_MOE, "parallel.tensor=2", SP}},
    {"llama_moe_tp2", "moe-debug.toml", 2, {LLAMA_MOE, "parallel.tensor=2"}},
    {"llama_moe_etp2", "moe-debug.toml", 2, {LLAMA_MOE, "parallel.expert_tensor=2"}},
    {"llama_moe_tp2_sp_etp2_ep2_alltoall",
     "moe-debug.toml",
     4,
     {LLAMA_MOE, "parallel.tensor=2", SP, "parallel.expert_tensor=2", "parallel.expert=2", A2A}},
    {"llama_moe_tp4_etp2_ep2_allgather_distributed",
     "moe-debug.toml",
     8,
     {LLAMA_MOE, "parallel.tensor=4", "parallel.expert_tensor=2", "parallel.expert=2", AG,
      "optimizer.distributed=true"}},
    // Pipeline parallelism (parallel/pipeline/), alone and folded with every other dimension.
    {"gpt2_pp2", "debug.toml", 2, {"parallel.pipeline=2"}},
    {"gpt2_mtp_pp2_tp2_sp",
     "debug.toml",
     4,
     {"model.mtp_num_layers=2", "parallel.pipeline=2", "parallel.tensor=2", SP}},
    {"llama_gqa_pp2_interleaved_dp2",
     "debug.toml",
     4,
     {LLAMA, "model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
    {"moe_pp2_ep2_alltoall", "moe-debug.toml", 4, {"parallel.pipeline=2", "parallel.expert=2", A2A}},
    {"moe_pp2_tp2_sp_etp2",
     "moe-debug.toml",
     4,
     {"parallel.pipeline=2", "parallel.tensor=2", SP, "parallel.expert_tensor=2"}},
    {"llama_moe_pp2_interleaved_tp2_etp2_ep2_allgather",
     "moe-debug.toml",
     8,
     {LLAMA_MOE, "model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.tensor=2",
      "parallel.expert_tensor=2", "parallel.expert=2", AG}},
    // Context parallelism (parallel/context_parallel.h): each sample cut into 2 x cp chunks (of 16 tokens for
    // gpt2, 8 or 4 for the Llama flavour: none a multiple of the attention's key block), alone and with dp, tp (+ sp).
    {"gpt2_cp2", "debug.toml", 2, {"parallel.context=2"}},
    {"gpt2_cp2_dp2", "debug.toml", 4, {"parallel.context=2"}},
    {"gpt2_cp2_tp2_sp", "debug.toml", 4, {"parallel.context=2", "parallel.tensor=2", SP}},
    {"llama_gqa_cp2_tp2", "debug.toml", 4, {LLAMA, "parallel.context=2", "parallel.tensor=2"}},
    {"llama_gqa_cp4", "debug.toml", 4, {LLAMA, "parallel.context=4"}},
    // Attention across the cp group by parallel.cp_comm_type (model/context_attention.h): ring attention,
    // the all-to-all to head shards, and both (all-to-all inside pairs, ring across).
    {"gpt2_cp2_p2p", "debug.toml", 2, {"parallel.context=2", "parallel.cp_comm_type=p2p"}},
    {"llama_gqa_cp4_p2p_dp2", "debug.toml", 8, {LLAMA, "parallel.context=4", "parallel.cp_comm_type=p2p"}},
    {"llama_gqa_cp4_a2a", "debug.toml", 4, {LLAMA, "parallel.context=4", "parallel.cp_comm_type=a2a"}},
    {"gpt2_cp2_tp2_sp_a2a",
     "debug.toml",
     4,
     {"parallel.context=2", "parallel.tensor=2", SP, "parallel.cp_comm_type=a2a"}},
    {"llama_gqa_cp4_a2a_p2p",
     "debug.toml",
     4,
     {LLAMA, "parallel.context=4", "parallel.cp_comm_type=a2a+p2p",
      "parallel.hierarchical_context_parallel_sizes=2,2"}},
    {"moe_cp2_ep2_p2p",
     "moe-debug.toml",
     4,
     {"parallel.context=2", "parallel.expert=2", A2A, "parallel.cp_comm_type=p2p"}},
    {"gpt2_pp2_cp2_a2a", "debug.toml", 4, {"parallel.pipeline=2", "parallel.context=2", "parallel.cp_comm_type=a2a"}},
    // MoE under context parallelism: the aux losses over the whole micro-batch (logits gathered over tp x cp; the
    // sequence aux loss per whole sequence), the router jitter at the tokens' global indices.
    {"moe_cp2_every_aux_loss_jitter",
     "moe-debug.toml",
     2,
     {"parallel.context=2", "moe.input_jitter_eps=0.01",
      "moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss"}},
    {"moe_cp2_tp2_sp_dp2", "moe-debug.toml", 8, {"parallel.context=2", "parallel.tensor=2", SP, "train.micro_batch=1"}},
    {"moe_cp2_tp2_seq_aux",
     "moe-debug.toml",
     4,
     {"parallel.context=2", "parallel.tensor=2", "moe.router_load_balancing_type=seq_aux_loss"}},
    {"moe_cp2_ep2_alltoall", "moe-debug.toml", 4, {"parallel.context=2", "parallel.expert=2", A2A}},
    {"llama_moe_cp2_etp2_ep2_allgather",
     "moe-debug.toml",
     4,
     {LLAMA_MOE, "parallel.context=2", "parallel.expert_tensor=2", "parallel.expert=2", AG}},
    // Context parallelism with multi-token prediction (each depth's ids and targets shifted over the whole
    // sequence, then the rank's positions taken; the depth's attention gathers K/V over cp) and with pipeline
    // parallelism (each stage's ranks form cp groups: 1F1B, interleaved, the last stage's copies of the word and
    // position embedding, the MoE aux loss counted once per cp group).
    {"gpt2_mtp_cp2",
     "debug.toml",
     2,
     {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "parallel.context=2"}},
    {"gpt2_mtp_cp2_dp2",
     "debug.toml",
     4,
     {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "parallel.context=2"}},
    {"gpt2_mtp_cp2_tp2_sp",
     "debug.toml",
     4,
     {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "parallel.context=2", "parallel.tensor=2", SP}},
    {"gpt2_pp2_cp2", "debug.toml", 4, {"parallel.pipeline=2", "parallel.context=2"}},
    {"llama_gqa_pp2_interleaved_cp2",
     "debug.toml",
     4,
     {LLAMA, "model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.context=2"}},
    {"gpt2_mtp_pp2_cp2", "debug.toml", 4, {"model.mtp_num_layers=1", "parallel.pipeline=2", "parallel.context=2"}},
    {"moe_pp2_cp2_every_aux_loss",
     "moe-debug.toml",
     4,
     {"parallel.pipeline=2", "parallel.context=2",
      "moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss"}},
    // FP8 per-tensor scaling: amax reduced over tp x cp x dp (dense) and etp x edp (experts); BF16's
    // own difference under the same layouts for comparison.
    {"bf16_gpt2_tp2_sp", "debug.toml", 2, {"precision.params=bf16", "parallel.tensor=2", SP}, {}, BF16_NOISE},
    {"bf16_moe_ep2_alltoall",
     "moe-debug.toml",
     2,
     {"precision.params=bf16", "parallel.expert=2", A2A, "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_delayed_moe_dp2", "moe-debug.toml", 2, {DELAYED, "train.micro_batch=4"}, WHOLE, BF16_NOISE},
    {"fp8_delayed_gpt2_tp2_sp", "debug.toml", 2, {DELAYED, "parallel.tensor=2", SP}, {}, BF16_NOISE},
    {"fp8_tensorwise_gpt2_tp4", "debug.toml", 4, {TENSORWISE, "parallel.tensor=4"}, {}, BF16_NOISE},
    {"fp8_tensorwise_gpt2_dp2", "debug.toml", 2, {TENSORWISE, "train.micro_batch=4"}, WHOLE},
    {"fp8_delayed_llama_tp2_sp_dp2",
     "debug.toml",
     4,
     {DELAYED, LLAMA, "parallel.tensor=2", SP, "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_delayed_moe_tp2_sp", "moe-debug.toml", 2, {DELAYED, "parallel.tensor=2", SP}, {}, BF16_NOISE},
    {"fp8_tensorwise_moe_tp2_dp2",
     "moe-debug.toml",
     4,
     {TENSORWISE, "parallel.tensor=2", "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_delayed_moe_ep2_alltoall",
     "moe-debug.toml",
     2,
     {DELAYED, "parallel.expert=2", A2A, "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_tensorwise_moe_ep2_allgather",
     "moe-debug.toml",
     2,
     {TENSORWISE, "parallel.expert=2", AG, "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_delayed_moe_etp2",
     "moe-debug.toml",
     2,
     {DELAYED, "parallel.expert_tensor=2", "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    {"fp8_tensorwise_moe_etp2_ep2_alltoall",
     "moe-debug.toml",
     4,
     {TENSORWISE, "parallel.expert_tensor=2", "parallel.expert=2", A2A, "train.micro_batch=2"},
     WHOLE,
     BF16_NOISE},
    {"fp8_delayed_llama_moe_tp2_sp_ep2_edp2_alltoall",
     "moe-debug.toml",
     4,
     {DELAYED, LLAMA_MOE, "parallel.tensor=2", SP, "parallel.expert=2", A2A, "train.micro_batch=4"},
     WHOLE,
     BF16_NOISE},
    // Under pipeline parallelism (each micro-batch in flight keeping its own quantised inputs): the
    // current-scaling recipes per micro-batch as one process; delayed scaling updates once per step
    // there, as one process does with the step's batch in one micro-batch (WHOLE).
    {"fp8_tensorwise_gpt2_pp2", "debug.toml", 2, {TENSORWISE, "parallel.pipeline=2"}, {}, BF16_NOISE},
    {"fp8_blockwise_moe_pp2_interleaved_ep2",
     "moe-debug.toml",
     4,
     {"precision.params=bf16", "precision.fp8=blockwise", "model.num_layers=4", "parallel.pipeline=2",
      "parallel.virtual_pipeline=2", "parallel.expert=2", A2A},
     {},
     BF16_NOISE},
    {"fp8_delayed_moe_pp2", "moe-debug.toml", 2, {DELAYED, "parallel.pipeline=2"}, WHOLE, BF16_NOISE},
    {"fp8_delayed_moe_pp2_interleaved_ep2_alltoall",
     "moe-debug.toml",
     4,
     {DELAYED, "model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.expert=2", A2A},
     WHOLE,
     BF16_NOISE},
    {"fp8_tensorwise_moe_pp2_afab_ep2_alltoall",
     "moe-debug.toml",
     4,
     {TENSORWISE, "parallel.pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward", "parallel.expert=2",
      A2A},
     {},
     BF16_NOISE},
};

constexpr int kSteps = 3;

Config job(const Row& row, const std::string& out_dir, bool single) {
  std::vector<std::string> o = {str("train.steps=", kSteps), "train.eval_interval=0", "train.threads=1",
                                "train.micro_batch=2",       "train.global_batch=8",  "data.synthetic_bytes=65536"};
  for (const std::string& k : row.overrides)
    if (!single || (k.rfind("parallel.", 0) != 0 && k.rfind("optimizer.distributed", 0) != 0)) o.push_back(k);
  if (single) o.insert(o.end(), row.single.begin(), row.single.end());
  o.push_back("train.out_dir=" + out_dir);
  return load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", row.config), o);
}

// Rank 0's fingerprint field of every step, as the exact double.
std::vector<double> field(const std::string& run_dir, const char* name) {
  std::vector<double> out;
  std::istringstream in(testing::read_file(fingerprint_path(run_dir, 0)));
  for (std::string line; std::getline(in, line);)
    out.push_back(
        std::bit_cast<double>(std::stoull(nlohmann::json::parse(line)[name].get<std::string>(), nullptr, 16)));
  return out;
}

std::string fingerprints(const std::string& run_dir, int ranks) {
  std::string all;
  for (int r = 0; r < ranks; ++r) all += testing::read_file(fingerprint_path(run_dir, r));
  return all;
}

class ParallelLayouts : public ::testing::TestWithParam<Row> {};

TEST_P(ParallelLayouts, ReproduceOneProcessAndAreBitwiseRunToRun) {
  const Row& row = GetParam();
  testing::TempDir dir;
  testing::train_ranks(1, job(row, dir.path("single"), true));
  testing::train_ranks(row.ranks, job(row, dir.path("a"), false));
  testing::train_ranks(row.ranks, job(row, dir.path("b"), false));
  const std::string a = fingerprints(dir.path("a"), row.ranks);
  EXPECT_EQ(std::count(a.begin(), a.end(), '\n'), kSteps * row.ranks);
  EXPECT_EQ(fingerprints(dir.path("b"), row.ranks), a) << "run to run";

  double worst_loss = 0, worst_norm = 0;
  for (const auto& [key, tolerance] : {std::pair{"loss", row.tolerance}, std::pair{"grad_norm", 10 * row.tolerance}}) {
    const std::vector<double> one = field(dir.path("single"), key), many = field(dir.path("a"), key);
    ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(many.size(), one.size());
    double& worst = key == std::string("loss") ? worst_loss : worst_norm;
    for (size_t s = 0; s < one.size(); ++s) {
      const double d = std::fabs(many[s] - one[s]) / std::fabs(one[s]);
      worst = std::max(worst, d);
      EXPECT_LT(d, tolerance) << row.name << ": " << key << " at step " << s + 1;
    }
  }
  std::printf("[ layout ] %-46s %d ranks: largest relative difference from one process: loss %.2e, grad norm %.2e\n",
              row.name, row.ranks, worst_loss, worst_norm);
}

INSTANTIATE_TEST_SUITE_P(Rows, ParallelLayouts, ::testing::ValuesIn(kRows),
                         [](const ::testing::TestParamInfo<Row>& info) { return std::string(info.param.name); });

// Bytes rank 0 sends per step in its tensor-parallel group (metrics.jsonl tp_bytes) and its
// expert-tensor-parallel group (etp_bytes) on the MoE preset (L = 2 MoE layers, C = 64, E = 4, K = 2,
// micro-batches of N = 128 tokens, global batch 8), against the formulas of docs/parallelism.md:
//   tp (P): per micro-batch, attention 4 (P-1)/P N C per layer, embedding + head 4 (P-1)/P N C,
//     loss 3 (P-1) N, and per MoE layer the logits' all-gather (P-1)/P N E plus, without SP, the
//     all-gathers of its output rows and of its input-gradient rows, 2 (P-1)/P N C; per step the
//     all-reduce of the replicated parameters computed on the rank's rows (SP: every norm; else the
//     MoE norms; the routers), of the expert-bias counts (E int64 per layer), and the grad norm's double;
//   etp (Q): per MoE layer and micro-batch, the segment tables (Q-1)(E/S x S + 1) int64, and the
//     gathers and reduce-scatters of the rows forward and backward, 4 x x R C floats with
//     R = N/P x K rows per rank (dropless, ep = 1: every choice is local).
TEST(ParallelFolding, CommunicationVolumePerStepMatchesTheFormula) {
  const int64_t L = 2, C = 64, E = 4, K = 2, N = 128, B = 8 / 2;  // B: micro-batches in a step
  struct Case {
    int tp, etp;
    bool sp;
  };
  for (const Case& c : {Case{2, 1, false}, Case{2, 1, true}, Case{4, 1, true}, Case{1, 2, false}, Case{1, 4, false},
                        Case{2, 2, true}}) {
    const int world = std::max(c.tp, c.etp);
    const Row row{"volume",
                  "moe-debug.toml",
                  world,
                  {str("parallel.tensor=", c.tp), str("parallel.expert_tensor=", c.etp),
                   str("parallel.sequence_parallel=", c.sp ? "true" : "false")}};
    testing::TempDir dir;
    testing::train_ranks(world, job(row, dir.path("run"), false));
    const int64_t m = B / (world / c.tp), P = c.tp, Q = c.etp;  // micro-batches per rank
    int64_t tp_bytes = 0, etp_bytes = 0;
    if (P > 1) {
      const int64_t micro = (4 * L + 4) * (P - 1) * N * C / P + L * (P - 1) * N * E / P +
                            (c.sp ? 0 : L * 2 * (P - 1) * N * C / P) + 3 * (P - 1) * N;
      const int64_t norms = c.sp ? (2 * L + 1) * 2 * C : L * 2 * C;  // LayerNorm weight + bias
      const int64_t replicated = norms + L * E * C;                  // + the routers
      tp_bytes = 4 * m * micro + 4 * 2 * (P - 1) * replicated / P + 8 * L * 2 * (P - 1) * E / P + 8 * (P - 1);
    }
    if (Q > 1) etp_bytes = L * m * (Q - 1) * (16 * (N / P) * K * C + 8 * (E + 1));
    std::istringstream in(testing::read_file(dir.path("run") + "/metrics.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(in, line); ++steps) {
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j.value("tp_bytes", int64_t{0}), tp_bytes) << "tp " << P << " etp " << Q << " sp " << c.sp;
      EXPECT_EQ(j.value("etp_bytes", int64_t{0}), etp_bytes) << "tp " << P << " etp " << Q << " sp " << c.sp;
    }
    EXPECT_EQ(steps, kSteps);
    std::printf(
        "[ moe-debug ] tp %d%s etp %d (world %d, %lld micro-batches per rank): tp %lld, etp %lld bytes per step\n",
        c.tp, c.sp ? " sp" : "   ", c.etp, world, static_cast<long long>(m), static_cast<long long>(tp_bytes),
        static_cast<long long>(etp_bytes));
  }
}

// Parallel folding: sizes that do not fit are one error naming the sizes (config validation for
// what the configuration alone decides, the mesh for the world size).
TEST(ParallelFolding, ErrorsNameTheSizesThatConflict) {
  auto error = [](const char* config, std::vector<std::string> o) {
    return testing::user_error_of([&] { load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", config), o); });
  };
  EXPECT_EQ(error("debug.toml", {"parallel.expert_tensor=2"}),
            "config: parallel.expert_tensor = 2 needs an MoE model (moe.num_experts > 0)");
  EXPECT_EQ(error("moe-debug.toml", {"parallel.expert_tensor=3"}),
            "config: moe.ffn_hidden_size = 128 is not divisible by parallel.expert_tensor = 3 (every "
            "expert-tensor-parallel rank holds the same number of hidden units)");
  EXPECT_EQ(error("moe-debug.toml", {"model.seq_length=63", "train.micro_batch=1", "parallel.tensor=2"}),
            "config: parallel.tensor = 2 with an MoE model: train.micro_batch x model.seq_length = 63 tokens are not "
            "divisible by it (each tensor-parallel rank routes its share of the tokens)");
  EXPECT_EQ(error("moe-debug.toml", {"parallel.tensor=3"}),
            "config: model.num_heads = 4 is not divisible by parallel.tensor = 3");
  // The world must hold both meshes: tp x cp x dp x pp and etp x ep x edp x pp.
  auto world_error = [](int ranks, std::vector<std::string> o) {
    testing::TempDir dir;
    o.push_back("train.out_dir=" + dir.path("run"));
    const Config c = load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/moe-debug.toml"), o);
    std::string message = "(no error)";
    try {
      testing::train_ranks(ranks, c);
    } catch (const std::exception& e) {
      message = e.what();
    }
    return message;
  };
  EXPECT_NE(world_error(4, {"parallel.expert_tensor=2", "parallel.expert=4"})
                .find("parallel: world size 4 is not divisible by expert_tensor (2) x expert (4) x pipeline (1)"),
            std::string::npos);
  EXPECT_NE(world_error(6, {"parallel.tensor=4"})
                .find("parallel: world size 6 is not divisible by tensor (4) x context (1) x pipeline (1)"),
            std::string::npos);
  EXPECT_NE(world_error(8, {"parallel.expert_tensor=2", "train.micro_batch=2"})
                .find("train.global_batch = 8 is not divisible by train.micro_batch (2) x data-parallel size (8"),
            std::string::npos);
}

}  // namespace
}  // namespace lockstep
