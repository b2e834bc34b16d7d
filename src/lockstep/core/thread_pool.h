// A pool of worker threads with static partitioning.
//
// parallel_for(n, fn) splits [0, n) into `threads()` contiguous chunks, chunk t = [n*t/T, n*(t+1)/T),
// and runs fn(begin, end) for each on its own thread (the caller runs chunk 0). The split is a pure
// function of n and the thread count; no work stealing, no dynamic scheduling.
//
// Determinism: the pool never decides *what* is computed, only *where*. Every kernel in lockstep
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

  // Runs fn(t) for t in [0, threads()): one call per worker, for kernels that want to own the
  // split themselves (e.g. the GEMM's 2D tiles).
  void run_on_all(const std::function<void(int)>& fn);

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

  int threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  bool busy_ = false;
  std::mutex error_mutex_;
  std::exception_ptr worker_error_;
};

// The split used by parallel_for: chunk t of T over [0, n).
inline int64_t chunk_begin(int64_t n, int t, int T) { return n * t / T; }

// Uses the current thread's pool, or runs fn(0, n) inline when there is none or it is busy.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
// Number of threads parallel_for would use on this thread right now.
int current_threads();

}  // namespace lockstep
