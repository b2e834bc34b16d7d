// Causal GQA attention (kernels/attention.h) on every backend: forward and backward against the
// double reference and central differences, packed documents, the context-parallel chunk forms and
// the query segments of determinism = "layout", and the thread settings. The portable-vs-AVX2
// checks of the CPU kernels are in test_attention.cpp.
#include <algorithm>
#include <bit>
#include <limits>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "attention_testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/parallel/context_parallel.h"

namespace lockstep::harness {
namespace {

using namespace lockstep::attention_testing;
using testing::all_close;
using testing::bitwise_equal;
using testing::to_double;

struct In {
  Dims d;
  DocStarts ds;
  std::vector<float> qkv, dout;
};
In make(const Dims& d, uint64_t seed, const DocStarts& ds = {}) {
  return In{d, ds, inputs(d, seed), out_grad(d, seed)};
}

// Forward then backward with dout on the backend; dqkv starts as NaN so that anything not assigned
// shows. Outputs prefix + "out", "lse", "dqkv"; the buffers stay in `keep` when given.
struct Fwd {
  Buf<float> out, lse;
};
void run_attention(Run& r, const In& in, const std::string& prefix = "", int64_t query_segments = 0,
                   Fwd* keep = nullptr) {
  const Dims& d = in.d;
  const Buf<float> qkv = r.in(in.qkv), dout = r.in(in.dout);
  const Buf<int32_t> doc = r.in(in.ds);
  Buf<float> out = r.zeros(d.out_size()), lse = r.zeros(d.lse_size());
  Buf<float> dqkv = r.full(d.qkv_size(), std::numeric_limits<float>::quiet_NaN());
  r.ops.attention_forward(out, lse, qkv, d.B, d.T, d.NH, d.NKV, d.HS, doc);
  r.ops.attention_backward(dqkv, dout, qkv, out, lse, d.B, d.T, d.NH, d.NKV, d.HS, doc, query_segments);
  r.out(prefix + "out", out);
  r.out(prefix + "lse", lse);
  r.out(prefix + "dqkv", dqkv);
  if (keep) *keep = Fwd{std::move(out), std::move(lse)};
}

// The forward and the backward against the double references (out, lse, dqkv).
void check_reference(const Result& got, const In& in, bool backward = true) {
  std::vector<double> ref_out, ref_lse;
  ref_forward(ref_out, ref_lse, to_double(in.qkv), in.d, in.ds);
  EXPECT_TRUE(all_close(got["out"], ref_out, 1e-5, 1e-5, "out " + name(in.d)));
  EXPECT_TRUE(all_close(got["lse"], ref_lse, 1e-6, 1e-6, "lse " + name(in.d)));
  if (backward) {
    const std::vector<double> ref = ref_backward(to_double(in.qkv), to_double(in.dout), in.d, in.ds);
    EXPECT_TRUE(all_close(got["dqkv"], ref, 1e-4, 1e-5, "dqkv " + name(in.d)));
  }
}

// dqkv against central differences of sum(out * dout) in double.
void check_finite_differences(const Result& got, const In& in) {
  const std::vector<double> R = to_double(in.dout);
  auto loss = [&](const std::vector<double>& x) {
    std::vector<double> out, lse;
    ref_forward(out, lse, x, in.d, in.ds);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += out[i] * R[i];
    return s;
  };
  const std::vector<double> fd = testing::finite_difference(loss, to_double(in.qkv));
  // One-token documents have dq = 0 exactly, but the kernel's dS = p * (dP - D) keeps the
  // rounding difference of D (lane-partial chains) and dP (one chain): ~1e-6 absolute.
  EXPECT_TRUE(all_close(got["dqkv"], fd, 1e-4, in.ds.empty() ? 1e-6 : 1e-5, "dqkv " + name(in.d)));
}

// A cp rank's local rows: its chunks of every sample.
struct Local {
  QueryChunks chunks;
  std::vector<int64_t> rows;  // global row of each local row
};
Local rank_rows(const Dims& d, int P, int r) {
  ContextParallel cp;
  cp.size = P;
  cp.rank = r;
  Local l{cp.chunks(d.T), {}};
  for (int64_t b = 0; b < d.B; ++b)
    for (const auto& [begin, end] : l.chunks)
      for (int64_t t = begin; t < end; ++t) l.rows.push_back(b * d.T + t);
  return l;
}

// Rows of x (width W) of the chunks ch, sample by sample; lse (B, NH, T) likewise per head.
std::vector<float> local_rows(const Dims& d, const std::vector<float>& x, int64_t W, const QueryChunks& ch) {
  std::vector<float> y;
  for (int64_t b = 0; b < d.B; ++b)
    for (const auto& [begin, end] : ch)
      y.insert(y.end(), x.begin() + (b * d.T + begin) * W, x.begin() + (b * d.T + end) * W);
  return y;
}
std::vector<float> local_lse(const Dims& d, const std::vector<float>& lse, const QueryChunks& ch) {
  std::vector<float> y;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h)
      for (const auto& [begin, end] : ch)
        y.insert(y.end(), lse.begin() + (b * d.NH + h) * d.T + begin, lse.begin() + (b * d.NH + h) * d.T + end);
  return y;
}

// Every position's keys and values, as the all-gather assembles them: (B, T, 2 NKV HS).
std::vector<float> all_kv(const Dims& d, const std::vector<float>& qkv) {
  const int64_t C3 = d.C3(), KV = 2 * d.NKV * d.HS;
  std::vector<float> kv(static_cast<size_t>(d.B * d.T * KV));
  for (int64_t n = 0; n < d.B * d.T; ++n) std::copy_n(qkv.begin() + n * C3 + d.NH * d.HS, KV, kv.begin() + n * KV);
  return kv;
}

// The chunk backward of the queries in ch (their rows of qkv, dout, out and lse): dkv, one block of
// (B, T, 2 NKV HS) per chunk with query segments.
std::vector<float> chunk_dkv(Run& r, const In& in, const std::vector<float>& out, const std::vector<float>& lse,
                             const QueryChunks& ch, int64_t G) {
  const Dims& d = in.d;
  const int64_t C3 = d.C3(), NHS = d.NH * d.HS, n = d.B * d.T * 2 * d.NKV * d.HS;
  const Buf<float> q = r.in(local_rows(d, in.qkv, C3, ch)), go = r.in(local_rows(d, in.dout, NHS, ch)),
                   o = r.in(local_rows(d, out, NHS, ch)), l = r.in(local_lse(d, lse, ch)), kv = r.in(all_kv(d, in.qkv));
  const Buf<int32_t> doc = r.in(in.ds);
  Buf<float> dq = r.zeros(q.size()), dkv = r.zeros(static_cast<int64_t>(G > 0 ? ch.size() : 1) * n);
  r.ops.attention_backward_chunks(dq, dkv, go, q, kv, o, l, d.B, d.T, ch, d.NH, d.NKV, d.HS, doc, G);
  return r.get(dkv);
}

}  // namespace

void add_attention_cases(Registry& reg) {
  for (const Dims& d : {Dims{1, 1, 2, 2, 8}, Dims{2, 7, 4, 4, 16}, Dims{1, 65, 4, 2, 64}, Dims{1, 130, 4, 1, 8},
                        Dims{2, 130, 8, 2, 16}, Dims{1, 64, 2, 1, 64}, Dims{1, 70, 3, 3, 12}}) {
    reg.add(
        {"Attention", "ForwardMatchesReference", {"attention_forward"}, name(d)}, [=] { return make(d, 1); },
        [](Run& r, const In& in) {
          const Dims& d = in.d;
          const Buf<float> qkv = r.in(in.qkv);
          Buf<float> out = r.zeros(d.out_size()), lse = r.zeros(d.lse_size());
          r.ops.attention_forward(out, lse, qkv, d.B, d.T, d.NH, d.NKV, d.HS, nullptr);
          r.out("out", out);
          r.out("lse", lse);
        },
        [](const Result& got, const In& in) { check_reference(got, in, false); });
  }

  for (const Dims& d : {Dims{1, 5, 2, 1, 8}, Dims{2, 3, 2, 2, 4}, Dims{1, 9, 4, 2, 8}}) {
    reg.add(
        {"Attention", "BackwardMatchesFiniteDifferences", {"attention_forward", "attention_backward"}, name(d)},
        [=] { return make(d, 2); }, [](Run& r, const In& in) { run_attention(r, in); }, check_finite_differences);
  }

  for (const Dims& d : {Dims{2, 130, 4, 2, 16}, Dims{1, 100, 2, 2, 64}, Dims{1, 67, 4, 1, 12}}) {
    reg.add(
        {"Attention", "BackwardMatchesReference", {"attention_forward", "attention_backward"}, name(d)},
        [=] { return make(d, 3); }, [](Run& r, const In& in) { run_attention(r, in); },
        [](const Result& got, const In& in) {
          const std::vector<double> ref = ref_backward(to_double(in.qkv), to_double(in.dout), in.d);
          EXPECT_TRUE(all_close(got["dqkv"], ref, 1e-4, 1e-5, "dqkv " + name(in.d)));
        });
  }

  // Every setting (1, 2, 3 threads on the CPU) gives the same bits; against the references.
  for (const Dims& d : {Dims{3, 130, 4, 2, 64}, Dims{2, 67, 6, 3, 12}}) {
    reg.add(
        {"Attention", "BitwiseIdenticalAcrossThreadCounts", {"attention_forward", "attention_backward"}, name(d)},
        [=] { return make(d, 4); }, [](Run& r, const In& in) { run_attention(r, in); },
        [](const Result& got, const In& in) { check_reference(got, in); });
  }

  // Packed documents: layouts that exercise the block logic (kAttnBlock = 64): documents crossing
  // block boundaries, a document starting exactly on a block (whole key blocks skipped), queries of
  // one block whose documents start in different blocks, one-token documents, a row without any
  // boundary.
  for (const Dims& d : {Dims{5, 200, 4, 2, 16}, Dims{5, 130, 2, 1, 12}, Dims{2, 70, 3, 3, 8}}) {
    reg.add(
        {"AttentionDocuments", "MatchesBlockDiagonalReference", {"attention_forward", "attention_backward"}, name(d)},
        [=] { return make(d, 6, doc_starts(d, layouts())); }, [](Run& r, const In& in) { run_attention(r, in); },
        [](const Result& got, const In& in) { check_reference(got, in); });
  }

  {
    const Dims d{2, 9, 2, 1, 8};
    reg.add(
        {"AttentionDocuments",
         "BackwardMatchesFiniteDifferences",
         {"attention_forward", "attention_backward"},
         name(d)},
        [=] {
          return make(d, 7, doc_starts(d, {{2, 3, 7}, {5}}));
        },
        [](Run& r, const In& in) { run_attention(r, in); }, check_finite_differences);
  }

  {
    const Dims d{2, 130, 4, 2, 16};
    reg.add(
        {"AttentionDocuments",
         "OneDocumentPerRowIsPlainCausalBitwise",
         {"attention_forward", "attention_backward"},
         name(d)},
        [=] { return make(d, 8, DocStarts(static_cast<size_t>(d.B * d.T), 0)); },
        [](Run& r, const In& in) {
          run_attention(r, in, "docs ");
          run_attention(r, In{in.d, {}, in.qkv, in.dout}, "plain ");
        },
        [](const Result& got, const In&) {
          for (const char* o : {"out", "lse", "dqkv"})
            EXPECT_TRUE(bitwise_equal(got[std::string("docs ") + o], got[std::string("plain ") + o], o));
        });
  }

  // A document that starts on a block boundary: its queries skip the earlier key blocks entirely,
  // which must give the bits of running that document alone at the start of a row (same block
  // alignment, same terms).
  {
    const Dims packed{1, 192, 2, 1, 16}, alone{1, 64, 2, 1, 16};
    reg.add(
        {"AttentionDocuments",
         "BlockAlignedDocumentEqualsItsOwnRowBitwise",
         {"attention_forward", "attention_backward"},
         name(packed)},
        [=] {
          return make(packed, 9, doc_starts(packed, {{50, 128}}));
        },
        [=](Run& r, const In& in) {
          run_attention(r, in, "packed ");
          const In tail{alone,
                        {},
                        std::vector<float>(in.qkv.begin() + 128 * packed.C3(), in.qkv.end()),
                        std::vector<float>(in.dout.begin() + 128 * packed.NH * packed.HS, in.dout.end())};
          run_attention(r, tail, "alone ");
        },
        [=](const Result& got, const In&) {
          const std::vector<float> out = got["packed out"], dqkv = got["packed dqkv"];
          const std::vector<float> out_tail(out.begin() + 128 * packed.NH * packed.HS, out.end());
          const std::vector<float> dqkv_tail(dqkv.begin() + 128 * packed.C3(), dqkv.end());
          EXPECT_TRUE(bitwise_equal(out_tail, got["alone out"], "out"));
          EXPECT_TRUE(bitwise_equal(dqkv_tail, got["alone dqkv"], "dqkv"));
        });
  }

  // Documents on every setting (1, 2, 3 threads on the CPU) bitwise; against the references.
  {
    const Dims d{5, 200, 4, 2, 12};
    reg.add(
        {"AttentionDocuments", "BitwiseAcrossThreadsAndPortable", {"attention_forward", "attention_backward"}, name(d)},
        [=] { return make(d, 10, doc_starts(d, layouts())); }, [](Run& r, const In& in) { run_attention(r, in); },
        [](const Result& got, const In& in) { check_reference(got, in); });
  }

  // Context parallelism's attention (attention_forward_chunks / attention_backward_chunks), every
  // cp rank of a group simulated in one process: rank r holds chunks r and 2P-1-r of each sample
  // and sees every key and value. Each rank's out, lse and dq rows are bitwise the whole-sequence
  // call's; the ranks' dK, dV contributions, summed in rank order (the reduce-scatter's order),
  // match the whole call to rounding and the double reference. Chunk sizes not multiples of
  // kAttnBlock (24, 16, 8, 5) and a multiple (64); GQA; packed documents.
  struct ChunkCase {
    Dims d;
    int P;
    bool docs;
  };
  for (const ChunkCase& c : {ChunkCase{{2, 96, 4, 2, 16}, 2, false}, ChunkCase{{1, 96, 4, 1, 12}, 3, false},
                             ChunkCase{{2, 64, 2, 2, 8}, 4, false}, ChunkCase{{1, 256, 2, 1, 16}, 2, false},
                             ChunkCase{{5, 200, 4, 2, 12}, 4, true}, ChunkCase{{1, 40, 2, 2, 8}, 4, true}}) {
    reg.add(
        {"AttentionChunks",
         "LoadBalancedChunksReproduceTheWholeSequence",
         {"attention_forward_chunks", "attention_backward_chunks", "attention_forward", "attention_backward"},
         name(c.d) + str(" P=", c.P, c.docs ? " documents" : "")},
        [=] { return make(c.d, 11, c.docs ? doc_starts(c.d, layouts()) : DocStarts{}); },
        [=](Run& r, const In& in) {
          const Dims& d = in.d;
          run_attention(r, in, "whole ");
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, Tl = d.T / c.P;
          const Buf<float> kv = r.in(all_kv(d, in.qkv));
          const Buf<int32_t> doc = r.in(in.ds);
          for (int rank = 0; rank < c.P; ++rank) {
            const Local l = rank_rows(d, c.P, rank);
            std::vector<float> q_local, dout_local;
            for (int64_t n : l.rows) {
              q_local.insert(q_local.end(), in.qkv.begin() + n * C3, in.qkv.begin() + (n + 1) * C3);
              dout_local.insert(dout_local.end(), in.dout.begin() + n * NHS, in.dout.begin() + (n + 1) * NHS);
            }
            const Buf<float> q = r.in(q_local), go = r.in(dout_local);
            Buf<float> out = r.zeros(d.B * Tl * NHS), lse = r.zeros(d.B * d.NH * Tl);
            r.ops.attention_forward_chunks(out, lse, q, kv, d.B, d.T, l.chunks, d.NH, d.NKV, d.HS, doc);
            Buf<float> dq = r.full(q.size(), std::numeric_limits<float>::quiet_NaN()), dkv = r.zeros(kv.size());
            r.ops.attention_backward_chunks(dq, dkv, go, q, kv, out, lse, d.B, d.T, l.chunks, d.NH, d.NKV, d.HS, doc,
                                            0);
            r.out(str("rank ", rank, " out"), out);
            r.out(str("rank ", rank, " lse"), lse);
            r.out(str("rank ", rank, " dq"), dq);
            r.out(str("rank ", rank, " dkv"), dkv);
          }
        },
        [=](const Result& got, const In& in) {
          const Dims& d = in.d;
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, Tl = d.T / c.P;
          const std::vector<float> whole_out = got["whole out"], whole_lse = got["whole lse"],
                                   whole_dqkv = got["whole dqkv"];
          std::vector<float> dkv_sum(static_cast<size_t>(d.B * d.T * 2 * d.NKV * d.HS), 0.0f);
          for (int rank = 0; rank < c.P; ++rank) {
            const Local l = rank_rows(d, c.P, rank);
            ASSERT_EQ(static_cast<int64_t>(l.rows.size()), d.B * Tl);
            const std::vector<float> out = got[str("rank ", rank, " out")], lse = got[str("rank ", rank, " lse")],
                                     dq = got[str("rank ", rank, " dq")], dkv = got[str("rank ", rank, " dkv")];
            for (size_t i = 0; i < dkv.size(); ++i) dkv_sum[i] += dkv[i];
            std::vector<float> want_out, got_dq, want_dq;
            for (size_t i = 0; i < l.rows.size(); ++i) {
              const int64_t n = l.rows[i], b = n / d.T, t = n % d.T;
              want_out.insert(want_out.end(), whole_out.begin() + n * NHS, whole_out.begin() + (n + 1) * NHS);
              got_dq.insert(got_dq.end(), dq.begin() + static_cast<int64_t>(i) * C3,
                            dq.begin() + static_cast<int64_t>(i) * C3 + NHS);
              want_dq.insert(want_dq.end(), whole_dqkv.begin() + n * C3, whole_dqkv.begin() + n * C3 + NHS);
              for (int64_t h = 0; h < d.NH; ++h)
                EXPECT_EQ(std::bit_cast<uint32_t>(lse[(b * d.NH + h) * Tl + static_cast<int64_t>(i) % Tl]),
                          std::bit_cast<uint32_t>(whole_lse[(b * d.NH + h) * d.T + t]))
                    << "rank " << rank << " lse row " << t << " head " << h;
            }
            const std::string at = str("rank ", rank);
            EXPECT_TRUE(bitwise_equal(out, want_out, "out " + at));
            EXPECT_TRUE(bitwise_equal(got_dq, want_dq, "dq " + at));
          }
          std::vector<float> want_dkv;
          std::vector<double> ref_dkv;
          const std::vector<double> ref = ref_backward(to_double(in.qkv), to_double(in.dout), d, in.ds);
          for (int64_t n = 0; n < d.B * d.T; ++n) {
            want_dkv.insert(want_dkv.end(), whole_dqkv.begin() + n * C3 + NHS, whole_dqkv.begin() + (n + 1) * C3);
            ref_dkv.insert(ref_dkv.end(), ref.begin() + n * C3 + NHS, ref.begin() + (n + 1) * C3);
          }
          EXPECT_TRUE(all_close(dkv_sum, to_double(want_dkv), 1e-5, 1e-6, "dkv vs whole"));
          EXPECT_TRUE(all_close(dkv_sum, ref_dkv, 1e-4, 1e-5, "dkv vs reference"));
        });
  }

  // The chunk forms' gradients against central differences: the ranks' dq rows and summed dK, dV
  // are the gradient of sum(out * dout) (out from the chunk forward of every rank).
  {
    const Dims d{1, 12, 2, 1, 4};
    const int P = 2;
    reg.add(
        {"AttentionChunks",
         "ChunkGradientsMatchFiniteDifferences",
         {"attention_forward_chunks", "attention_backward_chunks"},
         name(d) + str(" P=", P)},
        [=] { return make(d, 12, doc_starts(d, {{5}})); },
        [=](Run& r, const In& in) {
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, Tl = d.T / P;
          const Buf<float> kv = r.in(all_kv(d, in.qkv));
          const Buf<int32_t> doc = r.in(in.ds);
          for (int rank = 0; rank < P; ++rank) {
            const Local l = rank_rows(d, P, rank);
            const Buf<float> q = r.in(local_rows(d, in.qkv, C3, l.chunks)),
                             go = r.in(local_rows(d, in.dout, NHS, l.chunks));
            Buf<float> out = r.zeros(d.B * Tl * NHS), lse = r.zeros(d.B * d.NH * Tl), dq = r.zeros(q.size()),
                       dkv = r.zeros(kv.size());
            r.ops.attention_forward_chunks(out, lse, q, kv, d.B, d.T, l.chunks, d.NH, d.NKV, d.HS, doc);
            r.ops.attention_backward_chunks(dq, dkv, go, q, kv, out, lse, d.B, d.T, l.chunks, d.NH, d.NKV, d.HS, doc,
                                            0);
            r.out(str("rank ", rank, " dq"), dq);
            r.out(str("rank ", rank, " dkv"), dkv);
          }
        },
        [=](const Result& got, const In& in) {
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, KV = 2 * d.NKV * d.HS;
          // The gradient assembled: dq rows from their rank, dK, dV summed over the ranks.
          std::vector<float> dqkv(in.qkv.size(), 0.0f);
          for (int rank = 0; rank < P; ++rank) {
            const Local l = rank_rows(d, P, rank);
            const std::vector<float> dq = got[str("rank ", rank, " dq")], dkv = got[str("rank ", rank, " dkv")];
            for (size_t i = 0; i < l.rows.size(); ++i)
              std::copy_n(dq.begin() + static_cast<int64_t>(i) * C3, NHS, dqkv.begin() + l.rows[i] * C3);
            for (int64_t n = 0; n < d.B * d.T; ++n)
              for (int64_t j = 0; j < KV; ++j) dqkv[n * C3 + NHS + j] += dkv[n * KV + j];
          }
          Result assembled;
          Output o{"dqkv", 'f', std::vector<uint8_t>(dqkv.size() * 4), bitwise()};
          std::memcpy(o.raw.data(), dqkv.data(), o.raw.size());
          assembled.outputs.push_back(o);
          check_finite_differences(assembled, in);
        });
  }

  // Ring attention (attention_forward_partial / attention_backward_partial / attention_merge): every
  // rank of a ring of P simulated in one process. Rank r holds chunks r and 2P-1-r; at ring step i it
  // attends to rank (r - i) mod P's key chunks and merges the partial result into its own in ring
  // order. The merged out and lse and the assembled gradient (dq summed over the steps, each key
  // chunk's dK, dV summed over the ranks) match the double reference; the small case also central
  // differences. Chunks of 24, 16, 8, 5 and 64 positions; GQA; packed documents (queries that see no
  // key of a step: lse -inf there).
  for (const ChunkCase& c : {ChunkCase{{2, 96, 4, 2, 16}, 2, false}, ChunkCase{{1, 96, 4, 1, 12}, 3, false},
                             ChunkCase{{2, 64, 2, 2, 8}, 4, false}, ChunkCase{{1, 256, 2, 1, 16}, 2, false},
                             ChunkCase{{5, 200, 4, 2, 12}, 4, true}, ChunkCase{{1, 40, 2, 2, 8}, 4, true},
                             ChunkCase{{1, 12, 2, 1, 4}, 2, true}}) {
    reg.add(
        {"AttentionRing",
         "RingStepsMergedMatchReference",
         {"attention_forward_partial", "attention_backward_partial", "attention_merge"},
         name(c.d) + str(" P=", c.P, c.docs ? " documents" : "")},
        [=] {
          return make(c.d, 13,
                      !c.docs       ? DocStarts{}
                      : c.d.T == 12 ? doc_starts(c.d, {{5}})
                                    : doc_starts(c.d, layouts()));
        },
        [=](Run& r, const In& in) {
          const Dims& d = in.d;
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, KV = 2 * d.NKV * d.HS, Tl = d.T / c.P;
          const std::vector<float> kv_all = all_kv(d, in.qkv);
          const Buf<int32_t> doc = r.in(in.ds);
          std::vector<float> dqkv(in.qkv.size(), 0.0f), out_all(static_cast<size_t>(d.out_size())),
              lse_all(static_cast<size_t>(d.lse_size()));
          for (int rank = 0; rank < c.P; ++rank) {
            const Local l = rank_rows(d, c.P, rank);
            const Buf<float> q = r.in(local_rows(d, in.qkv, C3, l.chunks)),
                             go = r.in(local_rows(d, in.dout, NHS, l.chunks));
            Buf<float> out = r.zeros(d.B * Tl * NHS),
                       lse = r.full(d.B * d.NH * Tl, -std::numeric_limits<float>::infinity());
            Buf<float> part = r.zeros(d.B * Tl * NHS), part_lse = r.zeros(d.B * d.NH * Tl);
            for (int i = 0; i < c.P; ++i) {
              const QueryChunks kc = rank_rows(d, c.P, (rank - i + c.P) % c.P).chunks;
              const Buf<float> kv = r.in(local_rows(d, kv_all, KV, kc));
              r.ops.attention_forward_partial(part, part_lse, q, kv, d.B, d.T, l.chunks, kc, d.NH, d.NKV, d.HS, doc);
              r.ops.attention_merge(out, lse, part, part_lse, d.B, Tl, d.NH, d.HS);
            }
            Buf<float> dq = r.zeros(q.size());
            for (int i = 0; i < c.P; ++i) {
              const QueryChunks kc = rank_rows(d, c.P, (rank - i + c.P) % c.P).chunks;
              const Buf<float> kv = r.in(local_rows(d, kv_all, KV, kc));
              Buf<float> dkv = r.full(kv.size(), std::numeric_limits<float>::quiet_NaN());
              r.ops.attention_backward_partial(dq, dkv, go, q, kv, out, lse, d.B, d.T, l.chunks, kc, d.NH, d.NKV, d.HS,
                                               doc);
              const std::vector<float> g = r.get(dkv);
              int64_t row = 0;
              for (int64_t b = 0; b < d.B; ++b)
                for (const auto& [begin, end] : kc)
                  for (int64_t t = begin; t < end; ++t, ++row)
                    for (int64_t j = 0; j < KV; ++j) dqkv[(b * d.T + t) * C3 + NHS + j] += g[row * KV + j];
            }
            const std::vector<float> o = r.get(out), ls = r.get(lse), g = r.get(dq);
            for (size_t i = 0; i < l.rows.size(); ++i) {
              const int64_t n = l.rows[i], b = n / d.T, t = n % d.T, li = static_cast<int64_t>(i);
              std::copy_n(o.begin() + li * NHS, NHS, out_all.begin() + n * NHS);
              std::copy_n(g.begin() + li * C3, NHS, dqkv.begin() + n * C3);
              for (int64_t h = 0; h < d.NH; ++h)
                lse_all[static_cast<size_t>((b * d.NH + h) * d.T + t)] =
                    ls[static_cast<size_t>((b * d.NH + h) * Tl + li % Tl)];
            }
          }
          r.out("out", out_all);
          r.out("lse", lse_all);
          r.out("dqkv", dqkv);
        },
        [=](const Result& got, const In& in) {
          check_reference(got, in);
          if (in.d.T == 12) check_finite_differences(got, in);
        });
  }

  // One key chunk of the whole sequence is the whole-sequence call, bit for bit (the partial forms
  // walk the same key blocks).
  {
    const Dims d{2, 130, 4, 2, 16};
    reg.add(
        {"AttentionRing",
         "WholeSequenceAsOneKeyChunkIsTheWholeCallBitwise",
         {"attention_forward_partial", "attention_backward_partial", "attention_forward", "attention_backward"},
         name(d)},
        [=] { return make(d, 14, doc_starts(d, layouts())); },
        [=](Run& r, const In& in) {
          run_attention(r, in, "whole ");
          const QueryChunks all{{0, d.T}};
          const Buf<float> q = r.in(in.qkv), go = r.in(in.dout), kv = r.in(all_kv(d, in.qkv));
          const Buf<int32_t> doc = r.in(in.ds);
          Buf<float> out = r.zeros(d.out_size()), lse = r.zeros(d.lse_size());
          r.ops.attention_forward_partial(out, lse, q, kv, d.B, d.T, all, all, d.NH, d.NKV, d.HS, doc);
          Buf<float> dq = r.zeros(q.size()), dkv = r.zeros(kv.size());
          r.ops.attention_backward_partial(dq, dkv, go, q, kv, out, lse, d.B, d.T, all, all, d.NH, d.NKV, d.HS, doc);
          r.out("partial out", out);
          r.out("partial lse", lse);
          std::vector<float> dqkv = r.get(dq);
          const std::vector<float> g = r.get(dkv);
          const int64_t C3 = d.C3(), NHS = d.NH * d.HS, KV = 2 * d.NKV * d.HS;
          for (int64_t n = 0; n < d.B * d.T; ++n) std::copy_n(g.begin() + n * KV, KV, dqkv.begin() + n * C3 + NHS);
          r.out("partial dqkv", dqkv);
        },
        [](const Result& got, const In&) {
          for (const char* o : {"out", "lse", "dqkv"})
            EXPECT_TRUE(bitwise_equal(got[std::string("partial ") + o], got[std::string("whole ") + o], o));
        });
  }

  // Query segments (determinism = "layout" with layout_token_segments): the whole-sequence
  // backward with G segments keeps dq bitwise, its dK, dV are the canonical tree over the G
  // segments' chains (each segment computed alone, as a one-segment chunk) bitwise, it matches the
  // double reference; and the cp ranks' per-chunk results (attention_backward_chunks, rank r's
  // chunks r and 2P-1-r), summed along the canonical tree over the 2P chunks in position order, are
  // its bits exactly (what reduce_scatter_dkv does over the group). GQA, documents, chunks of 4..32.
  // (The portable kernel's bits: test_attention.cpp.)
  struct SegCase {
    Dims d;
    int64_t G;
    int P;
    bool docs;
  };
  for (const SegCase& c : {SegCase{{2, 64, 4, 2, 16}, 8, 2, false}, SegCase{{1, 128, 4, 1, 12}, 8, 4, false},
                           SegCase{{2, 96, 2, 2, 8}, 8, 2, true}, SegCase{{1, 256, 2, 1, 16}, 16, 2, false},
                           SegCase{{1, 40, 2, 2, 8}, 8, 4, true}}) {
    reg.add(
        {"AttentionChunks",
         "QuerySegmentsAreTheTreeOverSegmentsAndSplitOverCpRanks",
         {"attention_forward", "attention_backward", "attention_backward_chunks"},
         name(c.d) + str(" G=", c.G, " P=", c.P, c.docs ? " documents" : "")},
        [=] { return make(c.d, 21, c.docs ? doc_starts(c.d, layouts()) : DocStarts{}); },
        [=](Run& r, const In& in) {
          Fwd plain;
          run_attention(r, in, "plain ", 0, &plain);
          const std::vector<float> out = r.get(plain.out), lse = r.get(plain.lse);
          const Buf<float> qkv = r.in(in.qkv), dout = r.in(in.dout);
          const Buf<int32_t> doc = r.in(in.ds);
          Buf<float> seg = r.full(in.qkv.size(), std::numeric_limits<float>::quiet_NaN());
          r.ops.attention_backward(seg, dout, qkv, plain.out, plain.lse, in.d.B, in.d.T, in.d.NH, in.d.NKV, in.d.HS,
                                   doc, c.G);
          r.out("segmented dqkv", seg);
          // The definition: each segment from zero (a one-segment chunk).
          const std::vector<int64_t> sb = canonical_segments(in.d.T, c.G);
          for (int64_t g = 0; g < c.G; ++g)
            r.out(str("segment ", g, " dkv"), chunk_dkv(r, in, out, lse, {{sb[g], sb[g + 1]}}, c.G));
          for (int rank = 0; rank < c.P; ++rank) {
            ContextParallel cp;
            cp.size = c.P;
            cp.rank = rank;
            r.out(str("rank ", rank, " dkv"), chunk_dkv(r, in, out, lse, cp.chunks(in.d.T), c.G));
          }
        },
        [=](const Result& got, const In& in) {
          const Dims& d = in.d;
          const std::vector<float> seg = got["segmented dqkv"], plain = got["plain dqkv"];
          const int64_t C3 = d.C3(), KV = 2 * d.NKV * d.HS, NHS = d.NH * d.HS, n = d.B * d.T * KV;
          std::vector<float> want_dkv(static_cast<size_t>(n)), got_dq, want_dq;
          std::vector<double> ref_dkv;
          const std::vector<double> ref = ref_backward(to_double(in.qkv), to_double(in.dout), d, in.ds);
          for (int64_t r = 0; r < d.B * d.T; ++r) {
            std::copy_n(seg.begin() + r * C3 + NHS, KV, want_dkv.begin() + r * KV);
            ref_dkv.insert(ref_dkv.end(), ref.begin() + r * C3 + NHS, ref.begin() + (r + 1) * C3);
            got_dq.insert(got_dq.end(), seg.begin() + r * C3, seg.begin() + r * C3 + NHS);
            want_dq.insert(want_dq.end(), plain.begin() + r * C3, plain.begin() + r * C3 + NHS);
          }
          EXPECT_TRUE(bitwise_equal(got_dq, want_dq, "dq"));
          int64_t moved = 0;  // the segments are another association than the one chain: some bits differ
          for (int64_t r = 0; r < d.B * d.T * C3; ++r)
            moved += std::bit_cast<uint32_t>(seg[r]) != std::bit_cast<uint32_t>(plain[r]);
          EXPECT_GT(moved, 0);
          EXPECT_TRUE(all_close(want_dkv, ref_dkv, 1e-4, 1e-5, "dkv vs reference"));

          std::vector<std::vector<float>> leaves;
          for (int64_t g = 0; g < c.G; ++g) leaves.push_back(got[str("segment ", g, " dkv")]);
          std::vector<const float*> lp;
          for (const auto& l : leaves) lp.push_back(l.data());
          std::vector<float> tree(static_cast<size_t>(n)), stack(static_cast<size_t>(tree_sum_stack(c.G) * n));
          tree_sum(tree.data(), lp.data(), c.G, n, stack.data());
          EXPECT_TRUE(bitwise_equal(tree, want_dkv, "tree over segments"));

          // The cp ranks' chunks, combined along the tree over the 2P chunks in position order.
          std::vector<std::vector<float>> pieces(static_cast<size_t>(2 * c.P));
          for (int rank = 0; rank < c.P; ++rank) {
            const std::vector<float> dkv = got[str("rank ", rank, " dkv")];
            pieces[static_cast<size_t>(rank)].assign(dkv.begin(), dkv.begin() + n);
            pieces[static_cast<size_t>(2 * c.P - 1 - rank)].assign(dkv.begin() + n, dkv.end());
          }
          lp.clear();
          for (const auto& p : pieces) lp.push_back(p.data());
          stack.assign(static_cast<size_t>(tree_sum_stack(2 * c.P) * n), 0.0f);
          tree_sum(tree.data(), lp.data(), 2 * c.P, n, stack.data());
          EXPECT_TRUE(bitwise_equal(tree, want_dkv, "cp pieces"));
        });
  }
}

}  // namespace lockstep::harness
