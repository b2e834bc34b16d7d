#include "lockstep/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <thread>

#include "lockstep/comm/link_model.h"
#include "lockstep/comm/progress.h"
#include "lockstep/comm/transport.h"
#include "lockstep/core/error.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

// ---------------------------------------------------------------------------------------------
// Progress thread and handles

ProgressThread::ProgressThread() : thread_([this] { loop(); }) {}

ProgressThread::~ProgressThread() {
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<OpState> ProgressThread::post(std::function<void()> run) {
  auto op = std::make_shared<OpState>();
  op->owner = this;
  op->run = std::move(run);
  op->waited_ns = waited_ns_;
  {
    std::lock_guard lock(m_);
    queue_.push_back(op);
  }
  cv_.notify_one();
  return op;
}

void ProgressThread::execute(OpState& op) {
  std::exception_ptr error;
  try {
    op.run();
  } catch (...) {
    error = std::current_exception();
  }
  op.run = nullptr;  // drop captured buffers before waking the waiter
  {
    std::lock_guard lock(op.m);
    op.done = true;
    op.error = error;
  }
  op.cv.notify_all();
}

void ProgressThread::loop() {
  std::unique_lock lock(m_);
  for (;;) {
    cv_.wait(lock, [&] { return !running_ && (stop_ || !queue_.empty()); });
    if (queue_.empty()) return;
    std::shared_ptr<OpState> op = std::move(queue_.front());
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    execute(*op);
    lock.lock();
    running_ = false;
  }
}

bool ProgressThread::run_here(const std::shared_ptr<OpState>& op) {
  {
    std::lock_guard lock(m_);
    if (running_ || queue_.empty() || queue_.front() != op) return false;
    queue_.pop_front();
    running_ = true;
  }
  execute(*op);
  {
    std::lock_guard lock(m_);
    running_ = false;
  }
  cv_.notify_one();  // operations posted meanwhile (another thread of the rank), or the destructor
  return true;
}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    try {
      if (op_) wait();
    } catch (...) {
    }
    op_ = std::move(other.op_);
  }
  return *this;
}

Work::~Work() {
  try {
    if (op_) wait();
  } catch (...) {
  }
}

void Work::wait() {
  if (!op_) return;
  std::shared_ptr<OpState> op = std::move(op_);
  std::unique_lock lock(op->m);
  // A finished operation's progress thread may be gone (a handle can outlive its communicator):
  // only an unfinished one, whose thread is alive, is offered to run here.
  if (!op->done) {
    const auto t0 = std::chrono::steady_clock::now();
    lock.unlock();
    op->owner->run_here(op);
    lock.lock();
    op->cv.wait(lock, [&] { return op->done; });
    op->waited_ns->fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  if (op->error) std::rethrow_exception(op->error);
}

bool Work::done() const {
  if (!op_) return true;
  std::lock_guard lock(op_->m);
  return op_->done;
}

std::string Transport::where(const OpInfo& op) const {
  std::string s = str("rank ", world_rank(rank()), ": ", op.name, " over ranks [");
  for (int r = 0; r < size(); ++r) s += str(r ? ", " : "", world_rank(r));
  return s + "]";
}

// ---------------------------------------------------------------------------------------------
// The ordered reduction

namespace {

template <typename T>
inline T max_of(T acc, T x) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(acc)) return acc;  // the first NaN in rank order wins
    return (std::isnan(x) || x > acc) ? x : acc;
  } else {
    return x > acc ? x : acc;
  }
}

// out[i] = fold over r = 0..P-1 of contrib[r][i], in rank order. A tile of the running values
// stays in L1 while the contributions stream through, and is written to out only once every
// contribution to it has been read, so out may alias a contribution. Same order per element.
template <typename T>
void ordered_fold(T* out, const T* const* contrib, int P, int64_t n, ReduceOp op) {
  constexpr int64_t tile = 2048;
  alignas(64) T o[tile];
  if (op == ReduceOp::tree_sum && P > 2) {
    std::vector<T> stack(static_cast<size_t>(tree_sum_stack(P) * tile));
    std::vector<const T*> at(static_cast<size_t>(P));
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
      const int64_t m = std::min(n - i0, tile);
      for (int r = 0; r < P; ++r) at[r] = contrib[r] + i0;
      tree_sum(o, at.data(), P, m, stack.data());
      std::memcpy(out + i0, o, static_cast<size_t>(m) * sizeof(T));
    }
    return;
  }
  for (int64_t i0 = 0; i0 < n; i0 += tile) {
    const int64_t m = std::min(n - i0, tile);
    std::memcpy(o, contrib[0] + i0, static_cast<size_t>(m) * sizeof(T));
    for (int r = 1; r < P; ++r) {
      const T* c = contrib[r] + i0;
      if (op != ReduceOp::max) {
        for (int64_t i = 0; i < m; ++i) o[i] = o[i] + c[i];
      } else {
        for (int64_t i = 0; i < m; ++i) o[i] = max_of(o[i], c[i]);
      }
    }
    std::memcpy(out + i0, o, static_cast<size_t>(m) * sizeof(T));
  }
}

// Scratch of the progress thread: every operation runs there, one at a time.
char* scratch(size_t bytes) {
  thread_local std::vector<char> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

OpInfo op_info(const Transport& t, const char* name) {
  OpInfo op;
  op.name = name;
  op.deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                       std::chrono::duration<double>(t.timeout_s()));
  return op;
}

// Every step of every operation goes through here: the bytes this rank sends are counted.
// With a link model the step also completes no earlier than the model delivers its last message.
void exchange(Transport& t, const std::vector<SendSpec>& sends, const std::vector<RecvSpec>& recvs, const OpInfo& op) {
  for (const SendSpec& send : sends) t.bytes_sent += send.bytes;
  const auto start = LinkModel::Clock::now();
  t.exchange(sends, recvs, op);
  if (!t.link) return;
  const int me = t.world_rank(t.rank());
  LinkModel::Clock::time_point done = start;
  for (const SendSpec& s : sends) done = std::max(done, t.link->deliver(me, t.world_rank(s.peer), s.bytes, start));
  for (const RecvSpec& r : recvs)
    done = std::max(done, start + std::chrono::duration_cast<LinkModel::Clock::duration>(std::chrono::duration<double>(
                                      t.link->wire_seconds(t.world_rank(r.peer), me, r.bytes))));
  std::this_thread::sleep_until(done);
}

// One reduce-scatter step: block `me` (block r = [off[r], off[r+1])) of every rank's `in`, reduced
// in rank order into out (off[me+1] - off[me] elements; out may be that block of our own in).
template <typename T>
void reduce_scatter_step(Transport& t, T* out, const T* in, const std::vector<int64_t>& off, ReduceOp op,
                         const OpInfo& info) {
  const int P = t.size(), me = t.rank();
  const int64_t count = off[me + 1] - off[me];
  T* buf = reinterpret_cast<T*>(scratch(static_cast<size_t>(P * count) * sizeof(T)));
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  std::vector<const T*> contrib(P);
  for (int q = 0; q < P; ++q) {
    contrib[q] = q == me ? in + off[me] : buf + q * count;
    if (q == me) continue;
    sends.push_back({q, in + off[q], (off[q + 1] - off[q]) * int64_t(sizeof(T))});
    recvs.push_back({q, buf + q * count, count * int64_t(sizeof(T))});
  }
  exchange(t, sends, recvs, info);
  ordered_fold(out, contrib.data(), P, count, op);
}

// reduce_scatter_step over pieces (Communicator::*_pieces): chunk `me` of every rank's pieces, all
// received, combined along the canonical tree over the blocks' leaves into out.
template <typename T>
void reduce_scatter_pieces_step(Transport& t, T* out, const std::vector<const T*>& pieces,
                                const std::vector<int64_t>& off, const std::vector<int64_t>& blocks,
                                const OpInfo& info) {
  const int P = t.size(), me = t.rank();
  LOCKSTEP_CHECK(static_cast<int>(blocks.size()) == P + 1, info.name, ": ", blocks.size(), " block bounds for ", P,
                 " ranks");
  std::vector<int64_t> bounds{0};
  std::vector<int64_t> first(P + 1, 0);  // rank q's pieces are [first[q], first[q + 1]) of all
  for (int q = 0; q < P; ++q) {
    // An empty block (a rank whose values are another's: DataParallel's tp / cp replicas) has no pieces.
    const std::vector<int64_t> b = canonical_pieces(blocks.back(), blocks[q], blocks[q + 1]);
    bounds.insert(bounds.end(), b.begin() + 1, b.end());
    first[q + 1] = first[q] + static_cast<int64_t>(b.size()) - 1;
  }
  const int64_t K = first[me + 1] - first[me];
  LOCKSTEP_CHECK(static_cast<int64_t>(pieces.size()) == K, info.name, ": ", pieces.size(), " pieces given, rank ", me,
                 "'s block has ", K);
  const PieceTree tree(blocks.back(), bounds);
  const int64_t count = off[me + 1] - off[me];
  T* buf = reinterpret_cast<T*>(scratch(static_cast<size_t>(first[P] * count) * sizeof(T)));
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  std::vector<const T*> contrib(static_cast<size_t>(first[P]));
  for (int q = 0; q < P; ++q)
    for (int64_t k = 0; k < first[q + 1] - first[q]; ++k) {
      const int64_t g = first[q] + k;  // the piece's index among all
      const int tag = static_cast<int>(k);
      if (q == me) {
        contrib[g] = pieces[k] + off[me];
        continue;
      }
      contrib[g] = buf + g * count;
      recvs.push_back({q, buf + g * count, count * int64_t(sizeof(T)), tag});
    }
  for (int q = 0; q < P; ++q)
    for (int64_t k = 0; k < K && q != me; ++k)
      sends.push_back({q, pieces[k] + off[q], (off[q + 1] - off[q]) * int64_t(sizeof(T)), static_cast<int>(k)});
  exchange(t, sends, recvs, info);
  constexpr int64_t tile = 2048;
  std::vector<T> temps(static_cast<size_t>(tree.scratch_size() * tile));
  std::vector<const T*> at(contrib.size());
  for (int64_t i0 = 0; i0 < count; i0 += tile) {
    for (size_t g = 0; g < contrib.size(); ++g) at[g] = contrib[g] + i0;
    tree.sum(out + i0, at.data(), std::min(count - i0, tile), temps.data());
  }
}

// The all-gather step of all_reduce: chunk r = [off[r], off[r + 1]) of data from rank r.
template <typename T>
void all_gather_step(Transport& t, T* data, const std::vector<int64_t>& off, const OpInfo& info) {
  const int P = t.size(), me = t.rank();
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  for (int q = 0; q < P; ++q) {
    if (q == me) continue;
    sends.push_back({q, data + off[me], (off[me + 1] - off[me]) * int64_t(sizeof(T))});
    recvs.push_back({q, data + off[q], (off[q + 1] - off[q]) * int64_t(sizeof(T))});
  }
  exchange(t, sends, recvs, info);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Communicator

Communicator::Communicator(std::shared_ptr<Transport> transport, std::shared_ptr<ProgressThread> progress)
    : transport_(std::move(transport)), progress_(std::move(progress)) {}
Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

int Communicator::rank() const { return transport_->rank(); }
int Communicator::size() const { return transport_->size(); }
int Communicator::world_rank(int r) const { return transport_->world_rank(r); }
int Communicator::local_size() const { return transport_->local_size(); }
std::string Communicator::backend() const { return transport_->backend(); }
double Communicator::timeout_s() const { return transport_->timeout_s(); }
int64_t Communicator::bytes_sent() const { return transport_->bytes_sent; }
double Communicator::wait_seconds() const { return progress_->waited_seconds(); }

namespace {

// The P ranks' chunks of n elements (chunk_begin): rank r's is [off[r], off[r + 1]).
std::vector<int64_t> chunk_offsets(int64_t n, int P) {
  std::vector<int64_t> off(static_cast<size_t>(P + 1));
  for (int r = 0; r <= P; ++r) off[static_cast<size_t>(r)] = chunk_begin(n, r, P);
  return off;
}

// all_reduce: each rank's chunk reduced, then (gather) the reduced chunks all-gathered.
template <typename T>
void reduce_chunks(Transport& t, T* data, int64_t n, ReduceOp op, const OpInfo& info, bool gather) {
  const std::vector<int64_t> off = chunk_offsets(n, t.size());
  reduce_scatter_step(t, data + off[static_cast<size_t>(t.rank())], data, off, op, info);
  if (gather) all_gather_step(t, data, off, info);
}

}  // namespace

template <typename T>
Work Communicator::all_reduce_async(T* data, int64_t n, ReduceOp op) {
  if (size() == 1) return Work();
  Transport* t = transport_.get();
  return Work(progress_->post([t, data, n, op] { reduce_chunks(*t, data, n, op, op_info(*t, "all_reduce"), true); }));
}

template <typename T>
Work Communicator::reduce_scatter_in_place_async(T* data, int64_t n, ReduceOp op) {
  if (size() == 1) return Work();
  Transport* t = transport_.get();
  return Work(progress_->post(
      [t, data, n, op] { reduce_chunks(*t, data, n, op, op_info(*t, "reduce_scatter_in_place"), false); }));
}

template <typename T>
Work Communicator::all_reduce_pieces_async(T* out, std::vector<const T*> pieces, int64_t n,
                                           std::vector<int64_t> blocks) {
  Transport* t = transport_.get();
  return Work(progress_->post([t, out, pieces = std::move(pieces), n, blocks = std::move(blocks)] {
    const int P = t->size(), me = t->rank();
    const std::vector<int64_t> off = chunk_offsets(n, P);
    const OpInfo info = op_info(*t, "all_reduce_pieces");
    reduce_scatter_pieces_step(*t, out + off[me], pieces, off, blocks, info);
    if (P > 1) all_gather_step(*t, out, off, info);
  }));
}

template <typename T>
Work Communicator::reduce_scatter_pieces_async(T* out, std::vector<const T*> pieces, int64_t count,
                                               std::vector<int64_t> blocks) {
  Transport* t = transport_.get();
  return Work(progress_->post([t, out, pieces = std::move(pieces), count, blocks = std::move(blocks)] {
    const int P = t->size();
    std::vector<int64_t> off(P + 1);
    for (int r = 0; r <= P; ++r) off[r] = r * count;
    reduce_scatter_pieces_step(*t, out, pieces, off, blocks, op_info(*t, "reduce_scatter_pieces"));
  }));
}

template <typename T>
Work Communicator::reduce_scatter_async(T* out, const T* in, int64_t count, ReduceOp op) {
  Transport* t = transport_.get();
  return Work(progress_->post([t, out, in, count, op] {
    const int P = t->size();
    std::vector<int64_t> off(P + 1);
    for (int r = 0; r <= P; ++r) off[r] = r * count;
    reduce_scatter_step(*t, out, in, off, op, op_info(*t, "reduce_scatter"));
  }));
}

void all_reduce_exact(Communicator& comm, ExactSum* sums, int n) {
  const int P = comm.size();
  if (P == 1 || n == 0) return;
  const int64_t words = static_cast<int64_t>(n) * ExactSum::kWords;
  std::vector<uint64_t> mine(static_cast<size_t>(words)), all(static_cast<size_t>(words * P));
  for (int i = 0; i < n; ++i) sums[i].to_words(mine.data() + i * ExactSum::kWords);
  comm.all_gather(all.data(), mine.data(), words);
  for (int i = 0; i < n; ++i) {
    ExactSum s;
    for (int r = 0; r < P; ++r) s.merge(ExactSum::from_words(all.data() + r * words + i * ExactSum::kWords));
    sums[i] = s;
  }
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& s) {
  const int P = comm.size();
  std::vector<int64_t> lengths(static_cast<size_t>(P));
  const int64_t mine = static_cast<int64_t>(s.size());
  comm.all_gather(lengths.data(), &mine, 1);
  // Each rank's string padded to the longest: one all-gather of equal parts.
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::string padded = s, all(static_cast<size_t>(longest * P), '\0');
  padded.resize(static_cast<size_t>(longest), '\0');
  if (longest > 0) comm.all_gather(all.data(), padded.data(), longest);
  std::vector<std::string> out(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    out[static_cast<size_t>(r)] = all.substr(static_cast<size_t>(r * longest), static_cast<size_t>(lengths[r]));
  return out;
}

std::string broadcast_string(Communicator& comm, std::string s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  comm.broadcast(&n, 1, root);
  s.resize(static_cast<size_t>(n));
  if (n) comm.broadcast(s.data(), n, root);
  return s;
}

#define LOCKSTEP_INSTANTIATE(T)                                                                                     \
  template Work Communicator::all_reduce_async<T>(T*, int64_t, ReduceOp);                                           \
  template Work Communicator::reduce_scatter_in_place_async<T>(T*, int64_t, ReduceOp);                              \
  template Work Communicator::reduce_scatter_async<T>(T*, const T*, int64_t, ReduceOp);                             \
  template Work Communicator::all_reduce_pieces_async<T>(T*, std::vector<const T*>, int64_t, std::vector<int64_t>); \
  template Work Communicator::reduce_scatter_pieces_async<T>(T*, std::vector<const T*>, int64_t, std::vector<int64_t>);
LOCKSTEP_COMM_REDUCE_TYPES(LOCKSTEP_INSTANTIATE)
#undef LOCKSTEP_INSTANTIATE

Work Communicator::all_gather_bytes(void* out, const void* in, int64_t bytes) {
  Transport* t = transport_.get();
  return Work(progress_->post([t, out, in, bytes] {
    const int P = t->size(), me = t->rank();
    char* o = static_cast<char*>(out);
    if (o + me * bytes != in) std::memmove(o + me * bytes, in, static_cast<size_t>(bytes));
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      sends.push_back({q, o + me * bytes, bytes});
      recvs.push_back({q, o + q * bytes, bytes});
    }
    exchange(*t, sends, recvs, op_info(*t, "all_gather"));
  }));
}

Work Communicator::all_to_allv_bytes(void* out, std::vector<int64_t> recv_bytes, const void* in,
                                     std::vector<int64_t> send_bytes) {
  LOCKSTEP_CHECK(static_cast<int>(recv_bytes.size()) == size() && static_cast<int>(send_bytes.size()) == size(),
                 "all_to_allv: ", size(), " ranks, ", send_bytes.size(), " send counts, ", recv_bytes.size(),
                 " receive counts");
  LOCKSTEP_CHECK(recv_bytes[rank()] == send_bytes[rank()], "all_to_allv: this rank sends itself ", send_bytes[rank()],
                 " bytes but expects ", recv_bytes[rank()]);
  Transport* t = transport_.get();
  return Work(progress_->post([t, out, in, recv_bytes = std::move(recv_bytes), send_bytes = std::move(send_bytes)] {
    const int P = t->size(), me = t->rank();
    std::vector<int64_t> roff(P + 1, 0), soff(P + 1, 0);
    for (int q = 0; q < P; ++q) roff[q + 1] = roff[q] + recv_bytes[q], soff[q + 1] = soff[q] + send_bytes[q];
    char* o = static_cast<char*>(out);
    const char* i = static_cast<const char*>(in);
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      sends.push_back({q, i + soff[q], send_bytes[q]});
      recvs.push_back({q, o + roff[q], recv_bytes[q]});
    }
    std::memcpy(o + roff[me], i + soff[me], static_cast<size_t>(send_bytes[me]));
    exchange(*t, sends, recvs, op_info(*t, "all_to_all"));
  }));
}

Work Communicator::broadcast_bytes(void* data, int64_t bytes, int root) {
  LOCKSTEP_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of a group of ", size());
  Transport* t = transport_.get();
  return Work(progress_->post([t, data, bytes, root] {
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    if (t->rank() == root) {
      for (int q = 0; q < t->size(); ++q)
        if (q != root) sends.push_back({q, data, bytes});
    } else {
      recvs.push_back({root, data, bytes});
    }
    exchange(*t, sends, recvs, op_info(*t, "broadcast"));
  }));
}

Work Communicator::send_bytes(const void* data, int64_t bytes, int peer, int tag) {
  LOCKSTEP_CHECK(peer >= 0 && peer < size() && peer != rank(), "send: bad peer ", peer);
  Transport* t = transport_.get();
  return Work(progress_->post([t, data, bytes, peer, tag] {
    OpInfo op = op_info(*t, "send");
    op.p2p = true, op.tag = tag;
    exchange(*t, {{peer, data, bytes}}, {}, op);
  }));
}

Work Communicator::recv_bytes(void* data, int64_t bytes, int peer, int tag) {
  LOCKSTEP_CHECK(peer >= 0 && peer < size() && peer != rank(), "recv: bad peer ", peer);
  Transport* t = transport_.get();
  return Work(progress_->post([t, data, bytes, peer, tag] {
    OpInfo op = op_info(*t, "recv");
    op.p2p = true, op.tag = tag;
    exchange(*t, {}, {{peer, data, bytes}}, op);
  }));
}

Work Communicator::send_recv_bytes(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                                   int src, int tag) {
  LOCKSTEP_CHECK(dst >= 0 && dst < size() && dst != rank() && src >= 0 && src < size() && src != rank(),
                 "send_recv: bad peers ", dst, ", ", src);
  Transport* t = transport_.get();
  return Work(progress_->post([=] {
    OpInfo op = op_info(*t, "send_recv");
    op.p2p = true, op.tag = tag;
    exchange(*t, {{dst, send, send_bytes}}, {{src, recv, recv_bytes}}, op);
  }));
}

Work Communicator::send_recv_batch_async(const std::vector<Message>& sends, const std::vector<Message>& recvs) {
  std::vector<SendSpec> s;
  std::vector<RecvSpec> r;
  for (const Message& m : sends) {
    LOCKSTEP_CHECK(m.peer >= 0 && m.peer < size() && m.peer != rank() && m.tag >= 0, "send_recv_batch: bad peer ",
                   m.peer);
    s.push_back({m.peer, m.data, m.bytes, m.tag});
  }
  for (const Message& m : recvs) {
    LOCKSTEP_CHECK(m.peer >= 0 && m.peer < size() && m.peer != rank() && m.tag >= 0, "send_recv_batch: bad peer ",
                   m.peer);
    r.push_back({m.peer, m.data, m.bytes, m.tag});
  }
  Transport* t = transport_.get();
  return Work(progress_->post([t, s = std::move(s), r = std::move(r)] {
    OpInfo op = op_info(*t, "send_recv_batch");
    op.p2p = true;
    exchange(*t, s, r, op);
  }));
}

Work Communicator::barrier_async() {
  if (size() == 1) return Work();
  Transport* t = transport_.get();
  return Work(progress_->post([t] {
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    for (int q = 0; q < t->size(); ++q) {
      if (q == t->rank()) continue;
      sends.push_back({q, nullptr, 0});
      recvs.push_back({q, nullptr, 0});
    }
    exchange(*t, sends, recvs, op_info(*t, "barrier"));
  }));
}

Communicator Communicator::split(int color, int key) {
  std::shared_ptr<Transport> sub;
  Transport* t = transport_.get();
  Work(progress_->post([t, color, key, &sub] {
    const int P = t->size(), me = t->rank();
    std::vector<int32_t> all(2 * P);
    all[2 * me] = color, all[2 * me + 1] = key;
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      sends.push_back({q, &all[2 * me], 2 * sizeof(int32_t)});
      recvs.push_back({q, &all[2 * q], 2 * sizeof(int32_t)});
    }
    exchange(*t, sends, recvs, op_info(*t, "split"));
    std::vector<int> members;
    for (int q = 0; q < P; ++q)
      if (all[2 * q] == color) members.push_back(q);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
    sub = t->subgroup(color, key, members);
    sub->link = t->link;
  })).wait();
  return Communicator(std::move(sub), progress_);
}

void Communicator::set_link_model(std::shared_ptr<LinkModel> link) { transport_->link = std::move(link); }
LinkModel* Communicator::link_model() const { return transport_->link.get(); }

Communicator Communicator::split_groups(const std::vector<std::vector<int>>& groups) {
  int color = -1, key = -1;
  std::vector<int> seen(size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const int r = groups[g][i];
      LOCKSTEP_CHECK(r >= 0 && r < size() && !seen[r]++, "split_groups: rank ", r, " is out of range or listed twice");
      if (r == rank()) color = static_cast<int>(g), key = static_cast<int>(i);
    }
  }
  LOCKSTEP_CHECK(color >= 0, "split_groups: rank ", rank(), " is in no group");
  return split(color, key);
}

}  // namespace lockstep
