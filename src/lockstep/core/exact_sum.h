// Exact summation: the order-independent combiner of determinism = "layout" (docs/design/reductions.md#exact-sums).
//
// ExactSum holds the sum of any number of doubles EXACTLY: a Kulisch accumulator, one
// two's-complement fixed-point integer whose least significant bit is 2^-1074 (the smallest
// subnormal double) and whose 2176 bits reach 2^1101, so that more than 2^70 additions of the
// largest double cannot overflow it. Adding a double is integer addition of its significand at its
// exponent's position; merging two accumulators is integer addition of their words.
//
// Guarantee: value() is the exact sum of everything added (directly or through merge()) rounded
// ONCE to the nearest double, ties to even. Integer addition is associative and commutative, so the
// result does not depend on the order of the additions, on how they were grouped into accumulators
// (threads, chunks, ranks) or on the order of merges: any split of the same multiset of terms gives
// the same bits. Non-finite terms: any NaN, or both +inf and -inf, give NaN; else an infinity gives
// that infinity. An exact zero sum is +0.
//
// exact_sum_of_squares(x, n) adds x[i]^2 for floats: the square of a float is exact in a double
// (24-bit significands, 48-bit product), so the whole sum of squares is exact; squares are binned by
// the float's exponent in 64-bit integers and the bins added to the accumulator, which makes it a
// few times cheaper than adding each square. Parallel over the current thread pool; the result is
// the same for any thread count and any split of x (that is the point).
#pragma once

#include <cstdint>

namespace lockstep {

class ExactSum {
 public:
  static constexpr int kLimbs = 34;          // 2176 bits
  static constexpr int kWords = kLimbs + 1;  // the limbs and the non-finite flags: what to_words writes

  void add(double x);
  // Adds v x 2^(position - 1074): v placed with its bit 0 at bit `position` of the fixed-point
  // integer (0 <= position <= 2048).
  void add_scaled(uint64_t v, int position);
  void merge(const ExactSum& other);
  double value() const;
  bool operator==(const ExactSum& o) const;

  // The state as kWords 64-bit words (to send it to other ranks), and back.
  void to_words(uint64_t* words) const;
  static ExactSum from_words(const uint64_t* words);

 private:
  void add_at(int limb, uint64_t lo, uint64_t hi);
  void sub_at(int limb, uint64_t lo, uint64_t hi);
  uint64_t limbs_[kLimbs] = {};
  uint64_t flags_ = 0;  // bit 0: NaN, bit 1: +inf, bit 2: -inf
};

// sum over i of x[i]^2, exactly (see above).
ExactSum exact_sum_of_squares(const float* x, int64_t n);

}  // namespace lockstep
