// The mpi backend, run under mpirun (tests/mpi/CMakeLists.txt):
//
//   test_comm_mpi collectives  every collective against the serial reference (comm_suite.h), then
//                              the same suite on the threads backend with as many ranks (in rank
//                              0's process): the hash of every output must be the same, rank by rank
//   test_comm_mpi throw        rank 2 throws while the others wait in an all_reduce
//   test_comm_mpi stall        rank 3 never arrives; the others time out after 1 s
//
// Exit status 0 when every check passes; failures print one line per check.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "comm_suite.h"
#include "lockstep/comm/mpi/mpi_transport.h"
#include "lockstep/comm/threads/thread_transport.h"

using namespace lockstep;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int status = 0;
  if (mode == "collectives") {
    run_mpi(0, 30, [&](Communicator& comm) {
      const testing::SuiteResult mpi = testing::run_comm_suite(comm);
      for (const std::string& f : mpi.failures) std::printf("FAIL mpi: %s\n", f.c_str()), status = 1;
      // Rank 0 runs the threads backend with as many ranks and sends every rank its hash.
      std::vector<uint64_t> threads(comm.size());
      if (comm.rank() == 0)
        run_threads(comm.size(), 30, [&](Communicator& t) { threads[t.rank()] = testing::run_comm_suite(t).hash; });
      comm.broadcast(threads.data(), comm.size(), 0);
      if (threads[comm.rank()] != mpi.hash) {
        std::printf("FAIL rank %d of %d: outputs differ between mpi (%s) and threads (%s)\n", comm.rank(), comm.size(),
                    hex64(mpi.hash).c_str(), hex64(threads[comm.rank()]).c_str());
        status = 1;
      }
      // Everyone's verdict, so that rank 0 reports for the job.
      int bad = status;
      comm.all_reduce(&bad, 1, ReduceOp::max);
      if (comm.rank() == 0)
        std::printf("%s: %d ranks, %s\n", bad ? "FAILED" : "passed", comm.size(), hex64(mpi.hash).c_str());
      status = bad;
    });
  } else if (mode == "throw") {
    run_mpi(0, 20, [](Communicator& comm) {
      std::vector<float> x(100, 1.0f);
      comm.all_reduce(x.data(), 100);
      if (comm.rank() == 2) throw std::runtime_error("thrown on purpose");
      comm.all_reduce(x.data(), 100);
    });
    status = 1;  // not reached: the job is aborted
  } else if (mode == "stall") {
    run_mpi(0, 1, [](Communicator& comm) {
      if (comm.rank() == 3) std::this_thread::sleep_for(std::chrono::seconds(30));
      std::vector<float> x(100, 1.0f);
      comm.all_reduce(x.data(), 100);
    });
    status = 1;
  } else {
    std::fprintf(stderr, "usage: test_comm_mpi collectives|throw|stall\n");
    return 2;
  }
  return status;
}
