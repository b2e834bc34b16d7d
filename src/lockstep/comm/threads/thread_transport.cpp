#include "lockstep/comm/threads/thread_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "lockstep/comm/progress.h"
#include "lockstep/comm/transport.h"
#include "lockstep/core/error.h"

namespace lockstep {

namespace {

struct MsgKey {
  uint64_t ctx;  // the group
  int src, dst;  // world ranks
  bool p2p;
  int tag;
  uint64_t seq;  // collective: step of the group; p2p: order among (src, dst, tag)
  auto operator<=>(const MsgKey&) const = default;
};

struct Posted {
  const void* data;
  int64_t bytes;
  int state = 0;  // 0 posted, 1 being copied by the receiver, 2 consumed
};

constexpr std::chrono::microseconds kSpin{50};  // exchange's spin before it sleeps

// The spin yields: with more runnable threads than cores (more ranks than cores, or the ranks'
// thread pools) the rank being waited for gets the core.
inline void cpu_relax() { std::this_thread::yield(); }

uint64_t mix(uint64_t x) {  // splitmix64 finaliser: group ids from (parent, split number, color)
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

class ThreadWorld {
 public:
  ThreadWorld(int n, double timeout) : size(n), timeout_s(timeout), cvs(n), events(n), exited(n, 0) {}

  const int size;
  const double timeout_s;
  std::mutex m;
  std::vector<std::condition_variable> cvs;  // one per world rank: its progress thread sleeps here
  // Per world rank, bumped (under m) with every notification of its cv: what a rank spinning
  // before it sleeps watches (ThreadTransport::exchange).
  std::vector<std::atomic<uint64_t>> events;
  std::map<MsgKey, Posted*> mailbox;
  std::string failure;  // the first failure; empty while all is well
  int failure_rank = -1;
  std::vector<char> exited;

  void wake_locked(int rank) {
    events[rank].fetch_add(1, std::memory_order_release);
    cvs[rank].notify_all();
  }
  void wake_all_locked() {
    for (int r = 0; r < size; ++r) wake_locked(r);
  }
  void fail_locked(int rank, const std::string& msg) {
    if (failure.empty()) failure = msg, failure_rank = rank;
    wake_all_locked();
  }
  void fail(int rank, const std::string& msg) {
    std::lock_guard lock(m);
    fail_locked(rank, msg);
  }
  void mark_exited(int rank) {
    std::lock_guard lock(m);
    exited[rank] = 1;
    wake_all_locked();
  }
};

namespace {

class ThreadTransport final : public Transport {
 public:
  ThreadTransport(std::shared_ptr<ThreadWorld> world, std::vector<int> members, int me, uint64_t ctx)
      : w_(std::move(world)), members_(std::move(members)), me_(me), ctx_(ctx) {}

  int rank() const override { return me_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int world_rank(int r) const override { return members_[r]; }
  int local_size() const override { return w_->size; }
  const char* backend() const override { return "threads"; }
  double timeout_s() const override { return w_->timeout_s; }

  std::shared_ptr<Transport> subgroup(int color, int key, const std::vector<int>& members) override {
    std::vector<int> world(members.size());
    int me = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      world[i] = members_[members[i]];
      if (members[i] == me_) me = static_cast<int>(i);
    }
    LOCKSTEP_CHECK(me >= 0, "subgroup without this rank");
    const uint64_t ctx = mix(mix(ctx_ ^ mix(splits_++)) ^ static_cast<uint64_t>(static_cast<uint32_t>(color)));
    return std::make_shared<ThreadTransport>(w_, std::move(world), me, ctx);
  }

  void exchange(const std::vector<SendSpec>& sends, const std::vector<RecvSpec>& recvs, const OpInfo& op) override;

 private:
  std::shared_ptr<ThreadWorld> w_;
  std::vector<int> members_;  // world ranks, in group order
  int me_;
  uint64_t ctx_;
  uint64_t steps_ = 0, splits_ = 0;
  std::map<std::pair<int, int>, uint64_t> sent_, received_;  // p2p counts per (peer, tag)
};

void ThreadTransport::exchange(const std::vector<SendSpec>& sends, const std::vector<RecvSpec>& recvs,
                               const OpInfo& op) {
  ThreadWorld& W = *w_;
  const int self = members_[me_];
  std::unique_lock lock(W.m);
  if (!W.failure.empty()) throw CommError(str(where(op), ": stopped: ", W.failure));
  const uint64_t step = op.p2p ? 0 : steps_++;

  std::vector<Posted> posts(sends.size());
  std::vector<MsgKey> post_keys(sends.size()), recv_keys(recvs.size());
  for (size_t i = 0; i < sends.size(); ++i) {
    const int dst = members_[sends[i].peer];
    const int tag = op.tag + sends[i].tag;
    post_keys[i] = {ctx_, self, dst, op.p2p, tag, op.p2p ? sent_[{sends[i].peer, tag}]++ : step};
    posts[i] = {sends[i].data, sends[i].bytes, 0};
    W.mailbox[post_keys[i]] = &posts[i];
    W.wake_locked(dst);
  }
  for (size_t j = 0; j < recvs.size(); ++j) {
    const int tag = op.tag + recvs[j].tag;
    recv_keys[j] = {
        ctx_, members_[recvs[j].peer], self, op.p2p, tag, op.p2p ? received_[{recvs[j].peer, tag}]++ : step};
  }
  std::vector<char> received(recvs.size(), 0);

  // Withdraws our messages that nobody took and waits for those being copied: they point into the
  // caller's buffers, which are released when we return.
  auto withdraw = [&] {
    for (size_t i = 0; i < posts.size(); ++i)
      if (posts[i].state == 0) W.mailbox.erase(post_keys[i]);
    W.cvs[self].wait(
        lock, [&] { return std::none_of(posts.begin(), posts.end(), [](const Posted& p) { return p.state == 1; }); });
  };
  auto fail = [&](const std::string& msg) {
    W.fail_locked(self, msg);
    withdraw();
    throw CommError(msg);
  };

  for (;;) {
    // Scan until a whole pass under the lock finds nothing: a message posted while we copied
    // (lock released) notified nobody, since we were not waiting.
    bool copied = true;
    while (copied) {
      copied = false;
      for (size_t j = 0; j < recvs.size(); ++j) {
        if (received[j]) continue;
        auto it = W.mailbox.find(recv_keys[j]);
        if (it == W.mailbox.end()) continue;
        copied = true;
        Posted* p = it->second;
        if (p->bytes != recvs[j].bytes)
          fail(str(where(op), ": rank ", recv_keys[j].src, " sends ", p->bytes, " bytes, this rank expects ",
                   recvs[j].bytes));
        W.mailbox.erase(it);
        p->state = 1;
        lock.unlock();
        if (p->bytes) std::memcpy(recvs[j].data, p->data, static_cast<size_t>(p->bytes));
        lock.lock();
        p->state = 2;
        received[j] = 1;
        W.wake_locked(recv_keys[j].src);
      }
    }
    std::set<int> waiting_for;
    for (size_t j = 0; j < recvs.size(); ++j)
      if (!received[j]) waiting_for.insert(recv_keys[j].src);
    for (size_t i = 0; i < posts.size(); ++i)
      if (posts[i].state != 2) waiting_for.insert(post_keys[i].dst);
    if (waiting_for.empty()) return;
    if (!W.failure.empty()) {
      const std::string msg = str(where(op), ": stopped: ", W.failure);
      withdraw();
      throw CommError(msg);
    }
    for (int r : waiting_for)
      if (W.exited[r]) fail(str(where(op), ": rank ", r, " exited without taking part"));
    if (std::chrono::steady_clock::now() >= op.deadline) {
      std::string who;
      for (int r : waiting_for) who += str(who.empty() ? "" : ", ", r);
      fail(str(where(op), ": timed out after ", W.timeout_s, " s waiting for rank", waiting_for.size() > 1 ? "s " : " ",
               who, " (dist.timeout_s)"));
    }
    // A short spin before sleeping: once the peers are in the same operation their posts and takes
    // follow within microseconds, and a sleep and wake-up costs about a hundred on a busy machine.
    const uint64_t seen = W.events[self].load(std::memory_order_relaxed);
    lock.unlock();
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (W.events[self].load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until)
      cpu_relax();
    lock.lock();
    if (W.events[self].load(std::memory_order_relaxed) == seen) W.cvs[self].wait_until(lock, op.deadline);
  }
}

}  // namespace

void run_threads(int nproc, double timeout_s, const std::function<void(Communicator&)>& fn) {
  LOCKSTEP_CHECK(nproc >= 1, "run_threads: nproc = ", nproc);
  auto world = std::make_shared<ThreadWorld>(nproc, timeout_s);
  // What the rank threads share with us; they may outlive this call when one never stops.
  struct State {
    std::function<void(Communicator&)> fn;
    std::mutex m;
    std::condition_variable cv;
    int running = 0;
    std::vector<char> finished;
    std::vector<std::exception_ptr> errors;
  };
  auto state = std::make_shared<State>();
  state->fn = fn;
  state->running = nproc;
  state->finished.assign(nproc, 0);
  state->errors.resize(nproc);
  std::vector<int> all(nproc);
  for (int r = 0; r < nproc; ++r) all[r] = r;

  std::vector<std::thread> threads;
  for (int r = 0; r < nproc; ++r) {
    threads.emplace_back([world, state, all, r] {
      std::exception_ptr error;
      try {
        Communicator comm(std::make_shared<ThreadTransport>(world, all, r, 0), std::make_shared<ProgressThread>());
        state->fn(comm);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) world->fail(r, str("rank ", r, " failed: ", what_of(error)));
      world->mark_exited(r);
      std::lock_guard lock(state->m);
      state->errors[r] = error;
      state->finished[r] = 1;
      --state->running;
      state->cv.notify_all();
    });
  }

  // Wait for every rank; once one has failed, give the others timeout_s to notice and stop.
  std::unique_lock lock(state->m);
  std::chrono::steady_clock::time_point give_up{};
  bool gave_up = false;
  while (state->running > 0) {
    state->cv.wait_for(lock, std::chrono::milliseconds(50));
    bool failed;
    {
      std::lock_guard wl(world->m);
      failed = !world->failure.empty();
    }
    const auto now = std::chrono::steady_clock::now();
    if (failed && give_up == std::chrono::steady_clock::time_point{})
      give_up = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(timeout_s + 1.0));
    if (failed && now >= give_up) {
      gave_up = true;
      break;
    }
  }
  std::string stuck;
  for (int r = 0; r < nproc; ++r) {
    if (state->finished[r])
      threads[r].join();
    else
      threads[r].detach(), stuck += str(stuck.empty() ? "" : ", ", r);
  }
  std::string failure;
  int failure_rank;
  {
    std::lock_guard wl(world->m);
    failure = world->failure;
    failure_rank = world->failure_rank;
  }
  if (failure.empty()) return;
  std::exception_ptr root = failure_rank >= 0 ? state->errors[failure_rank] : nullptr;
  lock.unlock();
  if (gave_up || !root) {
    throw CommError(
        str(failure, gave_up ? str("; rank(s) ", stuck, " did not stop within ", timeout_s + 1.0, " s") : ""));
  }
  if (nproc == 1) std::rethrow_exception(root);
  try {
    std::rethrow_exception(root);
  } catch (const CommError&) {
    throw;  // already names the rank
  } catch (const UserError& e) {
    throw UserError(str("rank ", failure_rank, ": ", e.what()));
  } catch (const NonFiniteError& e) {
    throw NonFiniteError(e.what(), true);  // every rank stops at the same step: no rank to name
  } catch (const InternalError& e) {
    throw InternalError(str("rank ", failure_rank, ": ", e.what()));
  } catch (const std::exception& e) {
    throw CommError(str("rank ", failure_rank, ": ", e.what()));
  }
}

}  // namespace lockstep
