#include "lockstep/core/thread_pool.h"

#include <mutex>
#include <utility>

#include "lockstep/core/error.h"

namespace lockstep {

namespace {
thread_local ThreadPool* tls_pool = nullptr;

// Workers spin this many iterations (a pause is ~35 ns on Zen 4: ~70 us) before sleeping on the
// futex: kernels come in quick succession during a training step, and waking a sleeping thread
// costs tens of microseconds. Not longer: when other processes share the cores, a spinning thread
// burns the time slice its busy sibling needs, and run_parts does not wait for a sleeping worker.
constexpr int kSpinIterations = 2000;

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

ThreadPool::ThreadPool(int threads) : threads_(threads) {
  LOCKSTEP_CHECK(threads >= 1, "thread count ", threads);
  for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

// The generation counts jobs; its low bit says which kind the current one is. A run_on_all job
// waits for every worker, so a worker never misses one; a run_parts job may be over before a
// worker wakes, and the worker then joins nothing (claim_parts checks parts_open_).
void ThreadPool::worker(int t) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    for (int i = 0; g == seen && i < kSpinIterations; ++i) {
      cpu_relax();
      g = generation_.load(std::memory_order_acquire);
    }
    while (g == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    if (g & 1) {
      claim_parts(nullptr);
      continue;
    }
    try {
      (*job_)(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!worker_error_) worker_error_ = std::current_exception();
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void ThreadPool::claim_parts(std::exception_ptr* caller_error) {
  // Dekker-style handshake with run_parts' close (both sides sequentially consistent): either this
  // increment is seen by the caller's check after closing, so it waits for us, or we see the job
  // closed and touch nothing. The job's fields are written before parts_open_ is set.
  parts_active_.fetch_add(1, std::memory_order_seq_cst);
  if (parts_open_.load(std::memory_order_seq_cst)) {
    const int64_t n = parts_;
    for (int64_t p = next_part_.fetch_add(1, std::memory_order_relaxed); p < n;
         p = next_part_.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*parts_job_)(p);
      } catch (...) {
        // A worker records its error before it leaves the job, so the caller sees it.
        if (caller_error) {
          if (!*caller_error) *caller_error = std::current_exception();
        } else {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!worker_error_) worker_error_ = std::current_exception();
        }
      }
    }
  }
  if (parts_active_.fetch_sub(1, std::memory_order_seq_cst) == 1) parts_active_.notify_one();
}

void ThreadPool::run_parts(int64_t parts, const std::function<void(int64_t)>& fn) {
  if (parts <= 0) return;
  if (threads_ == 1 || parts == 1 || busy_) {
    for (int64_t p = 0; p < parts; ++p) fn(p);
    return;
  }
  busy_ = true;
  parts_job_ = &fn;
  parts_ = parts;
  next_part_.store(0, std::memory_order_relaxed);
  parts_open_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add((generation_.load(std::memory_order_relaxed) & 1) ? 2 : 1, std::memory_order_acq_rel);
  generation_.notify_all();
  std::exception_ptr err;
  claim_parts(&err);
  parts_open_.store(false, std::memory_order_seq_cst);
  int a = parts_active_.load(std::memory_order_seq_cst);
  for (int i = 0; a != 0 && i < kSpinIterations; ++i) {
    cpu_relax();
    a = parts_active_.load(std::memory_order_seq_cst);
  }
  while (a != 0) {
    parts_active_.wait(a, std::memory_order_seq_cst);
    a = parts_active_.load(std::memory_order_seq_cst);
  }
  busy_ = false;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!err && worker_error_) err = worker_error_;
    worker_error_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

void ThreadPool::run_on_all(const std::function<void(int)>& fn) {
  if (threads_ == 1 || busy_) {
    // Nested use (a kernel called from inside a parallel region) runs every part on this thread,
    // in order: same results, no deadlock.
    for (int t = 0; t < threads_; ++t) fn(t);
    return;
  }
  busy_ = true;
  job_ = &fn;
  pending_.store(threads_ - 1, std::memory_order_release);
  generation_.fetch_add((generation_.load(std::memory_order_relaxed) & 1) ? 1 : 2, std::memory_order_acq_rel);
  generation_.notify_all();
  std::exception_ptr err;
  try {
    fn(0);
  } catch (...) {
    err = std::current_exception();
  }
  int p = pending_.load(std::memory_order_acquire);
  for (int i = 0; p != 0 && i < kSpinIterations; ++i) {
    cpu_relax();
    p = pending_.load(std::memory_order_acquire);
  }
  while (p != 0) {
    pending_.wait(p, std::memory_order_acquire);
    p = pending_.load(std::memory_order_acquire);
  }
  busy_ = false;
  if (!err && worker_error_) err = std::exchange(worker_error_, nullptr);
  worker_error_ = nullptr;
  if (err) std::rethrow_exception(err);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int T = threads_;
  if (T == 1 || n == 1 || busy_) {
    fn(0, n);
    return;
  }
  run_parts(T, [&](int64_t t) {
    const int64_t b = chunk_begin(n, static_cast<int>(t), T), e = chunk_begin(n, static_cast<int>(t) + 1, T);
    if (b < e) fn(b, e);
  });
}

ThreadPool::Bind::Bind(ThreadPool* pool) : prev_(tls_pool) { tls_pool = pool; }
ThreadPool::Bind::~Bind() { tls_pool = prev_; }
ThreadPool* ThreadPool::current() { return tls_pool; }

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (tls_pool) {
    tls_pool->parallel_for(n, fn);
  } else if (n > 0) {
    fn(0, n);
  }
}

int current_threads() { return tls_pool ? tls_pool->threads() : 1; }

}  // namespace lockstep
