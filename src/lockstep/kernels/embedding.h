// Token (and learned position) embedding.
//
// Forward: out[b, t] = wte[tokens[b, t]] (+ wpe[pos]), pos = t, or positions[b, t] when given
// (packed documents whose positions restart at each document; each in [0, T)).
// Backward: dwte[v] += sum of dout[n] over the positions n with tokens[n] == v (negative tokens,
// another vocabulary shard's, are skipped: parallel/tensor_parallel.h), as a sorted
// segment sum: positions are ordered by (token, position), and each vocabulary row is summed by
// one thread in position order. dwpe[t] += sum over b of dout[b, t], in b order; with positions,
// dwpe[p] += the sum of dout[n] over the rows n with positions[n] == p, in row order (the same
// sorted segment sum as dwte). No atomics; bits do not depend on the thread count.
// P: the rows of wpe that positions index (0: T); context parallelism holds T / cp rows of a
// sample, at positions of the whole sequence.
#pragma once

#include <cstdint>
#include "lockstep/kernels/op.h"

namespace lockstep {

// The ops, as a backend binds them (kernels/ops.h).
struct EmbeddingOps {
  // Raises UserError naming the token when a token is outside [0, V).
  Op<void(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T, int64_t C,
          int64_t V, const int32_t* positions, int64_t P)>
      embedding_forward{"embedding_forward"};
  // order: scratch of B*T int32. segments, pos_segments > 0 (determinism = "layout" with
  // layout_token_segments, ParamStore::token_segments): dwte's (dwpe's) sums cut into that many token
  // segments over the B*T rows (core/tree_sum.h canonical_segments), each vocabulary (position) row's
  // segment sums from zero in row order, added along the canonical tree over the segments (empty
  // segments are zero leaves), then into the row.
  Op<void(float* dwte, float* dwpe, int32_t* order, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
          int64_t C, const int32_t* positions, int64_t P, int64_t segments, int64_t pos_segments)>
      embedding_backward{"embedding_backward"};
  // dbias[c] += sum over the N rows of dout[n, c], in row order (one thread per column range).
  // segments > 0 (determinism = "layout"): the rows cut into that many token segments
  // (core/tree_sum.h canonical_segments), each summed from zero, then summed along the canonical
  // tree before they are added (as norms.h does).
  Op<void(float* dbias, const float* dout, int64_t N, int64_t C, int64_t segments)> bias_backward{"bias_backward"};
  // x row r (C) = sum row r + wpe row p with p = positions[row0 + r] (positions null: (row0 + r) % T);
  // with wpe null, a copy of sum row r (a vocabulary-parallel lookup's position half).
  Op<void(float* x, const float* sum, const float* wpe, const int32_t* positions, int64_t row0, int64_t rows, int64_t T,
          int64_t C)>
      add_positions{"add_positions"};

  template <class F>
  void each(F&& f) {
    f(embedding_forward), f(embedding_backward), f(bias_backward), f(add_positions);
  }
};

}  // namespace lockstep
