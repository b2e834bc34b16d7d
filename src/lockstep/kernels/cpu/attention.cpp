#include "lockstep/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/libm.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
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
  static V max(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
    return a;
  }
  static V exp(V a) {
    for (float& e : a.x) e = vm::exp(e);
    return a;
  }
  // Lanes at index < n become fill.
  static V keep_from(V a, int64_t n, float fill) {
    for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) a.x[i] = fill;
    return a;
  }
  static float hsum(const V& a) { return vm::hsum8(a.x); }
  // Lanes whose document start ds is after key position pos become fill.
  static V mask_before_start(V a, const V& ds, float pos, float fill) {
    for (int i = 0; i < 8; ++i) a.x[i] = ds.x[i] > pos ? fill : a.x[i];
    return a;
  }
  // -inf lanes become 0: the shift of a softmax whose keys are all masked so far.
  static V finite_shift(V a) {
    for (float& e : a.x) e = e == -kInf ? 0.0f : e;
    return a;
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
  static V keep_from(V a, int64_t n, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t n32 = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
    const __m256 drop = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n32), lane));
    return _mm256_blendv_ps(a, _mm256_set1_ps(fill), drop);
  }
  static float hsum(V a) { return vm::hsum(a); }
  static V mask_before_start(V a, V ds, float pos, float fill) {
    const __m256 drop = _mm256_cmp_ps(ds, _mm256_set1_ps(pos), _CMP_GT_OQ);
    return _mm256_blendv_ps(a, _mm256_set1_ps(fill), drop);
  }
  static V finite_shift(V a) {
    const __m256 ninf = _mm256_cmp_ps(a, _mm256_set1_ps(-kInf), _CMP_EQ_OQ);
    return _mm256_blendv_ps(a, _mm256_setzero_ps(), ninf);
  }
};
using FastOps = Avx2Ops;
#else
using FastOps = PortableOps;
#endif

// Causal trimming of a tile product, per group of 4 rows starting at r0: columns below
// r0 + n_begin_off (rounded down to 8) are not computed, and the reduction runs over k in
// [r0 + k_begin_off, r0 + k_end_off). The skipped terms are products with exact zeros (masked
// probabilities).
struct Band {
  int64_t n_begin_off = -kFar;
  int64_t k_begin_off = -kFar;
  int64_t k_end_off = kFar;
};

// C (4 x 8*NV) = init + sum_k A(r, k) * Bm(k, :), one FMA chain per element over k ascending;
// A(r, k) = A[r * a_rs + k * a_ks]. init = C when accumulating, else 0.
template <class O, int NV>
inline void micro_tile(float* C, int64_t ldc, const float* A, int64_t a_rs, int64_t a_ks, const float* Bm, int64_t ldb,
                       int64_t k_begin, int64_t k_end, bool accumulate) {
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
void tile_mm(float* C, int64_t ldc, const float* A, int64_t a_rs, int64_t a_ks, const float* Bm, int64_t ldb, int64_t M,
             int64_t N, int64_t K, bool accumulate, const Band& band) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int64_t k_begin = std::max<int64_t>(0, r0 + band.k_begin_off);
    const int64_t k_end = std::min(K, r0 + band.k_end_off);
    float* c = C + r0 * ldc;
    const float* a = A + r0 * a_rs;
    int64_t c0 = std::max<int64_t>(0, (r0 + band.n_begin_off) / 8 * 8);
    for (; c0 + 16 <= N; c0 += 16)
      micro_tile<O, 2>(c + c0, ldc, a, a_rs, a_ks, Bm + c0, ldb, k_begin, k_end, accumulate);
    if (c0 < N) micro_tile<O, 1>(c + c0, ldc, a, a_rs, a_ks, Bm + c0, ldb, k_begin, k_end, accumulate);
  }
}

// dst (rows_pad x HSp) = src rows (n rows, stride ld_src, HS each) * scale, zero-padded.
void copy_rows(float* dst, int64_t HSp, const float* src, int64_t ld_src, int64_t n, int64_t rows_pad, int64_t HS,
               float scale) {
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

#ifdef LOCKSTEP_AVX2
// dst[d][i] = src[i][d] * scale for an 8 x 8 block.
inline void transpose8x8(float* dst, int64_t ldd, const float* src, int64_t lds, __m256 scale) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(src + i * lds), scale);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int d = 0; d < 4; ++d) {
    _mm256_storeu_ps(dst + d * ldd, _mm256_permute2f128_ps(r[d], r[d + 4], 0x20));
    _mm256_storeu_ps(dst + (d + 4) * ldd, _mm256_permute2f128_ps(r[d], r[d + 4], 0x31));
  }
}
#endif

// dst (HSp x kBlk), dst[d][i] = src row i element d * scale, zero-padded to n_pad columns. Pure
// data movement and one multiply per element, so the AVX2 blocks give the scalar loop's bits.
void copy_transposed(float* dst, int64_t HSp, const float* src, int64_t ld_src, int64_t n, int64_t n_pad, int64_t HS,
                     float scale) {
  int64_t n8 = 0, hs8 = 0;
#ifdef LOCKSTEP_AVX2
  n8 = n / 8 * 8;
  hs8 = HS / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8)
    for (int64_t d = 0; d < hs8; d += 8)
      transpose8x8(dst + d * kBlk + i, kBlk, src + i * ld_src + d, ld_src, _mm256_set1_ps(scale));
#endif
  for (int64_t i = 0; i < n_pad; ++i) {
    const float* s = src + i * ld_src;
    for (int64_t d = i < n8 ? hs8 : 0; d < HSp; ++d) dst[d * kBlk + i] = i < n && d < HS ? s[d] * scale : 0.0f;
  }
}

// A block of query rows: global positions [q0, q0 + nq) inside one kBlk-aligned block of
// positions, whose local rows start at `row`.
struct QBlock {
  int64_t q0, nq, row;
  int64_t chunk;    // the query chunk it belongs to
  int64_t segment;  // query segments: its canonical segment's index among the chunk's (else 0)
};

// A block of at most kBlk key rows: positions [k0, k0 + nk), rows [row, row + nk) of the key tensor,
// at row srow of the backward's padded copy (each key chunk padded to a multiple of 4 rows there).
struct KBlock {
  int64_t k0, nk, row, srow;
};

struct Shape {
  int64_t B, T, NH, NKV, HS;
  int64_t Tl;                      // query rows per sample (T without context parallelism)
  int64_t HSp;                     // HS rounded up to 8: tiles are zero-padded so every loop runs on whole vectors
  int64_t group;                   // query heads per kv head
  std::span<const QBlock> blocks;  // the query blocks of a sample, ascending
  float scale;
  // Query segments (determinism = "layout", layout_token_segments): dk and dv are summed per
  // canonical segment, each from zero, then along the canonical tree over each chunk's segments.
  int64_t segments = 0;        // per sample (0: one chain over all queries)
  int64_t max_chunk_segs = 0;  // the most segments a chunk holds
  int64_t chunks = 1;
  // The keys: blocks of kBlk positions from 0 (the whole sequence: rows = positions), or, for ring
  // attention's partial calls, each key chunk's blocks from its start, its rows back to back.
  std::span<const KBlock> kblocks{};
  std::span<const std::pair<int64_t, int64_t>> kchunks{};  // partial: the key chunks (else empty)
  int64_t Tk = 0;                                          // key rows per sample
  int64_t Tks = 0;                                         // rows of the backward's padded key copy
  bool partial = false;  // forward: a query may see no key (out 0, lse -inf); backward: dq accumulated
};

// Where the operands live. q (B, Tl, ldq) query head h at column h * HS; k, v (B, T, ldkv) key /
// value group g at column g * HS; out, dout (B, Tl, NH * HS). The gradients mirror them.
struct Io {
  const float* q;
  int64_t ldq;
  const float* k;
  const float* v;
  int64_t ldkv;
  float* dq;
  int64_t lddq;
  float* dk;
  float* dv;
  int64_t lddkv;
};

using Chunks = std::span<const std::pair<int64_t, int64_t>>;

// The query blocks of a sample; kept per calling thread (its capacity stays, so steady-state calls
// do not allocate), read by the pool's workers during the call.
Shape make_shape(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, Chunks chunks, int64_t segments) {
  LOCKSTEP_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0, "attention: B=", B, " T=", T, " NH=", NH, " NKV=", NKV,
                 " HS=", HS);
  LOCKSTEP_CHECK(NH % NKV == 0, "attention: NH=", NH, " is not a multiple of NKV=", NKV);
  LOCKSTEP_CHECK(segments >= 0 && segments <= T, "attention: ", segments, " query segments of ", T, " positions");
  thread_local std::vector<QBlock> blocks;
  blocks.clear();
  Shape s{B, T, NH, NKV, HS, 0, round_up(HS, 8), NH / NKV, {}, 1.0f / std::sqrt(static_cast<float>(HS))};
  s.segments = segments;
  s.chunks = static_cast<int64_t>(chunks.size());
  // Segment g of a sample is [g T / G, (g + 1) T / G) (canonical_segments).
  auto bound = [&](int64_t g) { return g * T / segments; };
  int64_t prev_end = 0;
  for (size_t j = 0; j < chunks.size(); ++j) {
    const auto [begin, end] = chunks[j];
    LOCKSTEP_CHECK(begin >= prev_end && begin < end && end <= T, "attention: query chunk [", begin, ", ", end,
                   ") is not ascending inside [0, ", T, ")");
    prev_end = end;
    int64_t g = 0, g_end = 1;  // the chunk's segments [g, g_end)
    if (segments) {
      g = begin * segments / T;
      while (bound(g) < begin) ++g;
      g_end = g;
      while (bound(g_end) < end) ++g_end;
      LOCKSTEP_CHECK(bound(g) == begin && bound(g_end) == end, "attention: query chunk [", begin, ", ", end,
                     ") is not whole segments of ", T, " / ", segments);
      s.max_chunk_segs = std::max(s.max_chunk_segs, g_end - g);
    }
    for (int64_t k = g; k < g_end; ++k) {
      const int64_t b0 = segments ? bound(k) : begin, b1 = segments ? bound(k + 1) : end;
      // Query blocks never cross a multiple of kBlk (or a segment), so every key block a query sees
      // is whole or the diagonal one, as in the whole-sequence call.
      for (int64_t q0 = b0; q0 < b1; q0 = (q0 / kBlk + 1) * kBlk) {
        const int64_t nq = std::min(b1, (q0 / kBlk + 1) * kBlk) - q0;
        blocks.push_back({q0, nq, s.Tl, static_cast<int64_t>(j), k - g});
        s.Tl += nq;
      }
    }
  }
  s.blocks = blocks;
  return s;
}

// The key blocks: the whole sequence's (kchunks empty) or those of each key chunk.
void set_keys(Shape& s, Chunks kchunks) {
  thread_local std::vector<KBlock> kb;
  kb.clear();
  if (kchunks.empty()) {
    for (int64_t k0 = 0; k0 < s.T; k0 += kBlk) kb.push_back({k0, std::min(kBlk, s.T - k0), k0, k0});
    s.Tk = s.T;
    s.Tks = round_up(s.T, 4);
  } else {
    int64_t prev_end = 0;
    for (const auto& [begin, end] : kchunks) {
      LOCKSTEP_CHECK(begin >= prev_end && begin < end && end <= s.T, "attention: key chunk [", begin, ", ", end,
                     ") is not ascending inside [0, ", s.T, ")");
      prev_end = end;
      for (int64_t k0 = begin; k0 < end; k0 += kBlk)
        kb.push_back({k0, std::min(kBlk, end - k0), s.Tk + k0 - begin, s.Tks + k0 - begin});
      s.Tk += end - begin;
      s.Tks += round_up(end - begin, 4);
    }
    s.partial = true;
    s.kchunks = kchunks;
  }
  s.kblocks = kb;
}

// Scratch that grows to the largest shape seen on this thread, then stays.
float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Score tiles are transposed, (key j, query i), so that a vector holds 8 queries: the softmax
// statistics of 8 queries advance together and the sums over keys need no horizontal reduction.
// Key j may be seen by query i when k0 + j <= q0 + i, i.e. i >= j - diag with diag = q0 - k0.
// Returns how many rows of query chunk [c, c + 8) hold a visible key: rows past it are all masked.
inline int64_t visible_rows(int64_t c, int64_t diag, int64_t nk) {
  return std::max<int64_t>(0, std::min(nk, c + 8 + diag));
}

// Document starts of a query block: dsf[i] = doc_start of query q0 + i as float (exact below 2^24
// positions; 0 for padding queries, which then see what plain causal attention shows them).
// Returns the first key position that any query of the block sees.
int64_t block_doc_starts(float* dsf, const int32_t* ds, int64_t q0, int64_t nq, int64_t nqp) {
  int64_t lo = q0;
  for (int64_t i = 0; i < nqp; ++i) {
    dsf[i] = i < nq ? static_cast<float>(ds[q0 + i]) : 0.0f;
    if (i < nq) lo = std::min<int64_t>(lo, ds[q0 + i]);
  }
  return lo;
}

// The largest document start among queries [c, c + 8): keys at or past it need no document mask.
inline int64_t chunk_doc_start(const float* dsf, int64_t c) {
  float hi = 0.0f;
  for (int64_t i = c; i < c + 8; ++i) hi = std::max(hi, dsf[i]);
  return static_cast<int64_t>(hi);
}

void check_doc_start(const int32_t* doc_start, int64_t B, int64_t T) {
  if (!doc_start) return;
  for (int64_t n = 0; n < B * T; ++n)
    LOCKSTEP_CHECK(doc_start[n] >= 0 && doc_start[n] <= n % T, "attention: doc_start ", doc_start[n], " at (b ", n / T,
                   ", t ", n % T, ") is outside [0, t]");
}

// One (b, h, query block): out rows and lse of the block.
template <class O>
void forward_block(float* out, float* lse, const Io& io, const int32_t* doc_start, const Shape& s, int64_t b, int64_t h,
                   const QBlock& blk, float* scratch) {
  using V = typename O::V;
  const int64_t HSp = s.HSp;
  float* qt = scratch;           // (HSp, kBlk) scaled queries, transposed
  float* kr = qt + HSp * kBlk;   // (kBlk, HSp) keys
  float* vr = kr + kBlk * HSp;   // (kBlk, HSp) values
  float* acc = vr + kBlk * HSp;  // (kBlk, HSp) unnormalised output
  float* pt = acc + kBlk * HSp;  // (kBlk keys, kBlk queries) scores, then probabilities
  float* m = pt + kBlk * kBlk;   // (kBlk) running max
  float* l = m + kBlk;           // (kBlk) running sum
  float* corr = l + kBlk;        // (kBlk) rescaling of acc for the current key block
  float* dsf = corr + kBlk;      // (kBlk) document starts of the queries (doc_start only)

  const int64_t g = h / s.group;
  const float* kbase = io.k + b * s.Tk * io.ldkv + g * s.HS;
  const float* vbase = io.v + b * s.Tk * io.ldkv + g * s.HS;
  const int64_t q0 = blk.q0, nq = blk.nq, nqp = round_up(nq, 8);
  copy_transposed(qt, HSp, io.q + (b * s.Tl + blk.row) * io.ldq + h * s.HS, io.ldq, nq, nqp, s.HS, s.scale);
  std::fill(acc, acc + nqp * HSp, 0.0f);
  std::fill(m, m + nqp, -kInf);
  std::fill(l, l + nqp, 0.0f);
  // Key blocks before every query's document hold only masked keys: skipping them drops terms
  // that are exact zeros (see finite_shift below), so the bits are those of computing them.
  const int32_t* ds = doc_start ? doc_start + b * s.T : nullptr;
  const int64_t lo = ds ? block_doc_starts(dsf, ds, q0, nq, nqp) : 0;

  // Key blocks in order, up to the last one holding a key at or before the block's last query.
  for (const KBlock& key : s.kblocks) {
    if (key.k0 >= q0 + nq) break;
    if (key.k0 + key.nk <= lo) continue;
    const int64_t k0 = key.k0, nk = key.nk, nkp = round_up(nk, 4);
    // The whole sequence: diag >= 0, a query block lies inside one kBlk-aligned block. A query's row
    // in the tile does not change its arithmetic: more masked keys in its visible rows only add exact
    // zeros. (Partial calls: keys may start after a block's first query, diag < 0.)
    const int64_t diag = q0 - k0;
    copy_rows(kr, HSp, kbase + key.row * io.ldkv, io.ldkv, nk, nkp, s.HS, 1.0f);
    copy_rows(vr, HSp, vbase + key.row * io.ldkv, io.ldkv, nk, nkp, s.HS, 1.0f);
    tile_mm<O>(pt, kBlk, kr, HSp, 1, qt, kBlk, nkp, nqp, HSp, false, Band{.n_begin_off = -diag});
    for (int64_t c = 0; c < nqp; c += 8) {
      const int64_t rows = visible_rows(c, diag, nk);
      const int64_t doc_rows = ds ? std::min(rows, chunk_doc_start(dsf, c) - k0) : 0;
      const V dsv = ds ? O::load(dsf + c) : O::zero();
      V bmax = O::set1(-kInf);
      for (int64_t j = 0; j < rows; ++j) {
        float* x = pt + j * kBlk + c;
        V sc = O::load(x);
        const bool causal = j - diag - c > 0, doc = j < doc_rows;
        if (causal) sc = O::keep_from(sc, j - diag - c, -kInf);
        if (doc) sc = O::mask_before_start(sc, dsv, static_cast<float>(k0 + j), -kInf);
        if (causal || doc) O::store(x, sc);
        bmax = O::max(bmax, sc);
      }
      const V m_old = O::load(m + c);
      const V m_new = O::max(m_old, bmax);
      // A query whose document starts in a later block has seen no key yet (m_new = -inf):
      // shifting by 0 instead gives p = 0, corr = 0, l = 0, as if the block were skipped.
      // Otherwise the shift is m_new itself.
      const V shift = O::finite_shift(m_new);
      V sum = O::zero();
      for (int64_t j = 0; j < rows; ++j) {
        float* x = pt + j * kBlk + c;
        const V p = O::exp(O::sub(O::load(x), shift));
        O::store(x, p);
        sum = O::add(sum, p);
      }
      for (int64_t j = rows; j < nkp; ++j) O::store(pt + j * kBlk + c, O::zero());
      const V cv = O::exp(O::sub(m_old, shift));
      O::store(corr + c, cv);
      O::store(m + c, m_new);
      O::store(l + c, O::fma(O::load(l + c), cv, sum));
    }
    for (int64_t i = 0; i < nqp; ++i) {
      const V cv = O::set1(corr[i]);
      float* ar = acc + i * HSp;
      for (int64_t d = 0; d < HSp; d += 8) O::store(ar + d, O::mul(O::load(ar + d), cv));
    }
    tile_mm<O>(acc, HSp, pt, 1, kBlk, vr, HSp, nqp, HSp, nkp, true, Band{.k_end_off = 4 + diag});
  }

  for (int64_t i = 0; i < nq; ++i) {
    float* ar = acc + i * HSp;
    if (l[i] == 0.0f) {  // a partial call's query that sees none of the keys (never the whole sequence)
      std::fill_n(out + ((b * s.Tl + blk.row + i) * s.NH + h) * s.HS, s.HS, 0.0f);
      lse[(b * s.NH + h) * s.Tl + blk.row + i] = -kInf;
      continue;
    }
    const V lv = O::set1(l[i]);
    for (int64_t d = 0; d < HSp; d += 8) O::store(ar + d, O::div(O::load(ar + d), lv));
    std::memcpy(out + ((b * s.Tl + blk.row + i) * s.NH + h) * s.HS, ar, s.HS * sizeof(float));
    lse[(b * s.NH + h) * s.Tl + blk.row + i] = m[i] + libm::logf(l[i]);
  }
}

template <class O>
void forward(float* out, float* lse, const Io& io, int64_t B, int64_t T, Chunks chunks, int64_t NH, int64_t NKV,
             int64_t HS, const int32_t* doc_start, Chunks kchunks = {}) {
  Shape s = make_shape(B, T, NH, NKV, HS, chunks, 0);
  set_keys(s, kchunks);
  check_doc_start(doc_start, B, T);
  const size_t need = static_cast<size_t>(4 * kBlk * s.HSp + kBlk * kBlk + 4 * kBlk);
  const auto nb = static_cast<int64_t>(s.blocks.size());
  parallel_for(B * NH * nb, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(need);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t qb = u % nb, h = u / nb % NH, b = u / (nb * NH);
      forward_block<O>(out, lse, io, doc_start, s, b, h, s.blocks[static_cast<size_t>(qb)], scratch);
    }
  });
}

// dk, dv (Tks, HSp) of (b, kv head g) into chunk j's (B, Tk, ...) gradient (chunk 0 without query
// segments).
void write_dkv(const Io& io, const Shape& s, int64_t b, int64_t g, int64_t j, const float* dk, const float* dv) {
  const int64_t HSp = s.HSp, base = j * s.B * s.Tk * io.lddkv;
  for (const KBlock& key : s.kblocks)
    for (int64_t t = 0; t < key.nk; ++t) {
      const int64_t at = base + (b * s.Tk + key.row + t) * io.lddkv + g * s.HS;
      std::memcpy(io.dk + at, dk + (key.srow + t) * HSp, s.HS * sizeof(float));
      std::memcpy(io.dv + at, dv + (key.srow + t) * HSp, s.HS * sizeof(float));
    }
}

// One (b, kv head g): dk, dv of g and dq of its query heads, all assigned.
template <class O>
void backward_group(const Io& io, const float* dout, const float* out, const float* lse, const int32_t* doc_start,
                    const Shape& s, int64_t b, int64_t g, float* scratch) {
  using V = typename O::V;
  const auto nb = static_cast<int64_t>(s.blocks.size());
  const int64_t HSp = s.HSp, Tk = s.Tks, Tq = nb * kBlk, C = s.NH * s.HS;
  float* kall = scratch;          // (Tk, HSp) keys
  float* vall = kall + Tk * HSp;  // (Tk, HSp) values
  float* dk = vall + Tk * HSp;    // (Tk, HSp)
  float* dv = dk + Tk * HSp;      // (Tk, HSp)
  float* lse_g = dv + Tk * HSp;   // (group, blocks x kBlk) lse, +inf past a block's rows so padding queries get p = 0
  float* dd = lse_g + s.group * Tq;  // (group, blocks x kBlk) D
  float* qs = dd + s.group * Tq;     // (kBlk, HSp) scaled queries of the query block
  float* qt = qs + kBlk * HSp;       // (HSp, kBlk) the same, transposed
  float* go = qt + HSp * kBlk;       // (kBlk, HSp) dout of the query block
  float* got = go + kBlk * HSp;      // (HSp, kBlk) the same, transposed
  float* dq = got + HSp * kBlk;      // (kBlk, HSp) unscaled dq of the query block
  float* pt = dq + kBlk * HSp;       // (kBlk keys, kBlk queries) scores, then probabilities
  float* dst = pt + kBlk * kBlk;     // (kBlk keys, kBlk queries) dP, then dS
  float* row = dst + kBlk * kBlk;    // (2, HSp) padded copies of one out and dout row
  float* dsf = row + 2 * HSp;        // (kBlk) document starts of the query block
  float* stack = dsf + kBlk;         // query segments: tree_sum_stack(segments of a chunk) x (dk, dv)
  const int64_t M = 2 * Tk * HSp;    // dk and dv, back to back
  const int32_t* ds = doc_start ? doc_start + b * s.T : nullptr;

  if (s.kchunks.empty()) {
    copy_rows(kall, HSp, io.k + b * s.T * io.ldkv + g * s.HS, io.ldkv, s.T, Tk, s.HS, 1.0f);
    copy_rows(vall, HSp, io.v + b * s.T * io.ldkv + g * s.HS, io.ldkv, s.T, Tk, s.HS, 1.0f);
  } else {
    // Each key chunk at its padded offset (that of its first block), its padding zero.
    for (int64_t row = 0, srow = 0; const auto& [begin, end] : s.kchunks) {
      const int64_t n = end - begin, at = (b * s.Tk + row) * io.ldkv + g * s.HS;
      copy_rows(kall + srow * HSp, HSp, io.k + at, io.ldkv, n, round_up(n, 4), s.HS, 1.0f);
      copy_rows(vall + srow * HSp, HSp, io.v + at, io.ldkv, n, round_up(n, 4), s.HS, 1.0f);
      row += n, srow += round_up(n, 4);
    }
  }
  std::fill(dk, dk + 2 * Tk * HSp, 0.0f);
  for (int64_t hh = 0; hh < s.group; ++hh) {
    const int64_t h = g * s.group + hh;
    for (int64_t qb = 0; qb < nb; ++qb) {
      const QBlock& blk = s.blocks[static_cast<size_t>(qb)];
      for (int64_t i = 0; i < kBlk; ++i) {
        const int64_t at_blk = hh * Tq + qb * kBlk + i;
        if (i >= blk.nq) {
          lse_g[at_blk] = kInf;
          dd[at_blk] = 0.0f;
          continue;
        }
        const int64_t t = blk.row + i;
        const int64_t at = (b * s.Tl + t) * C + h * s.HS;
        copy_rows(row, HSp, out + at, 0, 1, 1, s.HS, 1.0f);
        copy_rows(row + HSp, HSp, dout + at, 0, 1, 1, s.HS, 1.0f);
        V acc = O::zero();
        for (int64_t d = 0; d < HSp; d += 8) acc = O::fma(O::load(row + d), O::load(row + HSp + d), acc);
        dd[at_blk] = O::hsum(acc);
        lse_g[at_blk] = lse[(b * s.NH + h) * s.Tl + t];
      }
    }
  }

  // Without query segments one chain over (query head, query position) for every key; with them,
  // one such chain per segment from zero (its blocks i0 .. i1 - 1), pushed into the canonical tree
  // over its chunk's segments, which lands in the chunk's dk, dv.
  for (int64_t i0 = 0; i0 < nb;) {
    const QBlock& first = s.blocks[static_cast<size_t>(i0)];
    int64_t i1 = s.segments ? i0 + 1 : nb;
    while (i1 < nb && s.blocks[static_cast<size_t>(i1)].chunk == first.chunk &&
           s.blocks[static_cast<size_t>(i1)].segment == first.segment)
      ++i1;
    for (int64_t hh = 0; hh < s.group; ++hh) {
      const int64_t h = g * s.group + hh;
      for (int64_t qbi = i0; qbi < i1; ++qbi) {
        const QBlock& blk = s.blocks[static_cast<size_t>(qbi)];
        const int64_t q0 = blk.q0, nq = blk.nq, nqp = round_up(nq, 8);
        const float* qrow = io.q + (b * s.Tl + blk.row) * io.ldq + h * s.HS;
        const float* gorow = dout + (b * s.Tl + blk.row) * C + h * s.HS;
        copy_rows(qs, HSp, qrow, io.ldq, nq, nqp, s.HS, s.scale);
        copy_transposed(qt, HSp, qrow, io.ldq, nq, nqp, s.HS, s.scale);
        copy_rows(go, HSp, gorow, C, nq, nqp, s.HS, 1.0f);
        copy_transposed(got, HSp, gorow, C, nq, nqp, s.HS, 1.0f);
        std::fill(dq, dq + nqp * HSp, 0.0f);
        const float* lse_q = lse_g + hh * Tq + qbi * kBlk;
        const float* d_q = dd + hh * Tq + qbi * kBlk;
        const int64_t lo = ds ? block_doc_starts(dsf, ds, q0, nq, nqp) : 0;
        for (const KBlock& key : s.kblocks) {
          if (key.k0 >= q0 + nq) break;
          if (key.k0 + key.nk <= lo) continue;
          const int64_t k0 = key.k0, nk = key.nk, nkp = round_up(nk, 4);
          const int64_t diag = q0 - k0;
          const float* kr = kall + key.srow * HSp;
          const Band score_band{.n_begin_off = -diag};
          tile_mm<O>(pt, kBlk, kr, HSp, 1, qt, kBlk, nkp, nqp, HSp, false, score_band);
          tile_mm<O>(dst, kBlk, vall + key.srow * HSp, HSp, 1, got, kBlk, nkp, nqp, HSp, false, score_band);
          for (int64_t c = 0; c < nqp; c += 8) {
            const int64_t rows = visible_rows(c, diag, nk);
            const int64_t doc_rows = ds ? std::min(rows, chunk_doc_start(dsf, c) - k0) : 0;
            const V dsv = ds ? O::load(dsf + c) : O::zero();
            const V lv = O::load(lse_q + c), dv_ = O::load(d_q + c);
            for (int64_t j = 0; j < rows; ++j) {
              float* x = pt + j * kBlk + c;
              float* y = dst + j * kBlk + c;
              V sc = O::load(x);
              if (j - diag - c > 0) sc = O::keep_from(sc, j - diag - c, -kInf);
              if (j < doc_rows) sc = O::mask_before_start(sc, dsv, static_cast<float>(k0 + j), -kInf);
              const V p = O::exp(O::sub(sc, lv));
              O::store(x, p);
              O::store(y, O::mul(p, O::sub(O::load(y), dv_)));
            }
            for (int64_t j = rows; j < nkp; ++j) {
              O::store(pt + j * kBlk + c, O::zero());
              O::store(dst + j * kBlk + c, O::zero());
            }
          }
          const Band key_band{.k_begin_off = -diag};
          tile_mm<O>(dv + key.srow * HSp, HSp, pt, kBlk, 1, go, HSp, nkp, HSp, nqp, true, key_band);
          tile_mm<O>(dk + key.srow * HSp, HSp, dst, kBlk, 1, qs, HSp, nkp, HSp, nqp, true, key_band);
          tile_mm<O>(dq, HSp, dst, 1, kBlk, kr, HSp, nqp, HSp, nkp, true, Band{.k_end_off = 4 + diag});
        }
        for (int64_t i = 0; i < nq; ++i) {
          float* drow = io.dq + (b * s.Tl + blk.row + i) * io.lddq + h * s.HS;
          if (s.partial)
            for (int64_t d = 0; d < s.HS; ++d) drow[d] = drow[d] + dq[i * HSp + d] * s.scale;
          else
            for (int64_t d = 0; d < s.HS; ++d) drow[d] = dq[i * HSp + d] * s.scale;
        }
      }
    }
    if (s.segments) {
      const bool last = i1 == nb || s.blocks[static_cast<size_t>(i1)].chunk != first.chunk;
      tree_sum_push(dk, dk, first.segment, last, M, stack);
      if (last) write_dkv(io, s, b, g, first.chunk, dk, dv);
      std::fill(dk, dk + M, 0.0f);
    }
    i0 = i1;
  }
  if (!s.segments) write_dkv(io, s, b, g, 0, dk, dv);
}

template <class O>
void backward(const Io& io, const float* dout, const float* out, const float* lse, int64_t B, int64_t T, Chunks chunks,
              int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start, int64_t segments, Chunks kchunks = {}) {
  Shape s = make_shape(B, T, NH, NKV, HS, chunks, segments);
  set_keys(s, kchunks);
  check_doc_start(doc_start, B, T);
  const int64_t Tk = s.Tks, Tq = static_cast<int64_t>(s.blocks.size()) * kBlk;
  const size_t need = static_cast<size_t>((4 + 2 * tree_sum_stack(s.max_chunk_segs)) * Tk * s.HSp + 2 * s.group * Tq +
                                          5 * kBlk * s.HSp + 2 * kBlk * kBlk + 2 * s.HSp + kBlk);
  parallel_for(B * NKV, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(need);
    for (int64_t u = begin; u < end; ++u)
      backward_group<O>(io, dout, out, lse, doc_start, s, u / NKV, u % NKV, scratch);
  });
}

// The whole sequence from one fused qkv buffer (B, T, (NH + 2 NKV) HS), and its gradient.
Io fused_io(const float* qkv, float* dqkv, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t C3 = (NH + 2 * NKV) * HS;
  return Io{qkv,
            C3,
            qkv + NH * HS,
            qkv + (NH + NKV) * HS,
            C3,
            dqkv,
            C3,
            dqkv ? dqkv + NH * HS : nullptr,
            dqkv ? dqkv + (NH + NKV) * HS : nullptr,
            C3};
}

// Context parallelism: the rank's query rows of qkv (B, Tl, C3), keys and values gathered
// (B, T, 2 NKV HS).
Io chunk_io(const float* qkv, const float* kv, float* dqkv, float* dkv, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t C3 = (NH + 2 * NKV) * HS, KV = 2 * NKV * HS;
  return Io{qkv, C3, kv, kv + NKV * HS, KV, dqkv, C3, dkv, dkv ? dkv + NKV * HS : nullptr, KV};
}

// The whole sequence as one query chunk, without allocating.
struct Whole {
  std::pair<int64_t, int64_t> chunk;
  explicit Whole(int64_t T) : chunk{0, T} {}
  operator Chunks() const { return {&chunk, 1}; }
};

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t HS, const int32_t* doc_start) {
  forward<FastOps>(out, lse, fused_io(qkv, nullptr, NH, NKV, HS), B, T, Whole(T), NH, NKV, HS, doc_start);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start,
                        int64_t query_segments) {
  backward<FastOps>(fused_io(qkv, dqkv, NH, NKV, HS), dout, out, lse, B, T, Whole(T), NH, NKV, HS, doc_start,
                    query_segments);
}

void attention_forward_chunks(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                              const QueryChunks& chunks, int64_t NH, int64_t NKV, int64_t HS,
                              const int32_t* doc_start) {
  forward<FastOps>(out, lse, chunk_io(qkv, kv, nullptr, nullptr, NH, NKV, HS), B, T, chunks, NH, NKV, HS, doc_start);
}

void attention_backward_chunks(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                               const float* out, const float* lse, int64_t B, int64_t T, const QueryChunks& chunks,
                               int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start, int64_t query_segments) {
  backward<FastOps>(chunk_io(qkv, kv, dqkv, dkv, NH, NKV, HS), dout, out, lse, B, T, chunks, NH, NKV, HS, doc_start,
                    query_segments);
}

void attention_forward_partial(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                               const QueryChunks& q_chunks, const QueryChunks& k_chunks, int64_t NH, int64_t NKV,
                               int64_t HS, const int32_t* doc_start) {
  LOCKSTEP_CHECK(!k_chunks.empty(), "attention_forward_partial: no key chunks");
  forward<FastOps>(out, lse, chunk_io(qkv, kv, nullptr, nullptr, NH, NKV, HS), B, T, q_chunks, NH, NKV, HS, doc_start,
                   k_chunks);
}

void attention_backward_partial(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                                const float* out, const float* lse, int64_t B, int64_t T, const QueryChunks& q_chunks,
                                const QueryChunks& k_chunks, int64_t NH, int64_t NKV, int64_t HS,
                                const int32_t* doc_start) {
  LOCKSTEP_CHECK(!k_chunks.empty(), "attention_backward_partial: no key chunks");
  backward<FastOps>(chunk_io(qkv, kv, dqkv, dkv, NH, NKV, HS), dout, out, lse, B, T, q_chunks, NH, NKV, HS, doc_start,
                    0, k_chunks);
}

void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t Tq,
                     int64_t NH, int64_t HS) {
  parallel_for(B * NH, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / NH, h = u % NH;
      for (int64_t t = 0; t < Tq; ++t) {
        float& a = lse[u * Tq + t];
        const float p = part_lse[u * Tq + t];
        if (p == -kInf) continue;  // the part saw no key: nothing to add
        float* o = out + ((b * Tq + t) * NH + h) * HS;
        const float* po = part_out + ((b * Tq + t) * NH + h) * HS;
        if (a == -kInf) {  // nothing merged yet
          std::memcpy(o, po, static_cast<size_t>(HS) * sizeof(float));
          a = p;
          continue;
        }
        // lse = max + log(exp(a - max) + exp(p - max)); each side weighted by exp(its lse - lse).
        const float mx = std::max(a, p);
        const float merged = mx + libm::logf(libm::expf(a - mx) + libm::expf(p - mx));
        const float wa = libm::expf(a - merged), wp = libm::expf(p - merged);
        for (int64_t d = 0; d < HS; ++d) o[d] = std::fma(po[d], wp, o[d] * wa);
        a = merged;
      }
    }
  });
}

namespace detail {
void attention_forward_portable(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                int64_t HS, const int32_t* doc_start) {
  forward<PortableOps>(out, lse, fused_io(qkv, nullptr, NH, NKV, HS), B, T, Whole(T), NH, NKV, HS, doc_start);
}
void attention_backward_portable(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                                 int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start,
                                 int64_t query_segments) {
  backward<PortableOps>(fused_io(qkv, dqkv, NH, NKV, HS), dout, out, lse, B, T, Whole(T), NH, NKV, HS, doc_start,
                        query_segments);
}
}  // namespace detail

}  // namespace lockstep
