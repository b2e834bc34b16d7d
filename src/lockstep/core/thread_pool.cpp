#include "lockstep/core/thread_pool.h"

#include <mutex>
#include <utility>

#include "lockstep/core/error.h"

namespace lockstep {

namespace {
thread_local ThreadPool* tls_pool = nullptr;

// Workers spin this many iterations before sleeping on the futex: kernels come in quick
// succession during a training step, and waking a sleeping thread costs tens of microseconds.
constexpr int kSpinIterations = 20000;

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
    try {
      (*job_)(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!worker_error_) worker_error_ = std::current_exception();
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
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
  generation_.fetch_add(1, std::memory_order_acq_rel);
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
  run_on_all([&](int t) {
    const int64_t b = chunk_begin(n, t, T), e = chunk_begin(n, t + 1, T);
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
