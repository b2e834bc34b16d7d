#include "lockstep/core/exact_sum.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {
constexpr uint64_t kNaN = 1, kPosInf = 2, kNegInf = 4;
using u128 = unsigned __int128;
}  // namespace

void ExactSum::add_at(int limb, uint64_t lo, uint64_t hi) {
  u128 s = static_cast<u128>(limbs_[limb]) + lo;
  limbs_[limb] = static_cast<uint64_t>(s);
  s = static_cast<u128>(limbs_[limb + 1]) + hi + static_cast<uint64_t>(s >> 64);
  limbs_[limb + 1] = static_cast<uint64_t>(s);
  bool carry = (s >> 64) != 0;
  for (int i = limb + 2; carry && i < kLimbs; ++i) carry = ++limbs_[i] == 0;
}

void ExactSum::sub_at(int limb, uint64_t lo, uint64_t hi) {
  const uint64_t a = limbs_[limb];
  limbs_[limb] = a - lo;
  const uint64_t borrow0 = a < lo;
  const uint64_t b = limbs_[limb + 1], t = b - hi;
  limbs_[limb + 1] = t - borrow0;
  bool borrow = b < hi || t < borrow0;
  for (int i = limb + 2; borrow && i < kLimbs; ++i) borrow = limbs_[i]-- == 0;
}

void ExactSum::add(double x) {
  if (x == 0) return;
  if (!std::isfinite(x)) {
    flags_ |= std::isnan(x) ? kNaN : x > 0 ? kPosInf : kNegInf;
    return;
  }
  const uint64_t bits = std::bit_cast<uint64_t>(x);
  const int e = static_cast<int>((bits >> 52) & 0x7ff);
  uint64_t m = bits & ((uint64_t{1} << 52) - 1);
  // x = m x 2^(e - 1075) for a normal number (implicit bit set), m x 2^-1074 for a subnormal one.
  int pos = 0;
  if (e) m |= uint64_t{1} << 52, pos = e - 1;
  const int limb = pos >> 6, off = pos & 63;
  const uint64_t lo = m << off, hi = off ? m >> (64 - off) : 0;
  if (bits >> 63)
    sub_at(limb, lo, hi);
  else
    add_at(limb, lo, hi);
}

void ExactSum::add_scaled(uint64_t v, int position) {
  const int limb = position >> 6, off = position & 63;
  add_at(limb, v << off, off ? v >> (64 - off) : 0);
}

void ExactSum::merge(const ExactSum& o) {
  uint64_t carry = 0;
  for (int i = 0; i < kLimbs; ++i) {
    const u128 s = static_cast<u128>(limbs_[i]) + o.limbs_[i] + carry;
    limbs_[i] = static_cast<uint64_t>(s);
    carry = static_cast<uint64_t>(s >> 64);
  }
  flags_ |= o.flags_;
}

bool ExactSum::operator==(const ExactSum& o) const {
  return flags_ == o.flags_ && std::equal(limbs_, limbs_ + kLimbs, o.limbs_);
}

double ExactSum::value() const {
  if ((flags_ & kNaN) || (flags_ & (kPosInf | kNegInf)) == (kPosInf | kNegInf))
    return std::numeric_limits<double>::quiet_NaN();
  if (flags_ & kPosInf) return std::numeric_limits<double>::infinity();
  if (flags_ & kNegInf) return -std::numeric_limits<double>::infinity();
  uint64_t a[kLimbs];
  std::memcpy(a, limbs_, sizeof a);
  const bool negative = a[kLimbs - 1] >> 63;
  if (negative) {  // two's complement: |a| = ~a + 1
    bool carry = true;
    for (uint64_t& w : a) {
      w = ~w + (carry ? 1 : 0);
      carry = carry && w == 0;
    }
  }
  int top = kLimbs - 1;
  while (top >= 0 && a[top] == 0) --top;
  if (top < 0) return 0.0;
  const int h = top * 64 + 63 - std::countl_zero(a[top]);  // the highest set bit
  // Below 2^53 units of 2^-1074 the integer is the double's bit pattern (subnormal, or the
  // smallest binade of normal numbers): exact.
  if (h <= 52) {
    const double v = std::bit_cast<double>(a[0]);
    return negative ? -v : v;
  }
  auto bits_at = [&](int pos, int count) {  // `count` <= 64 bits from bit pos
    const int limb = pos >> 6, off = pos & 63;
    uint64_t v = a[limb] >> off;
    if (off && limb + 1 < kLimbs) v |= a[limb + 1] << (64 - off);
    return count == 64 ? v : v & ((uint64_t{1} << count) - 1);
  };
  uint64_t m = bits_at(h - 52, 53);
  const int round_pos = h - 53;
  const bool round = (a[round_pos >> 6] >> (round_pos & 63)) & 1;
  bool sticky = (a[round_pos >> 6] & ((uint64_t{1} << (round_pos & 63)) - 1)) != 0;
  for (int i = 0; !sticky && i < (round_pos >> 6); ++i) sticky = a[i] != 0;
  int hh = h;
  if (round && (sticky || (m & 1))) ++m;
  if (m >> 53) m >>= 1, ++hh;
  const int64_t e = hh - 51;  // biased exponent of m x 2^(hh - 52 - 1074)
  if (e >= 2047) return negative ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  const double v = std::bit_cast<double>((static_cast<uint64_t>(e) << 52) | (m & ((uint64_t{1} << 52) - 1)));
  return negative ? -v : v;
}

void ExactSum::to_words(uint64_t* words) const {
  std::memcpy(words, limbs_, sizeof limbs_);
  words[kLimbs] = flags_;
}

ExactSum ExactSum::from_words(const uint64_t* words) {
  ExactSum s;
  std::memcpy(s.limbs_, words, sizeof s.limbs_);
  s.flags_ = words[kLimbs];
  return s;
}

namespace {

// Squares of x[0, n) into s. A float is m x 2^(e - 150) (m the 24-bit significand, e >= 1 its
// biased exponent, 1 for subnormals), so x^2 = m^2 x 2^(2e - 300): m^2 < 2^48 is summed per
// exponent in a 64-bit bin, exact for up to 2^15 terms, then each bin is placed at bit
// 2e - 300 + 1074 of the accumulator. Four bin sets take every fourth element each (four
// independent chains of additions where neighbours share an exponent, as a gradient's mostly do;
// eight were no faster in bench/bench_grad_norm).
void add_squares(ExactSum& s, const float* x, int64_t n) {
  constexpr int64_t kFlush = int64_t{1} << 15;
  constexpr int kSets = 4;
  uint64_t bins[kSets][256];
  const auto bin = [&](int set, float v) {
    const uint32_t b = std::bit_cast<uint32_t>(v);
    uint32_t e = (b >> 23) & 0xff;
    uint64_t m = b & 0x7fffff;
    if (e)
      m |= 0x800000;
    else
      e = 1;
    bins[set][e] += m * m;
  };
  for (int64_t i0 = 0; i0 < n; i0 += kFlush) {
    const int64_t i1 = std::min(n, i0 + kFlush);
    std::memset(bins, 0, sizeof bins);
    int64_t i = i0;
    for (; i + kSets <= i1; i += kSets)
      for (int k = 0; k < kSets; ++k) bin(k, x[i + k]);
    for (; i < i1; ++i) bin(0, x[i]);
    for (int e = 1; e < 255; ++e) {
      uint64_t total = 0;  // the sets together hold a flush's 2^15 terms below 2^48: < 2^63, exact
      for (int k = 0; k < kSets; ++k) total += bins[k][e];
      if (total) s.add_scaled(total, 2 * e + 774);
    }
    uint64_t special = 0;  // an inf or NaN: its square sets the flags
    for (int k = 0; k < kSets; ++k) special |= bins[k][255];
    if (special)
      for (int64_t i = i0; i < i1; ++i)
        if (!std::isfinite(x[i])) s.add(static_cast<double>(x[i]) * static_cast<double>(x[i]));
  }
}

}  // namespace

ExactSum exact_sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t kPart = int64_t{1} << 16;
  const int64_t parts = (n + kPart - 1) / kPart;
  std::vector<ExactSum> sums(static_cast<size_t>(std::max<int64_t>(parts, 1)));
  parallel_for(parts, [&](int64_t p0, int64_t p1) {
    ExactSum& s = sums[static_cast<size_t>(p0)];
    add_squares(s, x + p0 * kPart, std::min(n, p1 * kPart) - p0 * kPart);
  });
  for (size_t p = 1; p < sums.size(); ++p) sums[0].merge(sums[p]);
  return sums[0];
}

}  // namespace lockstep
