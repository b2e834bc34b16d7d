#include "lockstep/data/documents.h"

namespace lockstep {

void document_layout(int32_t* positions, int32_t* doc_start, const int32_t* tokens, int64_t B, int64_t T, int32_t eod) {
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;
      if (positions) positions[n] = static_cast<int32_t>(t - start);
      if (doc_start) doc_start[n] = static_cast<int32_t>(start);
      if (tokens[n] == eod) start = t + 1;
    }
  }
}

int64_t mask_eod_targets(int32_t* targets, const int32_t* tokens, int64_t n, int32_t eod) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] == eod) targets[i] = -1;
  return count_targets(targets, n);
}

int64_t count_targets(const int32_t* targets, int64_t n) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += targets[i] >= 0;
  return count;
}

}  // namespace lockstep
