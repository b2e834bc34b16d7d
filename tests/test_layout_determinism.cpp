// determinism = "layout" (docs/determinism.md): one line per layout row, each trained on the threads
// backend and compared BITWISE with the single-process run of the same job: every step's global
// fingerprint fields (loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr and the hash of the
// parameters, which every rank holds whole) and, from the final checkpoint, every tensor: the
// parameters, both AdamW moments and the MoE expert biases. Also: what the mode refuses, and that
// it changes the single-process bits of the `run` mode (another summation order) but not its
// loss beyond rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;
using testing::train_ranks;

constexpr int kSteps = 3;

// preset's debug config, 3 steps, global batch 8 in micro-batches of 2 (M = 4), a checkpoint at
// the end, determinism = "layout", plus the row's keys.
Config job(const std::string& preset, const std::string& out_dir, std::vector<std::string> extra) {
  std::vector<std::string> o = {"determinism=layout",
                                "train.steps=" + std::to_string(kSteps),
                                "train.eval_interval=0",
                                "train.threads=1",
                                "train.micro_batch=2",
                                "data.synthetic_bytes=65536",
                                "train.save_interval=" + std::to_string(kSteps),
                                "optimizer.clip_grad=1.0",
                                "train.out_dir=" + out_dir};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + preset + ".toml", o);
}

// Rank 0's global fields per step: what every layout must reproduce. The parameters' hash only
// where rank 0 holds every parameter (not under expert or pipeline parallelism: the checkpoint
// compares them).
std::vector<std::string> global_fields(const std::string& run_dir, bool params = true) {
  std::vector<std::string> out;
  for (const FingerprintLine& line : read_fingerprint_lines(fingerprint_path(run_dir, 0))) {
    std::string s = "step " + std::to_string(line.step);
    for (const auto& [key, value] : line.fields)
      if (is_fingerprint_scalar(key) || (params && key == "params")) s += " " + key + "=" + value;
    out.push_back(s);
  }
  return out;
}

// The evaluation lines of metrics.jsonl (with train.eval_interval > 0): the eval losses as written.
std::vector<std::string> eval_lines(const std::string& run_dir) {
  std::vector<std::string> out;
  std::istringstream in(testing::read_file(run_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (line.find("\"eval_loss\"") != std::string::npos) out.push_back(line);
  return out;
}

// Empty when every tensor of the two runs' last checkpoints has the same bits; else the first that
// differs.
std::string checkpoint_difference(const std::string& a, const std::string& b) {
  const CheckpointMetadata ma = read_checkpoint_metadata(checkpoint_dir(a + "/checkpoints", kSteps));
  const CheckpointMetadata mb = read_checkpoint_metadata(checkpoint_dir(b + "/checkpoints", kSteps));
  if (ma.tensors.size() != mb.tensors.size()) return "tensor count";
  for (const CheckpointTensor& t : ma.tensors) {
    const CheckpointTensor* u = mb.find(t.name);
    if (!u) return t.name + " missing";
    if (read_checkpoint_tensor(ma, t) != read_checkpoint_tensor(mb, *u)) return t.name;
  }
  return "";
}

struct Row {
  int ranks;
  std::vector<std::string> keys;
};

// Trains the single-process run and every row; each row must match it bitwise.
void rows_match_single_process(const std::string& preset, const std::vector<Row>& rows,
                               const std::vector<std::string>& common = {}) {
  TempDir dir;
  const std::string ref = dir.path("single");
  train_ranks(1, job(preset, ref, common));
  const std::vector<std::string> expected = global_fields(ref);
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
  for (const std::string& key : common) {
    if (key.rfind("train.eval_interval=", 0) == 0 && key != "train.eval_interval=0") {
      ASSERT_FALSE(eval_lines(ref).empty()) << "no evaluation to compare";
    }
  }
  int k = 0;
  for (const Row& row : rows) {
    std::string name = std::to_string(row.ranks) + " ranks";
    for (const std::string& key : row.keys) name += " " + key;
    const std::string out = dir.path("row" + std::to_string(k++));
    std::vector<std::string> keys = common;
    keys.insert(keys.end(), row.keys.begin(), row.keys.end());
    train_ranks(row.ranks, job(preset, out, keys));
    const bool whole = name.find("parallel.expert") == std::string::npos &&
                       name.find("parallel.pipeline") == std::string::npos &&
                       name.find("parallel.tensor") == std::string::npos;
    EXPECT_EQ(global_fields(out, whole), whole ? expected : global_fields(ref, false)) << preset << ": " << name;
    EXPECT_EQ(checkpoint_difference(ref, out), "") << preset << ": " << name << ": checkpoint tensor differs";
    EXPECT_EQ(eval_lines(out), eval_lines(ref)) << preset << ": " << name << ": evaluation differs";
  }
}

// Data parallel 1 / 2 / 4 (4, 2, 1 micro-batches per rank), replicated and distributed optimizer,
// overlapped reduction and gather, several buckets, 1 vs 2 threads.
const std::vector<Row> kDataParallelRows = {
    {1, {"train.threads=2"}},
    {2, {}},
    {4, {}},
    {2, {"optimizer.distributed=true"}},
    {4, {"optimizer.distributed=true", "ddp.bucket_size=20000"}},
    {2, {"ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
    {4,
     {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
      "ddp.bucket_size=20000"}},
    {2, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "train.threads=2"}},
};

TEST(LayoutDeterminism, DenseDataParallelLayoutsMatchSingleProcess) {
  rows_match_single_process("debug", kDataParallelRows);
}

TEST(LayoutDeterminism, MoeDataParallelLayoutsMatchSingleProcess) {
  rows_match_single_process("moe-debug", kDataParallelRows);
}

// Expert parallelism 2 and 4 (with 1 or 2 expert data-parallel replicas), both token dispatchers,
// the distributed optimizer and overlap: each expert's gradient is the canonical tree over the
// micro-batches of every source rank.
TEST(LayoutDeterminism, ExpertParallelLayoutsMatchSingleProcess) {
  rows_match_single_process(
      "moe-debug", {
                       {2, {"parallel.expert=2"}},
                       {4, {"parallel.expert=2"}},
                       {4, {"parallel.expert=4"}},
                       {2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                       {4,
                        {"parallel.expert=2", "moe.token_dispatcher=alltoall", "optimizer.distributed=true",
                         "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                       {4, {"parallel.expert=4", "moe.token_dispatcher=alltoall", "optimizer.distributed=true"}},
                   });
}

// Expert tensor parallelism with parallel.tensor = 1 (attention data-parallel): each expert's hidden
// units split over etp, the proj forward and the fc input gradient cut into layout_segments canonical
// K segments (each rank's block summed along the canonical tree over the group, the proj bias added
// after), the expert weight gradients per (expert, source rank) as under expert parallelism. Both
// dispatchers, SwiGLU (gate and up sections), capacity with padding, other segment counts.
TEST(LayoutDeterminism, ExpertTensorParallelLayoutsMatchSingleProcess) {
  rows_match_single_process(
      "moe-debug", {
                       {2, {"parallel.expert_tensor=2"}},
                       {4, {"parallel.expert_tensor=2"}},
                       {4, {"parallel.expert_tensor=4"}},
                       {4, {"parallel.expert_tensor=2", "parallel.expert=2"}},
                       {4,
                        {"parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall",
                         "optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                   });
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.expert_tensor=2"}},
                                {4, {"parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                            },
                            {"model.preset=llama", "precision.params=bf16"});
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.expert_tensor=2"}},
                                {4, {"parallel.expert_tensor=2", "parallel.expert=2"}},
                                {4, {"parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                            },
                            {"moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true",
                             "moe.shared_expert_intermediate_size=64"});
  rows_match_single_process("moe-debug", {{4, {"parallel.expert_tensor=4"}}}, {"layout_segments=4"});
}

// Tensor parallelism, dense models: the row-parallel forward sums, the column-parallel and the
// head's input gradients, the softmax's sums (vocabulary segments), the embedding's sum (-0 rows)
// and the sequence-parallel gradients (token segments, summed per micro-batch) are cut into
// layout_segments canonical segments whatever parallel.tensor is. GPT-2 (tied, learned positions,
// biases), Llama (GQA, SwiGLU, RoPE), bf16, MTP, with data and pipeline parallelism.
TEST(LayoutDeterminism, TensorParallelLayoutsMatchSingleProcess) {
  rows_match_single_process(
      "debug",
      {
          {2, {"parallel.tensor=2"}},
          {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=2", "optimizer.distributed=true"}},
          {4,
           {"parallel.tensor=2", "parallel.sequence_parallel=true", "ddp.overlap_grad_reduce=true", "train.threads=2"}},
      });
  rows_match_single_process(
      "debug",
      {
          {2, {"parallel.tensor=2"}},
          {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
      },
      {"model.preset=llama", "model.num_heads=8", "model.num_query_groups=4"});
  rows_match_single_process("debug",
                            {
                                {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2"}},
                                {4, {"parallel.tensor=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                            },
                            {"model.num_layers=4", "model.tie_embeddings=false"});
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"model.preset=llama", "model.num_query_groups=2", "precision.params=bf16"});
  rows_match_single_process(
      "debug",
      {
          {2, {"parallel.tensor=2"}},
          {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
      },
      {"model.mtp_num_layers=1"});
}

// layout_token_segments: every weight gradient and attention's dK, dV in the micro-batch's token
// segments. Data, tensor (+ sequence) and pipeline parallelism reproduce the single process with
// the key; GPT-2, Llama (GQA, RoPE) bf16 (documents: AttentionChunks.QuerySegments...). The key changes the arithmetic
// (its single process differs from the one without it).
TEST(LayoutDeterminism, TokenSegmentsMatchSingleProcess) {
  const std::vector<std::string> key = {"layout_token_segments=true"};
  rows_match_single_process(
      "debug",
      {
          {2, {}},
          {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
          {2, {"parallel.pipeline=2"}},
      },
      key);
  rows_match_single_process(
      "debug",
      {
          {2, {}},
          {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
      },
      {"layout_token_segments=true", "model.preset=llama", "model.num_query_groups=2", "precision.params=bf16"});
  // MTP: the depths' eh_proj, norms, layers and embedding copies in token segments, their losses the
  // micro-batch's means (GPT::micro_batch_mean); tied and untied, with TP + SP, PP and DP (3 per rank).
  rows_match_single_process("debug",
                            {
                                {2, {}},
                                {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
                            },
                            {"layout_token_segments=true", "model.mtp_num_layers=2"});
  rows_match_single_process(
      "debug",
      {
          {4, {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=2", "optimizer.distributed=true"}},
      },
      {"layout_token_segments=true", "model.mtp_num_layers=1", "model.num_layers=4", "model.preset=llama",
       "model.num_query_groups=2", "precision.params=bf16", "train.global_batch=12"});
  // MoE models: the MoE sums are the S-segment trees of layout mode already; with the key the dense
  // layers' too (DP, TP, TP + SP, EP, ETP, a gated shared expert at TP 2 x EP 2).
  rows_match_single_process("moe-debug",
                            {
                                {2, {}},
                                {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
                                {2, {"parallel.expert=2"}},
                                {2, {"parallel.expert_tensor=2"}},
                            },
                            key);
  rows_match_single_process(
      "moe-debug", {{4, {"parallel.tensor=2", "parallel.expert=2"}}},
      {"layout_token_segments=true", "moe.shared_expert_intermediate_size=64", "moe.shared_expert_gate=true"});
  TempDir dir;
  train_ranks(1, job("debug", dir.path("on"), key));
  train_ranks(1, job("debug", dir.path("off"), {}));
  EXPECT_NE(global_fields(dir.path("on")), global_fields(dir.path("off")));
}

// The output head's weight gradient with the key when its row chunks (GPT::head: 2^22 logits, so 32
// rows at a vocabulary of 131,072) are shorter than a token segment or hold several: one process
// takes a 64-row segment in two parts (layout_segments 2), TP 2 (32,768-column shards: 64-row
// chunks) one segment per chunk; one process at 16 segments pushes blocks of 4 segments, CP 2
// (pieces of 2 segments) adds whole pieces in the product. Each the same tree, bit for bit.
TEST(LayoutDeterminism, TokenSegmentHeadChunksMatchSingleProcess) {
  const std::vector<std::string> big = {"layout_token_segments=true", "model.vocab_size=131072", "model.hidden_size=16",
                                        "train.global_batch=4"};
  std::vector<std::string> two = big, sixteen = big;
  two.push_back("layout_segments=2");
  sixteen.push_back("layout_segments=16");
  rows_match_single_process("debug", {{2, {"parallel.tensor=2"}}}, two);
  rows_match_single_process("debug", {{2, {"parallel.context=2"}}}, sixteen);
}

// The layouts an attention variant must keep one process's bits under (moe-debug).
const std::vector<Row> kAttentionRows = {
    {2, {"train.threads=1"}},     {2, {"parallel.context=2"}},
    {2, {"parallel.pipeline=2"}}, {2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}},
    {2, {"parallel.tensor=2"}},   {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=2"}},
};

// QK layernorm with its own head size (Qwen3): the norms' weight gradients are taken head by head
// in each token segment and added over all heads in head order (AttentionLayer::head_norm_backward),
// so data, context, pipeline and tensor parallelism (which splits the heads) keep one process's bits.
TEST(LayoutDeterminism, QkLayernormMatchesSingleProcess) {
  rows_match_single_process("moe-debug", kAttentionRows,
                            {"layout_token_segments=true", "model.preset=llama", "model.num_query_groups=2",
                             "model.qk_layernorm=true", "model.kv_channels=24"});
}

// A multi-token prediction depth after an MoE layer is MoE (model/mtp.h): its router, dispatch,
// experts, expert bias and aux loss keep one process's bits on the last pipeline stage, over
// expert, context and data parallelism (tensor parallelism: MoeTensorParallelLayoutsMatchSingleProcess).
TEST(LayoutDeterminism, MoeMtpDepthMatchesSingleProcess) {
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.pipeline=2"}},
                                {2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.pipeline=2", "parallel.expert=2", "optimizer.distributed=true"}},
                            },
                            {"layout_token_segments=true", "model.mtp_num_layers=1", "model.num_layers=4",
                             "moe.router_enable_expert_bias=true", "moe.router_score_function=sigmoid"});
}

// Multi-head latent attention (model/mla.h): the latent projections are ordinary layers, so data,
// context, pipeline and expert parallelism keep one process's bits; under tensor parallelism the
// sums over heads (the latents' and the shared k_pe's gradients) are taken in one process's order
// before the replicated down projections (with and without query compression, with sequence
// parallelism).
TEST(LayoutDeterminism, MultiLatentAttentionMatchesSingleProcess) {
  const std::vector<std::string> mla = {
      "layout_token_segments=true", "model.preset=llama",   "model.multi_latent_attention=true", "model.q_lora_rank=24",
      "model.kv_lora_rank=16",      "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=4",       "model.v_head_dim=10"};
  rows_match_single_process("moe-debug", kAttentionRows, mla);
  std::vector<std::string> uncompressed = mla;
  uncompressed.push_back("model.q_lora_rank=0");
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}}, uncompressed);
}

// Context parallelism (layout_token_segments): each cp rank's chunks are whole token segments, its 2B
// token pieces of every weight gradient and its two chunks' dK, dV trees are combined exactly over
// the group (combine_token_pieces, reduce_scatter_dkv_pieces): CP 2, CP 2 x DP 2 (distributed
// optimizer), CP 4 (16 segments), Llama GQA (RoPE) bf16 CP 2 and CP 2 x DP 2, bitwise equal to one
// process with the key (fingerprints and checkpoints).
TEST(LayoutDeterminism, ContextParallelMatchesSingleProcess) {
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "optimizer.distributed=true"}},
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                            },
                            {"layout_token_segments=true"});
  rows_match_single_process("debug", {{4, {"parallel.context=4"}}},
                            {"layout_token_segments=true", "layout_segments=16"});
  rows_match_single_process(
      "debug",
      {
          {2, {"parallel.context=2"}},
          {4, {"parallel.context=2"}},
          {4, {"parallel.context=2", "parallel.tensor=2"}},
      },
      {"layout_token_segments=true", "model.preset=llama", "model.num_query_groups=2", "precision.params=bf16"});
  // Micro-batches per rank not a power of two (6 at DP 1, 3 at DP 2): cp rank 0's block as pieces of
  // the tree over the step's micro-batches, the other cp ranks' blocks empty.
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2"}},
                                {4,
                                 {"parallel.context=2", "optimizer.distributed=true", "ddp.overlap_grad_reduce=true",
                                  "ddp.bucket_size=20000"}},
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                            },
                            {"layout_token_segments=true", "train.global_batch=12"});
  // Pipeline parallelism: each stage's cp group combines its chunks' pieces as the schedule runs the
  // micro-batches' backwards (tied head on the last stage, interleaved, DP 2 x A = 3 distributed).
  rows_match_single_process("debug",
                            {
                                {4, {"parallel.context=2", "parallel.pipeline=2"}},
                                {8, {"parallel.context=2", "parallel.pipeline=2", "parallel.tensor=2"}},
                            },
                            {"layout_token_segments=true", "model.num_layers=4"});
  rows_match_single_process("debug",
                            {
                                {4, {"parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                                {8,
                                 {"parallel.context=2", "parallel.pipeline=2", "optimizer.distributed=true",
                                  "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                            },
                            {"layout_token_segments=true", "model.num_layers=4", "model.preset=llama",
                             "model.num_query_groups=2", "precision.params=bf16", "train.global_batch=12"});
  // Sequence parallelism: the norms' gradients are each tp rank's units of the cp rank's rows (max(2B,
  // tp) units per cp rank), combined over tp x cp; TP 2 and 4, micro-batches of 1, 2 and 4, with DP,
  // PP (3 micro-batches per rank) and CP 4, GPT-2 and Llama GQA bf16.
  rows_match_single_process(
      "debug",
      {
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {8, {"parallel.context=2", "parallel.tensor=4", "parallel.sequence_parallel=true"}},
          {8,
           {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true",
            "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
      },
      {"layout_token_segments=true"});
  rows_match_single_process("debug",
                            {
                                {8, {"parallel.context=2", "parallel.tensor=4", "parallel.sequence_parallel=true"}},
                                {8, {"parallel.context=4", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                            },
                            {"layout_token_segments=true", "train.micro_batch=1", "layout_segments=16"});
  rows_match_single_process(
      "debug",
      {
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {8, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2"}},
      },
      {"layout_token_segments=true", "model.num_layers=4", "model.preset=llama", "model.num_query_groups=2",
       "precision.params=bf16", "train.global_batch=12"});
  rows_match_single_process("debug",
                            {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"layout_token_segments=true", "train.micro_batch=4", "layout_segments=16"});
  // MTP: the output head's weight gets a tree from every head (and, tied, the depths' lookups), the
  // embedding copies one per depth, folded in one by one over the cp group (fold_token_pieces); each
  // depth's loss the micro-batch's mean. Tied D = 2 at CP 2 and CP 4, untied (RoPE, no position copy)
  // Llama GQA bf16 at CP 2 x TP 2 + SP and CP 2 x PP 2, with DP 2 (3 micro-batches per rank).
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                            },
                            {"layout_token_segments=true", "model.mtp_num_layers=2"});
  rows_match_single_process("debug", {{4, {"parallel.context=4"}}},
                            {"layout_token_segments=true", "model.mtp_num_layers=2", "layout_segments=16"});
  rows_match_single_process(
      "debug",
      {
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.context=2", "parallel.pipeline=2"}},
          {8, {"parallel.context=2", "parallel.pipeline=2", "optimizer.distributed=true"}},
      },
      {"layout_token_segments=true", "model.mtp_num_layers=1", "model.num_layers=4", "model.preset=llama",
       "model.num_query_groups=2", "precision.params=bf16", "train.global_batch=12"});
  // FP8: the per-tensor recipes read each piece's rows of the operands quantised whole (the micro-batch's
  // amax over tp x cp); the block recipes cut the weight gradients' token blocks at the token segments.
  for (const char* recipe :
       {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp8=blockwise", "precision.fp8=mxfp8"})
    rows_match_single_process("debug",
                              {
                                  {2, {"parallel.context=2"}},
                                  {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                              },
                              {"layout_token_segments=true", "precision.params=bf16", recipe});
  rows_match_single_process(
      "debug",
      {
          {4, {"parallel.context=4"}},
          {4, {"parallel.context=2", "optimizer.distributed=true"}},
      },
      {"layout_token_segments=true", "layout_segments=16", "model.preset=llama", "model.num_query_groups=2",
       "precision.params=bf16", "precision.fp8=blockwise", "train.global_batch=12"});
  // NVFP4: the weight gradients' operands transformed and quantised over the rank's pieces at once (one
  // tensor amax over tp x cp), their stochastic rounding (and dgrad's) keyed by the pieces' micro-batch
  // tokens; chunks of whole 16-token blocks.
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                            },
                            {"layout_token_segments=true", "precision.params=bf16", "precision.fp4=nvfp4"});
  rows_match_single_process(
      "debug", {{4, {"parallel.context=4"}}, {4, {"parallel.context=2", "optimizer.distributed=true"}}},
      {"layout_token_segments=true", "layout_segments=16", "model.seq_length=128", "model.preset=llama",
       "model.num_query_groups=2", "precision.params=bf16", "precision.fp4=nvfp4", "train.global_batch=12"});
  // 112 tokens per micro-batch: a cp rank's share of the loss divided by the count is not exact, so
  // the micro-batch's loss is the mean over its gathered per-token losses, counted on cp rank 0.
  rows_match_single_process("debug", {{2, {"parallel.context=2"}}, {4, {"parallel.context=2", "parallel.tensor=2"}}},
                            {"layout_token_segments=true", "model.seq_length=56"});
}

// Context parallelism, MoE models (layout_token_segments): the MoE norm, router, shared expert (gate
// included) and expert weight gradients are computed per token piece of the rank's rows; under tensor
// parallelism (EP = ETP = 1) each tp rank's share of them, combined over tp x cp (the experts kept by
// one rank, their expert data-parallel reduction adding the others' -0). Micro-batches per rank a power
// of two or not (the expert group's kept blocks), DP, TP + SP, TP 4 with micro-batches of 1, CP 4, a
// capacity (both drop policies, padding), router jitter and expert bias, Llama bf16, PP.
// parallel.cp_comm_type = "a2a" (model/context_attention.h): each rank runs the single-process kernel on
// the whole sequence of its heads, so attention needs no combine: CP 2 and 4, with TP 2 x SP and DP,
// GPT-2 and Llama GQA bf16 (with RoPE and PP), an MoE model with EP, bitwise equal to one process.
TEST(LayoutDeterminism, ContextParallelAllToAllMatchesSingleProcess) {
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2", "parallel.cp_comm_type=a2a"}},
                                {4, {"parallel.context=4", "parallel.cp_comm_type=a2a"}},
                                {8,
                                 {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                  "parallel.cp_comm_type=a2a", "optimizer.distributed=true"}},
                            },
                            {"layout_token_segments=true", "layout_segments=16"});
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.context=2", "parallel.cp_comm_type=a2a"}},
                                {4, {"parallel.context=2", "parallel.cp_comm_type=a2a", "parallel.pipeline=2"}},
                            },
                            {"layout_token_segments=true", "model.preset=llama", "model.num_query_groups=2",
                             "precision.params=bf16", "model.num_layers=4"});
  rows_match_single_process(
      "moe-debug",
      {
          {4,
           {"parallel.context=2", "parallel.cp_comm_type=a2a", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
      },
      {"layout_token_segments=true"});
}

TEST(LayoutDeterminism, ContextParallelMoeMatchesSingleProcess) {
  const std::vector<std::string> key = {"layout_token_segments=true", "moe.shared_expert_intermediate_size=64",
                                        "moe.shared_expert_gate=true"};
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                                {4,
                                 {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                  "optimizer.distributed=true"}},
                            },
                            key);
  std::vector<std::string> odd = key;
  odd.push_back("train.global_batch=12");
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                                {4,
                                 {"parallel.context=2", "optimizer.distributed=true", "ddp.overlap_grad_reduce=true",
                                  "ddp.bucket_size=20000"}},
                            },
                            odd);
  rows_match_single_process("moe-debug", {{8, {"parallel.context=2", "parallel.tensor=4"}}},
                            {"layout_token_segments=true", "train.micro_batch=1"});
  rows_match_single_process("moe-debug", {{4, {"parallel.context=4"}}},
                            {"layout_token_segments=true", "layout_segments=16"});
  rows_match_single_process(
      "moe-debug",
      {
          {2, {"parallel.context=2"}},
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
      },
      {"layout_token_segments=true", "moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true",
       "moe.token_drop_policy=position", "moe.input_jitter_eps=0.01", "moe.router_enable_expert_bias=true",
       "moe.router_score_function=sigmoid"});
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                                {4, {"parallel.context=2", "parallel.pipeline=2"}},
                                {4, {"parallel.context=2", "parallel.expert=2", "parallel.pipeline=2"}},
                            },
                            {"layout_token_segments=true", "model.preset=llama", "precision.params=bf16",
                             "model.num_layers=4", "moe.expert_capacity_factor=1.0"});
  // MTP (its depths dense): the head's and depths' folded pieces beside the MoE layers' tp shares.
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.context=2", "parallel.tensor=2"}},
                                {2, {"parallel.context=2", "parallel.expert=2"}},
                            },
                            {"layout_token_segments=true", "model.mtp_num_layers=1"});
  // Split experts: the expert x expert-tensor group holds whole micro-batches' tp x cp ranks, whose
  // rows of each expert are put back in token order before the token-segment trees (both
  // dispatchers, EP 2 / 4 over one or two micro-batch groups, ETP, with TP + SP, expert data
  // parallelism with blocks of 3 micro-batches, CP 4).
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.context=2", "parallel.expert=2"}},
                                {2, {"parallel.context=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                                {2, {"parallel.context=2", "parallel.expert_tensor=2"}},
                                {4, {"parallel.context=2", "parallel.expert=4", "moe.token_dispatcher=alltoall"}},
                                {4,
                                 {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                  "parallel.expert=2", "parallel.expert_tensor=2", "moe.token_dispatcher=alltoall"}},
                            },
                            key);
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.context=2", "parallel.expert=2", "optimizer.distributed=true"}},
                                {4, {"parallel.context=2", "parallel.expert=4"}},
                            },
                            {"layout_token_segments=true", "train.global_batch=12", "moe.expert_capacity_factor=1.0",
                             "moe.pad_expert_input_to_capacity=true"});
  rows_match_single_process("moe-debug", {{4, {"parallel.context=4", "parallel.expert=4"}}},
                            {"layout_token_segments=true", "layout_segments=16"});
  // Quantised: each (expert, micro-batch group) block in token order is one process's tensor of the
  // expert's micro-batch rows (every recipe); the shared expert's pieces as in dense layers, under
  // tensor parallelism NVFP4 keying a tp rank's units by their micro-batch tokens (ParamStore::unit_token).
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp8=blockwise",
                             "precision.fp8=mxfp8", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug",
                              {
                                  {2, {"parallel.context=2", "parallel.expert=2"}},
                                  {4,
                                   {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                    "parallel.expert=2", "parallel.expert_tensor=2", "moe.token_dispatcher=alltoall"}},
                                  {4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=4"}},
                              },
                              {"layout_token_segments=true", "precision.params=bf16", recipe,
                               "moe.shared_expert_intermediate_size=64", "moe.shared_expert_gate=true"});
  // Quantised experts on every rank: each cp (x tp) rank quantises its own rows of an expert (the
  // per-tensor amax max-reduced over tp x cp), each token piece's weight gradient quantised along the
  // tokens segment by segment.
  for (const char* recipe :
       {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp8=blockwise", "precision.fp8=mxfp8"})
    rows_match_single_process("moe-debug",
                              {
                                  {2, {"parallel.context=2"}},
                                  {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                              },
                              {"layout_token_segments=true", "precision.params=bf16", recipe});
  rows_match_single_process(
      "moe-debug",
      {
          {2, {"parallel.context=2"}},
          {4, {"parallel.context=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
      },
      {"layout_token_segments=true", "precision.params=bf16", "precision.fp8=blockwise", "model.preset=llama",
       "moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"});
  // Expert groups smaller than the tp x cp group (a divisor of it): each micro-batch's expert
  // gradients as leaves per (expert, source, token unit), combined over the partners (the ranks of
  // the tp x cp group with the same expert coordinates) along the canonical tree over the units in
  // token order (model/moe/experts.h). CP 2 x TP 2 x EP 2 with both dispatchers, CP 4 x EP 2 (a
  // group's units {0, 1, 6, 7} of each sample), CP 2 x TP 2 + SP x ETP 2, CP 2 x TP 4 x EP 2 with
  // micro-batches of 1 (a unit is half a chunk), DP 2 with 3 micro-batches per rank (blocks as pieces)
  // and the distributed optimizer, padded with biases, Llama bf16. Combining the units in another
  // order (rotated by one) fails these rows.
  rows_match_single_process(
      "moe-debug",
      {
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2"}},
          {4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
          {4,
           {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}},
      },
      {"layout_token_segments=true"});
  rows_match_single_process("moe-debug", {{4, {"parallel.context=4", "parallel.expert=2"}}},
                            {"layout_token_segments=true", "layout_segments=16"});
  rows_match_single_process("moe-debug", {{8, {"parallel.context=2", "parallel.tensor=4", "parallel.expert=2"}}},
                            {"layout_token_segments=true", "train.micro_batch=1"});
  rows_match_single_process(
      "moe-debug",
      {{8, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2", "optimizer.distributed=true"}}},
      {"layout_token_segments=true", "train.global_batch=12"});
  rows_match_single_process(
      "moe-debug",
      {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}}},
      {"layout_token_segments=true", "moe.expert_capacity_factor=1.5", "moe.pad_expert_input_to_capacity=true",
       "train.lr=1.0", "train.warmup_steps=0"});
  rows_match_single_process(
      "moe-debug",
      {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2"}}},
      {"layout_token_segments=true", "model.preset=llama", "precision.params=bf16"});
  // FP8: a kept block (all of a group's sources' rows of an expert) holds several unit leaves, each
  // read from its first row (Precision::grouped_wgrad_segments); reading every leaf from the block's
  // first row fails the tensorwise rows.
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=blockwise"}) {
    rows_match_single_process(
        "moe-debug",
        {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}}},
        {"layout_token_segments=true", "precision.params=bf16", recipe});
    rows_match_single_process("moe-debug", {{4, {"parallel.context=4", "parallel.expert=2"}}},
                              {"layout_token_segments=true", "layout_segments=16", "precision.params=bf16", recipe});
  }
  rows_match_single_process(
      "moe-debug",
      {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}}},
      {"layout_token_segments=true", "precision.params=bf16", "precision.fp8=mxfp8",
       "moe.shared_expert_intermediate_size=64"});
  rows_match_single_process("moe-debug", {{4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2"}}},
                            {"layout_token_segments=true", "precision.params=bf16", "precision.fp8=delayed",
                             "precision.fp8_amax_history_len=2"});
  // With biases: the padding rows' activations zeroed (GroupedExperts' inert_padding); a learning rate
  // of 1 grows the fc biases in one step (without the zeroing these rows differ at step 2).
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.context=2"}},
                                {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                            },
                            {"layout_token_segments=true", "precision.params=bf16", "precision.fp8=blockwise",
                             "moe.expert_capacity_factor=1.5", "moe.pad_expert_input_to_capacity=true", "train.lr=1.0",
                             "train.warmup_steps=0"});
  rows_match_single_process(
      "moe-debug", {{8, {"parallel.context=2", "parallel.tensor=4", "parallel.expert=8"}}},
      {"layout_token_segments=true", "precision.params=bf16", "precision.fp4=nvfp4",
       "moe.shared_expert_intermediate_size=64", "train.micro_batch=1", "model.seq_length=128", "moe.num_experts=8"});
}

// Tensor parallelism, MoE models: each tp rank routes its own N / tp tokens, whole token segments of
// the micro-batch. The router, MoE norm and shared expert gradients are token-segment sums reduced
// over tp per micro-batch; each expert's weight gradient is, per micro-batch, the tree over its rows'
// token segments: from the tp ranks inside the expert x expert-tensor group (EP, ETP: both
// dispatchers), or reduced over tp per micro-batch (EP = ETP = 1). GPT-2 and Llama (SwiGLU) bf16,
// MTP, data and pipeline parallelism.
TEST(LayoutDeterminism, MoeTensorParallelLayoutsMatchSingleProcess) {
  // The first four: 2 or 4 micro-batches per rank (the global batch of 8, micro-batches of 2), each
  // micro-batch's expert gradients reduce-scattered over tp, every tp rank pushing its chunk
  // (ExpertTpSum::slices); they fail when a rank pushes another rank's chunk.
  rows_match_single_process(
      "moe-debug",
      {
          {2, {"parallel.tensor=2"}},
          {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
          {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
          {2, {"parallel.tensor=2", "parallel.expert=2"}},
          {2,
           {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2",
            "moe.token_dispatcher=alltoall"}},
          {4, {"parallel.tensor=2", "parallel.expert=4", "moe.token_dispatcher=alltoall"}},
          {4, {"parallel.tensor=2", "parallel.expert=2", "optimizer.distributed=true"}},
          {2, {"parallel.tensor=2", "parallel.expert_tensor=2"}},
          {4,
           {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2", "parallel.expert=2"}},
      },
      {"moe.shared_expert_intermediate_size=64"});
  rows_match_single_process("moe-debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"model.preset=llama", "precision.params=bf16"});
  rows_match_single_process("moe-debug", {{2, {"parallel.tensor=2"}}}, {"model.mtp_num_layers=1"});
  // 3 micro-batches per dp rank: the micro-batch groups' blocks go as pieces (EP 4: one expert
  // data-parallel replica; EP 2: two, the expert reduction over pieces).
  // EP = ETP = 1: tp rank 0's leaves as pieces of the expert reduction over tp x dp, the other tp
  // ranks' blocks empty (replicated and distributed optimizer; DP 3 x A = 3 and DP 2 x A = 5).
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.tensor=2", "parallel.expert=4"}},
                                {4, {"parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                                {4, {"parallel.tensor=2"}},
                                {4,
                                 {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true",
                                  "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                            },
                            {"train.global_batch=12"});
  rows_match_single_process("moe-debug",
                            {
                                {6, {"parallel.tensor=2", "optimizer.distributed=true"}},
                            },
                            {"train.global_batch=18"});
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
                            },
                            {"train.global_batch=20"});
  // ExpertTpSum::slices beyond powers of two: one data-parallel rank with 3 micro-batches (its block
  // is the whole step), and 3 data-parallel ranks with 2 each.
  rows_match_single_process("moe-debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"train.global_batch=6"});
  rows_match_single_process("moe-debug", {{6, {"parallel.tensor=2"}}}, {"train.global_batch=12"});
  // One micro-batch per rank (global batch = micro-batch 2 x dp): the tp ranks keep their parts of
  // the experts' gradients and the expert reduction over the tp x dp ranks adds them
  // (ExpertTpSum::parts); DP 3 x TP 2 + SP, DP 2 x TP 2 with the distributed optimizer,
  // PP 2 x TP 2 + SP (the pipelined grads-ready hook).
  rows_match_single_process("moe-debug", {{6, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"train.global_batch=6"});
  rows_match_single_process("moe-debug", {{4, {"parallel.tensor=2", "optimizer.distributed=true"}}},
                            {"train.global_batch=4"});
  rows_match_single_process("moe-debug",
                            {{4, {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"model.num_layers=4", "model.tie_embeddings=false", "train.global_batch=2"});
  // A capacity: the micro-batch's, each tp rank keeping its tokens' part of the micro-batch's drop mask
  // (both drop policies, padding to capacity; both dispatchers under EP, ETP, DP).
  const std::vector<Row> capacity_rows = {
      {2, {"parallel.tensor=2"}},
      {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
      {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
      {4, {"parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
      {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2"}},
      {4, {"parallel.tensor=2", "parallel.expert_tensor=2"}},
  };
  rows_match_single_process("moe-debug", capacity_rows, {"moe.expert_capacity_factor=1.0"});
  rows_match_single_process(
      "moe-debug", capacity_rows,
      {"moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true", "moe.token_drop_policy=position"});
  rows_match_single_process("moe-debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
                            {"model.preset=llama", "precision.params=bf16", "moe.expert_capacity_factor=1.0",
                             "moe.pad_expert_input_to_capacity=true"});
  rows_match_single_process(
      "moe-debug",
      {
          {4, {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
          {4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.tensor=2", "parallel.expert_tensor=2"}},
      },
      {"model.num_layers=4", "model.tie_embeddings=false"});
}

// Three micro-batches: the tree over 3 ranks (one micro-batch each) is the tree over 3 leaves.
TEST(LayoutDeterminism, ThreeRanksMatchSingleProcess) {
  rows_match_single_process("debug", {{3, {}}, {3, {"optimizer.distributed=true"}}}, {"train.global_batch=6"});
}

// Any number of micro-batches per data-parallel rank: a rank's block that is not a subtree of the
// canonical tree goes as its canonical pieces (parallel/data_parallel.h, Communicator::*_pieces).
// M = 6 on 3 ranks (2 each: subtrees) and on 2 (3 each: pieces); M = 9 on 3; M = 10 on 2 and 5;
// both optimizers, overlap, pipeline parallelism (1F1B and interleaved).
TEST(LayoutDeterminism, DataParallelBlocksOfAnySizeMatchSingleProcess) {
  rows_match_single_process(
      "debug",
      {
          {3, {}},
          {2, {}},
          {2, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
          {3, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"}},
          {4, {"parallel.pipeline=2", "optimizer.distributed=true"}},
          {6, {"parallel.pipeline=2"}},
      },
      {"train.global_batch=12"});
  rows_match_single_process(
      "debug",
      {
          {3, {}},
          {3, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
          {6, {"parallel.pipeline=2", "ddp.overlap_grad_reduce=true"}},
      },
      {"train.global_batch=18"});
  rows_match_single_process("debug",
                            {
                                {2, {"ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                                {2, {"optimizer.distributed=true"}},
                                {5, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true"}},
                            },
                            {"train.global_batch=20"});
  rows_match_single_process("debug",
                            {
                                {4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                            },
                            {"train.global_batch=24", "model.num_layers=4"});
}

// The same with MoE (expert gradients in the data-parallel tree): M = 9 on 3 ranks, M = 6 on 2.
TEST(LayoutDeterminism, MoeDataParallelBlocksOfAnySizeMatchSingleProcess) {
  rows_match_single_process(
      "moe-debug",
      {
          {3, {}},
          {3, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
      },
      {"train.global_batch=18"});
  rows_match_single_process("moe-debug", {{2, {"optimizer.distributed=true"}}}, {"train.global_batch=12"});
}

// Expert parallelism with one expert data-parallel replica and A not a power of two: each source's
// block as its pieces, all sources' pieces combined along the canonical tree over the step's
// micro-batches. EP 2 x A = 3, EP 3 x A = 3 (both dispatchers), ETP 2 x EP 2 x A = 3.
TEST(LayoutDeterminism, ExpertParallelBlocksOfAnySizeMatchSingleProcess) {
  rows_match_single_process(
      "moe-debug",
      {
          {2, {"parallel.expert=2"}},
          {2, {"parallel.expert=2", "moe.token_dispatcher=alltoall", "optimizer.distributed=true"}},
      },
      {"train.global_batch=12"});
  rows_match_single_process(
      "moe-debug",
      {
          {3, {"parallel.expert=3"}},
          {3, {"parallel.expert=3", "moe.token_dispatcher=alltoall", "ddp.overlap_grad_reduce=true"}},
      },
      {"train.global_batch=18", "moe.num_experts=3"});
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.expert=2", "parallel.expert_tensor=2"}},
                            },
                            {"train.global_batch=24"});
}

// Several expert data-parallel replicas whose expert-parallel groups' micro-batches are not subtrees:
// each group's block goes as its canonical pieces, built from the sources' pieces, and the expert
// data-parallel reduction combines the groups' pieces (Communicator::*_pieces). EP 2 x EDP 2 x A = 3
// (groups of 6 of 12), EP 3 x EDP 2 x A = 1 (groups of 3 of 6), EP 2 x EDP 3 x A = 3.
TEST(LayoutDeterminism, ExpertDataParallelGroupsOfAnySizeMatchSingleProcess) {
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.expert=2"}},
                                {4,
                                 {"parallel.expert=2", "moe.token_dispatcher=alltoall", "optimizer.distributed=true",
                                  "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
                            },
                            {"train.global_batch=24"});
  rows_match_single_process(
      "moe-debug",
      {
          {6, {"parallel.expert=3"}},
          {6, {"parallel.expert=3", "optimizer.distributed=true", "moe.token_dispatcher=alltoall"}},
      },
      {"train.global_batch=12", "moe.num_experts=3"});
  rows_match_single_process("moe-debug", {{6, {"parallel.expert=2", "optimizer.distributed=true"}}},
                            {"train.global_batch=36"});
}

// The Llama flavour with MTP and bf16 weights, sigmoid router with expert bias and jitter (MoE).
TEST(LayoutDeterminism, LlamaMtpBf16AndRouterFeaturesMatchSingleProcess) {
  rows_match_single_process(
      "debug", {{2, {}}, {4, {"optimizer.distributed=true"}}},
      {"model.preset=llama", "model.num_query_groups=2", "model.mtp_num_layers=1", "precision.params=bf16"});
  rows_match_single_process("moe-debug", {{2, {}}, {4, {"optimizer.distributed=true"}}},
                            {"moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
                             "moe.input_jitter_eps=0.01", "moe.router_load_balancing_type=seq_aux_loss"});
}

// The current-scaling FP8 recipes and NVFP4 (scales from each micro-batch's own tensors; stochastic
// rounding keyed by the global micro-batch index).
TEST(LayoutDeterminism, LowPrecisionRecipesMatchSingleProcess) {
  rows_match_single_process("debug", {{4, {"optimizer.distributed=true"}}},
                            {"precision.params=bf16", "precision.fp8=tensorwise"});
  rows_match_single_process("debug", {{2, {}}}, {"precision.params=bf16", "precision.fp8=mxfp8"});
  rows_match_single_process("moe-debug", {{4, {}}}, {"precision.params=bf16", "precision.fp8=blockwise"});
  rows_match_single_process("moe-debug", {{2, {"optimizer.distributed=true"}}},
                            {"precision.params=bf16", "precision.fp4=nvfp4"});
}

// FP8 delayed scaling: every micro-batch of a step quantises with the scale of the history as the
// step began; the step's amax is the max over all its micro-batches (each rank's, then max-reduced
// over the data-parallel ranks), and the history is updated once per step. The histories and scales
// are whole tensors of the checkpoint, compared with the rest. DP 2 and 4 (2 and 1 micro-batches
// per rank), replicated and distributed optimizer, both amax algorithms.
TEST(LayoutDeterminism, DelayedScalingMatchesSingleProcess) {
  rows_match_single_process("moe-debug", {{2, {}}, {4, {"optimizer.distributed=true"}}},
                            {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
  rows_match_single_process(
      "debug", {{4, {}}, {2, {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}}},
      {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_compute_algo=most_recent",
       "precision.fp8_margin=1"});
}

// Every low-precision recipe under pipeline parallelism: 1F1B with two micro-batches in flight on
// the first stage (each keeps its own quantised inputs for its weight gradient), all forwards then
// all backwards (every micro-batch in flight), interleaved, with
// data, tensor, expert and context parallelism; delayed scaling's once-per-step update over the stage's
// tensors, its histories in the checkpoint; NVFP4's stochastic rounding keyed by the tensor's name,
// the same on every stage; evaluation between steps (the MoE rows), with the scales as they are.
TEST(LayoutDeterminism, LowPrecisionUnderPipelineParallelismMatchesSingleProcess) {
  const std::string bf16 = "precision.params=bf16";
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp8=blockwise",
                             "precision.fp8=mxfp8", "precision.fp4=nvfp4"}) {
    rows_match_single_process("moe-debug",
                              {
                                  {2, {"parallel.pipeline=2"}},
                                  {2, {"parallel.pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward"}},
                                  {4,
                                   {"parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.expert=2",
                                    "moe.token_dispatcher=alltoall"}},
                              },
                              {bf16, recipe, "model.num_layers=4", "precision.fp8_amax_history_len=2",
                               "train.eval_interval=2", "train.eval_batches=2"});
    rows_match_single_process("debug",
                              {{4, {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
                               {4, {"parallel.pipeline=2", "optimizer.distributed=true"}}},
                              {bf16, recipe, "model.mtp_num_layers=1"});
    rows_match_single_process("debug", {{4, {"parallel.pipeline=2", "parallel.context=2"}}},
                              {bf16, recipe, "layout_token_segments=true", "train.micro_batch=2"});
  }
}

// An expert x expert-tensor group smaller than the tp group (G dividing tp): its sources are G
// consecutive tp ranks of a micro-batch, their token segments an aligned subtree of its tree; the
// tp / G groups holding the same experts (partners) sum each micro-batch's parts along the canonical
// tree, the first keeping the leaf and the others -0 (model/moe/experts.h). Both dispatchers, ETP,
// SP, data parallelism, the distributed optimizer, a capacity with padding, Llama bf16, pipeline
// parallelism, every FP8 recipe.
TEST(LayoutDeterminism, ExpertGroupsSmallerThanTensorParallelMatchSingleProcess) {
  rows_match_single_process(
      "moe-debug",
      {
          {4, {"parallel.tensor=4", "parallel.expert=2"}},
          {4,
           {"parallel.tensor=4", "parallel.expert=2", "moe.token_dispatcher=alltoall", "optimizer.distributed=true"}},
          {4, {"parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}},
          {8, {"parallel.tensor=4", "parallel.expert=2", "train.threads=2"}},
      });
  rows_match_single_process("moe-debug",
                            {{4, {"parallel.tensor=4", "parallel.expert=2", "moe.token_dispatcher=alltoall"}}},
                            {"moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"});
  // Blocks that are not subtrees: one data-parallel rank with 3 micro-batches (its block the whole
  // tree), and DP 2 with 3 per rank, where the first partner gives its block's pieces and the others
  // an empty block (with the distributed optimizer and overlapped buckets too).
  rows_match_single_process("moe-debug", {{4, {"parallel.tensor=4", "parallel.expert=2"}}}, {"train.global_batch=6"});
  rows_match_single_process(
      "moe-debug",
      {
          {8, {"parallel.tensor=4", "parallel.expert=2"}},
          {8,
           {"parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.expert_tensor=2",
            "optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"}},
      },
      {"train.global_batch=12"});
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.expert=2"}},
                                {8, {"parallel.tensor=4", "parallel.expert=2", "parallel.pipeline=2"}},
                            },
                            {"model.preset=llama", "precision.params=bf16", "model.num_layers=4"});
  // FP8: each token segment quantised on its own, the per-tensor amax max-reduced over the tp ranks
  // holding the same experts (the etp ranks and their partners). NVFP4: the group's rows of an expert
  // quantised as its part of the micro-batch's (amax reduced over etp and partners, stochastic
  // rounding at the rows' micro-batch indices), the weight gradients of whole micro-batch tensors
  // gathered from the partners (GroupedExperts::gathered_wgrad; under ETP each slice's amax reduced
  // over etp).
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp8=blockwise",
                             "precision.fp8=mxfp8", "precision.fp4=nvfp4"})
    rows_match_single_process(
        "moe-debug",
        {
            {4, {"parallel.tensor=4", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
            {4, {"parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.expert_tensor=2"}},
        },
        {"precision.params=bf16", recipe, "moe.shared_expert_intermediate_size=64"});
  rows_match_single_process(
      "moe-debug",
      {
          {8, {"parallel.tensor=4", "parallel.expert_tensor=2", "parallel.pipeline=2"}},
          {8, {"parallel.tensor=4", "parallel.expert=2", "optimizer.distributed=true", "train.threads=2"}},
      },
      {"model.preset=llama", "precision.params=bf16", "precision.fp4=nvfp4", "model.num_layers=4",
       "moe.expert_capacity_factor=1.0", "train.eval_interval=2"});
}

// Low precision with MoE under tensor parallelism: an expert x expert-tensor group holding whole tp
// groups has all of a micro-batch's rows of its experts (the tp ranks' tokens in order), quantised as
// one block, as one process quantises them. Every recipe, both dispatchers, ETP, SP, a capacity.
TEST(LayoutDeterminism, LowPrecisionMoeUnderTensorParallelismMatchesSingleProcess) {
  const std::string bf16 = "precision.params=bf16";
  const std::vector<Row> rows = {
      {4, {"parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
      {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2"}},
      {2, {"parallel.tensor=2", "parallel.expert_tensor=2"}},
  };
  for (const char* recipe :
       {"precision.fp8=tensorwise", "precision.fp8=blockwise", "precision.fp8=mxfp8", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug", rows, {bf16, recipe});
  rows_match_single_process("moe-debug", {rows[0]},
                            {bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
  rows_match_single_process("moe-debug", {rows[1]}, {bf16, "precision.fp4=nvfp4", "moe.expert_capacity_factor=1.0"});
  // A shared expert: the per-tensor recipes (its amax max-reduced over tp) and the block recipes (its
  // weight gradients' token blocks stop at the token segments, whole segments on every tp rank).
  rows_match_single_process("moe-debug", {rows[1]},
                            {bf16, "precision.fp8=tensorwise", "moe.shared_expert_intermediate_size=64"});
  // NVFP4: its rows' stochastic rounding keyed by their micro-batch tokens (ParamStore::rows_token).
  for (const char* recipe : {"precision.fp8=blockwise", "precision.fp8=mxfp8", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug", {rows[0], rows[1]},
                              {bf16, recipe, "moe.shared_expert_intermediate_size=64"});
  rows_match_single_process(
      "moe-debug", {{4, {"parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.expert_tensor=4"}}},
      {bf16, "precision.fp4=nvfp4", "moe.shared_expert_intermediate_size=64", "train.micro_batch=1"});
  rows_match_single_process(
      "moe-debug", {rows[0]},
      {bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2", "moe.shared_expert_intermediate_size=64"});
}

// Low precision with the experts on every rank (expert x expert-tensor = 1) under tensor parallelism:
// each tp rank quantises its own rows of an expert, with the per-tensor scales' amax max-reduced over
// the tp group and each weight gradient quantised along the tokens segment by segment (whole segments
// per rank), reduced over tp per micro-batch. NVFP4 quantises a rank's rows as its part of the
// micro-batch's (Precision::RowShare) and each expert's weight gradient on its rows gathered from
// every tp rank, a range of experts per rank cut by their rows (GroupedExperts::gathered_wgrad;
// in these runs 4 of every 32 cuts differ from E / tp ranks each, so both kinds are compared).
// Every recipe, SP, data parallelism, a shared expert, Llama's SwiGLU, a capacity.
TEST(LayoutDeterminism, LowPrecisionExpertsOnEveryRankUnderTensorParallelismMatchSingleProcess) {
  const std::string bf16 = "precision.params=bf16";
  const std::vector<Row> rows = {
      {2, {"parallel.tensor=2"}},
      {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"}},
      {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}},
      // 3 threads against the single process's 1: the block recipes' canonical pieces quantised one
      // per thread (many) or one at a time, each quantiser split over the threads (few): the same bits.
      {2, {"parallel.tensor=2", "train.threads=3"}},
  };
  for (const char* recipe :
       {"precision.fp8=tensorwise", "precision.fp8=blockwise", "precision.fp8=mxfp8", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug", rows, {bf16, recipe});
  rows_match_single_process("moe-debug", {rows[1]},
                            {bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
  // One micro-batch per rank: each tp rank keeps its own experts' gathered gradients and -0
  // elsewhere (ExpertTpSum::parts), the fill split over 3 threads.
  rows_match_single_process("moe-debug", {rows[3], {4, {"parallel.tensor=4", "train.threads=2"}}},
                            {bf16, "precision.fp4=nvfp4", "train.global_batch=2"});
  rows_match_single_process("moe-debug", {rows[1]}, {bf16, "precision.fp8=blockwise", "train.global_batch=4"});
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug", {rows[0], rows[1]},
                              {bf16, recipe, "moe.shared_expert_intermediate_size=64"});
  for (const char* recipe : {"precision.fp8=blockwise", "precision.fp4=nvfp4"})
    rows_match_single_process("moe-debug", {rows[1]}, {"model.preset=llama", bf16, recipe});
  // NVFP4 in the middle layers only (the first and last in bf16: both kinds of expert gradient under
  // ExpertTpSum::slices in one model), with 2 threads.
  rows_match_single_process(
      "moe-debug", {{2, {"parallel.tensor=2", "parallel.sequence_parallel=true", "train.threads=2"}}},
      {bf16, "precision.fp4=nvfp4", "precision.fp4_high_precision_layers=1", "model.num_layers=4"});
  // NVFP4 with more tp ranks than experts (two hold none of the gathered gradients), dropped tokens,
  // pipeline stages and evaluation between steps.
  rows_match_single_process("moe-debug", {{8, {"parallel.tensor=4", "parallel.pipeline=2"}}},
                            {bf16, "precision.fp4=nvfp4", "moe.num_experts=2", "moe.router_topk=1",
                             "moe.expert_capacity_factor=1.0", "train.eval_interval=2"});
  // Padded to capacity (capacity factor 1.0: padding rows and dropped tokens; at 0.5 every expert is
  // full): each rank's padding rows are zero rows in its last token segment, with the experts on every
  // rank and in split groups whose sources' rows hold them between. Without biases, and with them
  // (the padding rows' activations zeroed, GroupedExperts' inert_padding), at a learning rate of 1 so
  // that after one step the fc biases are large enough for gelu(b) to move the blocks' scales: without
  // the zeroing the blockwise rows differ at step 2.
  const std::vector<Row> padded = {rows[0],
                                   {4, {"parallel.tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                                   {4, {"parallel.tensor=4", "parallel.expert=2"}}};
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=blockwise"})
    rows_match_single_process(
        "moe-debug", {padded[0], padded[1]},
        {bf16, recipe, "model.bias=false", "moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"});
  for (const char* recipe : {"precision.fp8=blockwise", "precision.fp8=mxfp8"})
    rows_match_single_process("moe-debug", padded,
                              {bf16, recipe, "moe.expert_capacity_factor=1.5", "moe.pad_expert_input_to_capacity=true",
                               "train.lr=1.0", "train.warmup_steps=0"});
  // NVFP4 padded (experts on every rank): an expert's gathered weight-gradient rows are the tp ranks'
  // tokens, then padding to the capacity, as one process's; the forward and input-gradient rows keep
  // each rank's padding (zero rows: no amax, no draw).
  rows_match_single_process("moe-debug", {padded[0], {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}}},
                            {bf16, "precision.fp4=nvfp4", "moe.expert_capacity_factor=1.5",
                             "moe.pad_expert_input_to_capacity=true", "train.lr=1.0", "train.warmup_steps=0"});
  rows_match_single_process("moe-debug", {padded[0]},
                            {bf16, "precision.fp4=nvfp4", "model.bias=false", "moe.expert_capacity_factor=1.0",
                             "moe.pad_expert_input_to_capacity=true"});
}

// Low precision under expert parallelism: an expert's rows come from several ranks' micro-batches,
// so each (expert, source) block is quantised as its own tensor, as one process quantises the
// expert's rows of that micro-batch (its own current scale, blocks along its own tokens, stochastic
// rounding keyed by the source's micro-batch and the expert's index in the layer), and each block's
// weight gradient is its own quantised GEMM. EP 2 and 4, 1 or 2 expert data-parallel replicas, both
// dispatchers, every recipe.
TEST(LayoutDeterminism, LowPrecisionUnderExpertParallelismMatchesSingleProcess) {
  const std::string bf16 = "precision.params=bf16";
  rows_match_single_process(
      "moe-debug",
      {
          {2, {"parallel.expert=2"}},
          {4, {"parallel.expert=2", "moe.token_dispatcher=alltoall", "optimizer.distributed=true"}},
      },
      {bf16, "precision.fp8=tensorwise"});
  rows_match_single_process("moe-debug", {{2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}}},
                            {bf16, "precision.fp8=mxfp8"});
  rows_match_single_process("moe-debug", {{2, {"parallel.expert=2"}}}, {bf16, "precision.fp8=blockwise"});
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.expert=2"}},
                                {4, {"parallel.expert=4", "moe.token_dispatcher=alltoall"}},
                            },
                            {bf16, "precision.fp4=nvfp4"});
  rows_match_single_process("moe-debug", {{4, {"parallel.expert=2"}}},
                            {bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
}

// Low precision under tensor parallelism (dense) and expert tensor parallelism: the per-tensor amax
// is max-reduced over the ranks holding pieces of the tensor; the block recipes quantise every
// operand along a dimension the layout may split in its canonical pieces (no block straddles a
// shard); NVFP4's tensor scale is the whole tensor's and its stochastic rounding keys are global
// element indices (tensor/precision.h).
TEST(LayoutDeterminism, LowPrecisionUnderTensorParallelismMatchesSingleProcess) {
  const std::string bf16 = "precision.params=bf16", sp = "parallel.sequence_parallel=true";
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", sp}}, {4, {"parallel.tensor=2"}}},
                            {bf16, "precision.fp8=tensorwise"});
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", sp}}}, {bf16, "precision.fp8=blockwise"});
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", sp}}, {4, {"parallel.tensor=4", sp}}},
                            {bf16, "precision.fp8=mxfp8"});
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", sp}}},
                            {bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
  rows_match_single_process("debug", {{2, {"parallel.tensor=2", sp}}, {4, {"parallel.tensor=2", sp}}},
                            {bf16, "precision.fp4=nvfp4"});
  rows_match_single_process("moe-debug",
                            {{2, {"parallel.expert_tensor=2"}}, {4, {"parallel.expert_tensor=2", "parallel.expert=2"}}},
                            {bf16, "precision.fp8=tensorwise"});
  rows_match_single_process("moe-debug",
                            {{2, {"parallel.expert_tensor=2"}},
                             {4, {"parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}}},
                            {bf16, "precision.fp8=blockwise"});
  rows_match_single_process("moe-debug",
                            {{2, {"parallel.expert_tensor=2"}}, {4, {"parallel.expert_tensor=2", "parallel.expert=2"}}},
                            {bf16, "precision.fp4=nvfp4"});
  // SwiGLU experts: under expert tensor parallelism an expert's fc rows are two boxes (its gate and up
  // slices), one site per expert all the same.
  rows_match_single_process("moe-debug", {{2, {"parallel.expert_tensor=2"}}},
                            {"model.preset=llama", bf16, "precision.fp8=tensorwise"});
  rows_match_single_process("moe-debug", {{4, {"parallel.expert_tensor=2", "parallel.expert=2"}}},
                            {"model.preset=llama", bf16, "precision.fp4=nvfp4"});
  rows_match_single_process(
      "moe-debug",
      {{4, {"parallel.expert_tensor=2", "parallel.expert=2"}}, {4, {"parallel.expert_tensor=2", "parallel.tensor=2"}}},
      {"model.preset=llama", bf16, "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
}

// The histories are whole tensors under layout: a DP 4 run's checkpoint after step 2 resumes on one
// process and finishes bitwise as the single-process run.
TEST(LayoutDeterminism, DelayedScalingCheckpointReshardsToOneProcess) {
  const std::vector<std::string> delayed = {"precision.params=bf16", "precision.fp8=delayed",
                                            "precision.fp8_amax_history_len=2"};
  TempDir dir;
  train_ranks(1, job("moe-debug", dir.path("single"), delayed));
  std::vector<std::string> cut = delayed;
  cut.insert(cut.end(), {"train.save_interval=2", "train.exit_interval=2"});
  train_ranks(4, job("moe-debug", dir.path("resharded"), cut));
  std::vector<std::string> resume = delayed;
  resume.push_back("train.resume=auto");
  train_ranks(1, job("moe-debug", dir.path("resharded"), resume));
  EXPECT_EQ(global_fields(dir.path("resharded")), global_fields(dir.path("single")));
  EXPECT_EQ(checkpoint_difference(dir.path("single"), dir.path("resharded")), "");
}

// A job that changes its layout mid-run: steps 1-2 under one layout, checkpointed, step 3 resumed
// under another (resharded on load), is bitwise the uninterrupted single-process job: every step's
// global fingerprint fields and every tensor of the final checkpoint.
TEST(LayoutDeterminism, ResumedUnderAnotherLayoutMatchesSingleProcess) {
  struct Change {
    std::string preset;
    std::vector<std::string> common;
    Row before, after;
  };
  const std::string key = "layout_token_segments=true";
  const std::vector<Change> changes = {
      {"debug",
       {key},
       {4, {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"}},
       {4, {"parallel.pipeline=2", "optimizer.distributed=true"}}},
      {"debug",
       {key, "model.preset=llama", "model.num_query_groups=2", "precision.params=bf16"},
       {1, {}},
       {4, {"parallel.context=2", "optimizer.distributed=true"}}},
      {"moe-debug", {}, {4, {"parallel.tensor=2", "parallel.expert=2"}}, {2, {"parallel.expert_tensor=2"}}},
      {"moe-debug",
       {"moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true", "moe.input_jitter_eps=0.01"},
       {2, {"parallel.expert=2"}},
       {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
      {"moe-debug", {key}, {4, {"parallel.context=2", "parallel.expert=2"}}, {1, {}}},
      {"moe-debug",
       {"precision.params=bf16", "precision.fp8=blockwise"},
       {2, {"parallel.expert=2"}},
       {4, {"parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true"}}},
      {"moe-debug",
       {key, "moe.token_dispatcher=alltoall"},
       {4, {"parallel.expert=4"}},
       {4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=4"}}},
      {"moe-debug",
       {key},
       {4, {"parallel.context=2", "parallel.tensor=2", "parallel.expert=2"}},
       {2, {"parallel.tensor=2"}}},
      {"debug",
       {key, "model.mtp_num_layers=2"},
       {2, {"parallel.context=2"}},
       {4, {"parallel.tensor=4", "parallel.sequence_parallel=true"}}},
      {"debug",
       {"model.num_layers=4", "model.tie_embeddings=false"},
       {4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
       {2, {"parallel.tensor=2"}}},
      {"debug",
       {key, "precision.params=bf16", "precision.fp4=nvfp4"},
       {2, {"parallel.context=2"}},
       {2, {"parallel.tensor=2", "parallel.sequence_parallel=true"}}},
      // FP8 experts: a group of 2 under TP 4 (partners), then the experts on every rank under CP 2.
      {"moe-debug",
       {key, "precision.params=bf16", "precision.fp8=tensorwise"},
       {4, {"parallel.tensor=4", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
       {2, {"parallel.context=2"}}},
  };
  for (const Change& c : changes) {
    TempDir dir;
    train_ranks(1, job(c.preset, dir.path("single"), c.common));
    std::vector<std::string> before = c.common, after = c.common;
    before.insert(before.end(), c.before.keys.begin(), c.before.keys.end());
    before.insert(before.end(), {"train.save_interval=2", "train.exit_interval=2"});
    after.insert(after.end(), c.after.keys.begin(), c.after.keys.end());
    after.push_back("train.resume=auto");
    train_ranks(c.before.ranks, job(c.preset, dir.path("changed"), before));
    train_ranks(c.after.ranks, job(c.preset, dir.path("changed"), after));
    std::string name = c.preset;
    for (const auto* keys : {&c.common, &c.before.keys, &c.after.keys})
      for (const std::string& k : *keys) name += " " + k;
    EXPECT_EQ(global_fields(dir.path("changed"), false), global_fields(dir.path("single"), false)) << name;
    EXPECT_EQ(checkpoint_difference(dir.path("single"), dir.path("changed")), "") << name;
  }
}

// Pipeline parallelism (untied embeddings, 4 layers; tied and MTP below): every stage pushes each micro-batch's
// gradients as its leaf of the canonical tree whatever the schedule (1F1B, interleaved, all forward
// all backward); the losses and aux losses are exact sums over the stages.
TEST(LayoutDeterminism, PipelineLayoutsMatchSingleProcess) {
  const std::vector<std::string> untied = {"model.num_layers=4", "model.tie_embeddings=false"};
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.pipeline=2"}},
                                {4, {"parallel.pipeline=4"}},
                                {2, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                                {2, {"parallel.pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward"}},
                                {4,
                                 {"parallel.pipeline=2", "optimizer.distributed=true", "ddp.overlap_grad_reduce=true",
                                  "ddp.bucket_size=20000"}},
                            },
                            untied);
  std::vector<std::string> llama = untied;
  llama.insert(llama.end(), {"model.preset=llama", "model.num_query_groups=2"});
  rows_match_single_process("debug", {{2, {"parallel.pipeline=2"}}, {4, {"parallel.pipeline=2"}}}, llama);
  rows_match_single_process("moe-debug",
                            {
                                {4, {"parallel.pipeline=4"}},
                                {4, {"parallel.pipeline=2", "optimizer.distributed=true"}},
                                {4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                                // with expert parallelism: every in-flight micro-batch's dispatcher sums exactly
                                {4, {"parallel.pipeline=2", "parallel.expert=2"}},
                                {4, {"parallel.pipeline=2", "parallel.expert=2", "parallel.virtual_pipeline=2"}},
                                {4, {"parallel.pipeline=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                                {4,
                                 {"parallel.pipeline=2", "parallel.expert=2", "moe.token_dispatcher=alltoall",
                                  "parallel.virtual_pipeline=2"}},
                                {4, {"parallel.pipeline=2", "parallel.expert_tensor=2", "parallel.virtual_pipeline=2"}},
                            },
                            untied);
}

// Pipeline parallelism with a tied head and / or MTP: the word (and position) embedding's lookup
// part (first stage) and head + MTP part (last stage; on one process the head's copy of the
// embedding) are each the canonical tree over micro-batches, added after the data-parallel reduction.
TEST(LayoutDeterminism, PipelineTiedEmbeddingAndMtpMatchSingleProcess) {
  rows_match_single_process("debug",
                            {
                                {2, {"parallel.pipeline=2"}},
                                {4, {"parallel.pipeline=4"}},
                                {2, {"parallel.pipeline=2", "parallel.virtual_pipeline=2"}},
                                {4,
                                 {"parallel.pipeline=2", "optimizer.distributed=true", "ddp.overlap_grad_reduce=true",
                                  "ddp.bucket_size=20000"}},
                            },
                            {"model.num_layers=4"});
  rows_match_single_process(
      "debug",
      {
          {2, {"parallel.pipeline=2"}},
          {4, {"parallel.pipeline=2", "parallel.virtual_pipeline=2", "optimizer.distributed=true"}},
      },
      {"model.num_layers=4", "model.mtp_num_layers=2"});
  rows_match_single_process("debug", {{2, {"parallel.pipeline=2"}}, {4, {"parallel.pipeline=2"}}},
                            {"model.num_layers=4", "model.preset=llama", "model.num_query_groups=2",
                             "model.tie_embeddings=false", "model.mtp_num_layers=1"});
  rows_match_single_process("moe-debug",
                            {
                                {2, {"parallel.pipeline=2"}},
                                {4, {"parallel.pipeline=2", "parallel.expert=2", "moe.token_dispatcher=alltoall"}},
                            },
                            {"model.num_layers=4", "model.mtp_num_layers=1"});
}

// Same job, `run` vs `layout`, single process: the sums are ordered differently (tree vs left fold
// over micro-batches, exact vs blocked sums of squares), so the bits may differ, but only by
// rounding.
TEST(LayoutDeterminism, LayoutModeIsTheSameTrainingWithinRounding) {
  TempDir dir;
  train_ranks(1, job("debug", dir.path("layout"), {}));
  train_ranks(1, job("debug", dir.path("run"), {"determinism=run"}));
  const auto a = read_fingerprint_lines(fingerprint_path(dir.path("layout"), 0));
  const auto b = read_fingerprint_lines(fingerprint_path(dir.path("run"), 0));
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) {
    const double la = std::bit_cast<double>(std::stoull(*a[s].find("loss"), nullptr, 16));
    const double lb = std::bit_cast<double>(std::stoull(*b[s].find("loss"), nullptr, 16));
    EXPECT_LT(std::fabs(la - lb), 1e-6 * std::fabs(lb)) << "step " << s + 1;
  }
}

TEST(LayoutDeterminism, RefusesWhatItCannotMakeLayoutInvariant) {
  TempDir dir;
  auto error_of = [&](int ranks, const std::vector<std::string>& keys, const std::string& preset = "debug") {
    try {
      train_ranks(ranks, job(preset, dir.path("refused"), keys));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // Tensor parallelism: whole canonical segments per rank. (Errors come as "rank R: ..." from the
  // trainer, "config: ..." from validation.)
  EXPECT_NE(error_of(4, {"parallel.tensor=4", "layout_segments=2"})
                .find("determinism = \"layout\" with parallel.tensor = 4 and layout_segments = 2: parallel.tensor "
                      "must divide layout_segments"),
            std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.path("refused"))) << "nothing is written";
  // layout_token_segments: segments on sample boundaries.
  EXPECT_NE(error_of(1, {"layout_token_segments=true", "train.micro_batch=4", "layout_segments=2"})
                .find("determinism = \"layout\" with layout_token_segments = true, train.micro_batch = 4 and "
                      "layout_segments = 2: the micro-batch's token segments must fall on sample boundaries"),
            std::string::npos);
  EXPECT_NE(error_of(1, {"layout_token_segments=true", "determinism=run"})
                .find("layout_token_segments = true: needs determinism = \"layout\""),
            std::string::npos);
  // The experts' canonical K segments: F / layout_segments hidden units each, a block of them per etp rank.
  EXPECT_NE(error_of(1, {"moe.ffn_hidden_size=100"}, "moe-debug")
                .find("determinism = \"layout\" with moe.ffn_hidden_size = 100 and layout_segments = 8: the expert "
                      "hidden size must be divisible by layout_segments"),
            std::string::npos);
  EXPECT_NE(error_of(4, {"parallel.expert_tensor=4", "layout_segments=2"}, "moe-debug")
                .find("determinism = \"layout\" with parallel.expert_tensor = 4 and layout_segments = 2: "
                      "parallel.expert_tensor must divide layout_segments"),
            std::string::npos);
  // MoE under tensor parallelism: an expert group neither dividing tp nor a multiple of it; NVFP4
  // padded to capacity. (NVFP4 with a group dividing tp under context parallelism: test_context_parallel.)
  EXPECT_NE(error_of(4, {"parallel.tensor=4", "parallel.expert=3", "parallel.expert_tensor=2", "moe.num_experts=6"},
                     "moe-debug")
                .find("determinism = \"layout\" with parallel.tensor = 4, an MoE model and parallel.expert x "
                      "parallel.expert_tensor = 6: an expert's rows would come from parts of a micro-batch's ranks of "
                      "parallel.tensor = 4 that do not tile it"),
            std::string::npos);
  EXPECT_NE(error_of(4,
                     {"precision.params=bf16", "precision.fp4=nvfp4", "parallel.tensor=2", "parallel.expert=2",
                      "moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"},
                     "moe-debug")
                .find("determinism = \"layout\" with parallel.tensor = 2, an MoE model, precision.fp4 = \"nvfp4\" and "
                      "moe.pad_expert_input_to_capacity = true: a micro-batch's NVFP4 expert block would hold the "
                      "padding of each of its ranks of parallel.tensor = 2"),
            std::string::npos);
  EXPECT_NE(error_of(4,
                     {"precision.params=bf16", "precision.fp4=nvfp4", "parallel.tensor=2", "parallel.expert=2",
                      "moe.shared_expert_intermediate_size=64", "train.micro_batch=1", "model.seq_length=24"},
                     "moe-debug")
                .find("determinism = \"layout\" with precision.fp4 = \"nvfp4\", moe.shared_expert_intermediate_size = "
                      "64 and parallel.tensor = 2: the shared expert's weight gradients transform each tensor-parallel "
                      "rank's 12 tokens in 16-token Hadamard blocks"),
            std::string::npos);
  EXPECT_NE(error_of(1, {"moe.router_load_balancing_type=global_aux_loss"}, "moe-debug")
                .find("determinism = \"layout\" with moe.router_load_balancing_type = \"global_aux_loss\""),
            std::string::npos);
}

}  // namespace
}  // namespace lockstep
