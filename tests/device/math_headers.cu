// The host/device math headers compile for the GPU: every LOCKSTEP_HD function called from a
// __global__ kernel. Compiled (not run) by check_math_headers.sh with the flags that keep the
// device's bits equal to the host's (core/hd.h); a host-only call in an HD path, an exception, a
// std::string_view or an iostream there fails the compile.
#include <cstdint>

#include "lockstep/core/float_formats.h"
#include "lockstep/core/hd.h"
#include "lockstep/core/libm.h"
#include "lockstep/core/philox.h"
#include "lockstep/kernels/hadamard.h"
#include "lockstep/kernels/math.h"

namespace {

using namespace lockstep;

__global__ void math_headers(const float* x, const double* xd, const float* signs, uint64_t seed, int n, float* out,
                             double* outd, uint8_t* codes, uint32_t* words) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const float v = x[i];

  // core/hd.h
  float* o = out + 16 * i;
  o[0] = hd::fma(v, v, 1.0f) + static_cast<float>(hd::fma(xd[i], 2.0, 1.0)) + hd::rint(v) + hd::magnitude(v);
  o[1] = (hd::is_nan(v) || hd::is_inf(v) || !hd::is_finite(v)) ? 1.0f : static_cast<float>(hd::countl_zero(i + 1));

  // core/libm.h
  o[2] = libm::expf(v);
  o[3] = libm::logf(v);
  outd[i] = libm::log(xd[i]);

  // kernels/math.h
  o[4] = vm::exp(v);
  o[5] = vm::sigmoid(v);
  o[6] = vm::hsum8(x + (i & ~7));
  o[7] = vm::fma(vm::load<float>(x + i), vm::splat<float>(2.0f), 1.0f);
  vm::store(o + 8, v);

  // core/philox.h
  const RandomStream rng(seed, 0x1234);
  uint32_t* w = words + 12 * i;
  rng.block(static_cast<uint64_t>(i), w);
  w[4] = rng.bits(static_cast<uint64_t>(i));
  o[9] = rng.uniform(static_cast<uint64_t>(i));
  w[5] = static_cast<uint32_t>(rng.seed() ^ rng.purpose());
  uint32_t c[4] = {w[0], w[1], w[2], w[3]};
  philox4x32_10_rounds(1u, 2u, c);
  w[6] = c[0] ^ c[3];

  // core/float_formats.h
  uint8_t* b = codes + 16 * i;
  b[0] = encode(ElemFormat::e4m3, v);
  b[1] = encode(ElemFormat::e5m2, v, Overflow::nonfinite);
  b[2] = encode_e4m3(v);
  b[3] = encode_e5m2(v, Overflow::saturate);
  b[4] = encode_e2m1(v);
  b[5] = encode_stochastic(ElemFormat::e2m1, v, w[4]);
  b[6] = encode_saturating<ElemFormat::e4m3>(v);
  b[7] = encode_stochastic_as<ElemFormat::e5m2>(v, w[4]);
  b[8] = encode_e8m0(v, ScaleRounding::nearest);
  b[9] = encode_e8m0(v);
  o[10] =
      decode(ElemFormat::e5m2, b[1]) + decode_e4m3(b[0]) + decode_e5m2(b[3]) + decode_e2m1(b[4]) + decode_e8m0(b[8]);
  o[11] = max_finite(ElemFormat::e4m3) + static_cast<float>(max_exponent(ElemFormat::e2m1));

  // kernels/hadamard.h
  float h[16];
  for (int k = 0; k < 16; ++k) h[k] = x[(i & ~15) + k];
  hadamard16_apply(h, signs);
  o[12] = h[i & 15];
}

}  // namespace

// A host entry point, so that the kernel is odr-used and its device code generated.
void launch_math_headers(const float* x, const double* xd, const float* signs, uint64_t seed, int n, float* out,
                         double* outd, uint8_t* codes, uint32_t* words) {
  math_headers<<<(n + 127) / 128, 128>>>(x, xd, signs, seed, n, out, outd, codes, words);
}
