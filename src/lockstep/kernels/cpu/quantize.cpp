#include "lockstep/kernels/cpu/quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"
#include "lockstep/kernels/hadamard.h"

namespace lockstep {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// max(m, |v|) that keeps a NaN once it has seen one.
inline float max_abs(float m, float v) {
  const float a = std::abs(v);
  return (a > m || std::isnan(a)) ? a : m;
}

// max_abs folded over x[0, n) from 0: the max |x|, or the last NaN's |NaN| when x holds one.
// Vector lanes take the max of a NaN-free stretch (exact, so any order gives these bits); a stretch
// that holds a NaN is redone by the scalar loop, so that the same NaN comes out.
float run_amax(const float* x, int64_t n) {
  float m = 0.0f;
  int64_t i = 0;
#if LOCKSTEP_AVX2
  if (n >= 8) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0, nan = m0;
    for (; i + 32 <= n; i += 32) {
      const __m256 a0 = _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude);
      const __m256 a1 = _mm256_and_ps(_mm256_loadu_ps(x + i + 8), magnitude);
      const __m256 a2 = _mm256_and_ps(_mm256_loadu_ps(x + i + 16), magnitude);
      const __m256 a3 = _mm256_and_ps(_mm256_loadu_ps(x + i + 24), magnitude);
      nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a0, a1, _CMP_UNORD_Q), _mm256_cmp_ps(a2, a3, _CMP_UNORD_Q)));
      m0 = _mm256_max_ps(m0, a0);
      m1 = _mm256_max_ps(m1, a1);
      m2 = _mm256_max_ps(m2, a2);
      m3 = _mm256_max_ps(m3, a3);
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(m0, a);
    }
    if (_mm256_movemask_ps(nan) != 0) {
      i = 0;
    } else {
      m = vm::hmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    }
  }
#endif
  for (; i < n; ++i) m = max_abs(m, x[i]);
  return m;
}

float block_amax(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float m = 0.0f;
  for (int64_t r = r0; r < r1; ++r) m = max_abs(m, run_amax(x + r * cols + c0, c1 - c0));
  return m;
}

// block_amax of the 1-column blocks c0 .. c0 + n - 1 over rows [r0, r1): out[j] for column c0 + j.
// Vector lanes are columns (the max down each is exact in any order); a group of 8 columns holding
// a NaN is redone by block_amax, so that the same NaN comes out.
void column_amaxes(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t n, float* out) {
  int64_t j = 0;
#if LOCKSTEP_AVX2
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (; j + 8 <= n; j += 8) {
    __m256 m = _mm256_setzero_ps(), nan = m;
    for (int64_t r = r0; r < r1; ++r) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + r * cols + c0 + j), magnitude);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, a);
    }
    _mm256_storeu_ps(out + j, m);
    if (_mm256_movemask_ps(nan) != 0)
      for (int64_t k = j; k < j + 8; ++k) out[k] = block_amax(x, cols, r0, r1, c0 + k, c0 + k + 1);
  }
#endif
  for (; j < n; ++j) out[j] = block_amax(x, cols, r0, r1, c0 + j, c0 + j + 1);
}

// The rounding of each element: nearest-even, or stochastic with Philox bits keyed by the
// element's global index.
class Encoder {
 public:
  Encoder(ElemFormat f, const StochasticRounding& sr, int64_t cols)
      : f_(f),
        sr_(sr),
        rng_(sr.seed, sr_purpose(sr.tensor_id, sr.step)),
        row_stride_(sr.global_cols > 0 ? sr.global_cols : cols) {}
  ElemFormat format() const { return f_; }
  bool stochastic() const { return sr_.enabled; }
  uint64_t index(int64_t r, int64_t c) const { return static_cast<uint64_t>(sr_.index_base + r * row_stride_ + c); }
  const RandomStream& rng() const { return rng_; }

 private:
  ElemFormat f_;
  StochasticRounding sr_;
  RandomStream rng_;
  int64_t row_stride_;
};

void prepare(QuantizedTensor& q, int64_t rows, int64_t cols, ElemFormat f, ScaleFormat sf, int64_t block_rows,
             int64_t block_cols) {
  LOCKSTEP_CHECK(rows >= 0 && cols >= 0 && block_rows > 0 && block_cols > 0, "quantize sizes ", rows, "x", cols,
                 " blocks ", block_rows, "x", block_cols);
  LOCKSTEP_CHECK(f != ElemFormat::e2m1 || block_cols % 2 == 0 || block_cols >= cols,
                 "E2M1 blocks must span whole bytes (even block_cols), got ", block_cols);
  q.elem = f;
  q.scale_format = sf;
  q.rows = rows;
  q.cols = cols;
  q.block_rows = block_rows;
  q.block_cols = block_cols;
  q.tensor_scale = 1.0f;
  q.codes.resize(static_cast<size_t>(rows * q.row_bytes()));
  const auto grid = static_cast<size_t>(q.grid_rows() * q.grid_cols());
  q.scales.resize(sf == ScaleFormat::f32 ? grid : 0);
  q.scale_codes.resize(sf == ScaleFormat::f32 ? 0 : grid);
}

#if LOCKSTEP_AVX2
// encode_saturating<F>(x[i] * mult) (kStochastic: encode_stochastic_as<F>(x[i] * mult, draws[i]))
// for eight values, one code per 32-bit lane: the scalar encoder's steps in lanes. The product is
// the same IEEE multiply. The normal range truncates to M mantissa bits and rounds up by the
// dropped bits: to nearest even as integers, or when the draw is below their fraction (the scalar's
// exact float compare). The subnormal range scales |y| by 2^(M - emin) (exact, below 2^M) and rounds
// that to the nearest even integer, or truncates it and rounds up when the draw is below the
// remainder. Magnitudes above the largest finite saturate (infinity included); NaN gives the
// format's NaN (E2M1: its largest magnitude). The same codes as the scalar loop, bit for bit.
template <ElemFormat F, bool kStochastic>
inline __m256i encode8(const float* x, __m256 mult, __m256i draws) {
  constexpr float_formats_detail::Layout L = float_formats_detail::layout(F);
  constexpr int sh = 23 - L.M;
  // A NaN multiplier (a NaN block) gives itself, as the scalar path's scaled() does.
  const __m256i u = _mm256_castps_si256(vm::scaled(_mm256_loadu_ps(x), mult));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), L.sign_shift());
  // Normal: the top M mantissa bits with the rebiased exponent, plus one when rounding up.
  __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(a, sh), _mm256_set1_epi32((127 - L.bias) << L.M));
  const __m256i dropped = _mm256_and_si256(a, _mm256_set1_epi32((1 << sh) - 1));
  // |y| in units of the smallest subnormal (below 2^M in the subnormal range).
  const __m256 units =
      _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(float_formats_detail::pow2(L.M - L.emin())));
  __m256i subnormal;
  if constexpr (kStochastic) {
    const __m256 draw = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(draws, 8)), _mm256_set1_ps(0x1p-24f));
    const __m256 frac = _mm256_mul_ps(_mm256_cvtepi32_ps(dropped), _mm256_set1_ps(float_formats_detail::pow2(-sh)));
    normal = _mm256_sub_epi32(normal, _mm256_castps_si256(_mm256_cmp_ps(draw, frac, _CMP_LT_OQ)));
    const __m256 whole = _mm256_round_ps(units, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 rest = _mm256_sub_ps(units, whole);
    subnormal =
        _mm256_sub_epi32(_mm256_cvttps_epi32(whole), _mm256_castps_si256(_mm256_cmp_ps(draw, rest, _CMP_LT_OQ)));
  } else {
    const __m256i half = _mm256_set1_epi32(1 << (sh - 1));
    const __m256i odd = _mm256_srai_epi32(_mm256_slli_epi32(normal, 31), 31);  // all ones where odd
    const __m256i up =
        _mm256_or_si256(_mm256_cmpgt_epi32(dropped, half), _mm256_and_si256(_mm256_cmpeq_epi32(dropped, half), odd));
    normal = _mm256_sub_epi32(normal, up);  // up is all ones (-1) where it rounds up
    subnormal = _mm256_cvttps_epi32(_mm256_round_ps(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(((L.emin() + 127) << 23) - 1));
  __m256i mag = _mm256_blendv_epi8(subnormal, normal, is_normal);
  mag = _mm256_min_epi32(mag, _mm256_set1_epi32(static_cast<int>(L.max_mag)));
  const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(L.nan_mag), is_nan);
  return _mm256_or_si256(sign, mag);
}

// The low byte of each of the eight lanes, in order (FP8: eight codes).
inline void store8_bytes(uint8_t* out, __m256i codes) {
  const __m256i bytes =
      _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                  12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// Eight E2M1 codes (one per lane, below 16) as four bytes, the even element in the low nibble.
inline void store8_nibbles(uint8_t* out, __m256i codes) {
  const __m256i pairs = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));  // lane 2i: lo | hi << 4
  const __m256i bytes =
      _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8,
                                                  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i packed = _mm_unpacklo_epi16(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  const auto four = static_cast<uint32_t>(_mm_cvtsi128_si32(packed));
  std::memcpy(out, &four, 4);
}
#endif

// The multiplier of each column of a run: one for all its columns (tensorwise), or one per column
// block (per_block[b - b0] for block b of block_cols columns).
struct Mults {
  float all = 0.0f;
  const float* per_block = nullptr;
  int64_t b0 = 0, block_cols = 1;
  float at(int64_t c) const { return per_block ? per_block[c / block_cols - b0] : all; }
#if LOCKSTEP_AVX2
  // Columns c .. c + 7 (c a multiple of 8 from the block grid's start when block_cols is).
  __m256 at8(int64_t c) const {
    if (!per_block) return _mm256_set1_ps(all);
    if (block_cols == 1) return _mm256_loadu_ps(per_block + (c - b0));
    if (block_cols % 8 == 0) return _mm256_set1_ps(at(c));
    return _mm256_setr_ps(at(c), at(c + 1), at(c + 2), at(c + 3), at(c + 4), at(c + 5), at(c + 6), at(c + 7));
  }
#endif
};

#if LOCKSTEP_AVX2
// The vector part of a run: columns [c, c1) of row r in groups of 32 (nearest: of 8), each group's
// codes handed to store(column, codes) eight at a time; c is left at the first column not done.
// Stochastic: the group's 32 draws are bits(i .. i + 31) of its first element's index i, eight
// Philox blocks from i / 4 (and a ninth when i is not a multiple of 4).
template <ElemFormat F, bool kStochastic, typename Store>
inline void lanes32(const Encoder& enc, const float* row, int64_t r, int64_t& c, int64_t c1, const Mults& mult,
                    Store store) {
  if constexpr (kStochastic) {
    alignas(32) uint32_t draws[36];
    for (; c + 32 <= c1; c += 32) {
      const uint64_t i = enc.index(r, c), off = i & 3;
      enc.rng().blocks8(i >> 2, draws);
      if (off) {
        const std::array<uint32_t, 4> w = enc.rng().block((i >> 2) + 8);
        std::copy(w.begin(), w.end(), draws + 32);
      }
      for (int g = 0; g < 4; ++g)
        store(c + 8 * g, encode8<F, true>(row + c + 8 * g, mult.at8(c + 8 * g),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(draws + off + 8 * g))));
    }
  } else {
    for (; c + 8 <= c1; c += 8) store(c, encode8<F, false>(row + c, mult.at8(c), _mm256_setzero_si256()));
  }
}
#endif

// Writes the codes of row r, columns [c0, c1) of x times each column's multiplier. E2M1: c0 is even
// (blocks span whole bytes), so each byte is written by one call. The format and the rounding are template
// parameters so that the per-element encoding inlines.
template <ElemFormat F, bool kStochastic>
void encode_run_as(QuantizedTensor& q, const Encoder& enc, const float* x, int64_t r, int64_t c0, int64_t c1,
                   const Mults& mult) {
  const float* row = x + r * q.cols;
  // The row's draws are consecutive indices: one Philox block serves four of them.
  uint64_t block_index = ~uint64_t{0};
  std::array<uint32_t, 4> draws{};
  const auto code = [&](int64_t c) -> uint8_t {
    const float y = scaled(row[c], mult.at(c));
    if constexpr (kStochastic) {
      const uint64_t i = enc.index(r, c);
      if (i >> 2 != block_index) {
        block_index = i >> 2;
        draws = enc.rng().block(block_index);
      }
      return encode_stochastic_as<F>(y, draws[i & 3]);
    } else {
      return encode_saturating<F>(y);
    }
  };
  if constexpr (F != ElemFormat::e2m1) {
    uint8_t* out = q.codes.data() + r * q.cols;
    int64_t c = c0;
#if LOCKSTEP_AVX2
    lanes32<F, kStochastic>(enc, row, r, c, c1, mult,
                            [&](int64_t at, __m256i codes) { store8_bytes(out + at, codes); });
#endif
    for (; c < c1; ++c) out[c] = code(c);
  } else {
    uint8_t* out = q.codes.data() + r * q.row_bytes();
    int64_t c = c0;
#if LOCKSTEP_AVX2
    lanes32<F, kStochastic>(enc, row, r, c, c1, mult,
                            [&](int64_t at, __m256i codes) { store8_nibbles(out + at / 2, codes); });
#endif
    for (; c < c1; c += 2) {
      const uint8_t lo = code(c);
      const uint8_t hi = c + 1 < c1 ? code(c + 1) : 0;
      out[c / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <bool kStochastic>
void encode_run_sr(QuantizedTensor& q, const Encoder& enc, const float* x, int64_t r, int64_t c0, int64_t c1,
                   const Mults& mult) {
  switch (enc.format()) {
    case ElemFormat::e4m3:
      return encode_run_as<ElemFormat::e4m3, kStochastic>(q, enc, x, r, c0, c1, mult);
    case ElemFormat::e5m2:
      return encode_run_as<ElemFormat::e5m2, kStochastic>(q, enc, x, r, c0, c1, mult);
    case ElemFormat::e2m1:
      break;
  }
  encode_run_as<ElemFormat::e2m1, kStochastic>(q, enc, x, r, c0, c1, mult);
}

void encode_run(QuantizedTensor& q, const Encoder& enc, const float* x, int64_t r, int64_t c0, int64_t c1,
                const Mults& mult) {
  if (enc.stochastic()) {
    encode_run_sr<true>(q, enc, x, r, c0, c1, mult);
  } else {
    encode_run_sr<false>(q, enc, x, r, c0, c1, mult);
  }
}

// The scale of one block: what is stored, and what the elements are multiplied by before encoding.
struct BlockScale {
  float stored_f32 = 0.0f;
  uint8_t stored_code = 0;
  float mult = 0.0f;
};

// For every block (in parallel over rows of blocks): amax_b, then scale_of(amax_b), then the codes,
// row by row over up to 64 blocks at a time (so that a row's run spans many blocks: 1-column blocks
// go through the vector lanes too).
template <typename ScaleOf>
void quantize_blocks(QuantizedTensor& q, const float* x, const Encoder& enc, ScaleOf scale_of) {
  constexpr int64_t kChunk = 64;
  const int64_t gr = q.grid_rows(), gc = q.grid_cols();
  parallel_for(gr, [&](int64_t b0, int64_t b1) {
    float mults[kChunk], amaxes[kChunk];
    for (int64_t br = b0; br < b1; ++br) {
      const int64_t r0 = br * q.block_rows, r1 = std::min(q.rows, r0 + q.block_rows);
      for (int64_t bc0 = 0; bc0 < gc; bc0 += kChunk) {
        const int64_t bc1 = std::min(gc, bc0 + kChunk);
        if (q.block_cols == 1) column_amaxes(x, q.cols, r0, r1, bc0, bc1 - bc0, amaxes);
        for (int64_t bc = bc0; bc < bc1; ++bc) {
          const int64_t c0 = bc * q.block_cols, c1 = std::min(q.cols, c0 + q.block_cols);
          const BlockScale s = scale_of(q.block_cols == 1 ? amaxes[bc - bc0] : block_amax(x, q.cols, r0, r1, c0, c1));
          const auto b = static_cast<size_t>(br * gc + bc);
          if (q.scale_format == ScaleFormat::f32) {
            q.scales[b] = s.stored_f32;
          } else {
            q.scale_codes[b] = s.stored_code;
          }
          mults[bc - bc0] = s.mult;
        }
        const Mults m{0.0f, mults, bc0, q.block_cols};
        const int64_t c0 = bc0 * q.block_cols, c1 = std::min(q.cols, bc1 * q.block_cols);
        for (int64_t r = r0; r < r1; ++r) encode_run(q, enc, x, r, c0, c1, m);
      }
    }
  });
}

#ifdef LOCKSTEP_AVX2
// decode() of 8 FP8 codes (int32 lanes 0..255) without a table (gathers are slow): the magnitude
// bits shifted into an fp32's exponent and mantissa, times 2^(127 - bias), is the value exactly
// (subnormal codes become fp32 subnormals first, then normal); NaN / inf codes are blended in with
// the bits decode() has, and the sign bit is ORed in (so -0 stays -0).
inline __m256 decode8_fp8(ElemFormat f, __m256i code) {
  const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7F));
  const __m256i sign_bits = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  __m256 v;
  if (f == ElemFormat::e4m3) {
    v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  } else {
    v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 21)), _mm256_set1_ps(0x1p112f));
    const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
    const __m256 special =
        _mm256_blendv_ps(inf, nan, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7C))));
    v = _mm256_blendv_ps(v, special, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7B))));
  }
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign_bits));
}

// decode() of 8 E2M1 codes (int32 lanes 0..15): the 8 magnitudes fit one register.
inline __m256 decode8_e2m1(__m256i code) {
  const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 v = _mm256_permutevar8x32_ps(mags, _mm256_and_si256(code, _mm256_set1_epi32(7)));
  return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28)));
}
#endif

}  // namespace

void dequantize_row(const QuantizedTensor& q, int64_t r, int64_t c, int64_t len, float* out) {
  const std::array<float, 256>& table = decode_table(q.elem);
  const float ts = q.tensor_scale;
  const int64_t br = r / q.block_rows, end = c + len;
  const uint8_t* codes = q.codes.data() + r * q.row_bytes();
  if (q.block_cols == 1 && q.scale_format == ScaleFormat::f32 && q.elem != ElemFormat::e2m1) {
    // One scale per column (blockwise 128 x 1): the scales of the row's columns are consecutive.
    const float* sc = q.scales.data() + br * q.grid_cols();
#ifdef LOCKSTEP_AVX2
    const __m256 tv = _mm256_set1_ps(ts);
    for (; c + 8 <= end; c += 8, out += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
      const __m256 v = vm::scaled(decode8_fp8(q.elem, idx), _mm256_loadu_ps(sc + c));
      _mm256_storeu_ps(out, _mm256_mul_ps(v, tv));
    }
#endif
    for (; c < end; ++c) *out++ = scaled(table[codes[c]], sc[c]) * ts;
    return;
  }
  while (c < end) {
    const int64_t bc = c / q.block_cols, stop = std::min(end, (bc + 1) * q.block_cols);
    const float s = q.block_scale(br, bc);
    if (q.elem != ElemFormat::e2m1) {
#ifdef LOCKSTEP_AVX2
      // The same values and products, 8 at a time.
      const __m256 sv = _mm256_set1_ps(s), tv = _mm256_set1_ps(ts);
      for (; c + 8 <= stop; c += 8, out += 8) {
        const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
        const __m256 v = vm::scaled(decode8_fp8(q.elem, idx), sv);
        _mm256_storeu_ps(out, _mm256_mul_ps(v, tv));
      }
#endif
      for (; c < stop; ++c) *out++ = scaled(table[codes[c]], s) * ts;
    } else {
      if (c < stop && (c & 1)) {
        *out++ = scaled(table[codes[c >> 1] >> 4], s) * ts;
        ++c;
      }
#ifdef LOCKSTEP_AVX2
      // 4 bytes hold 8 codes, low nibble first.
      const __m256 sv = _mm256_set1_ps(s), tv = _mm256_set1_ps(ts);
      const __m128i nibble = _mm_set1_epi32(0xF);
      for (; c + 8 <= stop; c += 8, out += 8) {
        int32_t four;
        std::memcpy(&four, codes + (c >> 1), 4);
        const __m128i b = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
        const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_srli_epi32(b, 4);
        const __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
        const __m256 v = vm::scaled(decode8_e2m1(idx), sv);
        _mm256_storeu_ps(out, _mm256_mul_ps(v, tv));
      }
#endif
      for (; c < stop; ++c) *out++ = scaled(table[(codes[c >> 1] >> (4 * (c & 1))) & 0xF], s) * ts;
    }
  }
}

void dequantize(float* out, int64_t ld, const QuantizedTensor& q) {
  parallel_for(q.rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequantize_row(q, r, 0, q.cols, out + r * ld);
  });
}

float amax(const float* x, int64_t n) {
  // A fixed number of parts, combined in order: the same bits whatever the thread count (max is
  // exact in any order anyway; the order only fixes which NaN comes out).
  constexpr int64_t kParts = 64;
  const int64_t parts = std::min<int64_t>(kParts, std::max<int64_t>(1, n / 4096));
  float partial[kParts];
  parallel_for(parts, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i0 = n * p / parts;
      partial[p] = run_amax(x + i0, n * (p + 1) / parts - i0);
    }
  });
  float m = 0.0f;
  for (int64_t p = 0; p < parts; ++p) m = max_abs(m, partial[p]);
  return m;
}

void quantize_tensorwise(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f, float scale,
                         const StochasticRounding& sr) {
  LOCKSTEP_CHECK(scale > 0.0f && std::isfinite(scale), "tensorwise FP8 scale must be positive and finite, got ", scale);
  prepare(out, rows, cols, f, ScaleFormat::f32, std::max<int64_t>(rows, 1), std::max<int64_t>(cols, 1));
  out.scales[0] = 1.0f / scale;
  const Encoder enc(f, sr, cols);
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) encode_run(out, enc, x, r, 0, cols, Mults{scale});
  });
}

void quantize_blockwise(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f,
                        int64_t block_rows, int64_t block_cols, const StochasticRounding& sr) {
  prepare(out, rows, cols, f, ScaleFormat::f32, block_rows, block_cols);
  const float fmax = max_finite(f);
  quantize_blocks(out, x, Encoder(f, sr, cols), [fmax](float amax_b) {
    if (!std::isfinite(amax_b)) return BlockScale{kNaN, 0, kNaN};
    if (amax_b == 0.0f) return BlockScale{1.0f, 0, 1.0f};
    // 2^floor(log2(fmax / amax_b)): clear the mantissa of the fp32 quotient.
    int e = std::ilogb(fmax / amax_b);  // fmax / tiny amax_b = inf: ilogb gives INT_MAX
    e = std::clamp(e, -126, 127);
    const float s = std::ldexp(1.0f, e);
    return BlockScale{1.0f / s, 0, s};
  });
}

void quantize_mxfp8(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f,
                    ScaleRounding rounding, int64_t block_cols, const StochasticRounding& sr) {
  prepare(out, rows, cols, f, ScaleFormat::e8m0, 1, block_cols);
  const float fmax = max_finite(f);
  const int emax = max_exponent(f);
  quantize_blocks(out, x, Encoder(f, sr, cols), [=](float amax_b) {
    if (!std::isfinite(amax_b)) return BlockScale{0.0f, 0xFF, kNaN};
    uint8_t code;
    if (rounding == ScaleRounding::up) {
      code = encode_e8m0(amax_b / fmax, ScaleRounding::up);
    } else {
      // floor(log2 amax_b) - emax_elem (or nearest, for experiments), clamped at the smallest scale.
      code = static_cast<uint8_t>(std::max(0, encode_e8m0(amax_b, rounding) - emax));
    }
    return BlockScale{0.0f, code, 1.0f / decode_e8m0(code)};  // a power of two: exact
  });
}

void quantize_nvfp4(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                    const StochasticRounding& sr, const float* tensor_amax) {
  LOCKSTEP_CHECK(block_rows == 1 || block_rows == 16, "NVFP4 blocks are 1x16 or 16x16, got ", block_rows, "x16");
  prepare(out, rows, cols, ElemFormat::e2m1, ScaleFormat::e4m3, block_rows, 16);
  constexpr float kRange = 6.0f * 448.0f;
  const float t = tensor_amax ? *tensor_amax : amax(x, rows * cols);
  const float S = !std::isfinite(t) ? kNaN : t == 0.0f ? 1.0f : kRange / t;
  out.tensor_scale = !std::isfinite(t) ? kNaN : t == 0.0f ? 1.0f : t / kRange;
  quantize_blocks(out, x, Encoder(ElemFormat::e2m1, sr, cols), [S](float amax_b) {
    if (!std::isfinite(amax_b)) return BlockScale{0.0f, encode_e4m3(kNaN), 0.0f};
    const uint8_t code = encode_e4m3((amax_b / 6.0f) * S);
    const float d = decode_e4m3(code);
    return BlockScale{0.0f, code, d == 0.0f ? 0.0f : S / d};
  });
}

// ---- Hadamard

namespace {
// t[k * width + j] (k = 0..15) is element k of vector j, for j in [0, width): each vector goes through
// hadamard16_apply (kernels/hadamard.h), eight of them at once in vector lanes.
void hadamard16_lanes(float* t, int64_t width) {
  const float* s = hadamard16_signs().data();
  int64_t j = 0;
#if LOCKSTEP_AVX2
  for (; j + 8 <= width; j += 8) {
    __m256 v[16];
    for (int k = 0; k < 16; ++k) v[k] = _mm256_loadu_ps(t + k * width + j);
    hadamard16_apply(v, s);
    for (int k = 0; k < 16; ++k) _mm256_storeu_ps(t + k * width + j, v[k]);
  }
#endif
  for (; j < width; ++j) {
    float v[16];
    for (int k = 0; k < 16; ++k) v[k] = t[k * width + j];
    hadamard16_apply(v, s);
    for (int k = 0; k < 16; ++k) t[k * width + j] = v[k];
  }
}
}  // namespace

void hadamard16(float* out, const float* x, int64_t rows, int64_t cols, HadamardAxis axis) {
  const int64_t len = axis == HadamardAxis::rows ? rows : cols;
  LOCKSTEP_CHECK(len % 16 == 0, "hadamard16 needs a multiple of 16 along its axis, got ", len);
  if (axis == HadamardAxis::rows) {
    // Groups of 16 rows, a column strip at a time: t holds the strip's 16 rows.
    constexpr int64_t kStrip = 64;
    parallel_for(rows / 16, [&](int64_t g0, int64_t g1) {
      float t[16 * kStrip];
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t c0 = 0; c0 < cols; c0 += kStrip) {
          const int64_t w = std::min(kStrip, cols - c0);
          for (int k = 0; k < 16; ++k) std::copy_n(x + (g * 16 + k) * cols + c0, w, t + k * w);
          hadamard16_lanes(t, w);
          for (int k = 0; k < 16; ++k) std::copy_n(t + k * w, w, out + (g * 16 + k) * cols + c0);
        }
      }
    });
    return;
  }
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    float t[16];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        std::copy_n(x + r * cols + c0, 16, t);
        hadamard16_lanes(t, 1);
        std::copy_n(t, 16, out + r * cols + c0);
      }
    }
  });
}

}  // namespace lockstep
