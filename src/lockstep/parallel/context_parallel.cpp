#include "lockstep/parallel/context_parallel.h"

#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

ContextParallel::ContextParallel(Communicator* group)
    : comm(group), rank(group ? group->rank() : 0), size(group ? group->size() : 1) {}

QueryChunks ContextParallel::chunks(int64_t T, int r) const {
  if (size == 1) return {{0, T}};
  LOCKSTEP_CHECK(T % (2 * size) == 0, "context parallelism: ", T, " positions do not split into 2 x ", size, " chunks");
  const int64_t c = T / (2 * size);
  const int64_t late = 2 * size - 1 - r;
  return {{r * c, (r + 1) * c}, {late * c, (late + 1) * c}};
}

int64_t ContextParallel::global_row(int64_t n, int64_t T) const {
  const int64_t Tl = local(T), c = T / (2 * size), j = n % Tl;
  const int64_t chunk = j < c ? rank : 2 * size - 1 - rank;
  return n / Tl * T + chunk * c + j % c;
}

void ContextParallel::positions(int32_t* pos, int64_t B, int64_t T) const {
  for (int64_t n = 0; n < B * local(T); ++n) pos[n] = static_cast<int32_t>(global_row(n, T) % T);
}

void ContextParallel::take_local(int32_t* local, const int32_t* global, int64_t B, int64_t T) const {
  const QueryChunks ch = chunks(T);
  for (int64_t b = 0; b < B; ++b)
    for (const auto& [begin, end] : ch) {
      std::memcpy(local, global + b * T + begin, static_cast<size_t>(end - begin) * sizeof(int32_t));
      local += end - begin;
    }
}

namespace {
// Rank r's local rows (B, T / size, W) to their global positions in (B, T, W) (to_global: dst is
// the global tensor, src the local rows), or back (dst local, src global).
void move_rows(const ContextParallel& cp, int r, float* dst, const float* src, bool to_global, int64_t B, int64_t T,
               int64_t W) {
  const QueryChunks ch = cp.chunks(T, r);
  const int64_t Tl = cp.local(T);
  parallel_for(B, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t l = b * Tl * W;  // offset of the local rows
      for (const auto& [begin, end] : ch) {
        const int64_t g = (b * T + begin) * W, n = (end - begin) * W;
        std::memcpy(dst + (to_global ? g : l), src + (to_global ? l : g), static_cast<size_t>(n) * sizeof(float));
        l += n;
      }
    }
  });
}
}  // namespace

void all_gather_sequence(const ContextParallel& cp, float* global, float* buf, const float* local, int64_t B, int64_t T,
                         int64_t W) {
  const int64_t n = B * cp.local(T) * W;
  cp.comm->all_gather(buf, local, n);
  for (int r = 0; r < cp.size; ++r) move_rows(cp, r, global, buf + r * n, true, B, T, W);
}

void gather_kv(const ContextParallel& cp, float* kv, float* buf, const float* qkv, int64_t B, int64_t T, int64_t NH,
               int64_t NKV, int64_t HS) {
  const int64_t KV = 2 * NKV * HS, C3 = (NH + 2 * NKV) * HS, Tl = cp.local(T), n = B * Tl * KV;
  float* mine = buf + cp.size * n;
  // This rank's K and V columns, packed (B, Tl, KV); then every rank's block into its positions.
  parallel_for(B * Tl, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(mine + r * KV, qkv + r * C3 + NH * HS, static_cast<size_t>(KV) * sizeof(float));
  });
  all_gather_sequence(cp, kv, buf, mine, B, T, KV);
}

void reduce_scatter_dkv(const ContextParallel& cp, float* dqkv, float* buf, const float* dkv, int64_t B, int64_t T,
                        int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t KV = 2 * NKV * HS, C3 = (NH + 2 * NKV) * HS, Tl = cp.local(T), n = B * Tl * KV;
  float* mine = buf + cp.size * n;
  // Block r: this rank's contributions to rank r's rows, in rank r's local order.
  for (int r = 0; r < cp.size; ++r) move_rows(cp, r, buf + r * n, dkv, false, B, T, KV);
  cp.comm->reduce_scatter(mine, buf, n);
  parallel_for(B * Tl, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(dqkv + r * C3 + NH * HS, mine + r * KV, static_cast<size_t>(KV) * sizeof(float));
  });
}

}  // namespace lockstep
