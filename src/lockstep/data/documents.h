// Packed sequences: a sample holds several documents, each ended by the end-of-document token
// (EOD). Megatron's get_ltor_masks_and_position_ids semantics: a document ends *after* its EOD
// token, so the EOD belongs to the document it closes and the next document starts at the token
// after it.
//
//   doc_start[b, t] = (index of the last EOD before t in row b) + 1, or 0 if there is none
//   positions[b, t] = t - doc_start[b, t]        (data.reset_position_ids)
//
// Attention with data.reset_attention_mask lets token t see tokens doc_start[b, t] .. t
// (kernels/cpu/attention.h). data.eod_mask_loss drops the loss of every position whose *input*
// token is EOD (Megatron's loss_mask[data == eod_token] = 0), by marking its target -1, which
// the cross-entropy kernel ignores.
#pragma once

#include <cstdint>

namespace lockstep {

// positions and doc_start: (B, T) each; either may be null.
void document_layout(int32_t* positions, int32_t* doc_start, const int32_t* tokens, int64_t B, int64_t T, int32_t eod);

// targets[n] = -1 where tokens[n] == eod. Returns how many targets are left >= 0 (the tokens the
// loss averages over).
int64_t mask_eod_targets(int32_t* targets, const int32_t* tokens, int64_t n, int32_t eod);

// Targets >= 0 among n.
int64_t count_targets(const int32_t* targets, int64_t n);

}  // namespace lockstep
