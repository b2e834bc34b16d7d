#include "lockstep/kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/libm.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {

constexpr float kNormEps = 1e-20f;  // Megatron's guard in the sigmoid renormalisation

// softmax of x (n) into out, FP32: max, exp(x - max), sum in index order, divide.
void softmax(float* out, const float* x, int64_t n) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += out[i] = libm::expf(x[i] - m);
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}

float sigmoid(float x) { return 1.0f / (1.0f + libm::expf(-x)); }

// The K largest of v among `allowed` (null = all), ties to the lower index; out ascending.
void topk(int32_t* out, const float* v, const uint8_t* allowed, int64_t E, int64_t K) {
  int64_t n = 0;
  uint8_t taken[1024];
  LOCKSTEP_CHECK(E <= 1024, "router supports at most 1024 experts");
  std::fill(taken, taken + E, 0);
  for (int64_t k = 0; k < K; ++k) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (taken[e] || (allowed && !allowed[e])) continue;
      if (best < 0 || v[e] > v[best]) best = e;
    }
    LOCKSTEP_CHECK(best >= 0, "top-k found no expert");
    taken[best] = 1;
    out[n++] = static_cast<int32_t>(best);
  }
  std::sort(out, out + K);
}

// Top-K of v (E), group-limited when s.groups > 0: each group scores the sum of its best
// K / group_topk values, the group_topk best groups stay, and the K come from them.
void select(int32_t* out, const float* v, const RouterSpec& s) {
  if (s.groups <= 0) return topk(out, v, nullptr, s.E, s.K);
  const int64_t per = s.E / s.groups, take = s.K / s.group_topk;
  float gscore[1024];
  int32_t tmp[1024];
  for (int64_t g = 0; g < s.groups; ++g) {
    topk(tmp, v + g * per, nullptr, per, take);
    float sum = 0;
    for (int64_t i = 0; i < take; ++i) sum += v[g * per + tmp[i]];
    gscore[g] = sum;
  }
  int32_t kept_groups[1024];
  topk(kept_groups, gscore, nullptr, s.groups, s.group_topk);
  uint8_t allowed[1024] = {};
  for (int64_t i = 0; i < s.group_topk; ++i)
    std::fill(allowed + kept_groups[i] * per, allowed + (kept_groups[i] + 1) * per, 1);
  topk(out, v, allowed, s.E, s.K);
}

// The aux-loss scores a (E) of one token.
void aux_scores(float* a, const float* z, const RouterSpec& s) {
  if (!s.sigmoid) return softmax(a, z, s.E);
  float sum = 0;
  for (int64_t e = 0; e < s.E; ++e) sum += a[e] = sigmoid(z[e]);
  for (int64_t e = 0; e < s.E; ++e) a[e] /= sum + kNormEps;
}

}  // namespace

void route_topk(int32_t* idx, float* probs, const float* logits, const float* expert_bias, const RouterSpec& s,
                int64_t N) {
  const int64_t E = s.E, K = s.K;
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* z = logits + t * E;
      int32_t* id = idx + t * K;
      float* p = probs + t * K;
      if (!s.sigmoid && !s.pre_softmax) {
        select(id, z, s);
        float zk[1024];
        for (int64_t k = 0; k < K; ++k) zk[k] = z[id[k]];
        softmax(p, zk, K);
      } else if (!s.sigmoid) {
        softmax(sc.data(), z, E);
        select(id, sc.data(), s);
        for (int64_t k = 0; k < K; ++k) p[k] = sc[id[k]];
      } else {
        for (int64_t e = 0; e < E; ++e) sc[e] = sigmoid(z[e]);
        if (expert_bias) {
          for (int64_t e = 0; e < E; ++e) sel[e] = sc[e] + expert_bias[e];
          select(id, sel.data(), s);
        } else {
          select(id, sc.data(), s);
        }
        float sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += p[k] = sc[id[k]];
        if (K > 1)
          for (int64_t k = 0; k < K; ++k) p[k] /= sum + kNormEps;
      }
      for (int64_t k = 0; k < K; ++k) p[k] *= s.scaling;
    }
  });
}

void route_topk_backward(float* dlogits, const float* dprobs, const float* logits, const int32_t* idx,
                         const RouterSpec& s, int64_t N) {
  const int64_t E = s.E, K = s.K;
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc(static_cast<size_t>(E)), ds(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* z = logits + t * E;
      const int32_t* id = idx + t * K;
      const float* dp = dprobs + t * K;
      float* dz = dlogits + t * E;
      std::fill(dz, dz + E, 0.0f);
      if (!s.sigmoid && !s.pre_softmax) {
        // p = scaling * softmax(z_chosen): dz_j = scaling * p^_j (dp_j - <dp, p^>).
        float zk[1024], q[1024];
        for (int64_t k = 0; k < K; ++k) zk[k] = z[id[k]];
        softmax(q, zk, K);
        float dot = 0;
        for (int64_t k = 0; k < K; ++k) dot += dp[k] * q[k];
        for (int64_t k = 0; k < K; ++k) dz[id[k]] = s.scaling * q[k] * (dp[k] - dot);
      } else if (!s.sigmoid) {
        // p_j = scaling * softmax(z)_j for chosen j: dz = s (ds - <ds, s>).
        softmax(sc.data(), z, E);
        std::fill(ds.begin(), ds.end(), 0.0f);
        for (int64_t k = 0; k < K; ++k) ds[id[k]] = s.scaling * dp[k];
        float dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += ds[e] * sc[e];
        for (int64_t e = 0; e < E; ++e) dz[e] = sc[e] * (ds[e] - dot);
      } else {
        // p_j = scaling * s_j / (sum_chosen s + eps) (K > 1), s = sigmoid(z).
        float sk[1024], dsk[1024];
        float sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += sk[k] = sigmoid(z[id[k]]);
        if (K > 1) {
          const float D = sum + kNormEps;
          float dot = 0;
          for (int64_t k = 0; k < K; ++k) dot += dp[k] * sk[k];
          for (int64_t k = 0; k < K; ++k) dsk[k] = s.scaling * (dp[k] / D - dot / (D * D));
        } else {
          dsk[0] = s.scaling * dp[0];
        }
        for (int64_t k = 0; k < K; ++k) dz[id[k]] = dsk[k] * sk[k] * (1.0f - sk[k]);
      }
    }
  });
}

void apply_capacity(uint8_t* kept, const int32_t* idx, const float* probs, const RouterSpec& s, int64_t N) {
  const int64_t K = s.K, cap = expert_capacity(s, N);
  std::fill(kept, kept + N * K, uint8_t{1});
  if (cap == 0) return;
  parallel_for(s.E, [&](int64_t e0, int64_t e1) {
    std::vector<int64_t> choices;  // t * K + k, in token order
    for (int64_t e = e0; e < e1; ++e) {
      choices.clear();
      for (int64_t i = 0; i < N * K; ++i)
        if (idx[i] == e) choices.push_back(i);
      if (static_cast<int64_t>(choices.size()) <= cap) continue;
      if (!s.drop_by_position)
        std::stable_sort(choices.begin(), choices.end(), [&](int64_t a, int64_t b) { return probs[a] > probs[b]; });
      for (size_t j = static_cast<size_t>(cap); j < choices.size(); ++j) kept[choices[j]] = 0;
    }
  });
}

void router_statistics(RouterStatistics& st, const float* logits, const RouterSpec& s, int64_t B, int64_t T) {
  const int64_t E = s.E, K = s.K;
  st.counts.assign(static_cast<size_t>(B * E), 0);
  st.psum.assign(static_cast<size_t>(B * E), 0.0);
  st.zsq.assign(static_cast<size_t>(B), 0.0);
  const bool any_aux = s.aux_coeff > 0 && (s.aux || s.seq_aux || s.global_aux);
  if (!any_aux && s.z_coeff <= 0) return;
  std::vector<double>& psum = st.psum;
  std::vector<double>& zsq = st.zsq;
  std::vector<int64_t>& counts_seq = st.counts;
  // Per sequence: probability sums (B, E) and counts; per token lse^2 for the z-loss. One thread
  // per sequence, tokens in order.
  parallel_for(B, [&](int64_t b0, int64_t b1) {
    std::vector<float> a(static_cast<size_t>(E));
    int32_t id[1024];
    for (int64_t b = b0; b < b1; ++b) {
      double z2 = 0;
      for (int64_t t = b * T; t < (b + 1) * T; ++t) {
        const float* z = logits + t * E;
        if (s.z_coeff > 0) {
          float m = z[0];
          for (int64_t e = 1; e < E; ++e) m = std::max(m, z[e]);
          float sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += libm::expf(z[e] - m);
          const double lse = static_cast<double>(m) + libm::log(static_cast<double>(sum));
          z2 += lse * lse;
        }
        if (!any_aux) continue;
        aux_scores(a.data(), z, s);
        for (int64_t e = 0; e < E; ++e) psum[b * E + e] += a[e];
        topk(id, a.data(), nullptr, E, K);
        for (int64_t k = 0; k < K; ++k) ++counts_seq[b * E + id[k]];
      }
      zsq[b] = z2;
    }
  });
}

void aux_losses_backward(float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                         const double* g, const double* gseq, float scale, int64_t first, int64_t rows) {
  const int64_t E = s.E, N = B * T;
  const bool any_aux = s.aux_coeff > 0 && (s.aux || s.seq_aux || s.global_aux);
  const double n = static_cast<double>(N);
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    std::vector<float> a(static_cast<size_t>(E)), ga(static_cast<size_t>(E)), sg(static_cast<size_t>(E));
    for (int64_t t = first + r0; t < first + r1; ++t) {
      const float* z = logits + t * E;
      float* dz = dlogits + (t - first) * E;
      const int64_t b = t / T;
      if (any_aux) {
        for (int64_t e = 0; e < E; ++e) ga[e] = static_cast<float>(g[e] + gseq[b * E + e]) * scale;
        if (!s.sigmoid) {
          softmax(a.data(), z, E);
          float dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += ga[e] * a[e];
          for (int64_t e = 0; e < E; ++e) dz[e] += a[e] * (ga[e] - dot);
        } else {
          // a = sg / (sum sg + eps), sg = sigmoid(z).
          float sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += sg[e] = sigmoid(z[e]);
          const float D = sum + kNormEps;
          float dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += ga[e] * sg[e];
          for (int64_t e = 0; e < E; ++e) dz[e] += (ga[e] / D - dot / (D * D)) * sg[e] * (1.0f - sg[e]);
        }
      }
      if (s.z_coeff > 0) {
        // d/dz_e of coeff * lse^2 / N = coeff * 2 lse softmax(z)_e / N.
        float m = z[0];
        for (int64_t e = 1; e < E; ++e) m = std::max(m, z[e]);
        float sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += a[e] = libm::expf(z[e] - m);
        const float lse = m + libm::logf(sum);
        const float c = static_cast<float>(2.0 * s.z_coeff / n) * lse * scale;
        for (int64_t e = 0; e < E; ++e) dz[e] += c * (a[e] / sum);
      }
    }
  });
}

void router_jitter(float* u, float* y, const float* x, const int64_t* rows, int64_t N, int64_t C, uint64_t seed,
                   uint64_t purpose, float lo, float width) {
  const RandomStream rng(seed, purpose);
  parallel_for(N * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      u[i] = lo + width * rng.uniform(static_cast<uint64_t>(rows[i / C] * C + i % C));
      y[i] = x[i] * u[i];
    }
  });
}

}  // namespace lockstep
