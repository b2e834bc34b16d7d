// A pool of worker threads with static partitioning.
//
// parallel_for(n, fn) splits [0, n) into `threads()` contiguous chunks, chunk t = [n*t/T, n*(t+1)/T),
// and runs fn(begin, end) once for each. The split is a pure function of n and the thread count.
// Which thread runs a chunk is not fixed: the pool's threads claim chunks (run_parts) in order, so
// a worker that the OS has not scheduled yet delays nothing; its chunks run on the threads that are
// awake. On a busy machine (other processes on the cores) this is what keeps every parallel region
// from waiting for the slowest-to-wake thread.
//
// Determinism: the pool never decides *what* is computed, only *where*: a chunk or part computes the
// same thing whichever thread claims it. Every kernel in lockstep
// writes each output element from exactly one chunk with a reduction order that does not depend on
// the chunk boundaries, so results are bitwise identical for any thread count.
//
// A pool is bound to the calling thread with ThreadPool::Bind; kernels call
// lockstep::parallel_for, which uses the pool bound to the current thread (serial when none is).
// Each rank of a multi-rank job (later: ranks as threads) binds its own pool: no globals shared
// between ranks.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lockstep {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Runs fn(begin, end) over the static split of [0, n) into threads() chunks (empty chunks are
  // skipped). Blocks until every chunk is done. Not reentrant: a kernel inside fn runs serially.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

  // Runs fn(t) for t in [0, threads()): one call per worker, the caller running part 0, each on
  // its own thread (for work that needs every thread, e.g. per-thread state).
  void run_on_all(const std::function<void(int)>& fn);

  // Runs fn(p) once for every p in [0, parts), on whichever of the pool's threads claims p first
  // (claims go in increasing p). Returns when every part is done. The caller claims parts too and
  // never waits for a worker that has not started: a worker that wakes after the last part was
  // claimed does nothing. For kernels that own their split (the GEMM's tiles, grouped-GEMM parts):
  // fn(p) must compute the same thing whichever thread runs it (no thread ids), and parts must
  // not wait for each other.
  void run_parts(int64_t parts, const std::function<void(int64_t)>& fn);

  // RAII: makes `pool` the current thread's pool for lockstep::parallel_for.
  class Bind {
   public:
    explicit Bind(ThreadPool* pool);
    ~Bind();
    Bind(const Bind&) = delete;
    Bind& operator=(const Bind&) = delete;

   private:
    ThreadPool* prev_;
  };

  static ThreadPool* current();

 private:
  void worker(int t);
  // Claims and runs parts of the current run_parts job until none are left. The caller passes its
  // error slot; workers (null) record theirs in worker_error_.
  void claim_parts(std::exception_ptr* caller_error);

  int threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  // run_parts: the job, its part count, the next part to claim, whether the job still takes
  // helpers, and how many workers are inside it.
  const std::function<void(int64_t)>* parts_job_ = nullptr;
  int64_t parts_ = 0;
  std::atomic<int64_t> next_part_{0};
  std::atomic<bool> parts_open_{false};
  std::atomic<int> parts_active_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  bool busy_ = false;
  std::mutex error_mutex_;
  std::exception_ptr worker_error_;
};

// Chunk t of T over [0, n): the split of parallel_for and of the communicator's chunked collectives.
inline int64_t chunk_begin(int64_t n, int t, int T) { return n * t / T; }

// Uses the current thread's pool, or runs fn(0, n) inline when there is none or it is busy.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
// Number of threads parallel_for would use on this thread right now.
int current_threads();

}  // namespace lockstep
