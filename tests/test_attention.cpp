#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/attention.h"
#include "lockstep/parallel/context_parallel.h"
#include "testing.h"

namespace lockstep {
namespace {

struct Dims {
  int64_t B, T, NH, NKV, HS;
  int64_t C3() const { return (NH + 2 * NKV) * HS; }
  int64_t qkv_size() const { return B * T * C3(); }
  int64_t out_size() const { return B * T * NH * HS; }
  int64_t lse_size() const { return B * NH * T; }
};

std::string name(const Dims& d) {
  return str("B=", d.B, " T=", d.T, " NH=", d.NH, " NKV=", d.NKV, " HS=", d.HS);
}

// Offsets of query head h, key head g and value head g within a qkv row.
int64_t q_at(const Dims& d, int64_t h) { return h * d.HS; }
int64_t k_at(const Dims& d, int64_t g) { return (d.NH + g) * d.HS; }
int64_t v_at(const Dims& d, int64_t g) { return (d.NH + d.NKV + g) * d.HS; }

// Per-token document starts (B, T), or empty for plain causal attention. Query t sees keys
// first_key(t) .. t.
using DocStarts = std::vector<int32_t>;
int64_t first_key(const DocStarts& ds, const Dims& d, int64_t b, int64_t t) {
  return ds.empty() ? 0 : ds[b * d.T + t];
}

// Full masked softmax in double; p (T, T) of one (b, h), zero outside each query's visible keys.
void ref_probs(std::vector<double>& p, std::vector<double>* lse, const std::vector<double>& qkv,
               const Dims& d, int64_t b, int64_t h, const DocStarts& ds = {}) {
  const int64_t g = h / (d.NH / d.NKV);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.HS));
  p.assign(static_cast<size_t>(d.T * d.T), 0.0);
  for (int64_t t = 0; t < d.T; ++t) {
    const double* q = &qkv[(b * d.T + t) * d.C3() + q_at(d, h)];
    double m = -std::numeric_limits<double>::infinity();
    const int64_t j0 = first_key(ds, d, b, t);
    for (int64_t j = j0; j <= t; ++j) {
      const double* k = &qkv[(b * d.T + j) * d.C3() + k_at(d, g)];
      double s = 0;
      for (int64_t c = 0; c < d.HS; ++c) s += q[c] * k[c];
      p[t * d.T + j] = s * scale;
      m = std::max(m, s * scale);
    }
    double sum = 0;
    for (int64_t j = j0; j <= t; ++j) sum += std::exp(p[t * d.T + j] - m);
    for (int64_t j = j0; j <= t; ++j) p[t * d.T + j] = std::exp(p[t * d.T + j] - m) / sum;
    if (lse) (*lse)[(b * d.NH + h) * d.T + t] = m + std::log(sum);
  }
}

void ref_forward(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv,
                 const Dims& d, const DocStarts& ds = {}) {
  out.assign(static_cast<size_t>(d.out_size()), 0.0);
  lse.assign(static_cast<size_t>(d.lse_size()), 0.0);
  std::vector<double> p;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h) {
      ref_probs(p, &lse, qkv, d, b, h, ds);
      const int64_t g = h / (d.NH / d.NKV);
      for (int64_t t = 0; t < d.T; ++t) {
        double* o = &out[((b * d.T + t) * d.NH + h) * d.HS];
        for (int64_t j = 0; j <= t; ++j) {
          const double* v = &qkv[(b * d.T + j) * d.C3() + v_at(d, g)];
          for (int64_t c = 0; c < d.HS; ++c) o[c] += p[t * d.T + j] * v[c];
        }
      }
    }
}

// Gradient of sum(out * dout) with respect to qkv, in double.
std::vector<double> ref_backward(const std::vector<double>& qkv, const std::vector<double>& dout,
                                 const Dims& d, const DocStarts& ds = {}) {
  std::vector<double> dqkv(static_cast<size_t>(d.qkv_size()), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.HS));
  std::vector<double> p, dp(static_cast<size_t>(d.T));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h) {
      ref_probs(p, nullptr, qkv, d, b, h, ds);
      const int64_t g = h / (d.NH / d.NKV);
      auto row = [&](int64_t t) { return (b * d.T + t) * d.C3(); };
      for (int64_t t = 0; t < d.T; ++t) {
        const double* go = &dout[((b * d.T + t) * d.NH + h) * d.HS];
        double D = 0;
        for (int64_t j = 0; j <= t; ++j) {
          const double* v = &qkv[row(j) + v_at(d, g)];
          dp[j] = 0;
          for (int64_t c = 0; c < d.HS; ++c) dp[j] += go[c] * v[c];
          D += p[t * d.T + j] * dp[j];
        }
        for (int64_t j = 0; j <= t; ++j) {
          const double pj = p[t * d.T + j], ds = pj * (dp[j] - D) * scale;
          for (int64_t c = 0; c < d.HS; ++c) {
            dqkv[row(t) + q_at(d, h) + c] += ds * qkv[row(j) + k_at(d, g) + c];
            dqkv[row(j) + k_at(d, g) + c] += ds * qkv[row(t) + q_at(d, h) + c];
            dqkv[row(j) + v_at(d, g) + c] += pj * go[c];
          }
        }
      }
    }
  return dqkv;
}

struct Result {
  std::vector<float> out, lse, dqkv;
};

// Forward then backward with dout; dqkv starts as NaN so that anything not assigned shows.
Result run(const std::vector<float>& qkv, const std::vector<float>& dout, const Dims& d,
           bool portable = false, const DocStarts& ds = {}) {
  const int32_t* doc = ds.empty() ? nullptr : ds.data();
  Result r;
  r.out.assign(static_cast<size_t>(d.out_size()), 0.0f);
  r.lse.assign(static_cast<size_t>(d.lse_size()), 0.0f);
  r.dqkv.assign(static_cast<size_t>(d.qkv_size()), std::numeric_limits<float>::quiet_NaN());
  if (portable) {
    detail::attention_forward_portable(r.out.data(), r.lse.data(), qkv.data(), d.B, d.T, d.NH,
                                       d.NKV, d.HS, doc);
    detail::attention_backward_portable(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(),
                                        r.lse.data(), d.B, d.T, d.NH, d.NKV, d.HS, doc);
  } else {
    attention_forward(r.out.data(), r.lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS, doc);
    attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), d.B, d.T,
                       d.NH, d.NKV, d.HS, doc);
  }
  return r;
}

std::vector<float> inputs(const Dims& d, uint64_t seed) {
  return testing::randn(d.qkv_size(), seed, "attention/qkv", 1.5f);
}
std::vector<float> out_grad(const Dims& d, uint64_t seed) {
  return testing::randn(d.out_size(), seed, "attention/dout");
}

TEST(Attention, ForwardMatchesReference) {
  const Dims shapes[] = {
      {1, 1, 2, 2, 8},    {2, 7, 4, 4, 16},  {1, 65, 4, 2, 64}, {1, 130, 4, 1, 8},
      {2, 130, 8, 2, 16}, {1, 64, 2, 1, 64}, {1, 70, 3, 3, 12},
  };
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 1);
    std::vector<float> out(static_cast<size_t>(d.out_size())),
        lse(static_cast<size_t>(d.lse_size()));
    attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS);
    std::vector<double> ref_out, ref_lse;
    ref_forward(ref_out, ref_lse, testing::to_double(qkv), d);
    EXPECT_TRUE(testing::all_close(out, ref_out, 1e-5, 1e-5, "out " + name(d)));
    EXPECT_TRUE(testing::all_close(lse, ref_lse, 1e-6, 1e-6, "lse " + name(d)));
  }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  const Dims shapes[] = {{1, 5, 2, 1, 8}, {2, 3, 2, 2, 4}, {1, 9, 4, 2, 8}};
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 2);
    const std::vector<float> dout = out_grad(d, 2);
    const Result r = run(qkv, dout, d);
    const std::vector<double> R = testing::to_double(dout);
    auto loss = [&](const std::vector<double>& x) {
      std::vector<double> out, lse;
      ref_forward(out, lse, x, d);
      double s = 0;
      for (size_t i = 0; i < out.size(); ++i) s += out[i] * R[i];
      return s;
    };
    const std::vector<double> fd = testing::finite_difference(loss, testing::to_double(qkv));
    EXPECT_TRUE(testing::all_close(r.dqkv, fd, 1e-4, 1e-6, "dqkv " + name(d)));
  }
}

TEST(Attention, BackwardMatchesReference) {
  const Dims shapes[] = {{2, 130, 4, 2, 16}, {1, 100, 2, 2, 64}, {1, 67, 4, 1, 12}};
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 3);
    const std::vector<float> dout = out_grad(d, 3);
    const Result r = run(qkv, dout, d);
    const std::vector<double> ref =
        ref_backward(testing::to_double(qkv), testing::to_double(dout), d);
    EXPECT_TRUE(testing::all_close(r.dqkv, ref, 1e-4, 1e-5, "dqkv " + name(d)));
  }
}

TEST(Attention, BitwiseIdenticalAcrossThreadCounts) {
  const Dims shapes[] = {{3, 130, 4, 2, 64}, {2, 67, 6, 3, 12}};
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 4);
    const std::vector<float> dout = out_grad(d, 4);
    Result base;
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      ThreadPool::Bind bind(&pool);
      Result r = run(qkv, dout, d);
      if (threads == 1) {
        base = std::move(r);
        continue;
      }
      const std::string what = str(name(d), " threads=", threads);
      EXPECT_TRUE(testing::bitwise_equal(r.out, base.out, "out " + what));
      EXPECT_TRUE(testing::bitwise_equal(r.lse, base.lse, "lse " + what));
      EXPECT_TRUE(testing::bitwise_equal(r.dqkv, base.dqkv, "dqkv " + what));
    }
  }
}

TEST(Attention, PortableMatchesVectorBitwise) {
  const Dims shapes[] = {{2, 67, 4, 2, 12}, {1, 130, 2, 1, 64}};
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 5);
    const std::vector<float> dout = out_grad(d, 5);
    const Result fast = run(qkv, dout, d);
    const Result portable = run(qkv, dout, d, true);
    EXPECT_TRUE(testing::bitwise_equal(fast.out, portable.out, "out " + name(d)));
    EXPECT_TRUE(testing::bitwise_equal(fast.lse, portable.lse, "lse " + name(d)));
    EXPECT_TRUE(testing::bitwise_equal(fast.dqkv, portable.dqkv, "dqkv " + name(d)));
  }
}

// Document starts from the positions where documents begin in each row (besides 0); row b uses
// starts[b % starts.size()], entries >= T ignored.
DocStarts doc_starts(const Dims& d, const std::vector<std::vector<int64_t>>& starts) {
  DocStarts ds(static_cast<size_t>(d.B * d.T));
  for (int64_t b = 0; b < d.B; ++b) {
    int64_t cur = 0;
    const std::vector<int64_t>& row = starts[static_cast<size_t>(b) % starts.size()];
    for (int64_t t = 0; t < d.T; ++t) {
      for (int64_t s : row)
        if (s == t) cur = t;
      ds[b * d.T + t] = static_cast<int32_t>(cur);
    }
  }
  return ds;
}

// Layouts that exercise the block logic (kAttnBlock = 64): documents crossing block boundaries,
// a document starting exactly on a block (whole key blocks skipped), queries of one block whose
// documents start in different blocks (some have seen no key when the first key block ends),
// one-token documents, and a row without any boundary.
const std::vector<std::vector<int64_t>> kLayouts = {
    {3, 60, 70, 129}, {128, 140}, {1, 2, 3, 100, 140, 199}, {}, {64, 65, 190}};

TEST(AttentionDocuments, MatchesBlockDiagonalReference) {
  const Dims shapes[] = {{5, 200, 4, 2, 16}, {5, 130, 2, 1, 12}, {2, 70, 3, 3, 8}};
  for (const Dims& d : shapes) {
    const DocStarts ds = doc_starts(d, kLayouts);
    const std::vector<float> qkv = inputs(d, 6);
    const std::vector<float> dout = out_grad(d, 6);
    const Result r = run(qkv, dout, d, false, ds);
    std::vector<double> ref_out, ref_lse;
    ref_forward(ref_out, ref_lse, testing::to_double(qkv), d, ds);
    EXPECT_TRUE(testing::all_close(r.out, ref_out, 1e-5, 1e-5, "out " + name(d)));
    EXPECT_TRUE(testing::all_close(r.lse, ref_lse, 1e-6, 1e-6, "lse " + name(d)));
    const std::vector<double> ref =
        ref_backward(testing::to_double(qkv), testing::to_double(dout), d, ds);
    EXPECT_TRUE(testing::all_close(r.dqkv, ref, 1e-4, 1e-5, "dqkv " + name(d)));
  }
}

TEST(AttentionDocuments, BackwardMatchesFiniteDifferences) {
  const Dims d{2, 9, 2, 1, 8};
  const DocStarts ds = doc_starts(d, {{2, 3, 7}, {5}});
  const std::vector<float> qkv = inputs(d, 7);
  const std::vector<float> dout = out_grad(d, 7);
  const Result r = run(qkv, dout, d, false, ds);
  const std::vector<double> R = testing::to_double(dout);
  auto loss = [&](const std::vector<double>& x) {
    std::vector<double> out, lse;
    ref_forward(out, lse, x, d, ds);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += out[i] * R[i];
    return s;
  };
  const std::vector<double> fd = testing::finite_difference(loss, testing::to_double(qkv));
  // One-token documents have dq = 0 exactly, but the kernel's dS = p * (dP - D) keeps the
  // rounding difference of D (lane-partial chains) and dP (one chain): ~1e-6 absolute.
  EXPECT_TRUE(testing::all_close(r.dqkv, fd, 1e-4, 1e-5, "dqkv " + name(d)));
}

TEST(AttentionDocuments, OneDocumentPerRowIsPlainCausalBitwise) {
  const Dims d{2, 130, 4, 2, 16};
  const DocStarts ds(static_cast<size_t>(d.B * d.T), 0);
  const std::vector<float> qkv = inputs(d, 8);
  const std::vector<float> dout = out_grad(d, 8);
  const Result plain = run(qkv, dout, d);
  const Result docs = run(qkv, dout, d, false, ds);
  EXPECT_TRUE(testing::bitwise_equal(docs.out, plain.out, "out"));
  EXPECT_TRUE(testing::bitwise_equal(docs.lse, plain.lse, "lse"));
  EXPECT_TRUE(testing::bitwise_equal(docs.dqkv, plain.dqkv, "dqkv"));
}

// A document that starts on a block boundary: its queries skip the earlier key blocks entirely,
// which must give the bits of running that document alone at the start of a row (same block
// alignment, same terms).
TEST(AttentionDocuments, BlockAlignedDocumentEqualsItsOwnRowBitwise) {
  const Dims packed{1, 192, 2, 1, 16}, alone{1, 64, 2, 1, 16};
  const DocStarts ds = doc_starts(packed, {{50, 128}});
  const std::vector<float> qkv = inputs(packed, 9);
  const std::vector<float> dout = out_grad(packed, 9);
  const Result r = run(qkv, dout, packed, false, ds);
  const std::vector<float> qkv_tail(qkv.begin() + 128 * packed.C3(), qkv.end());
  const std::vector<float> dout_tail(dout.begin() + 128 * packed.NH * packed.HS, dout.end());
  const Result a = run(qkv_tail, dout_tail, alone);
  const std::vector<float> out_tail(r.out.begin() + 128 * packed.NH * packed.HS, r.out.end());
  const std::vector<float> dqkv_tail(r.dqkv.begin() + 128 * packed.C3(), r.dqkv.end());
  EXPECT_TRUE(testing::bitwise_equal(out_tail, a.out, "out"));
  EXPECT_TRUE(testing::bitwise_equal(dqkv_tail, a.dqkv, "dqkv"));
}

TEST(AttentionDocuments, BitwiseAcrossThreadsAndPortable) {
  const Dims d{5, 200, 4, 2, 12};
  const DocStarts ds = doc_starts(d, kLayouts);
  const std::vector<float> qkv = inputs(d, 10);
  const std::vector<float> dout = out_grad(d, 10);
  Result base;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    Result r = run(qkv, dout, d, false, ds);
    if (threads == 1) {
      base = std::move(r);
      continue;
    }
    const std::string what = str(" threads=", threads);
    EXPECT_TRUE(testing::bitwise_equal(r.out, base.out, "out" + what));
    EXPECT_TRUE(testing::bitwise_equal(r.lse, base.lse, "lse" + what));
    EXPECT_TRUE(testing::bitwise_equal(r.dqkv, base.dqkv, "dqkv" + what));
  }
  const Result portable = run(qkv, dout, d, true, ds);
  EXPECT_TRUE(testing::bitwise_equal(portable.out, base.out, "out portable"));
  EXPECT_TRUE(testing::bitwise_equal(portable.lse, base.lse, "lse portable"));
  EXPECT_TRUE(testing::bitwise_equal(portable.dqkv, base.dqkv, "dqkv portable"));
}

// Context parallelism's attention (attention_forward_chunks / attention_backward_chunks), every cp
// rank of a group simulated in one process: rank r holds chunks r and 2P-1-r of each sample and sees
// every key and value. Each rank's out, lse and dq rows are bitwise the whole-sequence call's; the
// ranks' dK, dV contributions, summed in rank order (the reduce-scatter's order), match the whole
// call to rounding and the double reference. Chunk sizes not multiples of kAttnBlock (24, 16, 8, 5)
// and a multiple (64); GQA; packed documents.
TEST(AttentionChunks, LoadBalancedChunksReproduceTheWholeSequence) {
  struct Case {
    Dims d;
    int P;
    bool docs;
  };
  const Case cases[] = {{{2, 96, 4, 2, 16}, 2, false}, {{1, 96, 4, 1, 12}, 3, false}, {{2, 64, 2, 2, 8}, 4, false},
                        {{1, 256, 2, 1, 16}, 2, false}, {{5, 200, 4, 2, 12}, 4, true}, {{1, 40, 2, 2, 8}, 4, true}};
  for (const Case& c : cases) {
    const Dims& d = c.d;
    const DocStarts ds = c.docs ? doc_starts(d, kLayouts) : DocStarts{};
    const int32_t* doc = ds.empty() ? nullptr : ds.data();
    const std::vector<float> qkv = inputs(d, 11), dout = out_grad(d, 11);
    const Result whole = run(qkv, dout, d, false, ds);
    const int64_t C3 = d.C3(), KV = 2 * d.NKV * d.HS, NHS = d.NH * d.HS, Tl = d.T / c.P;
    // Every position's keys and values, as the all-gather assembles them.
    std::vector<float> kv(static_cast<size_t>(d.B * d.T * KV));
    for (int64_t n = 0; n < d.B * d.T; ++n)
      std::copy_n(qkv.begin() + n * C3 + d.NH * d.HS, KV, kv.begin() + n * KV);
    std::vector<float> dkv_sum(kv.size(), 0.0f);
    for (int r = 0; r < c.P; ++r) {
      ContextParallel cp;
      cp.size = c.P;
      cp.rank = r;
      const QueryChunks chunks = cp.chunks(d.T);
      std::vector<int64_t> rows;  // global row of each local row
      for (int64_t b = 0; b < d.B; ++b)
        for (const auto& [begin, end] : chunks)
          for (int64_t t = begin; t < end; ++t) rows.push_back(b * d.T + t);
      ASSERT_EQ(static_cast<int64_t>(rows.size()), d.B * Tl);
      std::vector<float> q_local, dout_local;
      for (int64_t n : rows) {
        q_local.insert(q_local.end(), qkv.begin() + n * C3, qkv.begin() + (n + 1) * C3);
        dout_local.insert(dout_local.end(), dout.begin() + n * NHS, dout.begin() + (n + 1) * NHS);
      }
      std::vector<float> out(static_cast<size_t>(d.B * Tl * NHS)), lse(static_cast<size_t>(d.B * d.NH * Tl));
      attention_forward_chunks(out.data(), lse.data(), q_local.data(), kv.data(), d.B, d.T, chunks, d.NH, d.NKV, d.HS,
                               doc);
      std::vector<float> dq(q_local.size(), std::numeric_limits<float>::quiet_NaN()), dkv(kv.size());
      attention_backward_chunks(dq.data(), dkv.data(), dout_local.data(), q_local.data(), kv.data(), out.data(),
                                lse.data(), d.B, d.T, chunks, d.NH, d.NKV, d.HS, doc);
      for (size_t i = 0; i < dkv.size(); ++i) dkv_sum[i] += dkv[i];
      std::vector<float> want_out, want_lse, got_dq, want_dq;
      for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t n = rows[i], b = n / d.T, t = n % d.T;
        want_out.insert(want_out.end(), whole.out.begin() + n * NHS, whole.out.begin() + (n + 1) * NHS);
        got_dq.insert(got_dq.end(), dq.begin() + static_cast<int64_t>(i) * C3, dq.begin() + static_cast<int64_t>(i) * C3 + NHS);
        want_dq.insert(want_dq.end(), whole.dqkv.begin() + n * C3, whole.dqkv.begin() + n * C3 + NHS);
        for (int64_t h = 0; h < d.NH; ++h)
          EXPECT_EQ(std::bit_cast<uint32_t>(lse[(b * d.NH + h) * Tl + static_cast<int64_t>(i) % Tl]),
                    std::bit_cast<uint32_t>(whole.lse[(b * d.NH + h) * d.T + t]))
              << name(d) << " P=" << c.P << " rank " << r << " lse row " << t << " head " << h;
      }
      const std::string at = name(d) + str(" P=", c.P, " rank ", r);
      EXPECT_TRUE(testing::bitwise_equal(out, want_out, "out " + at));
      EXPECT_TRUE(testing::bitwise_equal(got_dq, want_dq, "dq " + at));
    }
    std::vector<float> want_dkv;
    std::vector<double> ref_dkv;
    const std::vector<double> ref = ref_backward(testing::to_double(qkv), testing::to_double(dout), d, ds);
    for (int64_t n = 0; n < d.B * d.T; ++n) {
      want_dkv.insert(want_dkv.end(), whole.dqkv.begin() + n * C3 + d.NH * d.HS, whole.dqkv.begin() + (n + 1) * C3);
      ref_dkv.insert(ref_dkv.end(), ref.begin() + n * C3 + d.NH * d.HS, ref.begin() + (n + 1) * C3);
    }
    EXPECT_TRUE(testing::all_close(dkv_sum, testing::to_double(want_dkv), 1e-5, 1e-6, "dkv vs whole " + name(d)));
    EXPECT_TRUE(testing::all_close(dkv_sum, ref_dkv, 1e-4, 1e-5, "dkv vs reference " + name(d)));
  }
}

// Query segments (determinism = "layout" with layout_token_segments): the whole-sequence backward
// with G segments keeps dq bitwise, its dK, dV are the canonical tree over the G segments' chains
// (each segment computed alone, as a one-segment chunk) bitwise, AVX2 and portable agree, it matches
// the double reference; and the cp ranks' per-chunk results (attention_backward_chunks, rank r's
// chunks r and 2P-1-r), summed along the canonical tree over the 2P chunks in position order, are
// its bits exactly (what reduce_scatter_dkv does over the group). GQA, documents, chunks of 4..32.
TEST(AttentionChunks, QuerySegmentsAreTheTreeOverSegmentsAndSplitOverCpRanks) {
  struct Case {
    Dims d;
    int64_t G;
    int P;
    bool docs;
  };
  const Case cases[] = {{{2, 64, 4, 2, 16}, 8, 2, false},  {{1, 128, 4, 1, 12}, 8, 4, false},
                        {{2, 96, 2, 2, 8}, 8, 2, true},     {{1, 256, 2, 1, 16}, 16, 2, false},
                        {{1, 40, 2, 2, 8}, 8, 4, true}};
  for (const Case& c : cases) {
    const Dims& d = c.d;
    const std::string at = name(d) + str(" G=", c.G, " P=", c.P);
    const DocStarts ds = c.docs ? doc_starts(d, kLayouts) : DocStarts{};
    const int32_t* doc = ds.empty() ? nullptr : ds.data();
    const std::vector<float> qkv = inputs(d, 21), dout = out_grad(d, 21);
    const Result plain = run(qkv, dout, d, false, ds);
    std::vector<float> seg(qkv.size(), std::numeric_limits<float>::quiet_NaN()), port = seg;
    attention_backward(seg.data(), dout.data(), qkv.data(), plain.out.data(), plain.lse.data(), d.B, d.T, d.NH, d.NKV,
                       d.HS, doc, c.G);
    detail::attention_backward_portable(port.data(), dout.data(), qkv.data(), plain.out.data(), plain.lse.data(), d.B,
                                        d.T, d.NH, d.NKV, d.HS, doc, c.G);
    EXPECT_TRUE(testing::bitwise_equal(port, seg, "portable " + at));
    const int64_t C3 = d.C3(), KV = 2 * d.NKV * d.HS, NHS = d.NH * d.HS, n = d.B * d.T * KV;
    std::vector<float> kv(static_cast<size_t>(n)), want_dkv(kv.size()), got_dq, want_dq;
    std::vector<double> ref_dkv;
    const std::vector<double> ref = ref_backward(testing::to_double(qkv), testing::to_double(dout), d, ds);
    for (int64_t r = 0; r < d.B * d.T; ++r) {
      std::copy_n(qkv.begin() + r * C3 + NHS, KV, kv.begin() + r * KV);
      std::copy_n(seg.begin() + r * C3 + NHS, KV, want_dkv.begin() + r * KV);
      ref_dkv.insert(ref_dkv.end(), ref.begin() + r * C3 + NHS, ref.begin() + (r + 1) * C3);
      got_dq.insert(got_dq.end(), seg.begin() + r * C3, seg.begin() + r * C3 + NHS);
      want_dq.insert(want_dq.end(), plain.dqkv.begin() + r * C3, plain.dqkv.begin() + r * C3 + NHS);
    }
    EXPECT_TRUE(testing::bitwise_equal(got_dq, want_dq, "dq " + at));
    int64_t moved = 0;  // the segments are another association than the one chain: some bits differ
    for (int64_t r = 0; r < d.B * d.T * C3; ++r) moved += std::bit_cast<uint32_t>(seg[r]) != std::bit_cast<uint32_t>(plain.dqkv[r]);
    EXPECT_GT(moved, 0) << at;
    EXPECT_TRUE(testing::all_close(want_dkv, ref_dkv, 1e-4, 1e-5, "dkv vs reference " + at));

    // Local rows of query chunks (one chunk per sample's list), as a cp rank holds them.
    auto local = [&](const std::vector<float>& x, int64_t W, const QueryChunks& ch) {
      std::vector<float> y;
      for (int64_t b = 0; b < d.B; ++b)
        for (const auto& [begin, end] : ch) y.insert(y.end(), x.begin() + (b * d.T + begin) * W, x.begin() + (b * d.T + end) * W);
      return y;
    };
    auto lse_local = [&](const QueryChunks& ch) {
      std::vector<float> y;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.NH; ++h)
          for (const auto& [begin, end] : ch)
            y.insert(y.end(), plain.lse.begin() + (b * d.NH + h) * d.T + begin, plain.lse.begin() + (b * d.NH + h) * d.T + end);
      return y;
    };
    auto chunk_dkv = [&](const QueryChunks& ch) {
      const std::vector<float> q = local(qkv, C3, ch), go = local(dout, NHS, ch), o = local(plain.out, NHS, ch);
      std::vector<float> dq(q.size()), dkv(static_cast<size_t>(static_cast<int64_t>(ch.size()) * n));
      attention_backward_chunks(dq.data(), dkv.data(), go.data(), q.data(), kv.data(), o.data(), lse_local(ch).data(),
                                d.B, d.T, ch, d.NH, d.NKV, d.HS, doc, c.G);
      return dkv;
    };
    // The definition: each segment from zero, then the tree.
    std::vector<std::vector<float>> leaves;
    const std::vector<int64_t> sb = canonical_segments(d.T, c.G);
    for (int64_t g = 0; g < c.G; ++g) leaves.push_back(chunk_dkv({{sb[g], sb[g + 1]}}));
    std::vector<const float*> lp;
    for (const auto& l : leaves) lp.push_back(l.data());
    std::vector<float> tree(static_cast<size_t>(n)), stack(static_cast<size_t>(tree_sum_stack(c.G) * n));
    tree_sum(tree.data(), lp.data(), c.G, n, stack.data());
    EXPECT_TRUE(testing::bitwise_equal(tree, want_dkv, "tree over segments " + at));

    // The cp ranks' chunks, combined along the tree over the 2P chunks in position order.
    std::vector<std::vector<float>> pieces(static_cast<size_t>(2 * c.P));
    for (int r = 0; r < c.P; ++r) {
      ContextParallel cp;
      cp.size = c.P;
      cp.rank = r;
      const std::vector<float> dkv = chunk_dkv(cp.chunks(d.T));
      pieces[static_cast<size_t>(r)].assign(dkv.begin(), dkv.begin() + n);
      pieces[static_cast<size_t>(2 * c.P - 1 - r)].assign(dkv.begin() + n, dkv.end());
    }
    lp.clear();
    for (const auto& p : pieces) lp.push_back(p.data());
    stack.assign(static_cast<size_t>(tree_sum_stack(2 * c.P) * n), 0.0f);
    tree_sum(tree.data(), lp.data(), 2 * c.P, n, stack.data());
    EXPECT_TRUE(testing::bitwise_equal(tree, want_dkv, "cp pieces " + at));
  }
}

}  // namespace
}  // namespace lockstep
