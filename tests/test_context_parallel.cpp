// Context parallelism (parallel/context_parallel.h) end to end: the communication volume against
// the formula of docs/parallelism.md, the held-pieces combine bit for bit, and the configurations it
// refuses. That CP 2 (alone, with DP
// and with TP + SP) reproduces one process is in test_parallel_layouts.cpp (rows gpt2_cp2...), its
// determinism run to run, across threads and resumed in test_determinism_matrix.cpp (rows cp2_...),
// its attention against the whole-sequence kernel in tests/ops/attention.cpp (HarnessAttentionChunks), packed
// documents in test_documents.cpp, checkpoints in test_checkpoint.cpp, threads vs mpi in tests/mpi.
#include <gtest/gtest.h>

#include <algorithm>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/parallel/context_parallel.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

Config job(const std::string& out_dir, std::vector<std::string> keys) {
  for (const std::string& k :
       {std::string("train.steps=2"), std::string("train.eval_interval=0"), std::string("train.threads=1"),
        std::string("train.micro_batch=2"), std::string("train.global_batch=8"), "train.out_dir=" + out_dir})
    keys.push_back(k);
  return load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/debug.toml"), keys);
}

// Bytes rank 0 sends per step in its cp group (metrics.jsonl cp_bytes): per layer and micro-batch,
// the all-gather of the keys and values of its B x T / cp rows and the reduce-scatter of their
// gradients, each (cp - 1) x B x T / cp x 2 NKV / tp x HS floats. debug.toml: L 2, T 64, 4 heads of 16.
TEST(ContextParallel, CommunicationVolumeMatchesTheFormula) {
  const int64_t L = 2, T = 64, NKV = 4, HS = 16, B = 2, global = 8;
  struct Case {
    int cp, tp, dp;
  };
  for (const Case& c : {Case{2, 1, 1}, Case{4, 1, 1}, Case{2, 2, 1}, Case{2, 1, 2}}) {
    testing::TempDir dir;
    const int world = c.cp * c.tp * c.dp;
    testing::train_ranks(world, job(dir.path("run"), {str("parallel.context=", c.cp), str("parallel.tensor=", c.tp)}));
    const int64_t micro = global / (B * c.dp), P = c.cp;
    const int64_t expected = 4 * micro * L * 2 * (P - 1) * B * (T / P) * 2 * (NKV / c.tp) * HS;
    std::istringstream in(testing::read_file(dir.path("run") + "/metrics.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(in, line); ++steps)
      EXPECT_EQ(nlohmann::json::parse(line).value("cp_bytes", int64_t{-1}), expected)
          << "cp " << c.cp << " tp " << c.tp << " dp " << c.dp;
    EXPECT_EQ(steps, 2);
    std::printf("[ debug ] cp %d x tp %d x dp %d: %lld bytes per step per rank in the cp group\n", c.cp, c.tp, c.dp,
                static_cast<long long>(expected));
  }
}

// The same for the other parallel.cp_comm_type values, per layer and micro-batch, n = B x T / cp rows:
// p2p sends its n rows' keys and values on P - 1 times forward and P - 1 times backward, and their
// gradients P times (the last hop brings them home): (3P - 2) x n x 2 NKV HS floats. a2a trades
// (A - 1) / A of its rows' q, k, v and of the output forward, and of the output gradient and the
// q, k, v gradient backward: 2 (A - 1) / A x n x ((NH + 2 NKV) HS + NH HS). a2a+p2p (A, P): the
// all-to-all on the rank's rows, then the ring of the group's A n rows of NKV / A groups.
TEST(ContextParallel, CommunicationVolumeOfEachTypeMatchesTheFormula) {
  const int64_t L = 2, T = 64, NH = 4, NKV = 4, HS = 16, B = 2, global = 8;
  struct Case {
    const char* type;
    int64_t a2a, ring;
  };
  for (const Case& c :
       {Case{"p2p", 1, 2}, Case{"p2p", 1, 4}, Case{"a2a", 2, 1}, Case{"a2a", 4, 1}, Case{"a2a+p2p", 2, 2}}) {
    testing::TempDir dir;
    const int64_t cp = c.a2a * c.ring, n = B * T / cp, micro = global / B;
    std::vector<std::string> keys = {str("parallel.context=", cp), str("parallel.cp_comm_type=", c.type)};
    if (std::string(c.type) == "a2a+p2p")
      keys.push_back(str("parallel.hierarchical_context_parallel_sizes=", c.a2a, ",", c.ring));
    testing::train_ranks(static_cast<int>(cp), job(dir.path("run"), keys));
    const int64_t a2a_floats = 2 * (c.a2a - 1) * n / c.a2a * ((NH + 2 * NKV) * HS + NH * HS);
    const int64_t ring_floats = c.ring > 1 ? (3 * c.ring - 2) * (c.a2a * n) * 2 * (NKV / c.a2a) * HS : 0;
    const int64_t expected = 4 * micro * L * (a2a_floats + ring_floats);
    std::istringstream in(testing::read_file(dir.path("run") + "/metrics.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(in, line); ++steps)
      EXPECT_EQ(nlohmann::json::parse(line).value("cp_bytes", int64_t{-1}), expected) << c.type << " cp " << cp;
    EXPECT_EQ(steps, 2);
    std::printf("[ debug ] %s cp %lld: %lld bytes per step per rank\n", c.type, static_cast<long long>(cp),
                static_cast<long long>(expected));
  }
}

// combine_held_pieces (the MoE partners' combine under CP, and combine_token_pieces' core): 4 ranks
// holding 2 pieces each of the 8 leaves of a tree, in a scrambled order; rank 0 gets the canonical
// tree over the leaves in token order bit for bit (the serial tree_sum), the others -0 in every
// element, and the pieces are left as they were. Leaves of mixed magnitudes, so that another order
// or grouping would give other bits; 1,001 elements, so that the ranks' slices are uneven.
TEST(ContextParallel, HeldPiecesCombineAlongTheCanonicalTreeInTokenOrder) {
  constexpr int R = 4;
  constexpr int64_t K = 2, L = 8, n = 1001;
  const int64_t order[L] = {5, 2, 7, 0, 3, 6, 1, 4};  // leaf g is rank order[g] / K's piece order[g] % K
  std::vector<std::vector<float>> held(R * K);
  for (int64_t j = 0; j < R * K; ++j) {
    held[static_cast<size_t>(j)] = testing::randn(n, 40 + static_cast<uint64_t>(j), "held");
    for (float& v : held[static_cast<size_t>(j)]) v = std::ldexp(v, static_cast<int>(j % 3) * 12 - 12);
  }
  std::vector<const float*> leaves(L);
  for (int64_t g = 0; g < L; ++g) leaves[static_cast<size_t>(g)] = held[static_cast<size_t>(order[g])].data();
  std::vector<float> want(n), stack(static_cast<size_t>(tree_sum_stack(L) * n));
  tree_sum(want.data(), leaves.data(), L, n, stack.data());
  std::vector<std::vector<float>> out(R, std::vector<float>(n, 1.0f));
  std::vector<std::vector<float>> pieces = held;
  run_threads(R, 30, [&](Communicator& comm) {
    const int me = comm.rank();
    float* mine[K] = {pieces[static_cast<size_t>(me * K)].data(), pieces[static_cast<size_t>(me * K + 1)].data()};
    std::vector<float> scratch;
    const std::unique_ptr<Device> cpu = Device::cpu();
    combine_held_pieces(
        cpu->ops, comm, out[static_cast<size_t>(me)].data(), mine, n, K, L,
        [&](int64_t g) {
          return std::pair<int64_t, int64_t>{order[g] / K, order[g] % K};
        },
        scratch);
  });
  EXPECT_TRUE(testing::bitwise_equal(out[0], want, "root on rank 0"));
  const std::vector<float> minus_zero(n, -0.0f);
  for (int r = 1; r < R; ++r)
    EXPECT_TRUE(testing::bitwise_equal(out[static_cast<size_t>(r)], minus_zero, "rank " + std::to_string(r)));
  for (int64_t j = 0; j < R * K; ++j)
    EXPECT_TRUE(testing::bitwise_equal(pieces[static_cast<size_t>(j)], held[static_cast<size_t>(j)], "piece"));
}

TEST(ContextParallel, RefusesWhatItDoesNotSupportByName) {
  auto error = [](const char* config, std::vector<std::string> o) {
    return testing::user_error_of([&] { load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", config), o); });
  };
  EXPECT_EQ(error("debug.toml", {"parallel.context=3"}),
            "config: parallel.context = 3: model.seq_length = 64 is not divisible by 2 x parallel.context = 6 (each "
            "sequence is cut into 2 x context chunks, two per rank)");
  EXPECT_EQ(error("debug.toml", {"parallel.context=2", "parallel.tensor=4", "parallel.sequence_parallel=true",
                                 "model.seq_length=12", "train.micro_batch=1"}),
            "config: parallel.context = 2 with parallel.sequence_parallel: train.micro_batch x model.seq_length / "
            "context = 6 tokens per rank are not divisible by parallel.tensor = 4");
  for (const auto& [keys, named] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"determinism=layout"}, "determinism = \"layout\""},
           {{"determinism=layout", "layout_token_segments=true", "train.micro_batch=4"},
            "determinism = \"layout\", train.micro_batch = 4 and layout_segments = 8"},
           {{"determinism=layout", "layout_token_segments=true", "train.micro_batch=1", "layout_segments=4",
             "parallel.tensor=4", "parallel.sequence_parallel=true"},
            "determinism = \"layout\", parallel.sequence_parallel, parallel.tensor = 4 and layout_segments = 4"}}) {
    std::vector<std::string> o = keys;
    o.push_back("parallel.context=2");
    const std::string e = error("debug.toml", o);
    EXPECT_EQ(e.rfind("config: parallel.context = 2 with " + named + ": ", 0), 0u) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // Attention's communication types (model/context_attention.h): the all-to-all's head split, the
  // hierarchical sizes, ring attention under layout mode, an unknown type.
  EXPECT_EQ(error("debug.toml", {"parallel.context=8", "parallel.cp_comm_type=a2a"}),
            "config: parallel.context = 8 with parallel.cp_comm_type = \"a2a\": the all-to-all gives each of "
            "parallel.tensor x 8 = 8 ranks whole heads: model.num_heads = 4 and query groups = 4 must be divisible by "
            "it");
  EXPECT_EQ(error("debug.toml", {"parallel.context=4", "parallel.tensor=2", "parallel.cp_comm_type=a2a+p2p",
                                 "parallel.hierarchical_context_parallel_sizes=4,1"}),
            "config: parallel.context = 4 with parallel.cp_comm_type = \"a2a+p2p\": the all-to-all gives each of "
            "parallel.tensor x 4 = 8 ranks whole heads: model.num_heads = 4 and query groups = 4 must be divisible by "
            "it");
  for (const char* sizes : {"", "2", "2,3", "0,4", "x,2", "2,2,1"})
    EXPECT_EQ(error("debug.toml", {"parallel.context=4", "parallel.cp_comm_type=a2a+p2p",
                                   str("parallel.hierarchical_context_parallel_sizes=", sizes)}),
              str("config: parallel.hierarchical_context_parallel_sizes = \"", sizes,
                  "\": cp_comm_type = \"a2a+p2p\" needs \"A,P\", two positive sizes whose product is "
                  "parallel.context = 4"));
  EXPECT_EQ(error("debug.toml", {"parallel.context=4", "parallel.cp_comm_type=p2p",
                                 "parallel.hierarchical_context_parallel_sizes=2,2"}),
            "config: parallel.hierarchical_context_parallel_sizes = \"2,2\": only for parallel.cp_comm_type = "
            "\"a2a+p2p\" (it is \"p2p\")");
  for (const char* type : {"p2p", "a2a+p2p"}) {
    const std::string e = error(
        "debug.toml", {"parallel.context=4", str("parallel.cp_comm_type=", type), "determinism=layout",
                       "layout_token_segments=true", "layout_segments=16",
                       "parallel.hierarchical_context_parallel_sizes=" + std::string(type[0] == 'a' ? "2,2" : "")});
    EXPECT_EQ(e.rfind(str("config: parallel.context = 4 with parallel.cp_comm_type = \"", type,
                          "\" and determinism = \"layout\": ring attention merges"),
                      0),
              0u)
        << e;
  }
  EXPECT_NE(error("debug.toml", {"parallel.context=2", "parallel.cp_comm_type=ring"}).find("parallel.cp_comm_type"),
            std::string::npos);

  // MoE under layout: the key, then an MoE model's limits: an expert x expert-tensor group that does
  // not tile a micro-batch's tp x cp ranks, NVFP4 experts of one rank or padded, NVFP4 shared
  // expert units of whole 16-token blocks, and under tensor parallelism a tp rank's rows of whole
  // token segments.
  for (const auto& [keys, named] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"determinism=layout"}, "determinism = \"layout\": the key and value gradients"},
           {{"layout_token_segments=true", "parallel.tensor=2", "parallel.expert=3", "moe.num_experts=6"},
            "determinism = \"layout\", an MoE model and parallel.expert x parallel.expert_tensor = 3: an expert's "
            "rows would come from parts of a micro-batch's ranks of parallel.tensor x parallel.context = 4 that do not "
            "tile it: the expert x expert-tensor group must be 1, a multiple of 4 or a divisor of it"},
           {{"layout_token_segments=true", "precision.params=bf16", "precision.fp4=nvfp4", "model.seq_length=64"},
            "determinism = \"layout\", an MoE model, precision.fp4 = \"nvfp4\" and parallel.expert x "
            "parallel.expert_tensor = 1: NVFP4's expert weight gradients transform an expert's rows of a micro-batch "
            "in 16-row Hadamard blocks"},
           {{"layout_token_segments=true", "precision.params=bf16", "precision.fp4=nvfp4", "parallel.expert=2",
             "moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"},
            "determinism = \"layout\", an MoE model, precision.fp4 = \"nvfp4\" and moe.pad_expert_input_to_capacity = "
            "true: a micro-batch's NVFP4 expert block would hold the padding of each of its ranks of parallel.tensor x "
            "parallel.context = 2"},
           {{"layout_token_segments=true", "train.micro_batch=1", "precision.params=bf16", "precision.fp4=nvfp4",
             "moe.shared_expert_intermediate_size=64", "moe.num_experts=8", "parallel.tensor=4", "parallel.expert=8"},
            "determinism = \"layout\", precision.fp4 = \"nvfp4\", moe.shared_expert_intermediate_size = 64 and "
            "parallel.tensor = 4: the shared expert's weight gradients transform each tensor-parallel rank's token "
            "units of 8 tokens"},
           {{"layout_token_segments=true", "train.micro_batch=1", "layout_segments=4", "parallel.tensor=4"},
            "determinism = \"layout\", an MoE model, parallel.tensor = 4 and layout_segments = 4: each tensor-parallel "
            "rank's rows must be whole token segments: parallel.context x parallel.tensor = 8"}}) {
    std::vector<std::string> o = keys;
    o.push_back("parallel.context=2");
    if (keys.size() > 1) o.push_back("determinism=layout");
    if (std::find(keys.begin(), keys.end(), "train.micro_batch=1") == keys.end()) o.push_back("train.micro_batch=2");
    const std::string moe = error("moe-debug.toml", o);
    EXPECT_EQ(moe.rfind("config: parallel.context = 2 with " + named, 0), 0u) << moe;
    EXPECT_EQ(moe.find('\n'), std::string::npos) << moe;
  }
  // A layout_segments that is no power of two is named as such, not as CP's divisibility.
  EXPECT_EQ(error("debug.toml",
                  {"parallel.context=2", "determinism=layout", "layout_token_segments=true", "layout_segments=12"}),
            "config: layout_segments = 12: must be a power of two in [1, 64]");
  // NVFP4 under layout: a rank's chunks must be whole 16-token Hadamard blocks.
  EXPECT_EQ(
      error("debug.toml",
            {"parallel.context=2", "determinism=layout", "layout_token_segments=true", "train.micro_batch=2",
             "precision.params=bf16", "precision.fp4=nvfp4", "model.seq_length=32"}),
      "config: parallel.context = 2 with determinism = \"layout\", precision.fp4 = \"nvfp4\" and model.seq_length = "
      "32: each rank's chunks of 8 tokens must be whole 16-token blocks of the weight gradients' Hadamard "
      "transform: model.seq_length / (2 x parallel.context) must be a multiple of 16");
  EXPECT_EQ(error("moe-debug.toml",
                  {"parallel.context=2", "parallel.tensor=4", "model.seq_length=12", "train.micro_batch=1"}),
            "config: parallel.context = 2 with an MoE model: train.micro_batch x model.seq_length / context = 6 tokens "
            "per rank are not divisible by parallel.tensor = 4");
}

}  // namespace
}  // namespace lockstep
