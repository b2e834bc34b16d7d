#include "lockstep/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {
namespace {

constexpr int64_t kBlk = kAttnBlock;
constexpr float kInf = std::numeric_limits<float>::infinity();
// An offset that no tile reaches: a band that does not trim.
constexpr int64_t kFar = int64_t{1} << 40;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The kernel is written once over 8-lane operations; both forms below do the same IEEE operation
// in every lane (max keeps _mm256_max_ps's "a > b ? a : b"), so they give the same bits.
struct PortableOps {
  struct V {
    float x[8];
  };
  static V set1(float a) {
    V r;
    for (float& e : r.x) e = a;
    return r;
  }
  static V zero() { return set1(0.0f); }
  static V load(const float* p) {
    V r;
    std::memcpy(r.x, p, sizeof r.x);
    return r;
  }
  static void store(float* p, const V& a) { std::memcpy(p, a.x, sizeof a.x); }
  static V fma(const V& a, const V& b, V c) {
    for (int i = 0; i < 8; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
    return c;
  }
  static V add(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = a.x[i] + b.x[i];
    return a;
  }
  static V sub(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = a.x[i] - b.x[i];
    return a;
  }
  static V mul(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = a.x[i] * b.x[i];
    return a;
  }
  static V div(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = a.x[i] / b.x[i];
    return a;
  }
  static float max1(float a, float b) { return a > b ? a : b; }
  static V max(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = max1(a.x[i], b.x[i]);
    return a;
  }
  static V exp(V a) {
    for (float& e : a.x) e = vm::exp(e);
    return a;
  }
  // Lanes at index >= n become fill.
  static V keep_first(V a, int64_t n, float fill) {
    for (int64_t i = std::max<int64_t>(n, 0); i < 8; ++i) a.x[i] = fill;
    return a;
  }
  static float hsum(const V& a) { return vm::hsum8(a.x); }
  static float hmax(const V& a) {
    const float a0 = max1(a.x[0], a.x[4]), a1 = max1(a.x[1], a.x[5]);
    const float a2 = max1(a.x[2], a.x[6]), a3 = max1(a.x[3], a.x[7]);
    return max1(max1(a0, a2), max1(a1, a3));
  }
};

#ifdef LOCKSTEP_AVX2
struct Avx2Ops {
  using V = __m256;
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V a) { return vm::exp(a); }
  static V keep_first(V a, int64_t n, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t n32 = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n32), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), a, keep);
  }
  static float hsum(V a) { return vm::hsum(a); }
  static float hmax(V a) { return vm::hmax(a); }
};
using FastOps = Avx2Ops;
#else
using FastOps = PortableOps;
#endif

// Causal trimming of a tile product, per group of 4 rows starting at r0: only columns below
// round_up(r0 + n_off, 8) are computed, and the reduction runs over k in [r0 + k_begin_off,
// r0 + k_end_off). The skipped terms are products with exact zeros (masked probabilities).
struct Band {
  int64_t n_off = kFar;
  int64_t k_begin_off = -kFar;
  int64_t k_end_off = kFar;
  int64_t cols(int64_t r0, int64_t N) const { return std::min(N, round_up(r0 + n_off, 8)); }
};

// C (4 x 8*NV) = init + sum_k A(r, k) * Bm(k, :), one FMA chain per element over k ascending;
// A(r, k) = A[r * a_rs + k * a_ks]. init = C when accumulating, else 0.
template <class O, int NV>
inline void micro_tile(float* C, int64_t ldc, const float* A, int64_t a_rs, int64_t a_ks,
                       const float* Bm, int64_t ldb, int64_t k_begin, int64_t k_end,
                       bool accumulate) {
  using V = typename O::V;
  V c[4][NV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? O::load(C + r * ldc + 8 * v) : O::zero();
  for (int64_t k = k_begin; k < k_end; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = O::load(Bm + k * ldb + 8 * v);
    for (int r = 0; r < 4; ++r) {
      const V a = O::set1(A[r * a_rs + k * a_ks]);
      for (int v = 0; v < NV; ++v) c[r][v] = O::fma(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) O::store(C + r * ldc + 8 * v, c[r][v]);
}

// C (M x N) (+)= A (M x K) * Bm (K x N), M a multiple of 4, N of 8, trimmed by band. Columns that
// the band skips are left untouched.
template <class O>
void tile_mm(float* C, int64_t ldc, const float* A, int64_t a_rs, int64_t a_ks, const float* Bm,
             int64_t ldb, int64_t M, int64_t N, int64_t K, bool accumulate, const Band& band) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int64_t n_end = band.cols(r0, N);
    const int64_t k_begin = std::max<int64_t>(0, r0 + band.k_begin_off);
    const int64_t k_end = std::min(K, r0 + band.k_end_off);
    float* c = C + r0 * ldc;
    const float* a = A + r0 * a_rs;
    int64_t c0 = 0;
    for (; c0 + 16 <= n_end; c0 += 16)
      micro_tile<O, 2>(c + c0, ldc, a, a_rs, a_ks, Bm + c0, ldb, k_begin, k_end, accumulate);
    if (c0 < n_end)
      micro_tile<O, 1>(c + c0, ldc, a, a_rs, a_ks, Bm + c0, ldb, k_begin, k_end, accumulate);
  }
}

// dst (rows_pad x HSp) = src rows (n rows, stride ld_src, HS each) * scale, zero-padded.
void copy_rows(float* dst, int64_t HSp, const float* src, int64_t ld_src, int64_t n,
               int64_t rows_pad, int64_t HS, float scale) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    float* d = dst + r * HSp;
    int64_t c = 0;
    if (r < n) {
      const float* s = src + r * ld_src;
      for (; c < HS; ++c) d[c] = s[c] * scale;
    }
    for (; c < HSp; ++c) d[c] = 0.0f;
  }
}

// dst (HSp x kBlk), dst[d][j] = src row j element d, zero-padded to n_pad columns.
void copy_transposed(float* dst, int64_t HSp, const float* src, int64_t ld_src, int64_t n,
                     int64_t n_pad, int64_t HS) {
  for (int64_t j = 0; j < n_pad; ++j) {
    const float* s = src + j * ld_src;
    int64_t d = 0;
    if (j < n)
      for (; d < HS; ++d) dst[d * kBlk + j] = s[d];
    for (; d < HSp; ++d) dst[d * kBlk + j] = 0.0f;
  }
}

struct Shape {
  int64_t B, T, NH, NKV, HS;
  int64_t HSp;     // HS rounded up to 8: tiles are zero-padded so every loop runs on whole vectors
  int64_t C3;      // qkv row length
  int64_t group;   // query heads per kv head
  int64_t blocks;  // blocks of kBlk positions
  float scale;
};

Shape make_shape(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  LOCKSTEP_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0, "attention: B=", B, " T=", T,
                 " NH=", NH, " NKV=", NKV, " HS=", HS);
  LOCKSTEP_CHECK(NH % NKV == 0, "attention: NH=", NH, " is not a multiple of NKV=", NKV);
  return Shape{B,
               T,
               NH,
               NKV,
               HS,
               round_up(HS, 8),
               (NH + 2 * NKV) * HS,
               NH / NKV,
               (T + kBlk - 1) / kBlk,
               1.0f / std::sqrt(static_cast<float>(HS))};
}

// Scratch that grows to the largest shape seen on this thread, then stays.
float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// One (b, h, query block): out rows and lse of the block.
template <class O>
void forward_block(float* out, float* lse, const float* qkv, const Shape& s, int64_t b, int64_t h,
                   int64_t qb, float* scratch) {
  using V = typename O::V;
  const int64_t HSp = s.HSp;
  float* qs = scratch;           // (kBlk, HSp) scaled queries
  float* kt = qs + kBlk * HSp;   // (HSp, kBlk) keys, transposed
  float* v = kt + HSp * kBlk;    // (kBlk, HSp)
  float* acc = v + kBlk * HSp;   // (kBlk, HSp) unnormalised output
  float* p = acc + kBlk * HSp;   // (kBlk, kBlk) scores, then probabilities
  float* m = p + kBlk * kBlk;    // (kBlk) running max
  float* l = m + kBlk;           // (kBlk) running sum

  const int64_t g = h / s.group;
  const float* base = qkv + b * s.T * s.C3;
  const int64_t q0 = qb * kBlk, nq = std::min(kBlk, s.T - q0), nqp = round_up(nq, 4);
  copy_rows(qs, HSp, base + q0 * s.C3 + h * s.HS, s.C3, nq, nqp, s.HS, s.scale);
  std::fill(acc, acc + nqp * HSp, 0.0f);
  std::fill(m, m + nqp, -kInf);
  std::fill(l, l + nqp, 0.0f);

  for (int64_t kb = 0; kb <= qb; ++kb) {
    const int64_t k0 = kb * kBlk, nk = std::min(kBlk, s.T - k0), nkp = round_up(nk, 8);
    const int64_t diag = q0 - k0;
    copy_transposed(kt, HSp, base + k0 * s.C3 + (s.NH + g) * s.HS, s.C3, nk, nkp, s.HS);
    copy_rows(v, HSp, base + k0 * s.C3 + (s.NH + s.NKV + g) * s.HS, s.C3, nk, nkp, s.HS, 1.0f);

    const Band score_band{.n_off = 4 + diag};
    tile_mm<O>(p, kBlk, qs, HSp, 1, kt, kBlk, nqp, nkp, HSp, false, score_band);
    for (int64_t r = 0; r < nqp; ++r) {
      float* pr = p + r * kBlk;
      const int64_t w = score_band.cols(r / 4 * 4, nkp);
      const int64_t valid = std::min(nk, q0 + r + 1 - k0);
      V vmax = O::set1(-kInf);
      for (int64_t c = 0; c < w; c += 8) {
        const V x = O::keep_first(O::load(pr + c), valid - c, -kInf);
        O::store(pr + c, x);
        vmax = O::max(vmax, x);
      }
      const float bmax = O::hmax(vmax);
      const float m_new = m[r] > bmax ? m[r] : bmax;
      const V mv = O::set1(m_new);
      V vsum = O::zero();
      for (int64_t c = 0; c < w; c += 8) {
        const V e = O::exp(O::sub(O::load(pr + c), mv));
        O::store(pr + c, e);
        vsum = O::add(vsum, e);
      }
      std::fill(pr + w, pr + nkp, 0.0f);
      if (m_new != m[r]) {
        const float corr = vm::exp(m[r] - m_new);
        const V cv = O::set1(corr);
        float* ar = acc + r * HSp;
        for (int64_t d = 0; d < HSp; d += 8) O::store(ar + d, O::mul(O::load(ar + d), cv));
        l[r] *= corr;
        m[r] = m_new;
      }
      l[r] += O::hsum(vsum);
    }
    tile_mm<O>(acc, HSp, p, kBlk, 1, v, HSp, nqp, HSp, nkp, true, Band{.k_end_off = 4 + diag});
  }

  for (int64_t r = 0; r < nq; ++r) {
    float* ar = acc + r * HSp;
    const V lv = O::set1(l[r]);
    for (int64_t d = 0; d < HSp; d += 8) O::store(ar + d, O::div(O::load(ar + d), lv));
    std::memcpy(out + ((b * s.T + q0 + r) * s.NH + h) * s.HS, ar, s.HS * sizeof(float));
    lse[(b * s.NH + h) * s.T + q0 + r] = m[r] + std::log(l[r]);
  }
}

template <class O>
void forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
             int64_t NKV, int64_t HS) {
  const Shape s = make_shape(B, T, NH, NKV, HS);
  parallel_for(B * NH * s.blocks, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(static_cast<size_t>(4 * kBlk * s.HSp + kBlk * kBlk + 2 * kBlk));
    for (int64_t u = begin; u < end; ++u) {
      const int64_t qb = u % s.blocks, h = u / s.blocks % NH, b = u / (s.blocks * NH);
      forward_block<O>(out, lse, qkv, s, b, h, qb, scratch);
    }
  });
}

// One (b, kv head g): dk, dv of g and dq of its query heads, all assigned.
template <class O>
void backward_group(float* dqkv, const float* dout, const float* qkv, const float* out,
                    const float* lse, const Shape& s, int64_t b, int64_t g, float* scratch) {
  using V = typename O::V;
  const int64_t HSp = s.HSp, Tp = round_up(s.T, 4), C = s.NH * s.HS;
  float* kr = scratch;             // (kBlk, HSp) keys
  float* kt = kr + kBlk * HSp;     // (HSp, kBlk) keys, transposed
  float* vt = kt + HSp * kBlk;     // (HSp, kBlk) values, transposed
  float* qs = vt + HSp * kBlk;     // (kBlk, HSp) scaled queries
  float* go = qs + kBlk * HSp;     // (kBlk, HSp) dout
  float* dk = go + kBlk * HSp;     // (kBlk, HSp)
  float* dv = dk + kBlk * HSp;     // (kBlk, HSp)
  float* p = dv + kBlk * HSp;      // (kBlk, kBlk) scores, then probabilities
  float* ds = p + kBlk * kBlk;     // (kBlk, kBlk) dP, then dS
  float* lse_t = ds + kBlk * kBlk; // (kBlk) lse of the query block, +inf on padding rows
  float* row = lse_t + kBlk;       // (2, HSp) padded copies of one out and dout row
  float* dd = row + 2 * HSp;       // (group, Tp) D
  float* dq = dd + s.group * Tp;   // (group, Tp, HSp) unscaled dq

  const float* base = qkv + b * s.T * s.C3;
  for (int64_t hh = 0; hh < s.group; ++hh) {
    const int64_t h = g * s.group + hh;
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t at = (b * s.T + t) * C + h * s.HS;
      copy_rows(row, HSp, out + at, 0, 1, 1, s.HS, 1.0f);
      copy_rows(row + HSp, HSp, dout + at, 0, 1, 1, s.HS, 1.0f);
      V acc = O::zero();
      for (int64_t d = 0; d < HSp; d += 8) acc = O::fma(O::load(row + d), O::load(row + HSp + d), acc);
      dd[hh * Tp + t] = O::hsum(acc);
    }
    std::fill(dd + hh * Tp + s.T, dd + (hh + 1) * Tp, 0.0f);
  }
  std::fill(dq, dq + s.group * Tp * HSp, 0.0f);

  for (int64_t kb = 0; kb < s.blocks; ++kb) {
    const int64_t k0 = kb * kBlk, nk = std::min(kBlk, s.T - k0), nkp = round_up(nk, 8);
    const float* krow = base + k0 * s.C3 + (s.NH + g) * s.HS;
    const float* vrow = base + k0 * s.C3 + (s.NH + s.NKV + g) * s.HS;
    copy_rows(kr, HSp, krow, s.C3, nk, nkp, s.HS, 1.0f);
    copy_transposed(kt, HSp, krow, s.C3, nk, nkp, s.HS);
    copy_transposed(vt, HSp, vrow, s.C3, nk, nkp, s.HS);
    std::fill(dk, dk + nkp * HSp, 0.0f);
    std::fill(dv, dv + nkp * HSp, 0.0f);

    for (int64_t hh = 0; hh < s.group; ++hh) {
      const int64_t h = g * s.group + hh;
      for (int64_t qb = kb; qb < s.blocks; ++qb) {
        const int64_t q0 = qb * kBlk, nq = std::min(kBlk, s.T - q0), nqp = round_up(nq, 4);
        const int64_t diag = q0 - k0;
        copy_rows(qs, HSp, base + q0 * s.C3 + h * s.HS, s.C3, nq, nqp, s.HS, s.scale);
        copy_rows(go, HSp, dout + (b * s.T + q0) * C + h * s.HS, C, nq, nqp, s.HS, 1.0f);
        const float* lse_row = lse + (b * s.NH + h) * s.T + q0;
        for (int64_t r = 0; r < nqp; ++r) lse_t[r] = r < nq ? lse_row[r] : kInf;

        const Band score_band{.n_off = 4 + diag};
        tile_mm<O>(p, kBlk, qs, HSp, 1, kt, kBlk, nqp, nkp, HSp, false, score_band);
        tile_mm<O>(ds, kBlk, go, HSp, 1, vt, kBlk, nqp, nkp, HSp, false, score_band);
        const float* d_row = dd + hh * Tp + q0;
        for (int64_t r = 0; r < nqp; ++r) {
          float* pr = p + r * kBlk;
          float* dsr = ds + r * kBlk;
          const int64_t w = score_band.cols(r / 4 * 4, nkp);
          const int64_t valid = std::min(nk, q0 + r + 1 - k0);
          const V lv = O::set1(lse_t[r]), dv_ = O::set1(d_row[r]);
          for (int64_t c = 0; c < w; c += 8) {
            const V x = O::keep_first(O::load(pr + c), valid - c, -kInf);
            const V e = O::exp(O::sub(x, lv));
            O::store(pr + c, e);
            O::store(dsr + c, O::mul(e, O::sub(O::load(dsr + c), dv_)));
          }
          std::fill(pr + w, pr + nkp, 0.0f);
          std::fill(dsr + w, dsr + nkp, 0.0f);
        }
        const Band key_band{.k_begin_off = -diag};
        tile_mm<O>(dv, HSp, p, 1, kBlk, go, HSp, nkp, HSp, nqp, true, key_band);
        tile_mm<O>(dk, HSp, ds, 1, kBlk, qs, HSp, nkp, HSp, nqp, true, key_band);
        tile_mm<O>(dq + (hh * Tp + q0) * HSp, HSp, ds, kBlk, 1, kr, HSp, nqp, HSp, nkp, true,
                   Band{.k_end_off = 4 + diag});
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      float* drow = dqkv + (b * s.T + k0 + j) * s.C3;
      std::memcpy(drow + (s.NH + g) * s.HS, dk + j * HSp, s.HS * sizeof(float));
      std::memcpy(drow + (s.NH + s.NKV + g) * s.HS, dv + j * HSp, s.HS * sizeof(float));
    }
  }

  for (int64_t hh = 0; hh < s.group; ++hh) {
    const int64_t h = g * s.group + hh;
    for (int64_t t = 0; t < s.T; ++t) {
      float* drow = dqkv + (b * s.T + t) * s.C3 + h * s.HS;
      const float* src = dq + (hh * Tp + t) * HSp;
      for (int64_t d = 0; d < s.HS; ++d) drow[d] = src[d] * s.scale;
    }
  }
}

template <class O>
void backward(float* dqkv, const float* dout, const float* qkv, const float* out,
              const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const Shape s = make_shape(B, T, NH, NKV, HS);
  const int64_t Tp = round_up(T, 4);
  const size_t need = static_cast<size_t>(7 * kBlk * s.HSp + 2 * kBlk * kBlk + kBlk + 2 * s.HSp +
                                          s.group * Tp * (1 + s.HSp));
  parallel_for(B * NKV, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(need);
    for (int64_t u = begin; u < end; ++u)
      backward_group<O>(dqkv, dout, qkv, out, lse, s, u / NKV, u % NKV, scratch);
  });
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t HS) {
  forward<FastOps>(out, lse, qkv, B, T, NH, NKV, HS);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t HS) {
  backward<FastOps>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS);
}

namespace detail {
void attention_forward_portable(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                                int64_t NH, int64_t NKV, int64_t HS) {
  forward<PortableOps>(out, lse, qkv, B, T, NH, NKV, HS);
}
void attention_backward_portable(float* dqkv, const float* dout, const float* qkv,
                                 const float* out, const float* lse, int64_t B, int64_t T,
                                 int64_t NH, int64_t NKV, int64_t HS) {
  backward<PortableOps>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS);
}
}  // namespace detail

}  // namespace lockstep
