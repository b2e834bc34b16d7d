// Packed SGEMM in the GotoBLAS/BLIS layout: B is packed into K-major panels of NR columns, A into
// K-major panels of MR rows, and a register-blocked micro-kernel computes one MR x NR tile of C.
//
// What differs from a BLAS: the micro-kernel does not compute a partial product and add it to C.
// It loads the tile's running value (init on the first K block, C afterwards), continues the FMA
// chain over the K block, and stores it back. Every element of C is therefore one chain
// fma(a_k, b_k, acc) for k = 0..K-1 in order, whatever the blocking, the thread split or the
// micro-kernel, which is the determinism contract of gemm.h.
#include "lockstep/kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {

namespace {

// Where a tile's chain starts on this K block.
enum class Init : uint8_t { kC, kZero, kBias };

// Computes the MR x NR tile c (row stride ldc) over kc steps from packed panels a (kc x MR) and
// b (kc x NR). init kBias reads NR values of bias.
using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                             Init init, const float* bias);

struct Kernel {
  const char* name;
  int mr, nr;
  int64_t mc, kc, nc;  // cache blocks: A block mc x kc stays in L2, a B micro-panel kc x nr in L1
  MicroKernel run;
};

constexpr int kMaxTile = 32 * 64;  // largest MR * NR of any micro-kernel below

// ---------------------------------------------------------------- micro-kernels

template <int MR, int NR>
void kernel_portable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, Init init,
                     const float* bias) {
  float acc[MR][NR];
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      acc[i][j] = init == Init::kC ? c[i * ldc + j] : init == Init::kBias ? bias[j] : 0.0f;
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) acc[i][j] = std::fma(a[i], b[j], acc[i][j]);
    }
    a += MR;
    b += NR;
  }
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = acc[i][j];
  }
}

#ifdef LOCKSTEP_AVX2
// MR rows of NV vectors of 8: MR * NV accumulators + NV for B + 1 broadcast of A <= 16 ymm.
template <int MR, int NV>
void kernel_avx2(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, Init init,
                 const float* bias) {
  __m256 acc[MR][NV];
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) {
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
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) bv[v] = _mm256_load_ps(b + 8 * v);
    _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
      _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
    }
    a += MR;
    b += 8 * NV;
  }
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
  }
}

// Zen 4 runs a 512-bit FMA as two 256-bit halves, so AVX-512 does not raise the FLOP peak; it
// doubles the register file, which allows a tile with half the loads per FMA.
template <int MR, int NV>
__attribute__((target("avx512f"))) void kernel_avx512(int64_t kc, const float* a, const float* b,
                                                      float* c, int64_t ldc, Init init,
                                                      const float* bias) {
  __m512 acc[MR][NV];
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) {
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
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) bv[v] = _mm512_load_ps(b + 16 * v);
    _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i]);
      _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, bv[v], acc[i][v]);
    }
    a += MR;
    b += 16 * NV;
  }
  _Pragma("GCC unroll 64") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  }
}
#endif

const Kernel kPortable{"portable", 6, 16, 144, 256, 4080, kernel_portable<6, 16>};
#ifdef LOCKSTEP_AVX2
const Kernel kAvx2{"avx2-6x16", 6, 16, 144, 256, 4080, kernel_avx2<6, 2>};
const Kernel kAvx512{"avx512-12x32", 12, 32, 144, 256, 4096, kernel_avx512<12, 2>};
#endif

const Kernel& best_kernel() {
#ifdef LOCKSTEP_AVX2
  static const Kernel& k = __builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2;
  return k;
#else
  return kPortable;
#endif
}

// ---------------------------------------------------------------- operands and packing

struct Problem {
  float* C;
  int64_t ldc;
  const float* A;
  int64_t lda;
  Trans ta;
  const float* B;
  int64_t ldb;
  Trans tb;
  int64_t M, N, K;
  Init init;
  const float* bias;
};

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

// op(A)[i0 .. i0+mc) x [k0 .. k0+kc) into panels of mr rows: panel p holds, for each k, the mr
// values of rows i0 + p*mr ..., rows past M zero.
void pack_a(float* dst, const Problem& p, int64_t i0, int64_t mc, int64_t k0, int64_t kc, int mr) {
  for (int64_t ip = 0; ip < mc; ip += mr) {
    const int64_t rows = std::min<int64_t>(mr, mc - ip);
    const int64_t i = i0 + ip;
    if (p.ta == Trans::T) {
      // Stored K x M: each k is a contiguous run of rows.
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = p.A + (k0 + k) * p.lda + i;
        float* d = dst + k * mr;
        std::memcpy(d, src, rows * sizeof(float));
        std::fill(d + rows, d + mr, 0.0f);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = p.A + (i + r) * p.lda + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * mr + r] = src[k];
      }
      for (int64_t r = rows; r < mr; ++r) {
        for (int64_t k = 0; k < kc; ++k) dst[k * mr + r] = 0.0f;
      }
    }
    dst += kc * mr;
  }
}

// op(B)[k0 .. k0+kc) x [j0 .. j0+nc) into panels of nr columns, columns past N zero.
void pack_b(float* dst, const Problem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc, int nr) {
  for (int64_t jp = 0; jp < nc; jp += nr) {
    const int64_t cols = std::min<int64_t>(nr, nc - jp);
    const int64_t j = j0 + jp;
    if (p.tb == Trans::N) {
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = p.B + (k0 + k) * p.ldb + j;
        float* d = dst + k * nr;
        std::memcpy(d, src, cols * sizeof(float));
        std::fill(d + cols, d + nr, 0.0f);
      }
    } else {
      // Stored N x K: read each column's K run contiguously, scatter into the L1-resident panel.
      for (int64_t c = 0; c < cols; ++c) {
        const float* src = p.B + (j + c) * p.ldb + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * nr + c] = src[k];
      }
      for (int64_t c = cols; c < nr; ++c) {
        for (int64_t k = 0; k < kc; ++k) dst[k * nr + c] = 0.0f;
      }
    }
    dst += kc * nr;
  }
}

// ---------------------------------------------------------------- driver

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits `len` into equal blocks of at most `cap`, each a multiple of `unit`: avoids a thin last
// block (a K block of 3 steps would pay a full tile load/store for almost no work).
int64_t balanced_block(int64_t len, int64_t cap, int64_t unit) {
  const int64_t blocks = ceil_div(len, cap);
  return ceil_div(ceil_div(len, blocks), unit) * unit;
}

// The tile rows [m0, m1) x columns [n0, n1) of C, on the calling thread.
void compute_region(const Kernel& kr, const Problem& p, int64_t m0, int64_t m1, int64_t n0,
                    int64_t n1) {
  thread_local Scratch a_scratch, b_scratch;
  const int mr = kr.mr, nr = kr.nr;
  const int64_t kc_max = balanced_block(p.K, kr.kc, 1);
  const int64_t mc_max = balanced_block(m1 - m0, kr.mc, mr);
  const int64_t nc_max = balanced_block(n1 - n0, kr.nc, nr);
  float* apack = a_scratch.get(static_cast<size_t>(mc_max * kc_max));
  float* bpack = b_scratch.get(static_cast<size_t>(nc_max * kc_max));
  alignas(64) float tile[kMaxTile];

  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    for (int64_t pc = 0; pc < p.K; pc += kc_max) {
      const int64_t kc = std::min(kc_max, p.K - pc);
      pack_b(bpack, p, pc, kc, jc, nc, nr);
      const Init init = pc == 0 ? p.init : Init::kC;
      for (int64_t ic = m0; ic < m1; ic += mc_max) {
        const int64_t mc = std::min(mc_max, m1 - ic);
        pack_a(apack, p, ic, mc, pc, kc, mr);
        for (int64_t jr = 0; jr < nc; jr += nr) {
          const int64_t cols = std::min<int64_t>(nr, nc - jr);
          const float* bias = p.bias ? p.bias + jc + jr : nullptr;
          for (int64_t ir = 0; ir < mc; ir += mr) {
            const int64_t rows = std::min<int64_t>(mr, mc - ir);
            const float* ap = apack + ir * kc;
            const float* bp = bpack + jr * kc;
            float* c = p.C + (ic + ir) * p.ldc + jc + jr;
            if (rows == mr && cols == nr) {
              kr.run(kc, ap, bp, c, p.ldc, init, bias);
              continue;
            }
            // Edge tile: run the full kernel on a copy holding the chain's current values.
            for (int64_t i = 0; i < mr; ++i) {
              for (int64_t j = 0; j < nr; ++j) {
                float v = 0.0f;
                if (i < rows && j < cols) {
                  v = init == Init::kC ? c[i * p.ldc + j] : init == Init::kBias ? bias[j] : 0.0f;
                }
                tile[i * nr + j] = v;
              }
            }
            kr.run(kc, ap, bp, tile, nr, Init::kC, nullptr);
            for (int64_t i = 0; i < rows; ++i) {
              std::memcpy(c + i * p.ldc, tile + i * nr, cols * sizeof(float));
            }
          }
        }
      }
    }
  }
}

void write_init(const Problem& p) {
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
// gives the same bits; this one balances the tiles and then minimises the packing (a thread packs
// the A rows and B columns of its rectangle).
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
    compute_region(kr, p, 0, p.M, 0, p.N);
    return;
  }
  int64_t best_tm = 1, best_cost = -1, best_perimeter = 0;
  for (int tm = 1; tm <= T; ++tm) {
    if (T % tm != 0) continue;
    const int64_t rows = ceil_div(units_m, tm) * kr.mr, cols = ceil_div(units_n, T / tm) * kr.nr;
    const int64_t cost = rows * cols, perimeter = rows + cols;
    if (best_cost < 0 || cost < best_cost || (cost == best_cost && perimeter < best_perimeter)) {
      best_tm = tm;
      best_cost = cost;
      best_perimeter = perimeter;
    }
  }
  const int64_t tm = best_tm, tn = T / best_tm;
  pool->run_on_all([&](int t) {
    const int64_t bm = t / tn, bn = t % tn;
    const int64_t m0 = std::min(p.M, chunk_begin(units_m, bm, tm) * kr.mr);
    const int64_t m1 = std::min(p.M, chunk_begin(units_m, bm + 1, tm) * kr.mr);
    const int64_t n0 = std::min(p.N, chunk_begin(units_n, bn, tn) * kr.nr);
    const int64_t n1 = std::min(p.N, chunk_begin(units_n, bn + 1, tn) * kr.nr);
    if (m0 < m1 && n0 < n1) compute_region(kr, p, m0, m1, n0, n1);
  });
}

void gemm_with(const Kernel& kr, float* C, int64_t ldc, const float* A, int64_t lda, Trans ta,
               const float* B, int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K,
               const GemmOptions& opt) {
  LOCKSTEP_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm sizes M=", M, " N=", N, " K=", K);
  LOCKSTEP_CHECK(ldc >= N, "gemm ldc=", ldc, " < N=", N);
  LOCKSTEP_CHECK(lda >= (ta == Trans::N ? K : M), "gemm lda=", lda, " too small");
  LOCKSTEP_CHECK(ldb >= (tb == Trans::N ? N : K), "gemm ldb=", ldb, " too small");
  const Init init = opt.accumulate ? Init::kC : opt.bias ? Init::kBias : Init::kZero;
  if (opt.k_segments.empty()) {
    run(kr, Problem{C, ldc, A, lda, ta, B, ldb, tb, M, N, K, init, opt.bias});
    return;
  }

  const auto seg = opt.k_segments;
  LOCKSTEP_CHECK(seg.size() >= 2 && seg.front() == 0 && seg.back() == K,
                 "gemm k_segments must run from 0 to K=", K);
  std::vector<float> partial(static_cast<size_t>(M * N));
  for (size_t s = 0; s + 1 < seg.size(); ++s) {
    const int64_t k0 = seg[s], k1 = seg[s + 1];
    LOCKSTEP_CHECK(k0 <= k1, "gemm k_segments not increasing at ", s);
    const float* As = A + (ta == Trans::N ? k0 : k0 * lda);
    const float* Bs = B + (tb == Trans::N ? k0 * ldb : k0);
    run(kr, Problem{partial.data(), N, As, lda, ta, Bs, ldb, tb, M, N, k1 - k0, Init::kZero,
                    nullptr});
    const Init base = s == 0 ? init : Init::kC;
    parallel_for(M, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* c = C + i * ldc;
        const float* q = partial.data() + i * N;
        for (int64_t j = 0; j < N; ++j) {
          const float b = base == Init::kC ? c[j] : base == Init::kBias ? opt.bias[j] : 0.0f;
          c[j] = b + q[j];
        }
      }
    });
  }
}

}  // namespace

void gemm(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B,
          int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  gemm_with(best_kernel(), C, ldc, A, lda, ta, B, ldb, tb, M, N, K, opt);
}

const char* gemm_kernel_name() { return best_kernel().name; }

namespace detail {
void gemm_portable(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B,
                   int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K, const GemmOptions& opt) {
  gemm_with(kPortable, C, ldc, A, lda, ta, B, ldb, tb, M, N, K, opt);
}
}  // namespace detail

}  // namespace lockstep
