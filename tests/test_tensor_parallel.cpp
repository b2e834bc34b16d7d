// Tensor and sequence parallelism (parallel/tensor_parallel.h): each rank's parameter shards are
// exactly the single-process weights at their boxes; a layout is bitwise deterministic run to run
// and across thread counts; the pairs of communication ops are each other's adjoints; the
// communication volume is the formula's; bad layouts are one clear error. The losses of every TP /
// SP / DP layout against one process: test_parallel_layouts.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/cross_entropy.h"
#include "lockstep/kernels/cpu/embedding.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/kernels/cpu/rope.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/attention.h"
#include "lockstep/model/gpt.h"
#include "lockstep/model/mlp.h"
#include "lockstep/model/moe/shared_experts.h"
#include "lockstep/model/norm.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/tensor/precision.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;
using testing::train_ranks;

// The Llama flavour shrunk for tests, with 8 heads over 4 KV groups so that TP 4 splits both.
const std::vector<std::string> kLlama = {"model.num_layers=2",       "model.hidden_size=64", "model.num_heads=8",
                                         "model.num_query_groups=4", "model.seq_length=32",  "train.global_batch=8"};

Config job(const std::string& preset, const std::string& out_dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"train.steps=3",       "train.eval_interval=0",      "train.threads=1",
                                "train.micro_batch=2", "data.synthetic_bytes=65536", "train.out_dir=" + out_dir};
  if (preset == "llama-tiny") o.insert(o.end(), kLlama.begin(), kLlama.end());
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + preset + ".toml", o);
}

std::string fingerprints(const std::string& run_dir, int ranks) {
  std::string all;
  for (int r = 0; r < ranks; ++r) all += read_file(fingerprint_path(run_dir, r));
  return all;
}

// A parameter shard's element (local index i) in the global tensor, by its boxes.
int64_t global_index(const ParamSpec& p, int64_t i) {
  for (const ParamBox& b : p.boxes) {
    const int64_t n = b.shape.numel();
    if (i >= n) {
      i -= n;
      continue;
    }
    int64_t g = 0, rem = i, stride = n;
    for (int d = 0; d < b.shape.rank(); ++d) {
      stride /= b.shape[d];
      const int64_t k = rem / stride;
      rem %= stride;
      g = g * p.global_shape[d] + b.offset[static_cast<size_t>(d)] + k;
    }
    return g;
  }
  ADD_FAILURE() << p.name << ": element " << i << " outside its boxes";
  return 0;
}

// Every parameter of `part` holds exactly full's values at its boxes; covered[parameter of full]
// counts how often each global element was seen.
void expect_shards_of(const GPT& full, const GPT& part, std::vector<std::vector<int>>& covered,
                      const std::string& where) {
  if (covered.empty()) {
    covered.resize(full.params().specs().size());
    for (size_t i = 0; i < covered.size(); ++i)
      covered[i].assign(static_cast<size_t>(full.params().specs()[i].shape.numel()), 0);
  }
  for (size_t i = 0; i < part.params().specs().size(); ++i) {
    const ParamSpec& p = part.params().specs()[i];
    const int whole = full.params().find(p.name);
    ASSERT_GE(whole, 0) << p.name;
    ASSERT_EQ(p.global_shape, full.params().specs()[whole].shape) << p.name;
    const float* v = part.params().value(static_cast<int>(i));
    const float* w = full.params().value(whole);
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      const int64_t gk = global_index(p, k);
      ASSERT_EQ(std::bit_cast<uint32_t>(v[k]), std::bit_cast<uint32_t>(w[gk])) << p.name << " " << where;
      covered[static_cast<size_t>(whole)][static_cast<size_t>(gk)] += 1;
    }
  }
}

// Every rank of TP 2 and 4 holds exactly the single-process values at its boxes (Philox by global
// index), and the shards of a tensor tile it once.
void shards_are_the_single_process_weights(const std::string& preset, std::vector<std::string> overrides) {
  overrides.push_back("model.preset=" + preset);
  const Config c = load_config("", overrides);
  GPT full(c.model, 1);
  full.params().init(7);
  for (int tp : {2, 4}) {
    std::vector<std::vector<int>> covered;
    for (int r = 0; r < tp; ++r) {
      TensorParallel g;
      g.rank = r;
      g.size = tp;
      GPT part(c.model, 1, MoeConfig{}, PrecisionConfig{}, g);
      part.params().init(7);
      expect_shards_of(full, part, covered, str("tp ", tp, " rank ", r));
    }
    for (size_t i = 0; i < covered.size(); ++i) {
      const ParamSpec& p = full.params().specs()[i];
      // Sharded tensors are tiled once; the others are replicated on every rank.
      const int expect = covered[i][0] == tp ? tp : 1;
      for (int n : covered[i]) ASSERT_EQ(n, expect) << p.name << " tp " << tp;
    }
  }
}

TEST(TensorParallel, ShardsAreTheSingleProcessWeightsGpt2) {
  shards_are_the_single_process_weights("gpt2", {"model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                                 "model.seq_length=16", "model.vocab_size=256"});
}
TEST(TensorParallel, ShardsAreTheSingleProcessWeightsLlamaGqaSwiglu) {
  shards_are_the_single_process_weights(
      "llama", {"model.num_layers=1", "model.hidden_size=32", "model.num_heads=8", "model.num_query_groups=4",
                "model.seq_length=16", "model.vocab_size=256"});
}

// Expert tensor parallelism (x expert parallelism): every rank holds exactly the single-process
// values at its boxes (each expert's fc rows of its hidden units, of the gate and up sections
// separately, and the proj columns of the same units), the boxes of the (etp x ep) ranks tile each
// expert tensor once, and the proj bias lives on etp rank 0 only.
TEST(ExpertTensorParallel, ShardsAreTheSingleProcessWeights) {
  for (const char* preset : {"gpt2", "llama"}) {
    const Config c =
        load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", {str("model.preset=", preset)});
    GPT full(c.model, 1, c.moe);
    full.params().init(7);
    for (const auto& [etp, ep] : {std::pair{2, 1}, std::pair{2, 2}}) {
      const int world = etp * ep;
      std::vector<std::vector<std::vector<int>>> covered(static_cast<size_t>(world));  // per rank, per parameter
      run_threads(world, 30, [&](Communicator& comm) {
        const Mesh mesh(world, {1, 1, 1, ep, etp});
        Communicator etp_group = comm.split_groups(mesh.groups(MeshGroup::etp));
        Communicator ep_group = comm.split_groups(mesh.groups(MeshGroup::ep));
        GPT part(c.model, 1, c.moe, PrecisionConfig{}, TensorParallel{}, ep > 1 ? &ep_group : nullptr, &etp_group);
        part.params().init(7);
        expect_shards_of(full, part, covered[static_cast<size_t>(comm.rank())],
                         str(preset, " etp ", etp, " ep ", ep, " rank ", comm.rank()));
      });
      for (size_t i = 0; i < full.params().specs().size(); ++i) {
        const ParamSpec& p = full.params().specs()[i];
        if (!p.expert) continue;
        for (int64_t k = 0; k < p.shape.numel(); ++k) {
          int n = 0;
          for (const auto& cover : covered) n += cover[i][static_cast<size_t>(k)];
          ASSERT_EQ(n, 1) << preset << " " << p.name << " element " << k << " etp " << etp << " ep " << ep;
        }
      }
    }
  }
}

// determinism = "layout": the vocab-parallel softmax cross-entropy on tp = 1, 2, 4 ranks (each its
// vocabulary shard) gives the one-process kernel's bits (cross_entropy_segments), losses and every
// logit's gradient, with S = 4 and 8 canonical segments, a vocabulary that S does not divide,
// ignored targets, masked logits and rows whose max is a signed zero.
TEST(TensorParallelLayout, VocabParallelCrossEntropyIsTheOneProcessBits) {
  const int64_t N = 7;
  for (const int64_t V : {int64_t{100}, int64_t{4 * 1100}}) {
    auto x = testing::randn(N * V, 41, "logits", 4.0f);
    auto targets = testing::random_ints(N, V, 41, "targets");
    targets[3] = -1;
    for (int64_t v = 1; v < V; v += 5) x[1 * V + v] = -std::numeric_limits<float>::infinity();
    targets[1] = 0;
    // Row 5: every logit <= 0, the max a -0 on some shards and +0 on others.
    for (int64_t v = 0; v < V; ++v) x[5 * V + v] = -std::fabs(x[5 * V + v]);
    x[5 * V + 3] = -0.0f;
    x[5 * V + V - 2] = 0.0f;
    for (const int64_t S : {4, 8}) {
      std::vector<float> ref_losses(N), ref_grad = x, scratch(3 * N);
      cross_entropy_segments(ref_losses.data(), ref_grad.data(), targets.data(), N, V, V, S, true, 0.125f,
                             scratch.data());
      for (int P : {1, 2, 4}) {
        const int64_t Vl = V / P;
        std::vector<std::vector<float>> losses(P), fwd(P), grads(P);
        run_threads(P, 30, [&](Communicator& comm) {
          TensorParallel tp(&comm, false);
          tp.segments = S;
          const int r = comm.rank();
          std::vector<float> mine(static_cast<size_t>(N * Vl)), loss_scratch;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t v = 0; v < Vl; ++v) mine[n * Vl + v] = x[n * V + r * Vl + v];
          std::vector<float> copy = mine;
          const std::unique_ptr<Device> cpu = Device::cpu();
          fwd[r].assign(N, 0.0f);
          losses[r].assign(N, 0.0f);
          vocab_parallel_cross_entropy(cpu->ops, tp, fwd[r].data(), copy.data(), targets.data(), N, V, Vl, false, 0.0f,
                                       loss_scratch);
          vocab_parallel_cross_entropy(cpu->ops, tp, losses[r].data(), mine.data(), targets.data(), N, V, Vl, true,
                                       0.125f, loss_scratch);
          grads[r] = mine;
        });
        for (int r = 0; r < P; ++r) {
          const std::string at = "V " + std::to_string(V) + ", S " + std::to_string(S) + ", tp " + std::to_string(P) +
                                 ", rank " + std::to_string(r);
          EXPECT_TRUE(testing::bitwise_equal(losses[r], ref_losses, "losses, " + at));
          EXPECT_TRUE(testing::bitwise_equal(fwd[r], ref_losses, "forward losses, " + at));
          std::vector<float> expect(static_cast<size_t>(N * Vl));
          for (int64_t n = 0; n < N; ++n)
            for (int64_t v = 0; v < Vl; ++v) expect[n * Vl + v] = ref_grad[n * V + r * Vl + v];
          EXPECT_TRUE(testing::bitwise_equal(grads[r], expect, "dlogits, " + at));
        }
      }
    }
  }
}

// determinism = "layout": the gradients of parameters that tensor parallelism replicates but whose
// gradient sums over tokens each rank holds only some of (a norm and an MoE shared expert with bias
// and gate here: GradRole::sequence_parallel) are computed in token segments
// (ParamStore::token_segments) and summed over the group with tree_sum
// (reduce_sequence_parallel_grads): on tp = 1, 2, 4 ranks holding N / tp rows each they are the
// one-process bits, LayerNorm and RMSNorm, S = 4 and 8. Under "run" tp 4 parts from one process.
TEST(TensorParallelLayout, TokenSumGradientsAreTheOneProcessBits) {
  const int64_t N = 64, C = 32, F = 48;
  const std::vector<float> x = testing::randn(N * C, 51, "x"), dout = testing::randn(N * C, 51, "dout");
  for (const bool rms : {false, true}) {
    for (const int64_t S : {0, 4, 8}) {
      std::vector<float> one;
      for (int P : {1, 2, 4}) {
        std::vector<float> grads;
        run_threads(P, 30, [&](Communicator& comm) {
          TensorParallel tp(&comm, true);
          tp.segments = S;
          const int64_t rows = N / P, r0 = comm.rank() * rows;
          ModelConfig m;
          m.hidden_size = C;
          m.normalization = rms ? "rmsnorm" : "layernorm";
          ParamStore ps;
          Arena arena;
          const Norm norm(ps, arena, "norm", rms, C, rows, 1e-5f);
          const SharedExpert shared(ps, arena, "shared.", m, F, true, rows);
          if (tp.on())
            for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) ps.set_sequence_parallel(i);
          ps.set_layout_segments(tp.segments, tp.size, tp.rank);
          const ArenaSlice normed = arena.reserve(rows * C), out = arena.reserve(rows * C);
          ps.allocate();
          ps.init(7);
          arena.allocate();
          std::vector<float> dnormed(rows * C, 0.0f), dx(rows * C, 0.0f), sdout(rows * C), sdact(rows * F),
              sdfc(rows * F), sdx(rows * C), base(rows * C, 0.0f);
          norm.forward(ps, arena, arena(normed), x.data() + r0 * C, rows);
          shared.forward(ps, arena, arena(out), base.data(), arena(normed));
          shared.backward(ps, arena, dnormed.data(), dout.data() + r0 * C, arena(normed),
                          SharedExpertScratch{sdout.data(), sdact.data(), sdfc.data(), sdx.data()});
          norm.backward(ps, arena, dx.data(), dnormed.data(), x.data() + r0 * C, rows);
          reduce_sequence_parallel_grads(tp, ps);
          if (comm.rank() == P - 1) grads.assign(ps.grads(), ps.grads() + ps.total());
        });
        if (P == 1) one = grads;
        const std::string at =
            std::string(rms ? "rmsnorm" : "layernorm") + ", S " + std::to_string(S) + ", tp " + std::to_string(P);
        if (S > 0) {
          EXPECT_TRUE(testing::bitwise_equal(grads, one, "gradients, " + at));
        }
        if (S == 0 && P == 4) {
          EXPECT_FALSE(testing::bitwise_equal(grads, one, "run mode, " + at));
        }
      }
    }
  }
}

// reduce_sequence_parallel_grads over a range of the table (the trainer's grads-ready hook under
// "layout", every micro-batch): only the sequence-parallel parameters in [first, end) are summed,
// with tree_sum under "layout" ((a + b) + (c + d) on 4 ranks) and the rank-order fold under "run".
TEST(TensorParallelLayout, SequenceParallelReductionOfARange) {
  for (const int64_t S : {0, 8}) {
    run_threads(4, 30, [&](Communicator& comm) {
      TensorParallel tp(&comm, true);
      tp.segments = S;
      ParamStore ps;
      const int a = ps.add("a", {3}, Init::zeros), b = ps.add("b", {2}, Init::zeros), c = ps.add("c", {2}, Init::zeros);
      ps.set_sequence_parallel(a);
      ps.set_sequence_parallel(c);
      ps.allocate();
      // Rank values whose sums differ between ((x0 + x1) + x2) + x3 and (x0 + x1) + (x2 + x3).
      const float v[4] = {1.0f, 1e-8f, -1.0f, 1e-8f};
      for (int i = 0; i < static_cast<int>(ps.total()); ++i) ps.grads()[i] = v[comm.rank()];
      reduce_sequence_parallel_grads(tp, ps, b, c + 1);
      const float tree = (v[0] + v[1]) + (v[2] + v[3]), fold = ((v[0] + v[1]) + v[2]) + v[3];
      ASSERT_NE(tree, fold);
      EXPECT_EQ(ps.grad(a)[0], v[comm.rank()]);  // outside the range
      EXPECT_EQ(ps.grad(b)[0], v[comm.rank()]);  // not sequence-parallel
      EXPECT_EQ(ps.grad(c)[1], S ? tree : fold);
    });
  }
}

// copy_to_tp / reduce_from_tp and gather_from_sp / scatter_to_sp are adjoint pairs: for random x
// and y, <forward(x), y> = <x, backward(y)> with each op's mirror as its backward.
TEST(TensorParallel, CommunicationPairsAreAdjoint) {
  constexpr int64_t rows = 3, C = 5;
  for (int P : {2, 4}) {
    std::vector<double> lhs(P), rhs(P);
    run_threads(P, 30, [&](Communicator& comm) {
      const TensorParallel tp(&comm, true);
      const int r = comm.rank();
      const std::vector<float> x = testing::randn(rows * C, 1, "x" + std::to_string(r));
      const std::vector<float> y = testing::randn(P * rows * C, 2, "y" + std::to_string(r));
      // gather_from_sp: x (rows) -> (P rows); its backward scatter_to_sp: y (P rows) -> (rows).
      std::vector<float> gx(static_cast<size_t>(P * rows * C)), sy(static_cast<size_t>(rows * C));
      gather_from_sp(tp, gx.data(), x.data(), rows, C);
      scatter_to_sp(tp, sy.data(), y.data(), rows, C);
      double a = 0, b = 0;
      for (size_t i = 0; i < gx.size(); ++i) a += static_cast<double>(gx[i]) * y[i];
      for (size_t i = 0; i < sy.size(); ++i) b += static_cast<double>(sy[i]) * x[i];
      // Summed over ranks, both sides are the same bilinear form.
      comm.all_reduce(&a, 1);
      comm.all_reduce(&b, 1);
      lhs[static_cast<size_t>(r)] = a;
      rhs[static_cast<size_t>(r)] = b;
      // reduce_from_tp: every rank ends with the rank-order sum; copy_to_tp leaves data alone.
      std::vector<float> s = x;
      reduce_from_tp(tp, s.data(), rows * C);
      float expect = 0;
      for (int q = 0; q < P; ++q) expect += testing::randn(rows * C, 1, std::string("x").append(std::to_string(q)))[0];
      EXPECT_EQ(s[0], expect);
    });
    for (int r = 0; r < P; ++r)
      EXPECT_NEAR(lhs[static_cast<size_t>(r)], rhs[static_cast<size_t>(r)], 1e-5 * std::fabs(lhs[0]));
  }
}

// The bytes one rank sends in its tensor-parallel group for one micro-batch's forward + backward
// (Communicator::bytes_sent), against the analytic count (docs/parallelism.md): per layer two
// row-parallel outputs reduced in forward and two column-parallel input gradients reduced in
// backward, each an all-reduce of N x C floats (2 (P - 1) / P x N x C sent) or, with sequence
// parallelism, a reduce-scatter plus the mirrored all-gather ((P - 1) / P x N x C each); the
// embedding's and the head's the same once more; and the loss's all-gather of 3 floats per token
// ((P - 1) x 3N sent).
TEST(TensorParallel, CommunicationVolumeMatchesTheFormula) {
  for (const char* preset : {"gpt2", "llama"}) {
    const Config c =
        load_config("", {"model.preset=" + std::string(preset), "model.num_layers=2", "model.hidden_size=64",
                         "model.num_heads=4", "model.seq_length=32", "model.vocab_size=256"});
    const int64_t B = 2, N = B * c.model.seq_length, C = c.model.hidden_size, L = c.model.num_layers;
    for (int P : {2, 4})
      for (bool sp : {false, true}) {
        std::vector<int64_t> sent(static_cast<size_t>(P));
        run_threads(P, 30, [&](Communicator& comm) {
          ThreadPool pool(1);
          ThreadPool::Bind bind(&pool);
          GPT model(c.model, B, MoeConfig{}, PrecisionConfig{}, TensorParallel(&comm, sp));
          model.params().init(1);
          const std::vector<int32_t> tokens = testing::random_ints(N, 256, 5, "tokens");
          const int64_t before = comm.bytes_sent();
          model.forward_backward(tokens.data(), tokens.data(), 1.0f / static_cast<float>(N));
          sent[static_cast<size_t>(comm.rank())] = comm.bytes_sent() - before;
        });
        const int64_t floats = (8 * L + 4) * (P - 1) * N * C / P + 3 * N * (P - 1);
        for (int r = 0; r < P; ++r)
          EXPECT_EQ(sent[static_cast<size_t>(r)], 4 * floats)
              << preset << " tp " << P << (sp ? " sp" : "") << " rank " << r;
        std::printf("[ %s ] tp %d%s: %lld bytes sent per rank per micro-batch (N = %lld, C = %lld, L = %lld)\n", preset,
                    P, sp ? " sp" : "   ", static_cast<long long>(sent[0]), static_cast<long long>(N),
                    static_cast<long long>(C), static_cast<long long>(L));
      }
  }
}

// Per optimizer step (metrics.jsonl's tp_bytes, rank 0): the micro-batches' volume above, plus,
// with sequence parallelism, the all-reduce of the norms' gradients, plus the gradient norm's
// all-gather of one double.
TEST(TensorParallel, CommunicationVolumePerStepMatchesTheFormula) {
  TempDir dir;
  const int64_t N = 2 * 64, C = 64, L = 2,
                accum = 2;  // debug.toml: micro-batches of 2 x 64 tokens, 8 per step over dp 2
  for (int P : {2, 4})
    for (bool sp : {false, true}) {
      const std::string out = dir.path(str("tp", P, sp));
      train_ranks(2 * P, job("debug", out,
                             {str("parallel.tensor=", P), str("parallel.sequence_parallel=", sp ? "true" : "false")}));
      const int64_t micro = 4 * ((8 * L + 4) * (P - 1) * N * C / P + 3 * N * (P - 1));
      const int64_t norms = (4 * L + 2) * C;  // LayerNorm weight and bias: two per layer and the final one
      const int64_t expect = accum * micro + (sp ? 4 * 2 * (P - 1) * norms / P : 0) + 8 * (P - 1);
      std::istringstream in(read_file(out + "/metrics.jsonl"));
      int steps = 0;
      for (std::string line; std::getline(in, line); ++steps)
        EXPECT_EQ(nlohmann::json::parse(line)["tp_bytes"].get<int64_t>(), expect) << "tp " << P << " sp " << sp;
      EXPECT_EQ(steps, 3);
      std::printf("[ debug, dp 2 ] tp %d%s: %lld bytes sent per rank per step\n", P, sp ? " sp" : "   ",
                  static_cast<long long>(expect));
    }
}

// TP 2 with sequence parallelism and DP 2 (world 4), distributed optimizer: identical fingerprints
// on every rank run to run and with 2 threads per rank instead of 1.
TEST(TensorParallel, BitwiseRunToRunAndAcrossThreads) {
  for (const char* preset : {"debug", "llama-tiny"}) {
    TempDir dir;
    const std::vector<std::string> o = {"parallel.tensor=2", "parallel.sequence_parallel=true",
                                        "optimizer.distributed=true"};
    train_ranks(4, job(preset, dir.path("a"), o));
    const std::string a = fingerprints(dir.path("a"), 4);
    ASSERT_NE(a.find("\"step\":3"), std::string::npos);
    EXPECT_NE(a.find("\"tp\":1"), std::string::npos);
    train_ranks(4, job(preset, dir.path("b"), o));
    EXPECT_EQ(fingerprints(dir.path("b"), 4), a) << preset << ": run to run";
    std::vector<std::string> two = o;
    two.push_back("train.threads=2");
    train_ranks(4, job(preset, dir.path("c"), two));
    EXPECT_EQ(fingerprints(dir.path("c"), 4), a) << preset << ": 1 vs 2 threads";
  }
}

TEST(TensorParallel, LayoutErrorsNameTheKeys) {
  auto error = [](std::vector<std::string> o) {
    return testing::user_error_of([&] { load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", o); });
  };
  EXPECT_EQ(error({"parallel.tensor=3"}), "config: model.num_heads = 4 is not divisible by parallel.tensor = 3");
  EXPECT_EQ(error({"model.preset=llama", "model.num_query_groups=2", "parallel.tensor=4"}),
            "config: model.num_query_groups = 2 is not divisible by parallel.tensor = 4");
  EXPECT_EQ(error({"model.vocab_size=258", "parallel.tensor=4"}),
            "config: model.vocab_size = 258 is not divisible by parallel.tensor = 4");
  EXPECT_EQ(error({"parallel.sequence_parallel=true"}),
            "config: parallel.sequence_parallel = true needs parallel.tensor > 1 (got 1)");
}

// ---- determinism = "layout": the GEMM-side reductions the group splits
// (docs/design/reductions.md#tensor-parallel-k-segments)
//
// Each is cut into kSegments canonical segments whatever the group's size, so tp = 2 and 4 (with
// and without sequence parallelism) must give the bits of one process (tp = 1, the same segments).

constexpr int64_t kSegments = 8;

// Index of the first element whose bits differ, -1 when none (sizes must agree).
int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return static_cast<int64_t>(i);
  return -1;
}

// Whole tensors by name, assembled from the ranks' shards (a replicated tensor: every rank's
// copy must agree).
using Tensors = std::map<std::string, std::vector<float>>;

// The gradients of ps's parameters (but those whose name holds `skip`, when given) into whole.
void add_grads(Tensors& whole, const ParamStore& ps, const std::string& skip) {
  for (size_t i = 0; i < ps.specs().size(); ++i) {
    const ParamSpec& p = ps.specs()[i];
    if (!skip.empty() && p.name.find(skip) != std::string::npos) continue;
    std::vector<float>& t = whole[p.name];
    if (t.empty()) t.assign(static_cast<size_t>(p.global_shape.numel()), std::numeric_limits<float>::quiet_NaN());
    const float* v = ps.grad(static_cast<int>(i));
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      float& g = t[static_cast<size_t>(global_index(p, k))];
      if (!std::isnan(g)) {
        EXPECT_EQ(std::bit_cast<uint32_t>(g), std::bit_cast<uint32_t>(v[k])) << p.name << " replicas differ";
      }
      g = v[k];
    }
  }
}

// The (N, C) rows of every rank, whole: gathered under sequence parallelism.
std::vector<float> whole_rows(const TensorParallel& tp, const float* rows, int64_t N, int64_t C) {
  std::vector<float> out(static_cast<size_t>(N * C));
  if (tp.sequence)
    gather_from_sp(tp, out.data(), rows, N / tp.size, C);
  else
    std::copy(rows, rows + N * C, out.begin());
  return out;
}

struct BlockRun {
  std::vector<float> out, dresid;  // (N, C) whole
  Tensors grads;
};

// One transformer layer (attention block, then MLP block) on this rank of `comm` (null: one
// process) in layout mode: forward from a random residual stream, backward from a random output
// gradient. Biases and norm weights get random values (they start at 0 and 1). The norms'
// gradients are left out under sequence parallelism: there they are partial sums over the rank's
// rows, combined by reduce_sequence_parallel_grads.
void run_block(Communicator* comm, bool sp, const ModelConfig& m, const PrecisionConfig& pc, int64_t B, BlockRun& r) {
  TensorParallel tp(comm, sp);
  tp.segments = kSegments;
  const int64_t T = m.seq_length, N = B * T, C = m.hidden_size, HS = m.head_dim();
  ParamStore ps;
  Arena arena;
  const AttentionLayer attn(ps, arena, "layers.0.", m, B, T, tp);
  const MlpLayer mlp(ps, arena, "layers.0.", m, N, tp);
  ps.allocate();
  ps.init(7);
  for (size_t i = 0; i < ps.specs().size(); ++i) {
    const ParamSpec& p = ps.specs()[i];
    if (p.name.find("norm") == std::string::npos && p.name.find("bias") == std::string::npos) continue;
    const std::vector<float> g = testing::randn(p.global_shape.numel(), 3, p.name);
    for (int64_t k = 0; k < p.shape.numel(); ++k)
      ps.value(static_cast<int>(i))[k] = g[static_cast<size_t>(global_index(p, k))];
  }
  Precision precision(pc, ps, 1);
  ps.set_precision(&precision);
  if (precision.bf16()) ps.use_bf16_weights();
  ps.sync_weights(0, static_cast<int>(ps.specs().size()));
  ps.zero_grads();
  arena.allocate();
  std::vector<float> cos(static_cast<size_t>(T * HS / 2)), sin(cos.size());
  rope_table(cos.data(), sin.data(), T, HS, m.rope_theta);
  const int64_t rows = tp.rows(N), row0 = tp.sequence ? tp.rank * rows : 0;
  std::vector<float> resid = testing::randn(N * C, 1, "resid"), dresid = testing::randn(N * C, 2, "dout");
  precision.round(resid.data(), N * C);
  precision.round(dresid.data(), N * C);
  resid.erase(resid.begin(), resid.begin() + row0 * C);
  dresid.erase(dresid.begin(), dresid.begin() + row0 * C);
  std::vector<float> mid(static_cast<size_t>(rows * C)), out(mid.size());
  attn.forward(ps, arena, mid.data(), resid.data(), cos.data(), sin.data());
  mlp.forward(ps, arena, out.data(), mid.data());
  const int64_t wide = std::max({C, mlp.fc_width(), attn.qkv_width()});
  std::vector<float> dnorm(static_cast<size_t>(N * C)), d1(static_cast<size_t>(N * wide)), d2(d1.size());
  mlp.backward(ps, arena, dresid.data(), mid.data(), MlpScratch{dnorm.data(), d1.data(), d2.data()});
  attn.backward(ps, arena, dresid.data(), resid.data(), cos.data(), sin.data(),
                AttentionScratch{dnorm.data(), d1.data(), d2.data()});
  r.out = whole_rows(tp, out.data(), N, C);
  r.dresid = whole_rows(tp, dresid.data(), N, C);
  add_grads(r.grads, ps, sp ? "norm" : "");
}

// The attention and MLP blocks under determinism = "layout": output, input gradient and every
// parameter gradient of TP 2 and 4, with and without sequence parallelism, bitwise those of one
// process (the row-parallel projections' forward sums, the column-parallel QKV / fc input
// gradients over their sections, and the reductions over the group as tree_sums).
void block_matches_one_process(const ModelConfig& m, const PrecisionConfig& pc, const std::string& what) {
  constexpr int64_t B = 2;
  BlockRun one;
  {
    ThreadPool pool(1);
    ThreadPool::Bind bind(&pool);
    run_block(nullptr, false, m, pc, B, one);
  }
  for (int P : {2, 4})
    for (bool sp : {false, true}) {
      std::vector<BlockRun> ranks(static_cast<size_t>(P));
      run_threads(P, 60, [&](Communicator& comm) {
        ThreadPool pool(comm.rank() == 0 ? 2 : 1);  // the thread count changes nothing either
        ThreadPool::Bind bind(&pool);
        run_block(&comm, sp, m, pc, B, ranks[static_cast<size_t>(comm.rank())]);
      });
      const std::string where = str(what, " tp ", P, sp ? " sp" : "");
      for (const BlockRun& r : ranks) {
        EXPECT_EQ(first_difference(r.out, one.out), -1) << where << ": output";
        EXPECT_EQ(first_difference(r.dresid, one.dresid), -1) << where << ": input gradient";
      }
      Tensors grads;
      for (const BlockRun& r : ranks)
        for (const auto& [name, t] : r.grads) {
          std::vector<float>& g = grads[name];
          if (g.empty()) g = t;
          for (size_t i = 0; i < t.size(); ++i)
            if (!std::isnan(t[i])) g[i] = t[i];
        }
      for (const auto& [name, g] : grads) {
        ASSERT_TRUE(one.grads.count(name)) << name;
        EXPECT_EQ(first_difference(g, one.grads.at(name)), -1) << where << ": gradient of " << name;
      }
      size_t expect = 0;
      for (const auto& [name, g] : one.grads) expect += !sp || name.find("norm") == std::string::npos;
      EXPECT_EQ(grads.size(), expect) << where;
    }
}

ModelConfig layout_model(const std::string& preset) {
  // 8 heads over 4 KV groups (llama) so that TP 4 splits both; ffn and head sizes not multiples
  // of the 8 segments per section on every rank (segments are cut at floor(s K / S)).
  return load_config("", {"model.preset=" + preset, "model.num_layers=1", "model.hidden_size=48", "model.num_heads=8",
                          "model.num_query_groups=" + std::string(preset == "llama" ? "4" : "0"), "model.seq_length=8",
                          "model.vocab_size=256"})
      .model;
}

TEST(TensorParallelLayout, Gpt2BlockMatchesOneProcess) {
  block_matches_one_process(layout_model("gpt2"), PrecisionConfig{}, "gpt2");
}
TEST(TensorParallelLayout, LlamaBlockMatchesOneProcess) {
  block_matches_one_process(layout_model("llama"), PrecisionConfig{}, "llama");
}
// bf16: each rank's partial sums stay fp32; the sum is rounded once, as one process rounds it.
TEST(TensorParallelLayout, Bf16BlockMatchesOneProcess) {
  PrecisionConfig pc;
  pc.params = "bf16";
  block_matches_one_process(layout_model("llama"), pc, "llama bf16");
  block_matches_one_process(layout_model("gpt2"), pc, "gpt2 bf16");
}

// The output head's input gradient (model/gpt.cpp GPT::head): K is the vocabulary, this rank's
// V / tp rows cut into its canonical segments (TensorParallel::k_segments over V), summed over the
// group on leaving the column-parallel region; the same bits as one process over all of V.
TEST(TensorParallelLayout, HeadInputGradientMatchesOneProcess) {
  constexpr int64_t N = 12, C = 24, V = 40;  // V / S = 5: five rows per segment
  const std::vector<float> dlogits = testing::randn(N * V, 1, "dlogits"), w = testing::randn(V * C, 2, "wte");
  TensorParallel one;
  one.segments = kSegments;
  const std::vector<int64_t> all = one.k_segments({V});
  ASSERT_EQ(all.size(), static_cast<size_t>(kSegments + 1));
  GemmOptions opt;
  opt.k_segments = all;
  std::vector<float> expect(static_cast<size_t>(N * C));
  gemm(expect.data(), dlogits.data(), Trans::N, w.data(), Trans::N, N, C, V, opt);
  for (int P : {2, 4})
    for (bool sp : {false, true})
      run_threads(P, 30, [&](Communicator& comm) {
        TensorParallel tp(&comm, sp);
        tp.segments = kSegments;
        const int64_t Vl = V / P, v0 = tp.vocab_begin(V);
        const std::vector<int64_t> mine = tp.k_segments({V});
        GemmOptions o;
        o.k_segments = mine;
        std::vector<float> dfull(static_cast<size_t>(N * C)), drows(static_cast<size_t>(tp.rows(N) * C));
        gemm(dfull.data(), C, dlogits.data() + v0, V, Trans::N, w.data() + v0 * C, C, Trans::N, N, C, Vl, o);
        const float* sum = enter_column_parallel_backward(tp, drows.data(), dfull.data(), N, C);
        EXPECT_EQ(first_difference(whole_rows(tp, sum, N, C), expect), -1) << "tp " << P << (sp ? " sp" : "");
      });
}

// The vocab-parallel embedding: the rows of tokens outside a rank's range are -0 under "layout",
// so the group's sum is the one row exactly, a -0 in the table included (a +0 would turn it +0).
TEST(TensorParallelLayout, EmbeddingMatchesOneProcessWithNegativeZeros) {
  constexpr int64_t B = 2, T = 8, N = B * T, C = 16, V = 32;
  std::vector<float> wte = testing::randn(V * C, 1, "wte");
  for (int64_t i = 0; i < V * C; i += 3) wte[static_cast<size_t>(i)] = -0.0f;
  const std::vector<float> wpe = testing::randn(T * C, 2, "wpe");
  const std::vector<int32_t> tokens = testing::random_ints(N, V, 3, "tokens");
  for (const bool positions : {false, true}) {
    std::vector<float> expect(static_cast<size_t>(N * C));
    embedding_forward(expect.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, B, T, C, V);
    for (int P : {2, 4})
      for (bool sp : {false, true})
        run_threads(P, 30, [&](Communicator& comm) {
          TensorParallel tp(&comm, sp);
          tp.segments = kSegments;
          std::vector<float> x(static_cast<size_t>(tp.rows(N) * C)), partial(static_cast<size_t>(N * C));
          std::vector<int32_t> local(static_cast<size_t>(N));
          const std::unique_ptr<Device> cpu = Device::cpu();
          vocab_parallel_embedding(cpu->ops, tp, x.data(), partial.data(), local.data(), tokens.data(),
                                   wte.data() + tp.vocab_begin(V) * C, positions ? wpe.data() : nullptr, nullptr, N, T,
                                   C, V);
          EXPECT_EQ(first_difference(whole_rows(tp, x.data(), N, C), expect), -1)
              << "tp " << P << (sp ? " sp" : "") << (positions ? " wpe" : "");
        });
  }
}

// The boundaries: segment s of S over K is [floor(s K / S), floor((s + 1) K / S)); a rank's are
// its block's, relative to its slice; with sections, each section's list in turn; none under "run".
TEST(TensorParallelLayout, SegmentBoundaries) {
  TensorParallel tp;
  EXPECT_TRUE(tp.k_segments({40}).empty());
  tp.segments = 8;
  EXPECT_EQ(tp.k_segments({20}), (std::vector<int64_t>{0, 2, 5, 7, 10, 12, 15, 17, 20}));
  tp.size = 2;
  tp.rank = 1;
  EXPECT_EQ(tp.k_segments({20}), (std::vector<int64_t>{0, 2, 5, 7, 10}));
  tp.size = 4;
  tp.rank = 2;
  EXPECT_EQ(tp.k_segments({20, 8}), (std::vector<int64_t>{0, 2, 5, 0, 1, 2}));
}

}  // namespace
}  // namespace lockstep
