// The communicator on the threads backend: every collective against a serial reference at world
// sizes 1 to 8, the same bits whatever order messages arrive in, and the failure modes (a rank that
// throws, never arrives, or exits) reported on every other rank within the timeout.
// The mpi backend runs the same suite under mpirun (tests/mpi/) and compares its bits with these.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "comm_suite.h"
#include "lockstep/comm/launch.h"
#include "lockstep/comm/progress.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/core/error.h"
#include "testing.h"

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

class CommWorldSizes : public ::testing::TestWithParam<int> {};

TEST_P(CommWorldSizes, EveryCollectiveMatchesTheSerialReference) {
  const int P = GetParam();
  std::vector<testing::SuiteResult> results(P);
  run_threads(P, 30, [&](Communicator& comm) { results[comm.rank()] = testing::run_comm_suite(comm); });
  for (int r = 0; r < P; ++r)
    for (const std::string& f : results[r].failures) ADD_FAILURE() << f;
}

TEST_P(CommWorldSizes, SameBitsWhateverTheArrivalOrder) {
  // Ranks reach each collective at staggered times, in a different order in each run.
  const int P = GetParam();
  auto run = [&](int shift) {
    std::vector<std::vector<float>> out(P);
    run_threads(P, 30, [&](Communicator& comm) {
      const int me = comm.rank();
      std::vector<float> x = testing::rank_values(me, 3001, "order");
      for (int rep = 0; rep < 3; ++rep) {
        std::this_thread::sleep_for(std::chrono::microseconds(200 * ((me + shift + rep) % P)));
        comm.all_reduce(x.data(), 3001);
      }
      out[me] = x;
    });
    return out;
  };
  const auto a = run(0), b = run(1);
  for (int r = 0; r < P; ++r) {
    EXPECT_TRUE(testing::bitwise_equal(a[r], b[r])) << "rank " << r;
    EXPECT_TRUE(testing::bitwise_equal(a[r], a[0])) << "rank " << r << " vs rank 0";
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, CommWorldSizes, ::testing::Range(1, 9));

// Runs fn on P ranks with a short timeout; returns each rank's error message ("" = none) and the
// error run_threads reports.
struct Outcome {
  std::vector<std::string> errors;
  std::string reported;
  double seconds;
};

Outcome run_failing(int P, double timeout, const std::function<void(Communicator&)>& fn) {
  Outcome o;
  o.errors.resize(P);
  std::mutex m;
  const auto t0 = Clock::now();
  try {
    run_threads(P, timeout, [&](Communicator& comm) {
      try {
        fn(comm);
      } catch (const std::exception& e) {
        std::lock_guard lock(m);
        o.errors[comm.rank()] = e.what();
        throw;
      }
    });
  } catch (const std::exception& e) {
    o.reported = e.what();
  }
  o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return o;
}

TEST(CommFailures, ARankThatThrowsStopsEveryOtherRank) {
  const Outcome o = run_failing(4, 5.0, [](Communicator& comm) {
    std::vector<float> x(100, 1.0f);
    comm.all_reduce(x.data(), 100);
    if (comm.rank() == 2) throw std::runtime_error("thrown on purpose");
    comm.all_reduce(x.data(), 100);
  });
  EXPECT_EQ(o.reported, "rank 2: thrown on purpose");
  for (int r : {0, 1, 3})
    EXPECT_EQ(o.errors[r],
              str("rank ", r, ": all_reduce over ranks [0, 1, 2, 3]: stopped: rank 2 failed: thrown on purpose"));
  EXPECT_LT(o.seconds, 2.0) << "the failure is announced, not waited out";
}

TEST(CommFailures, ARankThatNeverArrivesTimesOutOnTheOthers) {
  const Outcome o = run_failing(4, 0.3, [](Communicator& comm) {
    if (comm.rank() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    std::vector<float> x(10, 1.0f);
    comm.all_reduce(x.data(), 10);
  });
  // The first rank to time out names the missing rank; the others stop on its report.
  const std::string timeout =
      "all_reduce over ranks [0, 1, 2, 3]: timed out after 0.3 s waiting for rank 3 (dist.timeout_s)";
  EXPECT_NE(o.reported.find(timeout), std::string::npos) << o.reported;
  for (int r : {0, 1, 2})
    EXPECT_NE(o.errors[r].find(timeout), std::string::npos) << "rank " << r << ": " << o.errors[r];
  EXPECT_NE(o.errors[3].find("rank 3: all_reduce over ranks [0, 1, 2, 3]: stopped: "), std::string::npos)
      << o.errors[3];
  EXPECT_LT(o.seconds, 2.5);
}

TEST(CommFailures, ARankThatExitsIsNamed) {
  const Outcome o = run_failing(3, 5.0, [](Communicator& comm) {
    if (comm.rank() == 1) return;
    std::vector<float> x(10, 1.0f);
    comm.all_reduce(x.data(), 10);
  });
  EXPECT_NE(o.reported.find("rank 1 exited without taking part"), std::string::npos) << o.reported;
  EXPECT_LT(o.seconds, 2.0);
}

TEST(CommFailures, AStalledSubGroupTimesOutWithItsRanks) {
  const Outcome o = run_failing(4, 0.3, [](Communicator& comm) {
    Communicator pair = comm.split(comm.rank() / 2, comm.rank());
    if (comm.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    float v = 1;
    pair.all_reduce(&v, 1);  // ranks 0 and 1 complete theirs and stop
  });
  EXPECT_NE(o.errors[3].find("rank 3: all_reduce over ranks [2, 3]: timed out after 0.3 s waiting for rank 2"),
            std::string::npos)
      << o.errors[3];
}

TEST(CommAsync, PostingReturnsAtOnceAndWaitCompletesWhenThePeerArrives) {
  std::vector<double> posted_after(2), waited_after(2);
  std::vector<char> done_at_post(2);
  run_threads(2, 10, [&](Communicator& comm) {
    const int me = comm.rank();
    if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::vector<float> x(1000, static_cast<float>(me + 1));
    const auto t0 = Clock::now();
    Work w = comm.all_reduce_async(x.data(), 1000);
    posted_after[me] = std::chrono::duration<double>(Clock::now() - t0).count();
    done_at_post[me] = w.done();
    w.wait();
    waited_after[me] = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_EQ(x[999], 3.0f);
  });
  // Rank 0 posts long before rank 1 arrives: the post returns at once, the op completes later.
  EXPECT_LT(posted_after[0], 0.05);
  EXPECT_FALSE(done_at_post[0]);
  EXPECT_GT(waited_after[0], 0.1);
}

// The progress thread's order holds whoever runs an operation: a waiter may run the operation it
// waits for only when it is next and nothing runs (ProgressThread::run_here).
TEST(CommProgress, OperationsRunOneAtATimeInPostOrderWhoeverRunsThem) {
  ProgressThread pt;
  std::mutex m;
  std::vector<int> log;
  auto note = [&](int x) {
    std::lock_guard lock(m);
    log.push_back(x);
  };
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  auto first = pt.post([&] {
    open.wait();
    note(1);
  });
  auto second = pt.post([&] { note(2); });
  std::thread waiter([&] {
    Work(second).wait();  // not next (first is queued or running): waits its turn
    note(3);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard lock(m);
    EXPECT_TRUE(log.empty());
  }
  gate.set_value();
  waiter.join();
  Work(first).wait();
  EXPECT_EQ(log, (std::vector<int>{1, 2, 3}));
}

TEST(CommProgress, AWaitedOperationNobodyStartedRunsOnTheWaitingThread) {
  ProgressThread pt;
  int here = 0;
  for (int i = 0; i < 100; ++i) {
    std::thread::id ran;
    Work(pt.post([&] { ran = std::this_thread::get_id(); })).wait();  // a blocking call
    here += ran == std::this_thread::get_id();
  }
  // The progress thread is woken by each post and may take one first; the waiter, already running,
  // takes almost all.
  EXPECT_GT(here, 50);
  // An error thrown there reaches the waiter as from the progress thread.
  EXPECT_THROW(Work(pt.post([] { throw CommError("from the operation"); })).wait(), CommError);
}

TEST(CommLaunch, BackendChoice) {
  EXPECT_EQ(resolve_backend("threads"), "threads");
  if (!under_mpi_launcher()) {
    EXPECT_EQ(resolve_backend("auto"), "threads");
  }
  if (!mpi_available()) {
    EXPECT_THROW(resolve_backend("mpi"), UserError);
  }
}

}  // namespace
}  // namespace lockstep
