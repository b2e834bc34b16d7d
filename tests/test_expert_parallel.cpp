// Expert parallelism (parallel.expert, model/moe/alltoall_dispatcher.h, allgather_dispatcher.h)
// through the trainer on the threads backend. With parallel folding the ep ranks are data-parallel
// ranks with their own micro-batches, so each EP layout is compared with the data-parallel run on
// the same ranks (same micro-batches per rank) and with the single-rank run of the same global
// batch:
//   - a rank's expert tables are the box of its experts, drawn as the single process draws them;
//   - all-to-all, ep = world (no expert data parallelism): bitwise the DP losses and grad norms,
//     with and without capacity dropping and padding (the forward is the single-rank one, and the
//     expert gradients are summed per source rank in rank order: experts.h);
//   - every layout within rounding of the single rank (test_parallel_layouts.cpp); the
//     configuration errors name the sizes.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/dtype.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/gpt.h"
#include "lockstep/model/moe/alltoall_dispatcher.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::largest_loss_difference;
using testing::read_file;
using testing::TempDir;
using testing::train_ranks;
using testing::trajectory;

Config job(const std::string& out_dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"train.steps=4",       "train.eval_interval=0",      "train.threads=1",
                                "train.micro_batch=2", "data.synthetic_bytes=65536", "train.out_dir=" + out_dir};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", o);
}

TEST(ExpertParallel, EachRankHoldsAndInitialisesItsExpertsAsTheSingleProcess) {
  const Config c = job("unused");
  GPT whole(c.model, 2, c.moe);
  whole.params().init(7);
  for (int ep : {2, 4}) {
    run_threads(ep, 30, [&](Communicator& comm) {
      GPT part(c.model, 2, c.moe, PrecisionConfig{}, TensorParallel{}, &comm);
      part.params().init(7);
      const int64_t El = c.moe.num_experts / ep;
      int experts = 0;
      for (const ParamSpec& p : part.params().specs()) {
        const int w = whole.params().find(p.name);
        ASSERT_GE(w, 0) << p.name;
        const ParamSpec& g = whole.params().specs()[static_cast<size_t>(w)];
        EXPECT_EQ(p.global_shape, g.shape) << p.name;
        if (!p.expert) {
          EXPECT_EQ(p.shape, g.shape) << p.name;
          continue;
        }
        ++experts;
        EXPECT_EQ(p.shape[0], El) << p.name;
        ASSERT_EQ(p.boxes.size(), 1u) << p.name;
        EXPECT_EQ(p.boxes[0].offset[0], comm.rank() * El) << p.name;
        const int64_t n = p.shape.numel();
        const float* mine = part.params().value(static_cast<int>(&p - part.params().specs().data()));
        const float* ref = whole.params().value(w) + comm.rank() * n;
        EXPECT_TRUE(testing::bitwise_equal(mine, ref, n)) << p.name << " on ep rank " << comm.rank();
      }
      EXPECT_EQ(experts, 2 * 4) << "fc/proj weight and bias of 2 MoE layers";
    });
  }
}

// ep = world: the expert gradients are the data-parallel all-reduce's sums, bit for bit.
// norm_tolerance: 0, or the grad norm's relative tolerance where it may differ in its last bits
// only: run mode sums the squares in double, per ep rank then over ep under EP, per chunk under
// DP, so the same gradients can give norms an ulp apart (the losses, which depend on every earlier
// gradient, stay bitwise).
void alltoall_matches_data_parallel_bitwise(int ranks, std::vector<std::string> extra, double norm_tolerance = 0) {
  TempDir dir;
  train_ranks(ranks, job(dir.path("dp"), extra));
  extra.push_back("parallel.expert=" + std::to_string(ranks));
  extra.push_back("moe.token_dispatcher=alltoall");
  train_ranks(ranks, job(dir.path("ep"), extra));
  const auto dp = trajectory(dir.path("dp")), ep = trajectory(dir.path("ep"));
  ASSERT_EQ(dp.size(), 4u);
  ASSERT_EQ(ep.size(), dp.size());
  for (size_t s = 0; s < dp.size(); ++s) {
    EXPECT_EQ(std::bit_cast<uint64_t>(ep[s].first), std::bit_cast<uint64_t>(dp[s].first)) << "loss, step " << s + 1;
    if (norm_tolerance > 0)
      EXPECT_LE(std::fabs(ep[s].second - dp[s].second), norm_tolerance * dp[s].second) << "grad norm, step " << s + 1;
    else
      EXPECT_EQ(std::bit_cast<uint64_t>(ep[s].second), std::bit_cast<uint64_t>(dp[s].second))
          << "grad norm, step " << s + 1;
  }
}

TEST(ExpertParallel, AllToAllEp2MatchesDp2Bitwise) { alltoall_matches_data_parallel_bitwise(2, {}); }
TEST(ExpertParallel, AllToAllEp4MatchesDp4Bitwise) { alltoall_matches_data_parallel_bitwise(4, {}); }
TEST(ExpertParallel, AllToAllEp2WithCapacityDropAndPaddingMatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(2, {"moe.expert_capacity_factor=0.75", "moe.token_drop_policy=position",
                                             "moe.pad_expert_input_to_capacity=true"});
}
TEST(ExpertParallel, AllToAllEp2SwigluSigmoidBiasSharedExpertMatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(
      2,
      {"model.preset=llama", "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
       "moe.router_bias_update_rate=0.01", "moe.shared_expert_intermediate_size=32", "moe.expert_capacity_factor=1.0"});
}

// FP8 under expert parallelism (determinism = "run"): each expert's rows are quantised as one
// tensor, whose per-tensor scale is the amax data parallelism's reduction gives, and the weight
// gradient of each (expert, source) block reads its rows of that tensor (blockwise / mxfp8: the
// block quantised on its own, blocks along its own tokens, as the data-parallel rank quantises its
// rows): so the run is bitwise data parallelism's, whose expert weight gradients are quantised like
// every other. Before the fix the blocks' weight gradients were fp32 GEMMs on the unquantised rows,
// and the grad norm differed from the first step on (relative 1e-7 .. 1e-6, the losses from step 2).
// MXFP8: the same gradients, but step 4's grad norm is one ulp off (the double sum's order, above;
// the losses and every other step's norm are bitwise, over 8 steps too), so its norm is checked to
// 1e-14 relative, far below the 1e-7 of an unquantised wgrad.
TEST(ExpertParallel, AllToAllEp2Fp8TensorwiseMatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(2, {"precision.params=bf16", "precision.fp8=tensorwise"});
}
TEST(ExpertParallel, AllToAllEp2Fp8DelayedMatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(
      2, {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=4"});
}
TEST(ExpertParallel, AllToAllEp2Fp8BlockwiseSwigluMatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(2, {"precision.params=bf16", "precision.fp8=blockwise", "model.preset=llama"});
}
TEST(ExpertParallel, AllToAllEp2Mxfp8MatchesDp2Bitwise) {
  alltoall_matches_data_parallel_bitwise(2, {"precision.params=bf16", "precision.fp8=mxfp8"}, 1e-14);
}

// moe.shared_expert_overlap: the shared expert runs while the all-to-all is in flight, with the
// same bits on every rank (run and layout mode, and under the link model, where the exchange
// takes real time); refused without a shared expert or with another dispatcher.
TEST(ExpertParallel, SharedExpertOverlapKeepsTheBits) {
  testing::TempDir dir;
  auto job = [&](const std::string& out, std::vector<std::string> keys) {
    keys.insert(keys.end(),
                {"train.out_dir=" + dir.path(out), "train.steps=2", "train.eval_interval=0", "parallel.expert=2",
                 "moe.token_dispatcher=alltoall", "moe.shared_expert_intermediate_size=32"});
    return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", keys);
  };
  int k = 0;
  // Under tensor parallelism the shared expert's collectives run while the dispatcher's are in flight.
  for (const auto& [ranks, keys] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {}},
           {2, {"determinism=layout"}},
           {2, {"dist.link=intra=2GB/s:20us"}},
           {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2"}}}) {
    const std::string off = "off" + std::to_string(k), on = "on" + std::to_string(k++);
    testing::train_ranks(ranks, job(off, keys));
    std::vector<std::string> with = keys;
    with.push_back("moe.shared_expert_overlap=true");
    testing::train_ranks(ranks, job(on, with));
    for (int rank = 0; rank < ranks; ++rank) {
      const std::string a = testing::read_file(fingerprint_path(dir.path(off), rank));
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(testing::read_file(fingerprint_path(dir.path(on), rank)), a) << on << " rank " << rank;
    }
  }
  auto error = [](std::vector<std::string> keys) { return testing::user_error_of([&] { load_config("", keys); }); };
  EXPECT_EQ(error({"moe.num_experts=4", "moe.shared_expert_overlap=true"}),
            "config: moe.shared_expert_overlap = true needs moe.shared_expert_intermediate_size > 0");
  EXPECT_EQ(error({"moe.num_experts=4", "moe.shared_expert_overlap=true", "moe.shared_expert_intermediate_size=16",
                   "moe.token_dispatcher=allgather"}),
            "config: moe.shared_expert_overlap = true needs moe.token_dispatcher = \"alltoall\" (it is "
            "\"allgather\"), as Megatron's");
}

// moe.delay_wgrad_compute: the experts' fc weight gradients while the dispatch backward's rows travel.
// The same fingerprints in run and layout mode, with expert tensor parallelism, bf16 (its bf16 payload)
// and the link model on; refused without the all-to-all dispatcher.
TEST(ExpertParallel, DelayedWeightGradientsKeepTheBits) {
  testing::TempDir dir;
  int k = 0;
  for (const auto& [ranks, keys] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {}},
           {2, {"determinism=layout"}},
           {4, {"parallel.expert_tensor=2", "precision.params=bf16", "train.micro_batch=2"}},
           {2,
            {"dist.link=intra=2GB/s:20us", "moe.shared_expert_intermediate_size=32",
             "moe.shared_expert_overlap=true"}}}) {
    auto job = [&](const std::string& out, std::vector<std::string> extra) {
      extra.insert(extra.begin(), keys.begin(), keys.end());
      extra.insert(extra.end(), {"train.out_dir=" + dir.path(out), "train.steps=2", "train.eval_interval=0",
                                 "parallel.expert=2", "moe.token_dispatcher=alltoall"});
      return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
    };
    const std::string off = "off" + std::to_string(k), on = "on" + std::to_string(k++);
    testing::train_ranks(ranks, job(off, {}));
    testing::train_ranks(ranks, job(on, {"moe.delay_wgrad_compute=true"}));
    for (int rank = 0; rank < ranks; ++rank) {
      const std::string a = testing::read_file(fingerprint_path(dir.path(off), rank));
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(testing::read_file(fingerprint_path(dir.path(on), rank)), a) << on << " rank " << rank;
    }
  }
  EXPECT_EQ(testing::user_error_of([&] {
              load_config("", {"moe.num_experts=4", "moe.delay_wgrad_compute=true", "moe.token_dispatcher=allgather"});
            }),
            "config: moe.delay_wgrad_compute = true needs moe.token_dispatcher = \"alltoall\" (it is \"allgather\")");
}

TEST(ExpertParallel, ConfigurationErrorsNameTheSizes) {
  TempDir dir;
  EXPECT_EQ(
      testing::user_error_of([&] { job(dir.path("a"), {"parallel.expert=3"}); }),
      "config: moe.num_experts = 4 is not divisible by parallel.expert = 3 (every expert-parallel rank holds the same "
      "number of experts)");
  EXPECT_NE(testing::user_error_of([&] {
              job(dir.path("a"), {"parallel.expert=2", "moe.num_experts=0"});
            }).find("parallel.expert = 2 needs an MoE model (moe.num_experts > 0)"),
            std::string::npos);
  std::string message = "(no error)";
  try {
    train_ranks(3, job(dir.path("b"), {"parallel.expert=2"}));
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("parallel: world size 3 is not divisible by expert_tensor (1) x expert (2) x pipeline (1)"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// The all-to-all's bf16 payload (precision.params = "bf16", model/moe/alltoall_dispatcher.h): the same
// dispatch, combine and their backwards on two ranks with the rows as fp32 and as bf16 words. The
// dispatched rows, the combined output, the combine's backward rows once rounded (as the layer rounds
// them) and the input gradient are bitwise the fp32 payload's, and three of the four exchanges send
// half the bytes.
TEST(ExpertParallel, Bf16PayloadKeepsTheBitsAndHalvesTheRows) {
  const int64_t N = 12, E = 4, K = 2, C = 16;
  auto bf16_values = [](int64_t n, uint64_t seed, const std::string& name) {
    std::vector<float> v = testing::randn(n, seed, name);
    for (float& x : v) x = to_f32(to_bf16(x));
    return v;
  };
  std::vector<std::vector<std::vector<float>>> got(2, std::vector<std::vector<float>>(2));
  std::vector<std::vector<int64_t>> bytes(2, std::vector<int64_t>(2));
  for (int payload = 0; payload < 2; ++payload) {
    run_threads(2, 60, [&](Communicator& comm) {
      const std::unique_ptr<Device> device = Device::cpu();
      const Ops& ops = device->ops;
      const int r = comm.rank();
      std::vector<int32_t> idx(static_cast<size_t>(N * K));
      for (int64_t t = 0; t < N; ++t)  // two different experts per token, spread over both ranks
        idx[t * K] = static_cast<int32_t>((t + r) % E), idx[t * K + 1] = static_cast<int32_t>((t + r + 1 + t % 2) % E);
      const std::vector<uint8_t> kept(static_cast<size_t>(N * K), 1);
      const std::vector<float> x = bf16_values(N * C, 1 + r, "x"), dout = testing::randn(N * C, 3 + r, "dout");
      std::vector<float> probs = testing::randn(N * K, 5 + r, "probs");
      AllToAllDispatcher d(ops, comm, E, K, C, N, 0, false);
      d.set_bf16_payload(payload == 1);
      d.plan(idx.data(), kept.data(), N);
      const int64_t R = d.rows();
      std::vector<float> rows(static_cast<size_t>(std::max<int64_t>(R, 1) * C)), out(N * C, 0.0f), dx(N * C, 0.0f),
          drows(rows.size()), dprobs(N * K);
      d.dispatch(rows.data(), x.data());
      std::vector<float> expert_out = bf16_values(R * C, 7 + r, "expert out");  // the experts' rounded outputs
      d.combine(out.data(), x.data(), expert_out.data(), probs.data());
      d.combine_backward(drows.data(), dprobs.data(), dout.data(), expert_out.data(), probs.data());
      ops.round_bf16(drows.data(), drows.data(), R * C);  // as MoeLayer::backward does
      const std::vector<float> dexpert_in = testing::randn(R * C, 9 + r, "dexpert in");
      d.dispatch_backward(dx.data(), dexpert_in.data());
      std::vector<float>& all = got[static_cast<size_t>(r)][static_cast<size_t>(payload)];
      for (const std::vector<float>* v : {&rows, &out, &drows, &dprobs, &dx})
        all.insert(all.end(), v->begin(), v->end());
      bytes[static_cast<size_t>(r)][static_cast<size_t>(payload)] = d.bytes_sent();
    });
  }
  // Counts (E / S int64 per peer), then rows: each remote element 4 x 4 bytes in fp32; in bf16 2 bytes in
  // the dispatch, combine and combine backward, 4 in the dispatch backward. Over the group every row one
  // rank sends out is one another sends back, so the sums are 16 and 10 bytes per remote element.
  int64_t rows32 = 0, rows16 = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(testing::bitwise_equal(got[r][1], got[r][0], str("rank ", r)));
    rows32 += bytes[r][0] - (E / 2) * 8, rows16 += bytes[r][1] - (E / 2) * 8;
  }
  EXPECT_GT(rows32, 0);
  EXPECT_EQ(rows16 * 16, rows32 * 10);
}

}  // namespace
}  // namespace lockstep
