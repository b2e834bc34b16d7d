// Communication bandwidth on one machine (loopback / shared memory), both backends.
//
//   build/bench_comm [--nproc N]                      threads backend, N ranks (default 4)
//   mpirun -n N build/bench_comm                      mpi backend, and raw MPI_Allreduce /
//                                                     MPI_Alltoall on the same sizes
//
// For each message size (bytes of fp32 per rank; the first one float per rank): the median time of lockstep's
// all_reduce and all_to_all, their algorithm bandwidth (size / time, as nccl-tests report it), the ratio to raw MPI,
// and the cost of the deterministic reduction: all_reduce against the data movement it is made of (an all-to-all of the
// same bytes + an all-gather of 1/N of them), the difference being the rank-order sum and its scratch copies.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/comm/launch.h"
#include "lockstep/comm/threads/thread_transport.h"
#ifdef LOCKSTEP_HAVE_MPI
#include <mpi.h>

#include "lockstep/comm/mpi/mpi_transport.h"
#endif

using namespace lockstep;

namespace {

// Median seconds of fn over `reps` runs, each started together on every rank (barrier) and
// finished when the slowest rank is done (max over ranks).
double time_op(Communicator& comm, int reps, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    comm.all_reduce(&s, 1, ReduceOp::max);
    if (i >= 2) t.push_back(s);  // two warm-up runs
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void bench(Communicator& comm, bool raw_mpi) {
  const int P = comm.size();
  if (comm.rank() == 0) {
    std::printf("backend %s, %d ranks; times are medians, bandwidth = bytes per rank / time\n", comm.backend().c_str(),
                P);
    std::printf("%10s | %12s %9s %9s %11s | %12s %9s %9s\n", "bytes", "all_reduce", "GB/s", raw_mpi ? "vs MPI" : "",
                "movement", "all_to_all", "GB/s", raw_mpi ? "vs MPI" : "");
  }
  // One float per rank first (the latency of a small blocking collective: an amax, a count), then
  // 4 KB .. 64 MB.
  for (int64_t bytes = 4 * P; bytes <= (64 << 20); bytes = bytes < 4096 ? 4096 : bytes * 8) {
    const int64_t n = bytes / 4 / P * P;  // divisible by P for all_to_all
    const int reps = static_cast<int>(std::clamp<int64_t>((256 << 20) / bytes, 5, 200));
    std::vector<float> a(n, 1.0f), b(n, 0.0f);
    const double ar = time_op(comm, reps, [&] { comm.all_reduce(a.data(), n); });
    const double a2a = time_op(comm, reps, [&] { comm.all_to_all(b.data(), a.data(), n / P); });
    const double ag = time_op(comm, reps, [&] { comm.all_gather(b.data(), a.data(), n / P); });
    double mpi_ar = 0, mpi_a2a = 0;
#ifdef LOCKSTEP_HAVE_MPI
    if (raw_mpi) {
      mpi_ar = time_op(comm, reps, [&] {
        MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      });
      mpi_a2a = time_op(comm, reps, [&] {
        MPI_Alltoall(a.data(), static_cast<int>(n / P), MPI_FLOAT, b.data(), static_cast<int>(n / P), MPI_FLOAT,
                     MPI_COMM_WORLD);
      });
    }
#endif
    if (comm.rank() == 0) {
      const double gb = static_cast<double>(n) * 4 / 1e9;
      char r1[16] = "", r2[16] = "";
      if (raw_mpi)
        std::snprintf(r1, sizeof r1, "%.2fx", ar / mpi_ar), std::snprintf(r2, sizeof r2, "%.2fx", a2a / mpi_a2a);
      std::printf("%10lld | %9.1f us %9.2f %9s %8.1f us | %9.1f us %9.2f %9s\n", (long long)(n * 4), ar * 1e6, gb / ar,
                  r1, (a2a + ag) * 1e6, a2a * 1e6, gb / a2a, r2);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 4;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--nproc") && i + 1 < argc)
      nproc = std::atoi(argv[++i]);
    else
      return std::fprintf(stderr, "usage: bench_comm [--nproc N]   (or under mpirun)\n"), 2;
  }
  if (under_mpi_launcher()) {
#ifdef LOCKSTEP_HAVE_MPI
    // Raw MPI calls come from this thread while the progress thread is idle (each lockstep call
    // here is blocking), which MPI_THREAD_MULTIPLE allows.
    run_mpi(0, 600, [](Communicator& comm) { bench(comm, true); });
    return 0;
#else
    return std::fprintf(stderr, "bench_comm: built without MPI\n"), 2;
#endif
  }
  run_threads(nproc, 600, [](Communicator& comm) { bench(comm, false); });
  return 0;
}
