// Attention test helpers shared by the op harness's cases (tests/ops/attention.cpp) and the CPU
// backend's own tests (tests/test_attention.cpp): shapes, packed-document layouts, inputs, and the
// double-precision references.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../testing.h"
#include "lockstep/core/error.h"

namespace lockstep::attention_testing {

struct Dims {
  int64_t B, T, NH, NKV, HS;
  int64_t C3() const { return (NH + 2 * NKV) * HS; }
  int64_t qkv_size() const { return B * T * C3(); }
  int64_t out_size() const { return B * T * NH * HS; }
  int64_t lse_size() const { return B * NH * T; }
};

inline std::string name(const Dims& d) {
  return str("B=", d.B, " T=", d.T, " NH=", d.NH, " NKV=", d.NKV, " HS=", d.HS);
}

// Offsets of query head h, key head g and value head g within a qkv row.
inline int64_t q_at(const Dims& d, int64_t h) { return h * d.HS; }
inline int64_t k_at(const Dims& d, int64_t g) { return (d.NH + g) * d.HS; }
inline int64_t v_at(const Dims& d, int64_t g) { return (d.NH + d.NKV + g) * d.HS; }

// Per-token document starts (B, T), or empty for plain causal attention. Query t sees keys
// first_key(t) .. t.
using DocStarts = std::vector<int32_t>;
inline int64_t first_key(const DocStarts& ds, const Dims& d, int64_t b, int64_t t) {
  return ds.empty() ? 0 : ds[b * d.T + t];
}

// Full masked softmax in double; p (T, T) of one (b, h), zero outside each query's visible keys.
inline void ref_probs(std::vector<double>& p, std::vector<double>* lse, const std::vector<double>& qkv, const Dims& d,
                      int64_t b, int64_t h, const DocStarts& ds = {}) {
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

inline void ref_forward(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv,
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
inline std::vector<double> ref_backward(const std::vector<double>& qkv, const std::vector<double>& dout, const Dims& d,
                                        const DocStarts& ds = {}) {
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

inline std::vector<float> inputs(const Dims& d, uint64_t seed) {
  return testing::randn(d.qkv_size(), seed, "attention/qkv", 1.5f);
}
inline std::vector<float> out_grad(const Dims& d, uint64_t seed) {
  return testing::randn(d.out_size(), seed, "attention/dout");
}

// Document starts from the positions where documents begin in each row (besides 0); row b uses
// starts[b % starts.size()], entries >= T ignored.
inline DocStarts doc_starts(const Dims& d, const std::vector<std::vector<int64_t>>& starts) {
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
inline const std::vector<std::vector<int64_t>>& layouts() {
  static const std::vector<std::vector<int64_t>> l = {
      {3, 60, 70, 129}, {128, 140}, {1, 2, 3, 100, 140, 199}, {}, {64, 65, 190}};
  return l;
}

}  // namespace lockstep::attention_testing
