// Host/device per-element math: the annotation and the few primitives it is written with.
//
// A function marked LOCKSTEP_HD compiles for the CPU and, under nvcc, for the GPU, and gives the
// same bits on both when the device code is compiled with
//   -fmad=false -ftz=false -prec-div=true -prec-sqrt=true   (never --use_fast_math)
// and the host code with -ffp-contract=off (the top CMakeLists.txt): every fused multiply-add is
// written out (hd::fma), so neither compiler fuses or splits one on its own, subnormals are kept,
// and / and sqrt are correctly rounded on both sides. The rounding mode is the default (nearest).
//
// What differs on the device is the NaN an operation makes from non-NaN operands (the GPU's
// canonical 0x7fffffff, x86's 0xffc00000) and whether an operation keeps a NaN operand's payload:
// HD code that promises NaN bits (core/libm.h) builds them from integers; elsewhere only "is NaN"
// is the contract.
#pragma once

#include <cstdint>

#include <cmath>

#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#else
#define LOCKSTEP_HD
#endif

// A constant lookup table read by LOCKSTEP_HD functions: a __device__ array in the device pass (a
// table in global memory, read through the read-only cache), a constexpr array on the host.
// Internal linkage: each translation unit that uses one has its own copy.
#if defined(__CUDA_ARCH__)
#define LOCKSTEP_HD_TABLE __device__ static constexpr
#else
#define LOCKSTEP_HD_TABLE static constexpr
#endif

namespace lockstep::hd {

// std::bit_cast, callable from device code (std::bit_cast is a host function to nvcc).
template <class To, class From>
LOCKSTEP_HD constexpr To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  return __builtin_bit_cast(To, from);
}

// a * b + c with one rounding.
LOCKSTEP_HD inline float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
LOCKSTEP_HD inline double fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// x rounded to the nearest integer, ties to even (the default rounding mode); NaN and inf pass.
LOCKSTEP_HD inline float rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// Classification and magnitude from the bits: exact, and the same under any compiler flags.
LOCKSTEP_HD inline bool is_nan(float x) { return (bit_cast<uint32_t>(x) & 0x7fffffffu) > 0x7f800000u; }
LOCKSTEP_HD inline bool is_inf(float x) { return (bit_cast<uint32_t>(x) & 0x7fffffffu) == 0x7f800000u; }
LOCKSTEP_HD inline bool is_finite(float x) { return (bit_cast<uint32_t>(x) & 0x7fffffffu) < 0x7f800000u; }
LOCKSTEP_HD inline float magnitude(float x) { return bit_cast<float>(bit_cast<uint32_t>(x) & 0x7fffffffu); }

// The number of leading zero bits of x != 0.
LOCKSTEP_HD inline int countl_zero(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}

}  // namespace lockstep::hd
