// Bit-exact ports of glibc 2.36's expf, logf and log (x86-64, the FMA variants that glibc's ifunc
// picks on CPUs with FMA and AVX2: __expf_fma, __logf_fma, __log_fma), as host/device functions.
//
// Contract: libm::expf(x), libm::logf(x) and libm::log(d) return the same bits as std::exp(float),
// std::log(float) and std::log(double) of glibc 2.36 on such a CPU, NaN included (a NaN input
// comes back quietened with its payload and sign; a negative input to log gives x86's default NaN,
// 0xffc00000 / 0xfff8000000000000). Checked against the machine's libm: expf and logf over all
// 2^32 inputs, log over 400 million random doubles and its special cases
// (tests/test_libm.cpp; the long runs are LibmExhaustive.*, disabled by default). Only integer
// and double arithmetic and fused multiply-adds (hd::fma) are used, no libm call, so the device
// gives the same bits when compiled with the flags of core/hd.h (-fmad=false -ftz=false ...).
//
// The algorithms are ARM's optimized-routines ones that glibc carries: exp through 2^(k/32) from a
// 32-entry table and a cubic in double; logf through a 16-entry table of (1/c, log c) and a cubic
// in double; log through a 128-entry table and a degree-5 polynomial, with a degree-11 one near 1.
// Where glibc's C source writes a*b + c, its FMA build fuses it (GCC contracts by default); those
// are written here as hd::fma, and the exhaustive runs confirm the choice where it matters.
#pragma once

#include <cstdint>

#include "lockstep/core/hd.h"

namespace lockstep::libm {

namespace detail {

// 2^(i/32) as double bits, minus i << 47, so that adding k << 47 for k = 32 q + i gives
// 2^(q + i/32) (the exponent field absorbs q).
LOCKSTEP_HD_TABLE uint64_t kExp2Table[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

struct InvcLogc {
  double invc, logc;
};

// logf: for z in [0x3f330000, 2 * 0x3f330000) as fp32 bits, split into 16 intervals by the top
// mantissa bits, c near the interval's centre.
LOCKSTEP_HD_TABLE InvcLogc kLogfTable[16] = {
    {0x1.661ec79f8f3bep+0, -0x1.57bf7808caadep-2}, {0x1.571ed4aaf883dp+0, -0x1.2bef0a7c06ddbp-2},
    {0x1.49539f0f010b0p+0, -0x1.01eae7f513a67p-2}, {0x1.3c995b0b80385p+0, -0x1.b31d8a68224e9p-3},
    {0x1.30d190c8864a5p+0, -0x1.6574f0ac07758p-3}, {0x1.25e227b0b8ea0p+0, -0x1.1aa2bc79c8100p-3},
    {0x1.1bb4a4a1a343fp+0, -0x1.a4e76ce8c0e5ep-4}, {0x1.12358f08ae5bap+0, -0x1.1973c5a611cccp-4},
    {0x1.0953f419900a7p+0, -0x1.252f438e10c1ep-5}, {0x1.0000000000000p+0, 0x0.0p+0},
    {0x1.e608cfd9a47acp-1, 0x1.aa5aa5df25984p-5},  {0x1.ca4b31f026aa0p-1, 0x1.c5e53aa362eb4p-4},
    {0x1.b2036576afce6p-1, 0x1.526e57720db08p-3},  {0x1.9c2d163a1aa2dp-1, 0x1.bc2860d224770p-3},
    {0x1.886e6037841edp-1, 0x1.1058bc8a07ee1p-2},  {0x1.767dcf5534862p-1, 0x1.4043057b6ee09p-2},
};

// log: the same construction with 128 intervals of [0x1.6p-1, 0x1.6p0).
LOCKSTEP_HD_TABLE InvcLogc kLogTable[128] = {
    {0x1.734f0c3e0de9fp+0, -0x1.7cc7f79e69000p-2}, {0x1.713786a2ce91fp+0, -0x1.76feec20d0000p-2},
    {0x1.6f26008fab5a0p+0, -0x1.713e31351e000p-2}, {0x1.6d1a61f138c7dp+0, -0x1.6b85b38287800p-2},
    {0x1.6b1490bc5b4d1p+0, -0x1.65d5590807800p-2}, {0x1.69147332f0cbap+0, -0x1.602d076180000p-2},
    {0x1.6719f18224223p+0, -0x1.5a8ca86909000p-2}, {0x1.6524f99a51ed9p+0, -0x1.54f4356035000p-2},
    {0x1.63356aa8f24c4p+0, -0x1.4f637c36b4000p-2}, {0x1.614b36b9ddc14p+0, -0x1.49da7fda85000p-2},
    {0x1.5f66452c65c4cp+0, -0x1.445923989a800p-2}, {0x1.5d867b5912c4fp+0, -0x1.3edf439b0b800p-2},
    {0x1.5babccb5b90dep+0, -0x1.396ce448f7000p-2}, {0x1.59d61f2d91a78p+0, -0x1.3401e17bda000p-2},
    {0x1.5805612465687p+0, -0x1.2e9e2ef468000p-2}, {0x1.56397cee76bd3p+0, -0x1.2941b3830e000p-2},
    {0x1.54725e2a77f93p+0, -0x1.23ec58cda8800p-2}, {0x1.52aff42064583p+0, -0x1.1e9e129279000p-2},
    {0x1.50f22dbb2bddfp+0, -0x1.1956d2b48f800p-2}, {0x1.4f38f4734ded7p+0, -0x1.141679ab9f800p-2},
    {0x1.4d843cfde2840p+0, -0x1.0edd094ef9800p-2}, {0x1.4bd3ec078a3c8p+0, -0x1.09aa518db1000p-2},
    {0x1.4a27fc3e0258ap+0, -0x1.047e65263b800p-2}, {0x1.4880524d48434p+0, -0x1.feb224586f000p-3},
    {0x1.46dce1b192d0bp+0, -0x1.f474a7517b000p-3}, {0x1.453d9d3391854p+0, -0x1.ea4443d103000p-3},
    {0x1.43a2744b4845ap+0, -0x1.e020d44e9b000p-3}, {0x1.420b54115f8fbp+0, -0x1.d60a22977f000p-3},
    {0x1.40782da3ef4b1p+0, -0x1.cc00104959000p-3}, {0x1.3ee8f5d57fe8fp+0, -0x1.c202956891000p-3},
    {0x1.3d5d9a00b4ce9p+0, -0x1.b81178d811000p-3}, {0x1.3bd60c010c12bp+0, -0x1.ae2c9ccd3d000p-3},
    {0x1.3a5242b75dab8p+0, -0x1.a45402e129000p-3}, {0x1.38d22cd9fd002p+0, -0x1.9a877681df000p-3},
    {0x1.3755bc5847a1cp+0, -0x1.90c6d69483000p-3}, {0x1.35dce49ad36e2p+0, -0x1.87120a645c000p-3},
    {0x1.34679984dd440p+0, -0x1.7d68fb4143000p-3}, {0x1.32f5cceffcb24p+0, -0x1.73cb83c627000p-3},
    {0x1.3187775a10d49p+0, -0x1.6a39a9b376000p-3}, {0x1.301c8373e3990p+0, -0x1.60b3154b7a000p-3},
    {0x1.2eb4ebb95f841p+0, -0x1.5737d76243000p-3}, {0x1.2d50a0219a9d1p+0, -0x1.4dc7b8fc23000p-3},
    {0x1.2bef9a8b7fd2ap+0, -0x1.4462c51d20000p-3}, {0x1.2a91c7a0c1babp+0, -0x1.3b08abc830000p-3},
    {0x1.293726014b530p+0, -0x1.31b996b490000p-3}, {0x1.27dfa5757a1f5p+0, -0x1.2875490a44000p-3},
    {0x1.268b39b1d3bbfp+0, -0x1.1f3b9f879a000p-3}, {0x1.2539d838ff5bdp+0, -0x1.160c8252ca000p-3},
    {0x1.23eb7aac9083bp+0, -0x1.0ce7f57f72000p-3}, {0x1.22a012ba940b6p+0, -0x1.03cdc49fea000p-3},
    {0x1.2157996cc4132p+0, -0x1.f57bdbc4b8000p-4}, {0x1.201201dd2fc9bp+0, -0x1.e370896404000p-4},
    {0x1.1ecf4494d480bp+0, -0x1.d17983ef94000p-4}, {0x1.1d8f5528f6569p+0, -0x1.bf9674ed8a000p-4},
    {0x1.1c52311577e7cp+0, -0x1.adc79202f6000p-4}, {0x1.1b17c74cb26e9p+0, -0x1.9c0c3e7288000p-4},
    {0x1.19e010c2c1ab6p+0, -0x1.8a646b372c000p-4}, {0x1.18ab07bb670bdp+0, -0x1.78d01b3ac0000p-4},
    {0x1.1778a25efbcb6p+0, -0x1.674f145380000p-4}, {0x1.1648d354c31dap+0, -0x1.55e0e6d878000p-4},
    {0x1.151b990275fddp+0, -0x1.4485cdea1e000p-4}, {0x1.13f0ea432d24cp+0, -0x1.333d94d6aa000p-4},
    {0x1.12c8b7210f9dap+0, -0x1.22079f8c56000p-4}, {0x1.11a3028ecb531p+0, -0x1.10e4698622000p-4},
    {0x1.107fbda8434afp+0, -0x1.ffa6c6ad20000p-5}, {0x1.0f5ee0f4e6bb3p+0, -0x1.dda8d4a774000p-5},
    {0x1.0e4065d2a9fcep+0, -0x1.bbcece4850000p-5}, {0x1.0d244632ca521p+0, -0x1.9a1894012c000p-5},
    {0x1.0c0a77ce2981ap+0, -0x1.788583302c000p-5}, {0x1.0af2f83c636d1p+0, -0x1.5715e67d68000p-5},
    {0x1.09ddb98a01339p+0, -0x1.35c8a49658000p-5}, {0x1.08cabaf52e7dfp+0, -0x1.149e364154000p-5},
    {0x1.07b9f2f4e28fbp+0, -0x1.e72c082eb8000p-6}, {0x1.06ab58c358f19p+0, -0x1.a55f152528000p-6},
    {0x1.059eea5ecf92cp+0, -0x1.63d62cf818000p-6}, {0x1.04949cdd12c90p+0, -0x1.228fb8caa0000p-6},
    {0x1.038c6c6f0ada9p+0, -0x1.c317b20f90000p-7}, {0x1.02865137932a9p+0, -0x1.419355daa0000p-7},
    {0x1.0182427ea7348p+0, -0x1.81203c2ec0000p-8}, {0x1.008040614b195p+0, -0x1.0040979240000p-9},
    {0x1.fe01ff726fa1ap-1, 0x1.feff384900000p-9},  {0x1.fa11cc261ea74p-1, 0x1.7dc41353d0000p-7},
    {0x1.f6310b081992ep-1, 0x1.3cea3c4c28000p-6},  {0x1.f25f63ceeadcdp-1, 0x1.b9fc114890000p-6},
    {0x1.ee9c8039113e7p-1, 0x1.1b0d8ce110000p-5},  {0x1.eae8078cbb1abp-1, 0x1.58a5bd001c000p-5},
    {0x1.e741aa29d0c9bp-1, 0x1.95c8340d88000p-5},  {0x1.e3a91830a99b5p-1, 0x1.d276aef578000p-5},
    {0x1.e01e009609a56p-1, 0x1.07598e598c000p-4},  {0x1.dca01e577bb98p-1, 0x1.253f5e30d2000p-4},
    {0x1.d92f20b7c9103p-1, 0x1.42edd8b380000p-4},  {0x1.d5cac66fb5ccep-1, 0x1.606598757c000p-4},
    {0x1.d272caa5ede9dp-1, 0x1.7da76356a0000p-4},  {0x1.cf26e3e6b2ccdp-1, 0x1.9ab434e1c6000p-4},
    {0x1.cbe6da2a77902p-1, 0x1.b78c7bb0d6000p-4},  {0x1.c8b266d37086dp-1, 0x1.d431332e72000p-4},
    {0x1.c5894bd5d5804p-1, 0x1.f0a3171de6000p-4},  {0x1.c26b533bb9f8cp-1, 0x1.067152b914000p-3},
    {0x1.bf583eeece73fp-1, 0x1.147858292b000p-3},  {0x1.bc4fd75db96c1p-1, 0x1.2266ecdca3000p-3},
    {0x1.b951e0c864a28p-1, 0x1.303d7a6c55000p-3},  {0x1.b65e2c5ef3e2cp-1, 0x1.3dfc33c331000p-3},
    {0x1.b374867c9888bp-1, 0x1.4ba366b7a8000p-3},  {0x1.b094b211d304ap-1, 0x1.5933928d1f000p-3},
    {0x1.adbe885f2ef7ep-1, 0x1.66acd2418f000p-3},  {0x1.aaf1d31603da2p-1, 0x1.740f8ec669000p-3},
    {0x1.a82e63fd358a7p-1, 0x1.815c0f51af000p-3},  {0x1.a5740ef09738bp-1, 0x1.8e92954f68000p-3},
    {0x1.a2c2a90ab4b27p-1, 0x1.9bb3602f84000p-3},  {0x1.a01a01393f2d1p-1, 0x1.a8bed1c2c0000p-3},
    {0x1.9d79f24db3c1bp-1, 0x1.b5b515c01d000p-3},  {0x1.9ae2505c7b190p-1, 0x1.c2967ccbcc000p-3},
    {0x1.9852ef297ce2fp-1, 0x1.cf635d5486000p-3},  {0x1.95cbaeea44b75p-1, 0x1.dc1bd3446c000p-3},
    {0x1.934c69de74838p-1, 0x1.e8c01b8cfe000p-3},  {0x1.90d4f2f6752e6p-1, 0x1.f5509c0179000p-3},
    {0x1.8e6528effd79dp-1, 0x1.00e6c121fb800p-2},  {0x1.8bfce9fcc007cp-1, 0x1.071b80e93d000p-2},
    {0x1.899c0dabec30ep-1, 0x1.0d46b9e867000p-2},  {0x1.87427aa2317fbp-1, 0x1.13687334bd000p-2},
    {0x1.84f00acb39a08p-1, 0x1.1980d67234800p-2},  {0x1.82a49e8653e55p-1, 0x1.1f8ffe0cc8000p-2},
    {0x1.8060195f40260p-1, 0x1.2595fd7636800p-2},  {0x1.7e22563e0a329p-1, 0x1.2b9300914a800p-2},
    {0x1.7beb377dcb5adp-1, 0x1.3187210436000p-2},  {0x1.79baa679725c2p-1, 0x1.377266dec1800p-2},
    {0x1.77907f2170657p-1, 0x1.3d54ffbaf3000p-2},  {0x1.756cadbd6130cp-1, 0x1.432eee32fe000p-2},
};

// The quiet form of a NaN (what x86 arithmetic returns for a NaN operand): the payload and sign
// kept, the quiet bit set.
LOCKSTEP_HD inline float quiet(uint32_t nan_bits) { return hd::bit_cast<float>(nan_bits | 0x00400000u); }
LOCKSTEP_HD inline double quiet(uint64_t nan_bits) { return hd::bit_cast<double>(nan_bits | 0x0008000000000000ull); }

}  // namespace detail

// e^x rounded to fp32; glibc's __expf_fma bit for bit.
LOCKSTEP_HD inline float expf(float x) {
  const uint32_t ux = hd::bit_cast<uint32_t>(x);
  const uint32_t abstop = (ux >> 20) & 0x7ffu;
  if (abstop >= 0x42bu) {  // |x| >= 88, inf or NaN
    if (ux == 0xff800000u) return 0.0f;
    if (abstop >= 0x7f8u) return (ux & 0x7fffffffu) > 0x7f800000u ? detail::quiet(ux) : x;  // NaN, +inf
    if (x > 0x1.62e42ep6f) return hd::bit_cast<float>(0x7f800000u);  // above log(2^128): overflow
    if (x < -0x1.9fe368p6f) return 0.0f;                             // below log(2^-150)
    if (x < -0x1.9d1d9ep6f) return 0x1p-149f;                        // below log(2^-149): glibc's "may underflow" value
  }
  // x * 32 / ln 2 = k + r, k integer (round to nearest by the 1.5 * 2^52 shift), |r| <= 1/2.
  constexpr double kInvLn2N = 0x1.71547652b82fep+5, kShift = 0x1.8p+52;
  const double xd = x;
  double kd = hd::fma(kInvLn2N, xd, kShift);
  const uint64_t ki = hd::bit_cast<uint64_t>(kd);
  kd -= kShift;
  const double r = hd::fma(kInvLn2N, xd, -kd);
  // 2^(k/32) from the table, times 2^(r/32) ~ 1 + C2 r + C1 r^2 + C0 r^3.
  const double s = hd::bit_cast<double>(detail::kExp2Table[ki % 32] + (ki << 47));
  constexpr double C0 = 0x1.c6af84b912394p-20, C1 = 0x1.ebfce50fac4f3p-13, C2 = 0x1.62e42ff0c52d6p-6;
  const double z = hd::fma(C0, r, C1);
  const double r2 = r * r;
  double y = hd::fma(C2, r, 1.0);
  y = hd::fma(z, r2, y);
  return static_cast<float>(y * s);
}

// The natural logarithm rounded to fp32; glibc's __logf_fma bit for bit.
LOCKSTEP_HD inline float logf(float x) {
  uint32_t ix = hd::bit_cast<uint32_t>(x);
  if (ix == 0x3f800000u) return 0.0f;
  if (ix - 0x00800000u >= 0x7f800000u - 0x00800000u) {              // subnormal, zero, negative, inf or NaN
    if (ix * 2 == 0) return hd::bit_cast<float>(0xff800000u);       // +-0: -inf
    if (ix == 0x7f800000u) return x;                                // +inf
    if (ix * 2 > 0xff000000u) return detail::quiet(ix);             // NaN
    if (ix & 0x80000000u) return hd::bit_cast<float>(0xffc00000u);  // x < 0
    ix = hd::bit_cast<uint32_t>(x * 0x1p23f) - (23u << 23);         // subnormal
  }
  // x = 2^k z with z in [0x1.66p-1, 0x1.66p0); c near z, log x = log1p(z/c - 1) + log c + k ln 2.
  constexpr uint32_t kOff = 0x3f330000u;
  const uint32_t tmp = ix - kOff;
  const detail::InvcLogc t = detail::kLogfTable[(tmp >> 19) % 16];
  const int k = static_cast<int32_t>(tmp) >> 23;
  const double z = hd::bit_cast<float>(ix - (tmp & 0xff800000u));
  constexpr double kLn2 = 0x1.62e42fefa39efp-1;
  constexpr double A0 = -0x1.00ea348b88334p-2, A1 = 0x1.5575b0be00b6ap-2, A2 = -0x1.ffffef20a4123p-2;
  const double r = hd::fma(z, t.invc, -1.0);
  const double y0 = hd::fma(static_cast<double>(k), kLn2, t.logc);
  const double r2 = r * r;
  double y = hd::fma(A1, r, A2);
  y = hd::fma(A0, r2, y);
  y = hd::fma(y, r2, y0 + r);
  return static_cast<float>(y);
}

// Not defined: libm::log of a float would convert it to double; call libm::logf for fp32 (what
// std::log(float) is) or convert explicitly.
double log(float) = delete;

// The natural logarithm of a double; glibc's __log_fma bit for bit.
LOCKSTEP_HD inline double log(double x) {
  uint64_t ix = hd::bit_cast<uint64_t>(x);
  const uint32_t top = static_cast<uint32_t>(ix >> 48);
  constexpr uint64_t kLo = 0x3fee000000000000ull;  // 1 - 2^-4
  constexpr uint64_t kHi = 0x3ff1090000000000ull;  // 1 + 0x1.09p-4
  if (ix - kLo < kHi - kLo) {
    // Near 1: log1p(r) for r = x - 1 exactly, as r + B0 r^2 (split into hi + lo to keep the
    // rounding error of the big terms) + r^3 * poly(r).
    if (ix == 0x3ff0000000000000ull) return 0.0;
    constexpr double B0 = -0x1p-1, B1 = 0x1.5555555555577p-2, B2 = -0x1.ffffffffffdcbp-3, B3 = 0x1.999999995dd0cp-3,
                     B4 = -0x1.55555556745a7p-3, B5 = 0x1.24924a344de3p-3, B6 = -0x1.fffffa4423d65p-4,
                     B7 = 0x1.c7184282ad6cap-4, B8 = -0x1.999eb43b068ffp-4, B9 = 0x1.78182f7afd085p-4,
                     B10 = -0x1.5521375d145cdp-4;
    const double r = x - 1.0;
    const double r2 = r * r;
    const double r3 = r * r2;
    double p3 = hd::fma(r, B8, B7);
    p3 = hd::fma(r2, B9, p3);
    p3 = hd::fma(r3, B10, p3);
    double p2 = hd::fma(r, B5, B4);
    p2 = hd::fma(r2, B6, p2);
    p2 = hd::fma(r3, p3, p2);
    double p1 = hd::fma(r, B2, B1);
    p1 = hd::fma(r2, B3, p1);
    p1 = hd::fma(r3, p2, p1);
    // r = rhi + rlo with rhi on 26 bits, so that rhi^2 is exact.
    const double w = r * 0x1p27;
    const double rhi = (r + w) - w;
    const double rlo = r - rhi;
    const double h = rhi * rhi * B0;  // exact
    const double hi = r + h;
    double lo = (r - hi) + h;
    lo = hd::fma(B0 * rlo, rhi + r, lo);
    const double y = hd::fma(r3, p1, lo);
    return y + hi;
  }
  if (top - 0x0010u >= 0x7ff0u - 0x0010u) {                                 // subnormal, zero, negative, inf or NaN
    if (ix * 2 == 0) return hd::bit_cast<double>(0xfff0000000000000ull);    // -inf
    if (ix == 0x7ff0000000000000ull) return x;                              // +inf
    if (ix * 2 > 0xffe0000000000000ull) return detail::quiet(ix);           // NaN
    if (top & 0x8000u) return hd::bit_cast<double>(0xfff8000000000000ull);  // x < 0
    ix = hd::bit_cast<uint64_t>(x * 0x1p52) - (52ull << 52);                // subnormal
  }
  // x = 2^k z with z in [0x1.6p-1, 0x1.6p0); log x = log1p(z/c - 1) + log c + k ln 2.
  constexpr uint64_t kOff = 0x3fe6000000000000ull;
  const uint64_t tmp = ix - kOff;
  const detail::InvcLogc t = detail::kLogTable[(tmp >> 45) % 128];
  const int64_t k = static_cast<int64_t>(tmp) >> 52;
  const double z = hd::bit_cast<double>(ix - (tmp & (0xfffull << 52)));
  constexpr double kLn2Hi = 0x1.62e42fefa3800p-1, kLn2Lo = 0x1.ef35793c76730p-45;
  constexpr double A0 = -0x1.0000000000001p-1, A1 = 0x1.555555551305bp-2, A2 = -0x1.fffffffeb459p-3,
                   A3 = 0x1.999b324f10111p-3, A4 = -0x1.55575e506c89fp-3;
  const double r = hd::fma(z, t.invc, -1.0);
  const double kd = static_cast<double>(k);
  // hi + lo = r + log c + k ln 2 (k ln2hi + log c is exact).
  const double w = hd::fma(kd, kLn2Hi, t.logc);
  const double hi = w + r;
  const double lo = hd::fma(kd, kLn2Lo, (w - hi) + r);
  // log x = lo + (log1p(r) - r) + hi.
  const double r2 = r * r;
  const double p = hd::fma(r2, hd::fma(r, A4, A3), hd::fma(r, A2, A1));
  double y = hd::fma(r2, A0, lo);
  y = hd::fma(r * r2, p, y);
  return y + hi;
}

}  // namespace lockstep::libm
