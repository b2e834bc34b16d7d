// One run of every collective on a communicator, checked against a serial reference computed on
// each rank from every rank's (deterministic) inputs. Shared by the threads tests (test_comm.cpp)
// and the MPI test program (mpi/test_comm_mpi.cpp), which also compares the hash of all outputs
// between the two backends: same inputs, same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/core/error.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep::testing {

struct SuiteResult {
  uint64_t hash = 0;                  // of every output, in order
  std::vector<std::string> failures;  // empty when every check passed
};

// n normal values of rank r for the check `what`.
inline std::vector<float> rank_values(int r, int64_t n, const std::string& what) {
  std::vector<float> v(static_cast<size_t>(n));
  RandomStream(1000 + static_cast<uint64_t>(r), purpose_id(what)).fill_normal(v.data(), n, 1.0f);
  return v;
}

// A value that says where it came from: (src, dst, i).
inline float tagged(int src, int dst, int64_t i) { return static_cast<float>(src * 1000000 + dst * 10000 + i); }

inline SuiteResult run_comm_suite(Communicator& comm) {
  const int P = comm.size(), me = comm.rank();
  SuiteResult res;
  Hasher h;
  auto fail = [&](const std::string& what) { res.failures.push_back(str("rank ", me, " of ", P, ": ", what)); };
  auto same_bits = [&](const float* got, const float* want, int64_t n, const std::string& what) {
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(&got[i], &want[i], sizeof(float))) {
        fail(str(what, ": element ", i, " is ", got[i], ", expected ", want[i]));
        return;
      }
  };

  for (const int64_t n : {int64_t(1), int64_t(7), int64_t(1000), int64_t(40000)}) {
    // all_reduce sum: the rank-order fold, bit for bit, and close to the exact sum.
    std::vector<float> data = rank_values(me, n, "sum");
    comm.all_reduce(data.data(), n);
    std::vector<float> fold = rank_values(0, n, "sum");
    std::vector<double> exact(fold.begin(), fold.end());
    for (int r = 1; r < P; ++r) {
      const std::vector<float> x = rank_values(r, n, "sum");
      for (int64_t i = 0; i < n; ++i) fold[i] = fold[i] + x[i], exact[i] += x[i];
    }
    same_bits(data.data(), fold.data(), n, str("all_reduce sum n=", n));
    // reduce_scatter_in_place sum: this rank's chunk is the rank-order fold, the rest as it was.
    {
      const std::vector<float> mine = rank_values(me, n, "sum");
      std::vector<float> in_place = mine;
      comm.reduce_scatter_in_place(in_place.data(), n);
      const int64_t c0 = chunk_begin(n, me, P), c1 = chunk_begin(n, me + 1, P);
      same_bits(in_place.data(), mine.data(), c0, str("reduce_scatter_in_place sum n=", n, ": before the chunk"));
      same_bits(in_place.data() + c0, fold.data() + c0, c1 - c0, str("reduce_scatter_in_place sum n=", n));
      same_bits(in_place.data() + c1, mine.data() + c1, n - c1,
                str("reduce_scatter_in_place sum n=", n, ": after the chunk"));
      h.update(in_place.data() + c0, static_cast<size_t>(c1 - c0) * sizeof(float));
    }
    for (int64_t i = 0; i < n; ++i)
      if (std::abs(data[i] - exact[i]) > 1e-5 * P * (1 + std::abs(exact[i]))) {
        fail(str("all_reduce sum n=", n, ": element ", i, " is ", data[i], ", exact sum ", exact[i]));
        break;
      }
    h.update(data.data(), data.size() * sizeof(float));

    // all_reduce max, with a NaN from the last rank at element 0 when n > 1.
    std::vector<float> mx = rank_values(me, n, "max");
    if (n > 1 && me == P - 1) mx[0] = std::nanf("");
    comm.all_reduce(mx.data(), n, ReduceOp::max);
    std::vector<float> maxima(n, -INFINITY);
    for (int r = 0; r < P; ++r) {
      const std::vector<float> x = rank_values(r, n, "max");
      for (int64_t i = 0; i < n; ++i) maxima[i] = std::max(maxima[i], x[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float want = maxima[i];
      if (n > 1 && i == 0) {
        if (!std::isnan(mx[0])) fail(str("all_reduce max n=", n, ": a NaN contribution did not propagate"));
      } else if (mx[i] != want) {
        fail(str("all_reduce max n=", n, ": element ", i, " is ", mx[i], ", expected ", want));
        break;
      }
    }
    h.update(mx.data() + 1, (n - 1) * sizeof(float));

    // reduce_scatter: block `me` of the rank-order fold.
    std::vector<float> in = rank_values(me, n * P, "rs"), out(n);
    comm.reduce_scatter(out.data(), in.data(), n);
    std::vector<float> want = rank_values(0, n * P, "rs");
    for (int r = 1; r < P; ++r) {
      const std::vector<float> x = rank_values(r, n * P, "rs");
      for (int64_t i = 0; i < n * P; ++i) want[i] = want[i] + x[i];
    }
    same_bits(out.data(), want.data() + me * n, n, str("reduce_scatter n=", n));
    h.update(out.data(), out.size() * sizeof(float));

    // tree_sum: the canonical tree over ranks (core/tree_sum.h), by all_reduce and reduce_scatter
    // (over c x P >= n elements: the serial reference costs P leaves of that on every rank).
    {
      const int64_t c = n / P + 1, total = c * P;
      std::vector<std::vector<float>> xs;
      std::vector<const float*> leaves;
      for (int r = 0; r < P; ++r) xs.push_back(rank_values(r, total, "tree"));
      for (const auto& x : xs) leaves.push_back(x.data());
      std::vector<float> tree(total), stack(tree_sum_stack(P) * total + 1);
      tree_sum(tree.data(), leaves.data(), P, total, stack.data());
      std::vector<float> reduced = xs[me], chunk(c);
      comm.all_reduce(reduced.data(), total, ReduceOp::tree_sum);
      same_bits(reduced.data(), tree.data(), total, str("all_reduce tree_sum n=", total));
      comm.reduce_scatter(chunk.data(), xs[me].data(), c, ReduceOp::tree_sum);
      same_bits(chunk.data(), tree.data() + me * c, c, str("reduce_scatter tree_sum n=", c));
      h.update(chunk.data(), chunk.size() * sizeof(float));
      // In place over n elements (chunks of unequal sizes when P does not divide n): this rank's
      // chunk is the tree, the other chunks are left as they were.
      std::vector<float> in_place = xs[me];
      comm.reduce_scatter_in_place(in_place.data(), n, ReduceOp::tree_sum);
      const int64_t c0 = chunk_begin(n, me, P), c1 = chunk_begin(n, me + 1, P);
      same_bits(in_place.data(), xs[me].data(), c0, str("reduce_scatter_in_place n=", n, ": before the chunk"));
      same_bits(in_place.data() + c0, tree.data() + c0, c1 - c0, str("reduce_scatter_in_place tree_sum n=", n));
      same_bits(in_place.data() + c1, xs[me].data() + c1, total - c1,
                str("reduce_scatter_in_place n=", n, ": after the chunk"));
      h.update(in_place.data() + c0, static_cast<size_t>(c1 - c0) * sizeof(float));
    }

    // The *_pieces forms: leaves in blocks that are not subtrees (3 per rank; 1, 2, 3, 1, 2, 3, ...;
    // 2, 0, 2, 0, ...: every odd rank an empty block, as DataParallel's replicas that hold another
    // rank's values), each rank's block as its canonical pieces' tree sums, give every rank the
    // canonical tree over all leaves, bit for bit, as all_reduce and reduce_scatter.
    for (const int shape : {0, 1, 2}) {
      if (n > 1000) break;  // the serial reference costs every leaf on every rank
      std::vector<int64_t> blocks{0};
      for (int r = 0; r < P; ++r)
        blocks.push_back(blocks.back() + (shape == 0 ? 3 : shape == 1 ? r % 3 + 1 : 2 - 2 * (r % 2)));
      const int64_t L = blocks.back(), c = n / P + 1, total = c * P;
      std::vector<std::vector<float>> xs;
      std::vector<const float*> leaves;
      for (int64_t l = 0; l < L; ++l) xs.push_back(rank_values(static_cast<int>(l), total, "pieces"));
      for (const auto& x : xs) leaves.push_back(x.data());
      std::vector<float> stack(tree_sum_stack(L) * total + 1);
      auto tree = [&](int64_t a, int64_t b) {  // the canonical tree over leaves [a, b)
        std::vector<float> t(total);
        tree_sum(t.data(), leaves.data() + a, b - a, total, stack.data());
        return t;
      };
      const std::vector<float> want = tree(0, L);
      const bool empty = blocks[me] == blocks[me + 1];
      const std::vector<int64_t> bounds = canonical_pieces(L, blocks[me], blocks[me + 1]);
      std::vector<std::vector<float>> mine;
      std::vector<const float*> pieces;
      for (size_t k = 0; k + 1 < bounds.size(); ++k) mine.push_back(tree(bounds[k], bounds[k + 1]));
      for (const auto& m : mine) pieces.push_back(m.data());
      const char* shapes[] = {"3 leaves per rank", "1, 2, 3 leaves", "2, 0, 2, 0 leaves"};
      const std::string what = str(" (", shapes[shape], ") n=", total);
      std::vector<float> chunk(c);
      const int64_t sent = comm.bytes_sent();
      comm.reduce_scatter_pieces(chunk.data(), pieces, c, blocks);
      same_bits(chunk.data(), want.data() + me * c, c, "reduce_scatter_pieces" + what);
      // The wire: each of the rank's K pieces' chunks to every other rank.
      const int64_t K = static_cast<int64_t>(bounds.size()) - 1;
      if (comm.bytes_sent() - sent != K * (P - 1) * c * int64_t(sizeof(float)))
        fail(str("reduce_scatter_pieces", what, ": sent ", comm.bytes_sent() - sent, " bytes, expected ", K, " x ",
                 P - 1, " x ", c, " floats"));
      // Into the last piece, or (an empty block) a buffer of the rank's own.
      std::vector<float> all(empty ? total : 0);
      float* out = empty ? all.data() : mine.back().data();
      comm.all_reduce_pieces(out, pieces, total, blocks);
      same_bits(out, want.data(), total, "all_reduce_pieces" + what);
      h.update(chunk.data(), chunk.size() * sizeof(float));
    }

    // all_reduce_exact: every rank gets the exact sum of all ranks' values, the same bits as one
    // accumulator fed every value in another order (last rank first, elements backwards).
    {
      ExactSum sums[2];
      const std::vector<float> x = rank_values(me, n, "exact");
      for (int64_t i = 0; i < n; ++i) sums[i % 2].add(x[i]), sums[1].add(double(x[i]) * 1e-30);
      all_reduce_exact(comm, sums, 2);
      ExactSum want[2];
      for (int r = P - 1; r >= 0; --r) {
        const std::vector<float> y = rank_values(r, n, "exact");
        for (int64_t i = n - 1; i >= 0; --i) want[i % 2].add(y[i]), want[1].add(double(y[i]) * 1e-30);
      }
      for (int k = 0; k < 2; ++k) {
        const double got = sums[k].value(), expected = want[k].value();
        if (std::memcmp(&got, &expected, sizeof got))
          fail(str("all_reduce_exact n=", n, " sum ", k, ": ", got, ", expected ", expected));
        h.update(&got, sizeof got);
      }
    }

    // all_gather
    std::vector<float> mine = rank_values(me, n, "ag"), all(n * P);
    comm.all_gather(all.data(), mine.data(), n);
    for (int r = 0; r < P; ++r)
      same_bits(all.data() + r * n, rank_values(r, n, "ag").data(), n, str("all_gather n=", n));
    h.update(all.data(), all.size() * sizeof(float));
  }

  // Strings: ranks' strings of different lengths (rank 0's empty, one with a NUL inside) on every
  // rank in rank order, and a broadcast from the last rank.
  {
    auto text = [](int r) {
      return r == 0 ? std::string() : std::string(static_cast<size_t>(3 * r), 'a' + r) + '\0' + "x";
    };
    const std::vector<std::string> all = all_gather_strings(comm, text(me));
    if (static_cast<int>(all.size()) != P) fail(str("all_gather_strings: ", all.size(), " strings of ", P));
    for (int r = 0; r < P && r < static_cast<int>(all.size()); ++r)
      if (all[static_cast<size_t>(r)] != text(r)) fail(str("all_gather_strings: rank ", r, "'s string differs"));
    const std::string b = broadcast_string(comm, me == P - 1 ? text(me) : "?", P - 1);
    if (b != text(P - 1)) fail("broadcast_string from the last rank differs");
    for (const std::string& x : all) h.update(x.data(), x.size());
  }

  // Other element types of the reductions.
  {
    std::vector<double> d(5);
    std::vector<int64_t> k(5);
    std::vector<uint64_t> u(2);
    for (int i = 0; i < 5; ++i) d[i] = 0.1 * (me + 1) + i, k[i] = int64_t(me) * 1000 - i;
    u[0] = uint64_t(me) << 40, u[1] = ~u[0];
    comm.all_reduce(d.data(), 5);
    comm.all_reduce(k.data(), 5);
    comm.all_reduce(u.data(), 2, ReduceOp::max);
    for (int i = 0; i < 5; ++i) {
      double dw = 0.1 + i;
      int64_t kw = 0;
      for (int r = 1; r < P; ++r) dw = dw + (0.1 * (r + 1) + i);
      for (int r = 0; r < P; ++r) kw += int64_t(r) * 1000 - i;
      if (std::memcmp(&d[i], &dw, sizeof dw) || k[i] != kw) fail(str("all_reduce double/int64: element ", i));
    }
    if (u[0] != uint64_t(P - 1) << 40 || u[1] != ~uint64_t(0)) fail("all_reduce max uint64");
    h.update(d.data(), 5 * sizeof(double));
  }

  // all_to_all and all_to_allv: every value says who sent it to whom.
  {
    const int64_t c = 3;
    std::vector<float> in(c * P), out(c * P);
    for (int q = 0; q < P; ++q)
      for (int64_t i = 0; i < c; ++i) in[q * c + i] = tagged(me, q, i);
    comm.all_to_all(out.data(), in.data(), c);
    for (int r = 0; r < P; ++r)
      for (int64_t i = 0; i < c; ++i)
        if (out[r * c + i] != tagged(r, me, i)) fail(str("all_to_all: block ", r, " element ", i));
    h.update(out.data(), out.size() * sizeof(float));

    auto count = [](int src, int dst) { return int64_t((src + 2 * dst) % 5); };
    std::vector<int64_t> sc(P), rc(P);
    std::vector<float> vin, vout;
    for (int q = 0; q < P; ++q) {
      sc[q] = count(me, q), rc[q] = count(q, me);
      for (int64_t i = 0; i < sc[q]; ++i) vin.push_back(tagged(me, q, i));
    }
    for (int r = 0; r < P; ++r) vout.resize(vout.size() + rc[r]);
    comm.all_to_allv(vout.data(), rc, vin.data(), sc);
    size_t at = 0;
    for (int r = 0; r < P; ++r)
      for (int64_t i = 0; i < rc[r]; ++i, ++at)
        if (vout[at] != tagged(r, me, i)) fail(str("all_to_allv: from rank ", r, " element ", i));
    h.update(vout.data(), vout.size() * sizeof(float));
  }

  // broadcast from every root
  for (int root = 0; root < P; ++root) {
    std::vector<float> b = me == root ? rank_values(root, 33, "bcast") : std::vector<float>(33, 0.0f);
    comm.broadcast(b.data(), 33, root);
    same_bits(b.data(), rank_values(root, 33, "bcast").data(), 33, str("broadcast from ", root));
    h.update(b.data(), b.size() * sizeof(float));
  }

  // Point to point: a ring with send_recv, then ordered messages from rank 0 to the last rank.
  if (P > 1) {
    const int next = (me + 1) % P, prev = (me + P - 1) % P;
    std::vector<float> s = rank_values(me, 17, "ring"), r(17);
    comm.send_recv(s.data(), 17, next, r.data(), 17, prev, 5);
    same_bits(r.data(), rank_values(prev, 17, "ring").data(), 17, "send_recv ring");
    h.update(r.data(), r.size() * sizeof(float));
    // One batch of sends and receives in both directions (a pipeline stage's exchange): messages
    // match by (peer, tag, order sent), whatever order the batch lists them in.
    {
      std::vector<float> to_next = rank_values(me, 23, "batch-next"), to_prev = rank_values(me, 5, "batch-prev");
      std::vector<float> first = rank_values(me, 4, "batch-first"), second = rank_values(me, 4, "batch-second");
      std::vector<float> from_prev(23), from_next(5), first_in(4), second_in(4);
      using M = Communicator::Message;
      const std::vector<M> sends = {{next, 13, first.data(), 16},
                                    {prev, 12, to_prev.data(), 20},
                                    {next, 11, to_next.data(), 92},
                                    {next, 13, second.data(), 16}};
      const std::vector<M> recvs = {{prev, 11, from_prev.data(), 92},
                                    {prev, 13, first_in.data(), 16},
                                    {next, 12, from_next.data(), 20},
                                    {prev, 13, second_in.data(), 16}};
      comm.send_recv_batch_async(sends, recvs).wait();
      same_bits(from_prev.data(), rank_values(prev, 23, "batch-next").data(), 23, "send_recv_batch from prev");
      same_bits(from_next.data(), rank_values(next, 5, "batch-prev").data(), 5, "send_recv_batch from next");
      same_bits(first_in.data(), rank_values(prev, 4, "batch-first").data(), 4, "send_recv_batch: first of one tag");
      same_bits(second_in.data(), rank_values(prev, 4, "batch-second").data(), 4, "send_recv_batch: second of one tag");
      h.update(from_prev.data(), from_prev.size() * sizeof(float));
      h.update(from_next.data(), from_next.size() * sizeof(float));
    }
    for (int m = 0; m < 3; ++m) {
      float v = static_cast<float>(m);
      if (me == 0) comm.send(&v, 1, P - 1, 9);
      if (me == P - 1) {
        comm.recv(&v, 1, 0, 9);
        if (v != static_cast<float>(m)) fail(str("send/recv: message ", m, " arrived as ", v));
      }
    }
  }
  comm.barrier();

  // Asynchronous operations in flight together.
  {
    std::vector<float> a = rank_values(me, 500, "async-a"), g(3 * P), gi = rank_values(me, 3, "async-g");
    Work wa = comm.all_reduce_async(a.data(), 500);
    Work wg = comm.all_gather_async(g.data(), gi.data(), 3);
    wg.wait();
    wa.wait();
    std::vector<float> want = rank_values(0, 500, "async-a");
    for (int r = 1; r < P; ++r) {
      const std::vector<float> x = rank_values(r, 500, "async-a");
      for (int i = 0; i < 500; ++i) want[i] = want[i] + x[i];
    }
    same_bits(a.data(), want.data(), 500, "all_reduce_async");
    for (int r = 0; r < P; ++r) same_bits(g.data() + 3 * r, rank_values(r, 3, "async-g").data(), 3, "all_gather_async");
  }

  // Sub-groups: even and odd ranks, each ordered from the highest rank down; sums in group order.
  {
    Communicator sub = comm.split(me % 2, -me);
    std::vector<int> members;
    for (int r = P - 1; r >= 0; --r)
      if (r % 2 == me % 2) members.push_back(r);
    if (sub.size() != static_cast<int>(members.size()) || sub.world_rank(sub.rank()) != me) fail("split: membership");
    std::vector<float> x = rank_values(me, 64, "sub");
    sub.all_reduce(x.data(), 64);
    std::vector<float> want = rank_values(members[0], 64, "sub");
    for (size_t j = 1; j < members.size(); ++j) {
      const std::vector<float> y = rank_values(members[j], 64, "sub");
      for (int i = 0; i < 64; ++i) want[i] = want[i] + y[i];
    }
    same_bits(x.data(), want.data(), 64, "all_reduce in a split group");
    h.update(x.data(), x.size() * sizeof(float));
  }
  // Mesh groups: with tp = 2 (even worlds), each tp group all-gathers its world ranks.
  if (P % 2 == 0) {
    const Mesh mesh(P, {2, 1, 1, 1, 1});
    Communicator tp = comm.split_groups(mesh.groups(MeshGroup::tp));
    std::vector<int32_t> ranks(tp.size());
    const int32_t w = me;
    tp.all_gather(ranks.data(), &w, 1);
    if (std::vector<int>(ranks.begin(), ranks.end()) != mesh.group_of(MeshGroup::tp, me))
      fail("split_groups: tp group");
  }
  res.hash = h.digest();
  return res;
}

}  // namespace lockstep::testing
