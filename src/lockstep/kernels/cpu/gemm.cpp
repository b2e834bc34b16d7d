// Packed SGEMM in the GotoBLAS/BLIS layout: B is packed into K-major panels of NR columns, A into
// K-major panels of MR rows, and a register-blocked micro-kernel computes one MR x NR tile of C.
//
// What differs from a BLAS: the micro-kernel does not compute a partial product and add it to C.
// It loads the tile's running value (init on the first K block, C afterwards), continues the FMA
// chain over the K block, and stores it back. Every element of C is therefore one chain
// fma(a_k, b_k, acc) for k = 0..K-1 in order, whatever the blocking, the thread split or the
// micro-kernel, which is the determinism contract of gemm.h. Packing only copies values (a bf16 or
// quantised operand is decoded to exactly its dequantised fp32 values on the way).
#include "lockstep/kernels/cpu/gemm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "lockstep/core/error.h"
#ifdef LOCKSTEP_GEMM_BLAS
#include <cblas.h>
#endif
#include "lockstep/core/float_formats.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "lockstep/kernels/cpu/vecmath.h"

// GCC keeps a micro-kernel's accumulator array in registers only if the loops over it are unrolled
// before its scalar-replacement pass; without this it spills them to the stack on every k.
#define LOCKSTEP_UNROLL _Pragma("GCC unroll 64")

namespace lockstep {

namespace {

// Where a tile's chain starts on this K block.
enum class Init : uint8_t { kC, kZero, kBias };

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One product as the kernels see it: the caller's operands and where each chain starts. An operand
// whose a_src / b_src is not f32 is read from there (decoded while packing), not from A / B.
struct Problem : GemmBatchItem {
  Init init;
  int64_t segs = 0;  // k_segments: the number of segments S (0: one chain over K)
};

// The number of segments of k_segments (each of the sections' S + 1 boundaries running from 0 to
// the section's width, the widths summing to K), checked; 0 without segments.
int64_t count_segments(std::span<const int64_t> seg, std::span<const int64_t> sections_in, int64_t K) {
  if (seg.empty()) return 0;
  const std::span<const int64_t> whole(&K, 1);
  const auto sections = sections_in.empty() ? whole : sections_in;
  const int64_t J = static_cast<int64_t>(sections.size());
  LOCKSTEP_CHECK(static_cast<int64_t>(seg.size()) % J == 0 && static_cast<int64_t>(seg.size()) / J >= 2,
                 "gemm k_segments: ", seg.size(), " boundaries for ", J, " sections");
  const int64_t S = static_cast<int64_t>(seg.size()) / J - 1;
  int64_t width = 0;
  for (int64_t j = 0; j < J; ++j) {
    LOCKSTEP_CHECK(seg[j * (S + 1)] == 0 && seg[j * (S + 1) + S] == sections[j], "gemm k_segments of section ", j,
                   " must run from 0 to ", sections[j]);
    for (int64_t s = 0; s < S; ++s)
      LOCKSTEP_CHECK(seg[j * (S + 1) + s] <= seg[j * (S + 1) + s + 1], "gemm k_segments decrease at ", s,
                     " in section ", j);
    width += sections[j];
  }
  LOCKSTEP_CHECK(width == K, "gemm k_sections sum to ", width, ", not K=", K);
  return S;
}

// Checks a product's sizes and leading dimensions (`what` names it in the message) and derives
// where its chains start: C (accumulate), else bias (when given), else 0.
Problem make_problem(const GemmBatchItem& it, const char* what) {
  LOCKSTEP_CHECK(it.M >= 0 && it.N >= 0 && it.K >= 0, what, " sizes M=", it.M, " N=", it.N, " K=", it.K);
  LOCKSTEP_CHECK(it.ldc >= it.N, what, " ldc=", it.ldc, " < N=", it.N);
  LOCKSTEP_CHECK(it.lda >= (it.ta == Trans::N ? it.K : it.M), what, " lda=", it.lda, " too small");
  LOCKSTEP_CHECK(it.ldb >= (it.tb == Trans::N ? it.N : it.K), what, " ldb=", it.ldb, " too small");
  return Problem{it,
                 it.accumulate ? Init::kC
                 : it.bias     ? Init::kBias
                               : Init::kZero,
                 count_segments(it.k_segments, it.k_sections, it.K)};
}

// The grid tm x (parts / tm) of rectangles over units_m x units_n micro-tiles with the smallest
// largest rectangle, then the least packing (a rectangle packs its A rows and B columns). Returns
// tm. Any grid gives the same bits; this only balances the work.
int64_t choose_grid_rows(int64_t units_m, int64_t units_n, int64_t parts, int64_t mr, int64_t nr) {
  int64_t tm = -1, best_cost = -1, best_perimeter = 0;
  for (int64_t m = 1; m <= parts; ++m) {
    if (parts % m != 0 || m > units_m || parts / m > units_n) continue;
    const int64_t rows = ceil_div(units_m, m) * mr, cols = ceil_div(units_n, parts / m) * nr;
    const int64_t cost = rows * cols, perimeter = rows + cols;
    if (best_cost < 0 || cost < best_cost || (cost == best_cost && perimeter < best_perimeter)) {
      tm = m;
      best_cost = cost;
      best_perimeter = perimeter;
    }
  }
  return tm;  // -1: no factorisation fits (parts prime and larger than units_n)
}

// ---------------------------------------------------------------- micro-kernels
//
// kernel(kc, a, b, c, ldc, init, bias, ep): the MR x NR tile c (row stride ldc) continues its
// chains over kc steps of the packed panels a (kc x MR) and b (kc x NR, 64-byte aligned). Init
// kBias starts every row from bias[0 .. NR). With an epilogue (a segmented product's fold, see
// compute_region_segmented), the finished chains then take its additions in order, each one
// tile = add + tile elementwise (row i of add f at add[f] + i * ld[f]), and the tile is stored to
// ep->dst instead of c.
// Kept out of line: inlined into the driver, their accumulators compete with its registers.
struct Epilogue {
  static constexpr int kMaxAdds = 8;  // the held subtrees (up to 7: kMaxFusedSegments = 128) and the init
  const float* add[kMaxAdds];
  int64_t ld[kMaxAdds];  // an L1 tile's NR, C's ldc, or 0 for the bias row
  int adds = 0;
  float* dst = nullptr;
  int64_t ldd = 0;
  void push(const float* a, int64_t l) {
    add[adds] = a;
    ld[adds++] = l;
  }
};
using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, Init init,
                             const float* bias, const Epilogue* ep);

template <int MR, int NR>
[[gnu::noinline]] void kernel_portable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, Init init,
                                       const float* bias, const Epilogue* ep) {
  float acc[MR][NR];
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int j = 0; j < NR; ++j) {
      acc[i][j] = init == Init::kC ? c[i * ldc + j] : init == Init::kBias ? bias[j] : 0.0f;
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
      LOCKSTEP_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = std::fma(a[i], b[j], acc[i][j]);
    }
    a += MR;
    b += NR;
  }
  if (ep) {
    for (int f = 0; f < ep->adds; ++f) {
      LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
        LOCKSTEP_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = ep->add[f][i * ep->ld[f] + j] + acc[i][j];
      }
    }
    c = ep->dst;
    ldc = ep->ldd;
  }
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int j = 0; j < NR; ++j) c[i * ldc + j] = acc[i][j];
  }
}

#ifdef LOCKSTEP_AVX2
// MR rows of NV vectors of 8: MR * NV accumulators, NV for B and one broadcast of A in 16 ymm.
template <int MR, int NV>
[[gnu::noinline]] void kernel_avx2(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, Init init,
                                   const float* bias, const Epilogue* ep) {
  __m256 acc[MR][NV];
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) {
      if (init == Init::kC) {
        acc[i][v] = _mm256_loadu_ps(c + i * ldc + 8 * v);
      } else if (init == Init::kBias) {
        acc[i][v] = _mm256_loadu_ps(bias + 8 * v);
      } else {
        acc[i][v] = _mm256_setzero_ps();
      }
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m256 bv[NV];
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) bv[v] = _mm256_load_ps(b + 8 * v);
    LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
      LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) { acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]); }
    }
    a += MR;
    b += 8 * NV;
  }
  if (ep) {
    for (int f = 0; f < ep->adds; ++f) {
      LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
        LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) {
          acc[i][v] = _mm256_add_ps(_mm256_loadu_ps(ep->add[f] + i * ep->ld[f] + 8 * v), acc[i][v]);
        }
      }
    }
    c = ep->dst;
    ldc = ep->ldd;
  }
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
  }
}

// Zen 4 executes a 512-bit FMA as two 256-bit halves, so AVX-512 does not raise the FLOP peak, but
// its 32 registers hold a 4 x 64 tile: 4 loads of B and 4 broadcasts feed 16 FMAs. B streams from
// L2 (kc x 64 panel), A from L1, which is what lets a large kc amortise the C tile's load/store.
template <int MR, int NV>
[[gnu::noinline]] __attribute__((target("avx512f"))) void kernel_avx512(int64_t kc, const float* a, const float* b,
                                                                        float* c, int64_t ldc, Init init,
                                                                        const float* bias, const Epilogue* ep) {
  __m512 acc[MR][NV];
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) {
      if (init == Init::kC) {
        acc[i][v] = _mm512_loadu_ps(c + i * ldc + 16 * v);
      } else if (init == Init::kBias) {
        acc[i][v] = _mm512_loadu_ps(bias + 16 * v);
      } else {
        acc[i][v] = _mm512_setzero_ps();
      }
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NV];
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) bv[v] = _mm512_load_ps(b + 16 * v);
    LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i]);
      LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) { acc[i][v] = _mm512_fmadd_ps(av, bv[v], acc[i][v]); }
    }
    a += MR;
    b += 16 * NV;
  }
  if (ep) {
    for (int f = 0; f < ep->adds; ++f) {
      LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
        LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) {
          acc[i][v] = _mm512_add_ps(_mm512_loadu_ps(ep->add[f] + i * ep->ld[f] + 16 * v), acc[i][v]);
        }
      }
    }
    c = ep->dst;
    ldc = ep->ldd;
  }
  LOCKSTEP_UNROLL for (int i = 0; i < MR; ++i) {
    LOCKSTEP_UNROLL for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  }
}
#endif

// ---------------------------------------------------------------- packing
//
// A block of op(A) or op(B) is packed into panels of W (MR rows or NR columns), each panel K-major
// (kc steps of W values), the last panel zero-padded. The source has one of two layouts, which
// covers both operands in both transposes:
//   pack_rows: element (k, x) at src[k * ld + x]   (A transposed, B not)
//   pack_cols: element (k, x) at src[x * ld + k]   (A not transposed, B transposed)

template <int W>
void pack_rows(float* __restrict dst, const float* __restrict src, int64_t ld, int64_t kc, int64_t len) {
  const int64_t full = len / W, rem = len % W, panel = kc * W;
  // k outer: each source row is read once, front to back, and written to every panel.
  for (int64_t k = 0; k < kc; ++k) {
    const float* s = src + k * ld;
    float* d = dst + k * W;
    // Rows are ld apart, often pages apart (A^T of the weight gradient): the hardware prefetcher
    // does not cross pages, so fetch a few rows ahead.
    constexpr int64_t kAhead = 8;
    if (k + kAhead < kc) {
      for (int64_t x = 0; x < len; x += 16) __builtin_prefetch(s + kAhead * ld + x);
    }
    for (int64_t q = 0; q < full; ++q) {
      LOCKSTEP_UNROLL for (int x = 0; x < W; ++x) d[q * panel + x] = s[q * W + x];
    }
    if (rem) {
      float* dr = d + full * panel;
      for (int64_t x = 0; x < rem; ++x) dr[x] = s[full * W + x];
      for (int64_t x = rem; x < W; ++x) dr[x] = 0.0f;
    }
  }
}

#ifdef LOCKSTEP_AVX2
// 8 source rows of 8 consecutive k -> 8 rows of 8 x, one per k, at dst + k * stride.
inline void transpose_8x8(float* dst, int64_t stride, const float* src, int64_t ld) {
  __m256 r[8], t[8];
  LOCKSTEP_UNROLL for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  LOCKSTEP_UNROLL for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  LOCKSTEP_UNROLL for (int h = 0; h < 8; h += 4) {
    r[h + 0] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);      // k0 | k4
    r[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);      // k1 | k5
    r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);  // k2 | k6
    r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);  // k3 | k7
  }
  LOCKSTEP_UNROLL for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// 4 source rows of 8 consecutive k -> 32 contiguous values, 4 per k.
inline void transpose_4x8(float* dst, const float* src, int64_t ld) {
  const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ld);
  const __m256 r2 = _mm256_loadu_ps(src + 2 * ld), r3 = _mm256_loadu_ps(src + 3 * ld);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 k04 = _mm256_shuffle_ps(t0, t2, 0x44), k15 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 k26 = _mm256_shuffle_ps(t1, t3, 0x44), k37 = _mm256_shuffle_ps(t1, t3, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(k04, k15, 0x20));
  _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(k26, k37, 0x20));
  _mm256_storeu_ps(dst + 16, _mm256_permute2f128_ps(k04, k15, 0x31));
  _mm256_storeu_ps(dst + 24, _mm256_permute2f128_ps(k26, k37, 0x31));
}
#endif

template <int W>
void pack_cols(float* __restrict dst, const float* __restrict src, int64_t ld, int64_t kc, int64_t len) {
  for (int64_t x0 = 0; x0 < len; x0 += W, dst += kc * W) {
    const int64_t rows = std::min<int64_t>(W, len - x0);
    const float* s = src + x0 * ld;
    int64_t k = 0;
#ifdef LOCKSTEP_AVX2
    if constexpr (W % 8 == 0) {
      if (rows == W) {
        for (; k + 8 <= kc; k += 8) {
          for (int r = 0; r < W; r += 8) transpose_8x8(dst + k * W + r, W, s + r * ld + k, ld);
        }
      }
    } else if constexpr (W == 4) {
      if (rows == W) {
        for (; k + 8 <= kc; k += 8) transpose_4x8(dst + k * W, s + k, ld);
      }
    }
#endif
    for (; k < kc; ++k) {
      for (int64_t r = 0; r < rows; ++r) dst[k * W + r] = s[r * ld + k];
      for (int64_t r = rows; r < W; ++r) dst[k * W + r] = 0.0f;
    }
  }
}

// ---------------------------------------------------------------- driver

// 64-byte aligned scratch that only grows: the packing buffers of one thread, reused across calls.
class Scratch {
 public:
  float* get(size_t n) {
    if (n > size_) {
      data_.reset(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64)));
      LOCKSTEP_CHECK(data_ != nullptr, "out of memory for ", n, " floats of GEMM packing");
      size_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  size_t size_ = 0;
};

// ---------------------------------------------------------------- decoding while packing
//
// A bf16 or quantised operand is decoded one stored row segment at a time into a small buffer
// (L1 / L2 resident; quantised: dequantize_row), which the fp32 packing routines then lay out: the
// packed panels hold exactly the values dequantize() would produce, so the micro-kernels and the
// FMA chains are the fp32 ones.

// Stored row r, columns [c, c + len) of the operand's storage (its view origin applied), as fp32.
void decode_row(const GemmOperand& src, int64_t r, int64_t c, int64_t len, float* out) {
  if (src.kind == GemmOperand::Kind::bf16) {
    const bf16* p = static_cast<const bf16*>(src.data) + r * src.ld + c;
    for (int64_t j = 0; j < len; ++j) out[j] = to_f32(p[j]);
    return;
  }
  const auto& q = *static_cast<const QuantizedTensor*>(src.data);
  r += src.row0;
  c += src.col0;
  // pack_cols_decoded comes back for the next segment of this row only after W other rows: fetch it
  // now, as the hardware prefetcher would for the longer fp32 rows.
  const uint8_t* codes = q.codes.data() + r * q.row_bytes();
  const int64_t end = c + len, next = q.elem == ElemFormat::e2m1 ? end / 2 : end, row_end = q.row_bytes();
  for (int64_t b = next; b < std::min(row_end, next + (next - (q.elem == ElemFormat::e2m1 ? c / 2 : c))); b += 64) {
    __builtin_prefetch(codes + b);
  }
  dequantize_row(q, r, c, len, out);
}

// pack_rows from a decoded source: element (k, x) is stored (k0 + k, x0 + x).
template <int W>
void pack_rows_decoded(float* dst, const GemmOperand& src, int64_t k0, int64_t kc, int64_t x0, int64_t len) {
  thread_local Scratch row;
  float* tmp = row.get(static_cast<size_t>(len));
  const int64_t full = len / W, rem = len % W, panel = kc * W;
  for (int64_t k = 0; k < kc; ++k) {
    decode_row(src, k0 + k, x0, len, tmp);
    float* d = dst + k * W;
    for (int64_t q = 0; q < full; ++q) std::memcpy(d + q * panel, tmp + q * W, W * sizeof(float));
    if (rem) {
      float* dr = d + full * panel;
      for (int64_t x = 0; x < rem; ++x) dr[x] = tmp[full * W + x];
      for (int64_t x = rem; x < W; ++x) dr[x] = 0.0f;
    }
  }
}

// pack_cols from a decoded source: element (k, x) is stored (x0 + x, k0 + k). A panel's W stored
// rows are decoded kChunk values of k at a time (an L1-sized buffer), then transposed by pack_cols
// into the panel's rows k .. k + kChunk (a panel is k-major, so a k-range is a contiguous part).
template <int W>
void pack_cols_decoded(float* dst, const GemmOperand& src, int64_t k0, int64_t kc, int64_t x0, int64_t len) {
  constexpr int64_t kChunk = 64;
  alignas(64) float tmp[W * kChunk];
  for (int64_t x = 0; x < len; x += W, dst += kc * W) {
    const int64_t rows = std::min<int64_t>(W, len - x);
    for (int64_t k = 0; k < kc; k += kChunk) {
      const int64_t n = std::min(kChunk, kc - k);
      for (int64_t r = 0; r < rows; ++r) decode_row(src, x0 + x + r, k0 + k, n, tmp + r * n);
      pack_cols<W>(dst + k * W, tmp, n, n, rows);
    }
  }
}

// The block [k0, k0 + kc) x [x0, x0 + len) of op(X) into panels of W. k_rows: element (k, x) is
// stored at row k, column x (A transposed, B not), else at row x, column k.
template <int W>
void pack_operand(float* dst, const GemmOperand& src, const float* x, int64_t ld, bool k_rows, int64_t k0, int64_t kc,
                  int64_t x0, int64_t len) {
  if (src.kind != GemmOperand::Kind::f32) {
    if (k_rows) {
      pack_rows_decoded<W>(dst, src, k0, kc, x0, len);
    } else {
      pack_cols_decoded<W>(dst, src, k0, kc, x0, len);
    }
  } else if (k_rows) {
    pack_rows<W>(dst, x + k0 * ld + x0, ld, kc, len);
  } else {
    pack_cols<W>(dst, x + x0 * ld + k0, ld, kc, len);
  }
}

// op(A)[i0, i0 + mc) x [k0, k0 + kc) into panels of MR rows.
template <int MR>
void pack_a(float* dst, const Problem& p, int64_t i0, int64_t mc, int64_t k0, int64_t kc) {
  pack_operand<MR>(dst, p.a_src, p.A, p.lda, p.ta == Trans::T, k0, kc, i0, mc);
}

// op(B)[k0, k0 + kc) x [j0, j0 + nc) into panels of NR columns.
template <int NR>
void pack_b(float* dst, const Problem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc) {
  pack_operand<NR>(dst, p.b_src, p.B, p.ldb, p.tb == Trans::N, k0, kc, j0, nc);
}

// Splits `len` into equal blocks of at most `cap`, each a multiple of `unit`: avoids a thin last
// block (a K block of 3 steps would pay a full tile load/store for almost no work).
int64_t balanced_block(int64_t len, int64_t cap, int64_t unit) {
  const int64_t blocks = ceil_div(len, cap);
  return ceil_div(ceil_div(len, blocks), unit) * unit;
}

struct Blocks {
  int64_t mc, kc, nc;  // cache blocks: a packed B block is kc x nc, a packed A block mc x kc
};

// The segmented product in one pass (k_segments, up to kMaxFusedSegments segments and K up to
// kMaxFusedK x the kernel's kc): K is not blocked, so a tile's packed A and B panels hold every
// segment, and each tile runs one micro-kernel call per (segment, section) piece into an
// L1-resident tile of its own, folding the canonical tree over the segments as they come (the
// binary counter of core/tree_sum.h: segment s goes to slot popcount(s) and completes the subtrees
// of its trailing one bits, smallest first; the last one folds every held subtree), and writes C =
// init + the tree once. The fold runs in the epilogue of the segment's last kernel call (Epilogue:
// its chains still in registers, the held subtrees added, the result stored once), and a whole
// tile's last segment adds the init and stores to C there too. The same chains and additions as
// gemm_with's segment-by-segment path, with the operands packed once and no product-sized scratch.
constexpr int64_t kMaxFusedSegments = 128;  // slots = bit_width(S - 1) + 1 <= 8 tiles
constexpr int64_t kMaxFusedK = 4;           // in kernel kc's

// A segmented product past those limits: gemm_with runs it segment by segment, each segment in
// regions of its own.
bool segment_by_segment(const Problem& p, const Blocks& bl) {
  return p.segs > 0 && (p.segs > kMaxFusedSegments || p.K > kMaxFusedK * bl.kc);
}

// c[0, w) = init + t[0, w) (C: c + t, bias: bias + t, 0: t): a segmented product's last addition,
// the init plus the tree over its segments (t), for one tile row or one row block.
inline void add_to_init(Init init, float* c, const float* bias, const float* t, int64_t w) {
  if (init == Init::kC) {
    for (int64_t e = 0; e < w; ++e) c[e] = c[e] + t[e];
  } else if (init == Init::kBias) {
    for (int64_t e = 0; e < w; ++e) c[e] = bias[e] + t[e];
  } else {
    std::memcpy(c, t, static_cast<size_t>(w) * sizeof(float));
  }
}

template <int MR, int NR, MicroKernel Micro>
void compute_region_segmented(const Problem& p, const Blocks& bl, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  thread_local Scratch a_scratch, b_scratch;
  thread_local std::vector<int64_t> pieces;  // (segment, section) -> [k0, k1) in K
  const int64_t K = p.K, S = p.segs;
  const std::span<const int64_t> whole(&K, 1);
  const auto sections = p.k_sections.empty() ? whole : p.k_sections;
  const int64_t J = static_cast<int64_t>(sections.size());
  pieces.resize(static_cast<size_t>(2 * S * J));
  for (int64_t s = 0; s < S; ++s) {
    int64_t at = 0;
    for (int64_t j = 0; j < J; ++j) {
      pieces[2 * (s * J + j)] = at + p.k_segments[j * (S + 1) + s];
      pieces[2 * (s * J + j) + 1] = at + p.k_segments[j * (S + 1) + s + 1];
      at += sections[j];
    }
  }
  // The packed blocks hold all of K: as many rows (columns) as the unsegmented blocks' floats allow.
  const int64_t kc = std::max<int64_t>(K, 1);
  const int64_t mc_cap = std::max<int64_t>(MR, bl.mc * bl.kc / kc / MR * MR);
  const int64_t nc_cap = std::max<int64_t>(NR, bl.nc * bl.kc / kc / NR * NR);
  const int64_t mc_max = balanced_block(m1 - m0, mc_cap, MR), nc_max = balanced_block(n1 - n0, nc_cap, NR);
  float* apack = a_scratch.get(static_cast<size_t>(mc_max * kc));
  float* bpack = b_scratch.get(static_cast<size_t>(nc_max * kc));
  constexpr int kSlots = std::bit_width(static_cast<uint64_t>(kMaxFusedSegments - 1)) + 1;
  alignas(64) float slot[kSlots][MR * NR];

  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    pack_b<NR>(bpack, p, 0, K, jc, nc);
    for (int64_t ic = m0; ic < m1; ic += mc_max) {
      const int64_t mc = std::min(mc_max, m1 - ic);
      pack_a<MR>(apack, p, ic, mc, 0, K);
      for (int64_t jr = 0; jr < nc; jr += NR) {
        const int64_t cols = std::min<int64_t>(NR, nc - jr);
        const float* bias = p.bias ? p.bias + jc + jr : nullptr;
        const float* bp = bpack + jr * K;
        for (int64_t ir = 0; ir < mc; ir += MR) {
          const int64_t rows = std::min<int64_t>(MR, mc - ir);
          const float* ap = apack + ir * K;
          // A whole tile takes the init and goes to C in the last segment's kernel call.
          const bool whole = rows == MR && cols == NR;
          float* c = p.C + (ic + ir) * p.ldc + jc + jr;
          float* cur = nullptr;
          for (int64_t s = 0; s < S; ++s) {
            const int held = std::popcount(static_cast<uint64_t>(s));
            float* P = slot[held];
            const bool last = s == S - 1;
            const int fold = last ? held : std::countr_one(static_cast<uint64_t>(s));
            // The fold in the chain's last call: held subtree + carry, smallest first, into the
            // slot of the subtree it completes (or C).
            Epilogue ep;
            for (int f = 1; f <= fold; ++f) ep.push(slot[held - f], NR);
            cur = slot[held - fold];
            ep.dst = cur;
            ep.ldd = NR;
            if (last && whole) {
              if (p.init == Init::kC) ep.push(c, p.ldc);
              if (p.init == Init::kBias) ep.push(bias, 0);
              ep.dst = c;
              ep.ldd = p.ldc;
            }
            // The segment's chain from 0 over its part of each section in turn (K = 0: the 0).
            for (int64_t j = 0; j < J; ++j) {
              const int64_t k0 = pieces[2 * (s * J + j)], k1 = pieces[2 * (s * J + j) + 1];
              // (bias unread: given as is rather than null, which would have GCC clone the kernel
              // for a null bias and warn about the kBias load it keeps in the clone.)
              Micro(k1 - k0, ap + k0 * MR, bp + k0 * NR, P, NR, j == 0 ? Init::kZero : Init::kC, bias,
                    j == J - 1 ? &ep : nullptr);
            }
          }
          if (!whole)
            for (int64_t i = 0; i < rows; ++i) add_to_init(p.init, c + i * p.ldc, bias, cur + i * NR, cols);
        }
      }
    }
  }
}

// The rows [m0, m1) x columns [n0, n1) of C, on the calling thread. Loop order of BLIS: for each
// B block, for each A block, every B micro-panel against every A micro-panel.
template <int MR, int NR, MicroKernel Micro>
void compute_region(const Problem& p, const Blocks& bl, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (p.segs) {
    LOCKSTEP_CHECK(!segment_by_segment(p, bl), "gemm: a segmented product past the one-pass limits reached a region");
    compute_region_segmented<MR, NR, Micro>(p, bl, m0, m1, n0, n1);
    return;
  }
  thread_local Scratch a_scratch, b_scratch;
  const int64_t kc_max = balanced_block(p.K, bl.kc, 1);
  const int64_t mc_max = balanced_block(m1 - m0, bl.mc, MR);
  const int64_t nc_max = balanced_block(n1 - n0, bl.nc, NR);
  float* apack = a_scratch.get(static_cast<size_t>(mc_max * kc_max));
  float* bpack = b_scratch.get(static_cast<size_t>(nc_max * kc_max));
  alignas(64) float tile[MR * NR];

  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    for (int64_t pc = 0; pc < p.K; pc += kc_max) {
      const int64_t kc = std::min(kc_max, p.K - pc);
      pack_b<NR>(bpack, p, pc, kc, jc, nc);
      const Init init = pc == 0 ? p.init : Init::kC;
      for (int64_t ic = m0; ic < m1; ic += mc_max) {
        const int64_t mc = std::min(mc_max, m1 - ic);
        pack_a<MR>(apack, p, ic, mc, pc, kc);
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const int64_t cols = std::min<int64_t>(NR, nc - jr);
          const float* bias = p.bias ? p.bias + jc + jr : nullptr;
          const float* bp = bpack + jr * kc;
          for (int64_t ir = 0; ir < mc; ir += MR) {
            const int64_t rows = std::min<int64_t>(MR, mc - ir);
            const float* ap = apack + ir * kc;
            float* c = p.C + (ic + ir) * p.ldc + jc + jr;
            // The next tile's C rows are strided, which the hardware prefetcher does not follow.
            for (int64_t i = MR; i < std::min<int64_t>(2 * MR, mc - ir); ++i) {
              for (int64_t j = 0; j < cols; j += 16) __builtin_prefetch(c + i * p.ldc + j, 1, 3);
            }
            if (rows == MR && cols == NR) {
              Micro(kc, ap, bp, c, p.ldc, init, bias, nullptr);
              continue;
            }
            // Edge tile: run the full kernel on a copy holding the chains' current values.
            for (int64_t i = 0; i < MR; ++i) {
              for (int64_t j = 0; j < NR; ++j) {
                float v = 0.0f;
                if (i < rows && j < cols) {
                  v = init == Init::kC ? c[i * p.ldc + j] : init == Init::kBias ? bias[j] : 0.0f;
                }
                tile[i * NR + j] = v;
              }
            }
            Micro(kc, ap, bp, tile, NR, Init::kC, nullptr, nullptr);
            for (int64_t i = 0; i < rows; ++i) {
              std::memcpy(c + i * p.ldc, tile + i * NR, cols * sizeof(float));
            }
          }
        }
      }
    }
  }
}

struct Kernel {
  const char* name;
  int mr, nr;
  Blocks blocks;
  void (*region)(const Problem&, const Blocks&, int64_t, int64_t, int64_t, int64_t);
};

// Cache blocks measured on Zen 4 (32 KB L1d, 1 MB L2 per core), 2 threads: docs/performance.md.
// For 4x64 the packed A block (32 x 768, 96 KB) stays in L2 next to the B micro-panel being swept
// (768 x 64, 192 KB); kc = 768 amortises each tile's C load/store over 768 FMAs per element.
const Kernel kPortable{"portable", 6, 16, {48, 512, 4080}, compute_region<6, 16, kernel_portable<6, 16>>};
#ifdef LOCKSTEP_AVX2
const Kernel kAvx2{"avx2-6x16", 6, 16, {48, 512, 4080}, compute_region<6, 16, kernel_avx2<6, 2>>};
const Kernel kAvx512{"avx512-4x64", 4, 64, {32, 768, 2048}, compute_region<4, 64, kernel_avx512<4, 4>>};
#endif

// Fastest first.
std::vector<const Kernel*> runnable_kernels() {
  std::vector<const Kernel*> kernels;
#ifdef LOCKSTEP_AVX2
  __builtin_cpu_init();  // may run during static initialisation, before libgcc's own call
  if (__builtin_cpu_supports("avx512f")) kernels.push_back(&kAvx512);
  kernels.push_back(&kAvx2);
#endif
  kernels.push_back(&kPortable);
  return kernels;
}

const Kernel& best_kernel() {
  static const Kernel& k = *runnable_kernels().front();
  return k;
}

// C of a product with K = 0: its init. Segmented (k_segments), every segment's chain is +0, so
// C = init + 0 (a -0 in C or bias becomes +0; 0 without init).
void write_init(const Problem& p) {
  if (p.segs) {
    for (int64_t i = 0; i < p.M; ++i) {
      float* c = p.C + i * p.ldc;
      for (int64_t j = 0; j < p.N; ++j)
        c[j] = p.init == Init::kC ? c[j] + 0.0f : p.init == Init::kBias ? p.bias[j] + 0.0f : 0.0f;
    }
    return;
  }
  if (p.init == Init::kC) return;
  for (int64_t i = 0; i < p.M; ++i) {
    float* c = p.C + i * p.ldc;
    if (p.init == Init::kBias) {
      std::memcpy(c, p.bias, p.N * sizeof(float));
    } else {
      std::fill(c, c + p.N, 0.0f);
    }
  }
}

// Splits C into a grid of tm x tn rectangles, one per thread, along tile boundaries. Any split
// gives the same bits; this one balances the tiles, then minimises packing (a thread packs the A
// rows and B columns of its rectangle).
void run(const Kernel& kr, const Problem& p) {
  if (p.M == 0 || p.N == 0) return;
  if (p.K == 0) {
    write_init(p);
    return;
  }
  ThreadPool* pool = ThreadPool::current();
  const int64_t units_m = ceil_div(p.M, kr.mr), units_n = ceil_div(p.N, kr.nr);
  // Below this many FMAs, waking the workers costs more than it saves.
  constexpr int64_t kMinParallelWork = int64_t{1} << 18;
  const int T = pool && p.M * p.N * p.K >= kMinParallelWork ? pool->threads() : 1;
  if (T == 1) {
    kr.region(p, kr.blocks, 0, p.M, 0, p.N);
    return;
  }
  const int64_t fit = choose_grid_rows(units_m, units_n, T, kr.mr, kr.nr);
  // When no grid of T rectangles fits the tiles (tiny M and N): rows only, some of them empty.
  const int64_t tm = fit > 0 ? fit : T, tn = T / tm;
  // Rectangles go to whichever threads are awake (run_parts): the bits are the same either way.
  pool->run_parts(T, [&](int64_t t) {
    const int64_t bm = t / tn, bn = t % tn;
    const int64_t m0 = std::min(p.M, chunk_begin(units_m, bm, tm) * kr.mr);
    const int64_t m1 = std::min(p.M, chunk_begin(units_m, bm + 1, tm) * kr.mr);
    const int64_t n0 = std::min(p.N, chunk_begin(units_n, bn, tn) * kr.nr);
    const int64_t n1 = std::min(p.N, chunk_begin(units_n, bn + 1, tn) * kr.nr);
    if (m0 < m1 && n0 < n1) kr.region(p, kr.blocks, m0, m1, n0, n1);
  });
}

// The problem C = init + op(A) op(B) on operands in any storage: an fp32 operand is read in place,
// any other is decoded while packing (its view checked against the stored matrix here).
Problem make_operand_problem(float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M, int64_t N,
                             int64_t K, const GemmOptions& opt, const char* what) {
  const auto floats = [](const GemmOperand& o) {
    return o.kind == GemmOperand::Kind::f32 ? static_cast<const float*>(o.data) : nullptr;
  };
  Problem p = make_problem({C,
                            ldc,
                            floats(A),
                            A.ld,
                            A.trans,
                            floats(B),
                            B.ld,
                            B.trans,
                            M,
                            N,
                            K,
                            opt.accumulate,
                            opt.bias,
                            {},
                            {},
                            opt.k_segments,
                            opt.k_sections},
                           what);
  p.a_src = A;
  p.b_src = B;
  // Stored shape of op(X) (rows x cols) for an operand whose op is (outer x K) (A) or (K x outer) (B).
  const auto check_view = [&](const GemmOperand& o, int64_t stored_rows, int64_t stored_cols, const char* name) {
    if (o.kind != GemmOperand::Kind::quantized) return;
    const auto& q = *static_cast<const QuantizedTensor*>(o.data);
    LOCKSTEP_CHECK(o.row0 >= 0 && o.col0 >= 0 && o.row0 + stored_rows <= q.rows && o.col0 + stored_cols <= q.cols, what,
                   " operand ", name, ": a ", stored_rows, "x", stored_cols, " view at (", o.row0, ", ", o.col0,
                   ") does not fit the quantised ", q.rows, "x", q.cols);
  };
  if (M > 0 && N > 0 && K > 0) {
    check_view(A, A.trans == Trans::N ? M : K, A.trans == Trans::N ? K : M, "A");
    check_view(B, B.trans == Trans::N ? K : N, B.trans == Trans::N ? N : K, "B");
  }
  return p;
}

void gemm_with(const Kernel& kr, float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M,
               int64_t N, int64_t K, const GemmOptions& opt);

struct BatchPart {
  int64_t item, m0, m1, n0, n1, work;
};

void gemm_batch_with(const Kernel& kr, const GemmBatchItem* items, int64_t count) {
  // Reused between calls (steady-state steps do not allocate); the parts below name the caller's
  // instances, since a thread_local named inside a lambda would be the running thread's own.
  thread_local std::vector<Problem> problems_store;
  thread_local std::vector<BatchPart> parts_store;
  std::vector<Problem>& problems = problems_store;
  std::vector<BatchPart>& parts = parts_store;
  problems.clear();
  parts.clear();
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const GemmBatchItem& it = items[i];
    const bool plain_a = it.a_src.data == nullptr, plain_b = it.b_src.data == nullptr;
    if (plain_a && plain_b) {
      problems.push_back(make_problem(it, "gemm_batch item"));
    } else {
      problems.push_back(make_operand_problem(it.C, it.ldc, plain_a ? gemm_operand(it.A, it.lda, it.ta) : it.a_src,
                                              plain_b ? gemm_operand(it.B, it.ldb, it.tb) : it.b_src, it.M, it.N, it.K,
                                              {it.accumulate, it.bias, it.k_segments, it.k_sections},
                                              "gemm_batch item"));
    }
    const Problem& p = problems.back();
    if (it.M > 0 && it.N > 0 && it.K == 0) write_init(p);
    if (segment_by_segment(p, kr.blocks)) continue;  // after the region, on its own (below)
    total += it.M * it.N * it.K;
  }
  ThreadPool* pool = ThreadPool::current();
  const int T = pool ? pool->threads() : 1;
  // About 8 rectangles per thread: enough that the last ones balance the threads (and that a
  // thread the OS holds back leaves little behind), few enough that packing stays a small share
  // (a rectangle packs its A rows and B columns).
  constexpr int64_t kMinPartWork = int64_t{1} << 20;
  const int64_t target = std::max<int64_t>(kMinPartWork, total / (8 * T) + 1);
  for (int64_t i = 0; i < count; ++i) {
    const Problem& p = problems[static_cast<size_t>(i)];
    const int64_t work = p.M * p.N * p.K;
    if (work == 0 || segment_by_segment(p, kr.blocks)) continue;
    const int64_t units_m = ceil_div(p.M, kr.mr), units_n = ceil_div(p.N, kr.nr);
    const int64_t want = std::clamp<int64_t>((work + target / 2) / target, 1, units_m * units_n);
    const int64_t fit = choose_grid_rows(units_m, units_n, want, kr.mr, kr.nr);
    const int64_t tm = fit > 0 ? fit : std::min(want, units_m);  // no fit: rows only
    const int64_t tn = fit > 0 ? want / fit : 1;
    for (int64_t bm = 0; bm < tm; ++bm) {
      for (int64_t bn = 0; bn < tn; ++bn) {
        const int64_t m0 = std::min(p.M, units_m * bm / tm * kr.mr),
                      m1 = std::min(p.M, units_m * (bm + 1) / tm * kr.mr);
        const int64_t n0 = std::min(p.N, units_n * bn / tn * kr.nr),
                      n1 = std::min(p.N, units_n * (bn + 1) / tn * kr.nr);
        if (m0 < m1 && n0 < n1) parts.push_back(BatchPart{i, m0, m1, n0, n1, (m1 - m0) * (n1 - n0) * p.K});
      }
    }
  }
  std::stable_sort(parts.begin(), parts.end(), [](const BatchPart& a, const BatchPart& b) { return a.work > b.work; });
  const auto run_part = [&](int64_t j) {
    const BatchPart& q = parts[static_cast<size_t>(j)];
    kr.region(problems[static_cast<size_t>(q.item)], kr.blocks, q.m0, q.m1, q.n0, q.n1);
  };
  const int64_t n = static_cast<int64_t>(parts.size());
  if (pool && T > 1) {
    pool->run_parts(n, run_part);
  } else {
    for (int64_t j = 0; j < n; ++j) run_part(j);
  }
  // Segmented products past the one-pass limits: segment by segment, each in its own regions.
  for (int64_t i = 0; i < count; ++i) {
    const Problem& p = problems[static_cast<size_t>(i)];
    if (!segment_by_segment(p, kr.blocks) || p.M * p.N * p.K == 0) continue;
    gemm_with(kr, p.C, p.ldc, p.a_src.data ? p.a_src : gemm_operand(p.A, p.lda, p.ta),
              p.b_src.data ? p.b_src : gemm_operand(p.B, p.ldb, p.tb), p.M, p.N, p.K,
              {p.accumulate, p.bias, p.k_segments, p.k_sections});
  }
}

void gemm_with(const Kernel& kr, float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M,
               int64_t N, int64_t K, const GemmOptions& opt) {
  const Problem p = make_operand_problem(C, ldc, A, B, M, N, K, opt, "gemm");
  // No segments, or few enough and K short enough: one pass (compute_region_segmented).
  if (!segment_by_segment(p, kr.blocks)) {
    run(kr, p);
    return;
  }
  // Else each segment's chain goes to its own scratch matrix; the S partial products are summed
  // along the canonical tree (core/tree_sum.h), then added to the init (tensor-parallel reductions
  // under determinism = "layout": S - 1 extra additions over M x N, small against the products).
  const auto seg = opt.k_segments;
  const std::span<const int64_t> whole(&K, 1);
  const auto sections = opt.k_sections.empty() ? whole : opt.k_sections;
  const int64_t J = static_cast<int64_t>(sections.size());
  const int64_t S = p.segs, MN = M * N;
  // The canonical tree over the segments, streamed (core/tree_sum.h's binary counter: the same
  // additions as tree_sum): after s segments the tree holds popcount(s) complete subtrees, largest
  // first, in slots 0, 1, ...; segment s's product goes to the next slot and is folded into the
  // subtrees it completes right away, while it is still in cache. So the scratch is
  // bit_width(S - 1) + 1 products, not S, and each product is read back once, hot.
  const int64_t slots = std::bit_width(static_cast<uint64_t>(S - 1)) + 1;
  // Scratch kept per thread across calls: no allocation (and no page faults) in steady state.
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < slots * MN) scratch.resize(static_cast<size_t>(slots * MN));
  float* slot = scratch.data();
  const Init init = p.init;
  for (int64_t s = 0; s < S; ++s) {
    const int held = std::popcount(static_cast<uint64_t>(s));
    float* P = slot + held * MN;
    int64_t at = 0;  // where section j starts in K
    for (int64_t j = 0; j < J; ++j) {
      const int64_t k0 = at + seg[j * (S + 1) + s], k1 = at + seg[j * (S + 1) + s + 1];
      at += sections[j];
      LOCKSTEP_CHECK(k0 <= k1, "gemm k_segments decrease at ", s, " in section ", j);
      // K runs along A's stored columns for A, along its rows for A^T; the other way round for B.
      const GemmOperand As = A.trans == Trans::N ? gemm_operand_at(A, 0, k0) : gemm_operand_at(A, k0, 0);
      const GemmOperand Bs = B.trans == Trans::T ? gemm_operand_at(B, 0, k0) : gemm_operand_at(B, k0, 0);
      // The first part starts the segment's chain from 0, the next ones continue it (K = 0 writes
      // the 0: every element of P is written).
      GemmOptions part;
      part.accumulate = j > 0;
      run(kr, make_operand_problem(P, N, As, Bs, M, N, k1 - k0, part, "gemm segment"));
    }
    // The subtrees segment s completes: those of its trailing one bits (the smallest held ones);
    // the last segment folds every held one. carry = P, then held subtree + carry, smallest first;
    // the last adds the init.
    const bool last = s == S - 1;
    const int fold = last ? held : std::countr_one(static_cast<uint64_t>(s));
    if (!last && fold == 0) continue;
    parallel_for(M, [&](int64_t i0, int64_t i1) {
      constexpr int64_t kBlock = 256;
      float carry[kBlock];
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t b0 = 0; b0 < N; b0 += kBlock) {
          const int64_t e0 = i * N + b0, w = std::min(kBlock, N - b0);
          std::memcpy(carry, P + e0, static_cast<size_t>(w) * sizeof(float));
          for (int f = 1; f <= fold; ++f) {
            const float* h = slot + (held - f) * MN + e0;
            for (int64_t e = 0; e < w; ++e) carry[e] = h[e] + carry[e];
          }
          if (!last) {
            std::memcpy(slot + (held - fold) * MN + e0, carry, static_cast<size_t>(w) * sizeof(float));
            continue;
          }
          add_to_init(init, C + i * ldc + b0, opt.bias ? opt.bias + b0 : nullptr, carry, w);
        }
    });
  }
}

#ifdef LOCKSTEP_GEMM_BLAS
// Bench-only build (cmake -DLOCKSTEP_GEMM_BLAS=ON): fp32 products go to OpenBLAS's sgemm, whose
// reduction order depends on its blocking and thread count, so the contract of gemm.h does not
// hold. It exists to measure what the contract costs (bench/determinism_tax.sh); false when the
// call needs this file (k_segments).
bool blas_gemm(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B, int64_t ldb, Trans tb,
               int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  if (!opt.k_segments.empty()) return false;
  if (M == 0 || N == 0) return true;
  if (!opt.accumulate)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = opt.bias ? opt.bias[j] : 0.0f;
  if (K > 0)
    cblas_sgemm(CblasRowMajor, ta == Trans::N ? CblasNoTrans : CblasTrans, tb == Trans::N ? CblasNoTrans : CblasTrans,
                static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0f, A, static_cast<int>(lda), B,
                static_cast<int>(ldb), 1.0f, C, static_cast<int>(ldc));
  return true;
}
#endif

}  // namespace

void gemm(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B, int64_t ldb, Trans tb,
          int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
#ifdef LOCKSTEP_GEMM_BLAS
  if (blas_gemm(C, ldc, A, lda, ta, B, ldb, tb, M, N, K, opt)) return;
#endif
  gemm_with(best_kernel(), C, ldc, gemm_operand(A, lda, ta), gemm_operand(B, ldb, tb), M, N, K, opt);
}

void gemm(float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M, int64_t N, int64_t K,
          const GemmOptions& opt) {
#ifdef LOCKSTEP_GEMM_BLAS
  using K_ = GemmOperand::Kind;
  if (A.kind == K_::f32 && B.kind == K_::f32 &&
      blas_gemm(C, ldc, static_cast<const float*>(A.data), A.ld, A.trans, static_cast<const float*>(B.data), B.ld,
                B.trans, M, N, K, opt))
    return;
#endif
  gemm_with(best_kernel(), C, ldc, A, B, M, N, K, opt);
}

void gemm_batch(const GemmBatchItem* items, int64_t count) {
#ifdef LOCKSTEP_GEMM_BLAS
  for (int64_t i = 0; i < count; ++i) {
    const GemmBatchItem& t = items[i];
    GemmOptions opt;
    opt.accumulate = t.accumulate;
    opt.bias = t.bias;
    opt.k_segments = t.k_segments;
    opt.k_sections = t.k_sections;
    if (t.a_src.data || t.b_src.data || !blas_gemm(t.C, t.ldc, t.A, t.lda, t.ta, t.B, t.ldb, t.tb, t.M, t.N, t.K, opt))
      gemm_batch_with(best_kernel(), &t, 1);
  }
  return;
#endif
  gemm_batch_with(best_kernel(), items, count);
}

#ifdef LOCKSTEP_GEMM_BLAS
const char* gemm_kernel_name() { return "openblas (bench-only build: no determinism guarantee)"; }
#else
const char* gemm_kernel_name() { return best_kernel().name; }
#endif

namespace detail {
void gemm_portable(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B, int64_t ldb, Trans tb,
                   int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  gemm_with(kPortable, C, ldc, gemm_operand(A, lda, ta), gemm_operand(B, ldb, tb), M, N, K, opt);
}

std::vector<std::string> gemm_kernels() {
  std::vector<std::string> names;
  for (const Kernel* k : runnable_kernels()) names.emplace_back(k->name);
  return names;
}

void gemm_with_kernel(const std::string& kernel, float* C, int64_t ldc, const float* A, int64_t lda, Trans ta,
                      const float* B, int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  gemm_with_kernel(kernel, C, ldc, gemm_operand(A, lda, ta), gemm_operand(B, ldb, tb), M, N, K, opt);
}

void gemm_with_kernel(const std::string& kernel, float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B,
                      int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  for (const Kernel* k : runnable_kernels()) {
    if (kernel == k->name) return gemm_with(*k, C, ldc, A, B, M, N, K, opt);
  }
  LOCKSTEP_CHECK(false, "no GEMM micro-kernel named ", kernel, " on this machine");
}
}  // namespace detail

}  // namespace lockstep
