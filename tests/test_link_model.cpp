// The wire model (dist.link, comm/link_model.h): its text, its arithmetic (levels by node, one
// link's messages in FIFO order), that a step waits for the modelled delivery, and that the bits
// never depend on it.
#include <gtest/gtest.h>

#include <chrono>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/link_model.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/config/link_spec.h"
#include "lockstep/train/fingerprint.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

TEST(LinkModel, ReadsTheSpecAndRefusesWhatItCannotRead) {
  const LinkSpec s = parse_link_spec("intra=900GB/s:2us,inter=50GB/s:5us", "dist.link");
  EXPECT_DOUBLE_EQ(s.intra.bytes_per_s, 900e9);
  EXPECT_DOUBLE_EQ(s.intra.latency_s, 2e-6);
  EXPECT_DOUBLE_EQ(s.inter.bytes_per_s, 50e9);
  EXPECT_DOUBLE_EQ(s.inter.latency_s, 5e-6);
  EXPECT_FALSE(parse_link_spec("", "dist.link").on());
  EXPECT_TRUE(parse_link_spec("inter=100MB/s:1ms", "dist.link").on());
  auto error = [](std::vector<std::string> keys) { return testing::user_error_of([&] { load_config("", keys); }); };
  EXPECT_EQ(error({"dist.link=intra=fast"}),
            "config: dist.link = \"intra=fast\": cannot read \"intra=fast\" (expected intra=BANDWIDTH:LATENCY or "
            "inter=BANDWIDTH:LATENCY, e.g. intra=900GB/s:2us)");
  EXPECT_EQ(error({"dist.link=intra=900GB/s:2us,nvlink=1GB/s:1us"}),
            "config: dist.link = \"intra=900GB/s:2us,nvlink=1GB/s:1us\": cannot read \"nvlink=1GB/s:1us\" (expected "
            "intra=BANDWIDTH:LATENCY or inter=BANDWIDTH:LATENCY, e.g. intra=900GB/s:2us)");
  EXPECT_EQ(error({"dist.link=intra=0GB/s:2us"}).find("cannot read \"intra=0GB/s:2us\"") != std::string::npos, true);
  EXPECT_EQ(error({"dist.link_scale=fast"}),
            "config: dist.link_scale = \"fast\": expected a positive number or \"h100\"");
  EXPECT_EQ(error({"parallel.ranks_per_node=-1"}),
            "config: parallel.ranks_per_node = -1: must be >= 0 (0 = every rank on one node)");
  EXPECT_EQ(error({"dist.link=intra=1GB/s:1us", "dist.link_scale=h100", "parallel.ranks_per_node=8"}), "(no error)");
}

TEST(LinkModel, LevelsByNodeAndOneLinksMessagesInOrder) {
  LinkModel m(parse_link_spec("intra=1GB/s:10us,inter=100MB/s:1ms", "dist.link"), 2);
  EXPECT_TRUE(m.same_node(0, 1));
  EXPECT_FALSE(m.same_node(1, 2));
  EXPECT_DOUBLE_EQ(m.wire_seconds(0, 1, 1000000), 10e-6 + 1e-3);
  EXPECT_DOUBLE_EQ(m.wire_seconds(1, 2, 1000000), 1e-3 + 1e-2);
  const auto t0 = LinkModel::Clock::now();
  const auto first = m.deliver(0, 1, 1000000, t0), second = m.deliver(0, 1, 1000000, t0);
  const auto other = m.deliver(0, 3, 1000000, t0);  // another link: not behind them
  using us = std::chrono::microseconds;
  EXPECT_NEAR(std::chrono::duration_cast<us>(first - t0).count(), 1010, 1);
  EXPECT_NEAR(std::chrono::duration_cast<us>(second - t0).count(), 2020, 1);
  EXPECT_NEAR(std::chrono::duration_cast<us>(other - t0).count(), 11000, 1);
  m.scale_bandwidths(2.0);
  EXPECT_DOUBLE_EQ(m.wire_seconds(0, 1, 1000000), 5e-6 + 0.5e-3);
}

// An all-reduce of 4 MB over two ranks at 100 MB/s moves 2 MB each way in each of its two steps
// (reduce-scatter, all-gather): it cannot finish before the model delivers them (>= 40 ms), and its
// result is the one without the model.
TEST(LinkModel, AStepWaitsForTheModelledDelivery) {
  const int64_t n = 1 << 20;
  std::vector<std::vector<float>> results(2);
  std::vector<double> seconds(2);
  for (bool modelled : {false, true})
    run_threads(2, 60, [&](Communicator& comm) {
      if (modelled)
        comm.set_link_model(std::make_shared<LinkModel>(parse_link_spec("intra=100MB/s:1ms", "dist.link"), 0));
      std::vector<float> x = testing::randn(n, 7 + comm.rank(), "x");
      const auto t0 = std::chrono::steady_clock::now();
      comm.all_reduce(x.data(), n);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (comm.rank() == 0) {
        if (modelled) {
          seconds[1] = s;
          EXPECT_TRUE(testing::bitwise_equal(x, results[0]));
        } else {
          results[0] = x;
        }
      }
    });
  EXPECT_GE(seconds[1], 0.04);
}

// Training with the model on gives the bits of training without it (data and tensor parallel).
TEST(LinkModel, TheBitsNeverDependOnIt) {
  testing::TempDir dir;
  auto job = [&](const std::string& out, std::vector<std::string> keys) {
    keys.insert(keys.end(), {"train.out_dir=" + dir.path(out), "train.steps=2", "train.eval_interval=0",
                             "train.global_batch=8", "train.micro_batch=2", "parallel.tensor=2"});
    return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", keys);
  };
  testing::train_ranks(4, job("off", {}));
  testing::train_ranks(4, job("on", {"dist.link=intra=5GB/s:5us,inter=1GB/s:20us", "parallel.ranks_per_node=2"}));
  for (int rank = 0; rank < 4; ++rank) {
    const std::string off = testing::read_file(fingerprint_path(dir.path("off"), rank));
    EXPECT_FALSE(off.empty());
    EXPECT_EQ(testing::read_file(fingerprint_path(dir.path("on"), rank)), off) << "rank " << rank;
  }
}

}  // namespace
}  // namespace lockstep
