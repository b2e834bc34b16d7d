#include "lockstep/train/fingerprint.h"

#include <bit>
#include <cstdio>

#include "lockstep/core/hash.h"
#include "lockstep/train/json_line.h"

namespace lockstep {

std::string Fingerprint::json() const {
  auto bits = [](double v) { return hex64(std::bit_cast<uint64_t>(v)); };
  return JsonLine()
      .add("step", step)
      .add("rank", rank)
      .add("dp", dp)
      .add("tp", tp)
      .add("pp", pp)
      .add("ep", ep)
      .add("cp", cp)
      .add("loss", bits(loss))
      .add("lm_loss", bits(lm_loss))
      .add("aux_loss", bits(aux_loss))
      .add("mtp_loss", bits(mtp_loss))
      .add("grad_norm", bits(grad_norm))
      .add("lr", bits(lr))
      .add("params", hex64(params))
      .add("grads", hex64(grads))
      .add("optimizer", hex64(optimizer))
      .add("rng", hex64(rng))
      .str();
}

std::string fingerprint_path(const std::string& run_dir, int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.jsonl", rank);
  return run_dir + "/fingerprints/" + name;
}

}  // namespace lockstep
