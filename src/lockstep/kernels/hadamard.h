// The 16-point random Hadamard transform of NVFP4's weight-gradient recipe on one vector, host and
// device (LOCKSTEP_HD, core/hd.h).
//
// v <- (H16 diag(signs) v) / 4: the signs multiply first, then the butterflies of the fast
// Walsh-Hadamard transform in one fixed order (stride 1, 2, 4, 8; within a stride the pairs
// (i, i + h) by ascending i; (a, b) -> (a + b, a - b)), then the exact scaling by 1/4. Every
// element goes through the same IEEE operations in the same order on every backend, so the bits
// agree (no FMA is involved; the device needs no flags beyond those of core/hd.h).
//
// V is the lane type: float for one vector (the device, the CPU's scalar path), or a CPU vector
// type holding the same element of several vectors (kernels/cpu/quantize.cpp runs __m256: eight
// columns at once, each with exactly these operations). signs is hadamard16_signs()
// (kernels/quantize.h), drawn once on the host; a device kernel receives a copy of it.
#pragma once

#include "lockstep/core/hd.h"

namespace lockstep {

template <class V>
LOCKSTEP_HD inline void hadamard16_apply(V* v, const float* signs) {
  for (int k = 0; k < 16; ++k) v[k] = v[k] * signs[k];
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const V a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
  for (int k = 0; k < 16; ++k) v[k] = v[k] * 0.25f;
}

}  // namespace lockstep
