#include "lockstep/config/link_spec.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "lockstep/core/error.h"

namespace lockstep {

namespace {

// "900GB/s" -> 9e11 bytes per second with units {"GB/s", 1e9}, ...; false when it is not a
// non-negative number followed by one of the units.
bool quantity(const std::string& text, const std::vector<std::pair<std::string, double>>& units, double& out) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !(v >= 0)) return false;
  for (const auto& [name, factor] : units)
    if (std::string(end) == name) {
      out = v * factor;
      return true;
    }
  return false;
}

}  // namespace

LinkSpec parse_link_spec(const std::string& spec, const std::string& key) {
  LinkSpec out;
  const std::vector<std::pair<std::string, double>> rates = {
      {"B/s", 1.0}, {"KB/s", 1e3}, {"MB/s", 1e6}, {"GB/s", 1e9}, {"TB/s", 1e12}};
  const std::vector<std::pair<std::string, double>> times = {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1.0}};
  for (size_t at = 0; at < spec.size();) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string part = spec.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = part.find('='), colon = part.find(':');
    const std::string level = part.substr(0, eq);
    LinkLevel l;
    const bool ok = eq != std::string::npos && colon != std::string::npos && colon > eq &&
                    (level == "intra" || level == "inter") &&
                    quantity(part.substr(eq + 1, colon - eq - 1), rates, l.bytes_per_s) && l.bytes_per_s > 0 &&
                    quantity(part.substr(colon + 1), times, l.latency_s);
    if (!ok)
      user_error(key, " = \"", spec, "\": cannot read \"", part,
                 "\" (expected intra=BANDWIDTH:LATENCY or inter=BANDWIDTH:LATENCY, e.g. intra=900GB/s:2us)");
    (level == "intra" ? out.intra : out.inter) = l;
  }
  return out;
}

double parse_link_scale(const std::string& text, const std::string& key) {
  if (text == "h100") return 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v > 0))
    user_error(key, " = \"", text, "\": expected a positive number or \"h100\"");
  return v;
}

}  // namespace lockstep
