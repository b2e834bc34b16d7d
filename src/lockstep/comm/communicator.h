// The communicator: collectives and point-to-point messages among the ranks of a group.
//
// One class for every backend. A backend (comm/transport.h: `threads`, every rank a thread of one
// process; `mpi`, one process per rank) only moves bytes between ranks; every reduction is done
// here, by the same code on every backend:
//
//   reduce_scatter = all-to-all of the blocks + a local sum of the P contributions in rank order
//   all_reduce     = reduce_scatter over P contiguous chunks + all_gather of the reduced chunks
//
// Determinism: element i of a sum is ((x_0 + x_1) + x_2) + ... + x_{P-1}, x_r being the
// contribution of group rank r, whatever the backend, the transport's algorithm, the chunking or
// the order in which messages arrive. The same inputs therefore give the same bits on `threads`
// and `mpi` (checked by tests), and equal the serial left fold over ranks. Max returns the first
// NaN in rank order if any contribution is NaN, else the largest value (+0 and -0 compare equal;
// the one of the lowest rank wins). tree_sum sums the P contributions along the canonical tree over
// ranks instead (core/tree_sum.h: split at the largest power of two below P), the cross-rank part
// of determinism = "layout"'s micro-batch tree; it equals sum for P <= 2. The *_pieces forms are
// that tree when the ranks' blocks of leaves are not whole subtrees: each rank contributes its
// block's canonical pieces, combined along the canonical tree over all leaves.
//
// Asynchrony: every operation has an `_async` form that returns a Work handle at once; the
// operation runs on the rank's progress thread (one per rank, shared by the rank's groups) while
// the caller computes, and Work::wait() blocks until it is done (rethrowing its error). Buffers
// must stay untouched until then. A rank's operations run in the order it posted them, so ranks
// must post operations on overlapping groups in the same order. The blocking form = async + wait.
//
// Failures: every operation has a deadline (dist.timeout_s from its start). A peer that does not
// arrive in time, that failed, or that exited makes the operation throw CommError naming this rank,
// the operation, the group and the peer at fault; under the threads backend the failure is also
// announced to every other rank so that all of them stop, not only the neighbours of the fault.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace lockstep {

class Transport;
class ProgressThread;
class LinkModel;
struct OpState;

// A distributed failure: timeout, failed or exited peer. The message names the rank, the operation
// and the peer.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& msg) : std::runtime_error(msg) {}
};

// The exit status of a process that ends on a CommError (a rank failed: timeout, failed or exited
// peer), which `lockstep train --max-restarts` and `lockstep launch` restart (docs/faults.md).
// 75 is sysexits.h's EX_TEMPFAIL: a temporary failure, worth retrying.
constexpr int kExitRankFailure = 75;

enum class ReduceOp { sum, max, tree_sum };

// Handle of an asynchronous operation. wait() blocks until the operation is complete and rethrows
// its error; a handle destroyed without wait() waits (and drops the error: the failure has already
// been announced to the group and the next operation reports it).
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<OpState> op) : op_(std::move(op)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&& other) noexcept;
  ~Work();
  void wait();
  bool done() const;

 private:
  std::shared_ptr<OpState> op_;
};

class Communicator {
 public:
  // A communicator over every rank of a transport (the world, or a group made by split()).
  Communicator(std::shared_ptr<Transport> transport, std::shared_ptr<ProgressThread> progress);
  ~Communicator();
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;

  int rank() const;
  int size() const;
  // The world rank of group rank r (the rank in the job), for messages and fingerprints.
  int world_rank(int r) const;
  int local_size() const;       // ranks of the job on this machine (to share its cores)
  std::string backend() const;  // "threads" | "mpi"
  double timeout_s() const;
  // Bytes this rank has sent to the other ranks of this group so far (every operation, every
  // backend: what the algorithms above move, e.g. 2 (P - 1) / P x n elements for an all-reduce of
  // n). Read it while none of the group's operations is in flight.
  int64_t bytes_sent() const;
  // Seconds this rank has spent blocked waiting for operations (Work::wait, the blocking forms
  // included): the operation's own work when it runs on the caller's thread, and waiting for
  // peers. One counter per rank, shared by all its groups; summed over the rank's waiting threads.
  double wait_seconds() const;

  // The wire model of this rank's operations (comm/link_model.h; this group's and every group split
  // from it afterwards). Set before any operation is in flight.
  void set_link_model(std::shared_ptr<LinkModel> link);
  LinkModel* link_model() const;

  // Collective over this group: every rank with the same color forms a new group, ordered by key
  // (ties by rank). Megatron's groups: see comm/mesh.h and split_groups().
  Communicator split(int color, int key);
  // Collective over this group: the group of `groups` (lists of ranks of this group) that holds
  // this rank, its ranks in list order. Every rank must be in exactly one list.
  Communicator split_groups(const std::vector<std::vector<int>>& groups);

  // data (n) <- reduction over ranks of data (n).
  template <typename T>
  void all_reduce(T* data, int64_t n, ReduceOp op = ReduceOp::sum) {
    all_reduce_async(data, n, op).wait();
  }
  template <typename T>
  Work all_reduce_async(T* data, int64_t n, ReduceOp op = ReduceOp::sum);
  // all_reduce without its all-gather: on rank r, chunk r of data ([chunk_begin(n, r, P), chunk_begin(n, r + 1, P)),
  // core/thread_pool.h) <- the reduction over ranks of chunk r of data; the other chunks are left as they were.
  template <typename T>
  void reduce_scatter_in_place(T* data, int64_t n, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_in_place_async(data, n, op).wait();
  }
  template <typename T>
  Work reduce_scatter_in_place_async(T* data, int64_t n, ReduceOp op = ReduceOp::sum);
  // out (count) <- reduction over ranks of block `rank` of in (size * count).
  template <typename T>
  void reduce_scatter(T* out, const T* in, int64_t count, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(out, in, count, op).wait();
  }
  template <typename T>
  Work reduce_scatter_async(T* out, const T* in, int64_t count, ReduceOp op = ReduceOp::sum);
  // determinism = "layout" when the ranks' blocks of leaves are not subtrees (core/tree_sum.h): the
  // canonical tree over blocks.back() leaves, rank r holding leaves [blocks[r], blocks[r + 1]) as
  // the sums of its block's K_r canonical pieces (canonical_pieces; pieces[k], k < K_r, each laid
  // out as the plain form's input). Every rank computes the same PieceTree over all ranks' pieces
  // and receives all of them for its chunk (an all-to-all of K_r times the bytes: sum's
  // reduce-scatter step sends (P - 1) / P x n elements per rank, this one K_r times that), so the
  // result is bitwise the tree over all leaves, and equals tree_sum when every K_r is 1 and the
  // blocks are equal. out may be one of the pieces (the rank's last, typically). A rank may hold an
  // empty block (blocks[r] == blocks[r + 1]): it gives no pieces and receives the sum all the same.
  template <typename T>
  void all_reduce_pieces(T* out, const std::vector<const T*>& pieces, int64_t n, const std::vector<int64_t>& blocks) {
    all_reduce_pieces_async(out, pieces, n, blocks).wait();
  }
  template <typename T>
  Work all_reduce_pieces_async(T* out, std::vector<const T*> pieces, int64_t n, std::vector<int64_t> blocks);
  template <typename T>
  void reduce_scatter_pieces(T* out, const std::vector<const T*>& pieces, int64_t count,
                             const std::vector<int64_t>& blocks) {
    reduce_scatter_pieces_async(out, pieces, count, blocks).wait();
  }
  template <typename T>
  Work reduce_scatter_pieces_async(T* out, std::vector<const T*> pieces, int64_t count, std::vector<int64_t> blocks);
  // out (size * count): block r <- in (count) of rank r.
  template <typename T>
  void all_gather(T* out, const T* in, int64_t count) {
    all_gather_async(out, in, count).wait();
  }
  template <typename T>
  Work all_gather_async(T* out, const T* in, int64_t count) {
    return all_gather_bytes(out, in, count * int64_t(sizeof(T)));
  }
  // out (size * count): block r <- block `rank` of in (size * count) of rank r.
  template <typename T>
  void all_to_all(T* out, const T* in, int64_t count) {
    all_to_all_async(out, in, count).wait();
  }
  template <typename T>
  Work all_to_all_async(T* out, const T* in, int64_t count) {
    return all_to_allv_bytes(out, std::vector<int64_t>(size(), count * int64_t(sizeof(T))), in,
                             std::vector<int64_t>(size(), count * int64_t(sizeof(T))));
  }
  // Variable sizes: in holds send_counts[r] elements for rank r, back to back; out receives
  // recv_counts[r] elements from rank r, back to back. recv_counts must match what the peers send
  // (exchange counts first with all_to_all when they are not known).
  template <typename T>
  void all_to_allv(T* out, const std::vector<int64_t>& recv_counts, const T* in,
                   const std::vector<int64_t>& send_counts) {
    all_to_allv_async(out, recv_counts, in, send_counts).wait();
  }
  template <typename T>
  Work all_to_allv_async(T* out, const std::vector<int64_t>& recv_counts, const T* in,
                         const std::vector<int64_t>& send_counts) {
    return all_to_allv_bytes(out, scaled(recv_counts, sizeof(T)), in, scaled(send_counts, sizeof(T)));
  }
  // data (n) <- data of rank root.
  template <typename T>
  void broadcast(T* data, int64_t n, int root) {
    broadcast_async(data, n, root).wait();
  }
  template <typename T>
  Work broadcast_async(T* data, int64_t n, int root) {
    return broadcast_bytes(data, n * int64_t(sizeof(T)), root);
  }
  // Point to point; messages between two ranks with the same tag arrive in the order sent. A send
  // completes when the peer receives it, and a rank runs one operation at a time: a rank that
  // both sends and receives (a ring, a pipeline exchange) uses send_recv, which does both at once.
  template <typename T>
  void send(const T* data, int64_t n, int peer, int tag = 0) {
    send_async(data, n, peer, tag).wait();
  }
  template <typename T>
  Work send_async(const T* data, int64_t n, int peer, int tag = 0) {
    return send_bytes(data, n * int64_t(sizeof(T)), peer, tag);
  }
  template <typename T>
  void recv(T* data, int64_t n, int peer, int tag = 0) {
    recv_async(data, n, peer, tag).wait();
  }
  template <typename T>
  Work recv_async(T* data, int64_t n, int peer, int tag = 0) {
    return recv_bytes(data, n * int64_t(sizeof(T)), peer, tag);
  }
  template <typename T>
  void send_recv(const T* send, int64_t send_n, int dst, T* recv, int64_t recv_n, int src, int tag = 0) {
    send_recv_async(send, send_n, dst, recv, recv_n, src, tag).wait();
  }
  template <typename T>
  Work send_recv_async(const T* send, int64_t send_n, int dst, T* recv, int64_t recv_n, int src, int tag = 0) {
    return send_recv_bytes(send, send_n * int64_t(sizeof(T)), dst, recv, recv_n * int64_t(sizeof(T)), src, tag);
  }
  // Several point-to-point messages posted together (Megatron's batch_isend_irecv): the operation
  // completes when every one has; each is matched by (peer, tag, order sent) like send / recv. A
  // pipeline stage that sends to and receives from its neighbours in one batch cannot deadlock the
  // way one blocking send after another can.
  struct Message {
    int peer;
    int tag;
    void* data;  // read by a send
    int64_t bytes;
  };
  Work send_recv_batch_async(const std::vector<Message>& sends, const std::vector<Message>& recvs);
  void barrier() { barrier_async().wait(); }
  Work barrier_async();

 private:
  static std::vector<int64_t> scaled(const std::vector<int64_t>& counts, size_t elem) {
    std::vector<int64_t> b(counts.size());
    for (size_t i = 0; i < counts.size(); ++i) b[i] = counts[i] * int64_t(elem);
    return b;
  }
  Work all_gather_bytes(void* out, const void* in, int64_t bytes);
  Work all_to_allv_bytes(void* out, std::vector<int64_t> recv_bytes, const void* in, std::vector<int64_t> send_bytes);
  Work broadcast_bytes(void* data, int64_t bytes, int root);
  Work send_bytes(const void* data, int64_t bytes, int peer, int tag);
  Work recv_bytes(void* data, int64_t bytes, int peer, int tag);
  Work send_recv_bytes(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes, int src, int tag);

  std::shared_ptr<Transport> transport_;
  std::shared_ptr<ProgressThread> progress_;
};

class ExactSum;
// sums[0, n) <- each the exact sum of the group's accumulators (core/exact_sum.h): an all-gather of
// their words, merged by integer addition, so every rank gets the same bits whatever the group's
// size or order (determinism = "layout"'s scalar sums).
void all_reduce_exact(Communicator& comm, ExactSum* sums, int n);

// Strings (metadata, reports; never tensor data): every rank's s, in rank order, on every rank;
// and root's s on every rank.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& s);
std::string broadcast_string(Communicator& comm, std::string s, int root = 0);

// Reductions are defined for these element types (explicit instantiations in communicator.cpp).
#define LOCKSTEP_COMM_REDUCE_TYPES(X) X(float) X(double) X(int32_t) X(int64_t) X(uint64_t)

}  // namespace lockstep
