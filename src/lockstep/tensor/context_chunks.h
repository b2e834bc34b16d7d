// Which cp rank holds which chunk of a sample under context parallelism (parallel/context_parallel.h):
// each sample's T positions are cut into 2 x cp chunks of T / (2 cp), and cp rank r holds chunks r
// (its early chunk, side 0) and 2 cp - 1 - r (its late one, side 1). Free of dependencies, so that
// the parameter table (ParamStore's token pieces) and the context-parallel code share one layout.
#pragma once

#include <cstdint>

namespace lockstep {

struct ChunkHolder {
  int64_t rank, side;
};
// Chunk c of a sample's 2 size chunks: held by rank c (side 0) or rank 2 size - 1 - c (side 1).
inline ChunkHolder chunk_holder(int64_t size, int64_t c) {
  return c < size ? ChunkHolder{c, 0} : ChunkHolder{2 * size - 1 - c, 1};
}
// Rank r's late chunk.
inline int64_t late_chunk(int64_t size, int64_t r) { return 2 * size - 1 - r; }
// The tokens of one chunk of a sample of T tokens.
inline int64_t chunk_tokens(int64_t size, int64_t T) { return T / (2 * size); }

}  // namespace lockstep
