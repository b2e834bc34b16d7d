#include "lockstep/kernels/cpu/embedding.h"

#include <algorithm>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

namespace {
// Column blocks of 16 floats (one cache line) so that two threads never write the same line.
constexpr int64_t kColBlock = 16;

inline void add_row(float* __restrict dst, const float* __restrict src, int64_t C) {
  for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
}

// dst[keys[n]] += dout[n] for every row n, as a sorted segment sum: rows ordered by (key, row),
// each dst row summed by one thread in row order. order: scratch of N int32. segments > 0: each
// key's rows of token segment s (canonical_segments(N, segments)) summed from zero, the segments'
// sums added along the canonical tree (an empty segment is a zero leaf), then into dst.
void segment_sum(float* dst, int32_t* order, const float* dout, const int32_t* keys, int64_t N, int64_t C,
                 int64_t segments = 0) {
  // Rows ordered by (key, row): equal to a stable sort by key, but in place.
  for (int64_t n = 0; n < N; ++n) order[n] = static_cast<int32_t>(n);
  std::sort(order, order + N, [keys](int32_t a, int32_t b) { return keys[a] != keys[b] ? keys[a] < keys[b] : a < b; });
  // Negative keys (rows another rank's vocabulary shard owns) sort first and are skipped.
  const int64_t skip = std::partition_point(order, order + N, [keys](int32_t a) { return keys[a] < 0; }) - order;
  const std::vector<int64_t> bounds = canonical_segments(N, segments);
  // A chunk owns the segments (runs of one key) that start inside it, and follows its last one
  // past the chunk end: each dst row is written by one thread, in row order.
  parallel_for(N - skip, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> leaves;
    if (segments) leaves.resize(static_cast<size_t>(segments * C));
    begin += skip;
    end += skip;
    int64_t i = begin;
    while (i < end && i > skip && keys[order[i]] == keys[order[i - 1]]) ++i;
    while (i < end) {
      const int32_t v = keys[order[i]];
      float* row = dst + static_cast<int64_t>(v) * C;
      if (segments) std::fill(leaves.begin(), leaves.end(), 0.0f);
      int64_t k = 0;  // the token segment of row order[i] (rows ascend within a key)
      do {
        const int64_t n = order[i];
        if (segments) {
          while (bounds[static_cast<size_t>(k + 1)] <= n) ++k;
          add_row(leaves.data() + k * C, dout + n * C, C);
        } else {
          add_row(row, dout + n * C, C);
        }
        ++i;
      } while (i < N && keys[order[i]] == v);
      if (segments) {
        tree_sum_in_place(leaves.data(), segments, C, 0, C);
        add_row(row, leaves.data(), C);
      }
    }
  });
}

void check_positions(const int32_t* positions, int64_t N, int64_t T) {
  if (!positions) return;
  for (int64_t n = 0; n < N; ++n)
    LOCKSTEP_CHECK(positions[n] >= 0 && positions[n] < T, "embedding: position ", positions[n], " of row ", n,
                   " is outside [0, ", T, ")");
}
}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, const int32_t* positions, int64_t P) {
  // Validate everything before writing anything: a bad token leaves `out` untouched.
  for (int64_t n = 0; n < B * T; ++n) {
    if (tokens[n] < 0 || tokens[n] >= V) {
      user_error("embedding: token ", tokens[n], " at position ", n, " (b ", n / T, ", t ", n % T,
                 ") is outside the vocabulary [0, ", V, ")");
    }
  }
  check_positions(wpe ? positions : nullptr, B * T, P ? P : T);
  parallel_for(B * T, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* __restrict o = out + n * C;
      const float* __restrict w = wte + static_cast<int64_t>(tokens[n]) * C;
      if (wpe) {
        const float* __restrict p = wpe + (positions ? positions[n] : n % T) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = w[c] + p[c];
      } else {
        std::copy(w, w + C, o);
      }
    }
  });
}

void embedding_backward(float* dwte, float* dwpe, int32_t* order, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, const int32_t* positions, int64_t P, int64_t segments,
                        int64_t pos_segments) {
  segment_sum(dwte, order, dout, tokens, B * T, C, segments);
  if (dwpe && !positions && pos_segments) {
    // Each row's position as its key, for the segmented sum.
    thread_local std::vector<int32_t> pos;
    pos.resize(static_cast<size_t>(B * T));
    for (int64_t n = 0; n < B * T; ++n) pos[static_cast<size_t>(n)] = static_cast<int32_t>(n % T);
    segment_sum(dwpe, order, dout, pos.data(), B * T, C, pos_segments);
  } else if (dwpe && positions) {
    check_positions(positions, B * T, P ? P : T);
    segment_sum(dwpe, order, dout, positions, B * T, C, pos_segments);
  } else if (dwpe) {
    parallel_for(T, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t b = 0; b < B; ++b) add_row(dwpe + t * C, dout + (b * T + t) * C, C);
      }
    });
  }
}

void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C, int64_t segments) {
  const int64_t blocks = (C + kColBlock - 1) / kColBlock;
  if (segments == 0) {
    parallel_for(blocks, [&](int64_t begin, int64_t end) {
      const int64_t c0 = begin * kColBlock, c1 = std::min(C, end * kColBlock);
      for (int64_t n = 0; n < N; ++n) add_row(dbias + c0, dout + n * C + c0, c1 - c0);
    });
    return;
  }
  // Each token segment's column sums from zero, then the canonical tree over the segments.
  const std::vector<int64_t> bounds = canonical_segments(N, segments);
  parallel_for(blocks, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kColBlock, c1 = std::min(C, end * kColBlock);
    add_segment_tree(dbias + c0, c1 - c0, bounds, [&](float* leaf, int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) add_row(leaf, dout + n * C + c0, c1 - c0);
    });
  });
}

void add_positions(float* x, const float* sum, const float* wpe, const int32_t* positions, int64_t row0, int64_t rows,
                   int64_t T, int64_t C) {
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = row0 + r;
      const float* p = wpe ? wpe + (positions ? positions[n] : n % T) * C : nullptr;
      for (int64_t c = 0; c < C; ++c) x[r * C + c] = p ? sum[r * C + c] + p[c] : sum[r * C + c];
    }
  });
}

}  // namespace lockstep
