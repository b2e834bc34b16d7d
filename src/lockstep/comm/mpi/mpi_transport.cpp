#include "lockstep/comm/mpi/mpi_transport.h"

#include <mpi.h>

#include <climits>
#include <cstdio>
#include <set>
#include <thread>

#include "lockstep/comm/progress.h"
#include "lockstep/comm/transport.h"
#include "lockstep/core/error.h"

namespace lockstep {

namespace {

constexpr int kCollectiveTag = 1;

class MpiTransport final : public Transport {
 public:
  // Takes ownership of coll (collective steps); p2p messages get a duplicate of it, so that a
  // user's tags can never match a collective step.
  MpiTransport(MPI_Comm coll, std::vector<int> world_ranks, int local_size, double timeout_s)
      : coll_(coll), world_ranks_(std::move(world_ranks)), local_size_(local_size), timeout_s_(timeout_s) {
    MPI_Comm_rank(coll_, &rank_);
    MPI_Comm_size(coll_, &size_);
    MPI_Comm_dup(coll_, &p2p_);
  }
  ~MpiTransport() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_free(&p2p_);
      MPI_Comm_free(&coll_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override { return world_ranks_[r]; }
  int local_size() const override { return local_size_; }
  const char* backend() const override { return "mpi"; }
  double timeout_s() const override { return timeout_s_; }

  std::shared_ptr<Transport> subgroup(int color, int key, const std::vector<int>& members) override {
    // MPI orders the new group by key, then by rank: the order `members` is in.
    MPI_Comm sub;
    MPI_Comm_split(coll_, color, key, &sub);
    std::vector<int> world(members.size());
    for (size_t i = 0; i < members.size(); ++i) world[i] = world_ranks_[members[i]];
    return std::make_shared<MpiTransport>(sub, std::move(world), local_size_, timeout_s_);
  }

  void exchange(const std::vector<SendSpec>& sends, const std::vector<RecvSpec>& recvs, const OpInfo& op) override {
    const MPI_Comm comm = op.p2p ? p2p_ : coll_;
    const int tag = op.p2p ? op.tag : kCollectiveTag;
    const size_t n = recvs.size() + sends.size();
    std::vector<MPI_Request> reqs(n);
    std::vector<int> peer(n);
    for (size_t j = 0; j < recvs.size(); ++j) {
      LOCKSTEP_CHECK(recvs[j].bytes <= INT_MAX, op.name, ": messages above 2 GiB are not supported");
      MPI_Irecv(recvs[j].data, static_cast<int>(recvs[j].bytes), MPI_BYTE, recvs[j].peer, tag + recvs[j].tag, comm,
                &reqs[j]);
      peer[j] = recvs[j].peer;
    }
    for (size_t i = 0; i < sends.size(); ++i) {
      LOCKSTEP_CHECK(sends[i].bytes <= INT_MAX, op.name, ": messages above 2 GiB are not supported");
      const size_t k = recvs.size() + i;
      // MPI's C API takes a non-const buffer for sends it never writes.
      MPI_Isend(const_cast<void*>(sends[i].data), static_cast<int>(sends[i].bytes), MPI_BYTE, sends[i].peer,
                tag + sends[i].tag, comm, &reqs[k]);
      peer[k] = sends[i].peer;
    }
    std::vector<int> indices(n);
    std::vector<MPI_Status> statuses(n);
    size_t remaining = n;
    auto idle_since = std::chrono::steady_clock::now();
    while (remaining > 0) {
      int done = 0;
      MPI_Testsome(static_cast<int>(n), reqs.data(), &done, indices.data(), statuses.data());
      if (done == MPI_UNDEFINED) break;
      for (int d = 0; d < done; ++d) {
        const int k = indices[d];
        if (static_cast<size_t>(k) < recvs.size()) {
          int got = 0;
          MPI_Get_count(&statuses[d], MPI_BYTE, &got);
          if (got != recvs[k].bytes)
            throw CommError(str(where(op), ": rank ", world_ranks_[peer[k]], " sent ", got,
                                " bytes, this rank expects ", recvs[k].bytes));
        }
      }
      remaining -= static_cast<size_t>(done);
      const auto now = std::chrono::steady_clock::now();
      if (done > 0) idle_since = now;
      if (remaining == 0) break;
      if (now >= op.deadline) {
        std::set<int> waiting_for;
        for (size_t k = 0; k < n; ++k)
          if (reqs[k] != MPI_REQUEST_NULL) waiting_for.insert(world_ranks_[peer[k]]);
        std::string who;
        for (int r : waiting_for) who += str(who.empty() ? "" : ", ", r);
        throw CommError(str(where(op), ": timed out after ", timeout_s_, " s waiting for rank",
                            waiting_for.size() > 1 ? "s " : " ", who, " (dist.timeout_s)"));
      }
      // Spin while messages flow (MPI progresses inside the test calls); back off when idle.
      if (now - idle_since > std::chrono::milliseconds(20)) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  MPI_Comm coll_, p2p_;
  std::vector<int> world_ranks_;
  int rank_ = 0, size_ = 1, local_size_ = 1;
  double timeout_s_;
};

}  // namespace

void run_mpi(int expected_size, double timeout_s, const std::function<void(Communicator&)>& fn) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  // The progress thread makes every MPI call between init and finalize (MPI_Abort aside).
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    if (provided < MPI_THREAD_SERIALIZED)
      user_error(
          "this MPI library does not support calls from a thread other than the main one (MPI_THREAD_SERIALIZED)");
    if (expected_size > 0 && expected_size != size)
      user_error("--nproc ", expected_size, " under mpirun with ", size,
                 " processes: each mpirun process is one rank (drop --nproc or make them agree)");
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int local = 1;
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
    MPI_Comm world;
    MPI_Comm_dup(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(size);
    for (int r = 0; r < size; ++r) ranks[r] = r;
    {
      Communicator comm(std::make_shared<MpiTransport>(world, std::move(ranks), local, timeout_s),
                        std::make_shared<ProgressThread>());
      fn(comm);
    }
  } catch (const std::exception& e) {
    if (size == 1) {
      MPI_Finalize();
      throw;
    }
    const bool user = dynamic_cast<const UserError*>(&e) != nullptr;
    const std::string msg = dynamic_cast<const CommError*>(&e) ? e.what() : str("rank ", rank, ": ", e.what());
    std::fprintf(stderr, "lockstep: error: %s\n", msg.c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, user ? 2 : dynamic_cast<const CommError*>(&e) ? kExitRankFailure : 1);
  }
  MPI_Finalize();
}

}  // namespace lockstep
