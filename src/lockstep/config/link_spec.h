// dist.link's text: the two levels of the wire model (comm/link_model.h), read and checked with the
// rest of the config.
#pragma once

#include <string>

namespace lockstep {

struct LinkLevel {
  double bytes_per_s = 0;  // 0: this level is not modelled (no delay)
  double latency_s = 0;
};

struct LinkSpec {
  LinkLevel intra, inter;
  bool on() const { return intra.bytes_per_s > 0 || inter.bytes_per_s > 0; }
};

// "intra=900GB/s:2us,inter=50GB/s:5us" (either level may be left out; B, KB, MB, GB, TB per s in
// powers of 1000, and ns, us, ms, s); "" = no model. UserError naming `key` and the part it cannot
// read.
LinkSpec parse_link_spec(const std::string& spec, const std::string& key);

// dist.link_scale: a positive number, or "h100": the factor then comes from this CPU's measured GEMM
// peak (comm/link_model.h), returned as 0 here.
double parse_link_scale(const std::string& text, const std::string& key);

}  // namespace lockstep
