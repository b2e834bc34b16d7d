#include "lockstep/core/trace.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "lockstep/core/hash.h"

namespace lockstep {

ModuleTrace::ModuleTrace(bool record, int64_t inject_step, std::string inject_module, bool nan)
    : record_(record), inject_step_(inject_step), inject_module_(std::move(inject_module)), inject_nan_(nan) {}

void ModuleTrace::set_position(int64_t step, int64_t micro) {
  step_ = step;
  micro_ = micro;
  if (first_step_ < 0) first_step_ = step;
}

void ModuleTrace::set_action(int64_t micro, int64_t chunk, bool backward) {
  micro_ = micro;
  chunk_ = chunk;
  backward_ = backward;
}

namespace {
// A record of buffer x[0, n): its hash, whether it holds an inf or a NaN, its norm and max |x|.
ModuleTrace::Record record_of(int64_t step, int64_t micro, std::string_view module, bool grad_in, const float* x,
                              int64_t n, int64_t chunk, bool backward) {
  ModuleTrace::Record r{step, micro, std::string(module), grad_in, hash_floats_blocks(x, n), chunk, backward};
  double sq = 0;
  float max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    sq += static_cast<double>(x[i]) * x[i];
    if (!(a <= max_abs) && !std::isnan(max_abs)) max_abs = a;  // a NaN replaces the maximum and stays
    r.nonfinite = r.nonfinite || !std::isfinite(x[i]);
  }
  r.norm = std::sqrt(sq);
  r.max_abs = max_abs;
  return r;
}
}  // namespace

void ModuleTrace::out(std::string_view module, float* y, int64_t n) {
  if (step_ == first_step_ && micro_ == 0 && !replay_) modules_.emplace_back(module);
  if (step_ == inject_step_ && micro_ == 0 && n > 0 && module == inject_module_) {
    y[0] = inject_nan_ ? std::numeric_limits<float>::quiet_NaN()
                       : std::bit_cast<float>(std::bit_cast<uint32_t>(y[0]) ^ 1u);
    injected_ = true;
  }
  if (record_ && !replay_) records_.push_back(record_of(step_, micro_, module, false, y, n, chunk_, backward_));
}

void ModuleTrace::grad_in(std::string_view module, const float* dx, int64_t n) {
  if (record_) records_.push_back(record_of(step_, micro_, module, true, dx, n, chunk_, backward_));
}

ModuleTrace::Bind::Bind(ModuleTrace* trace) : prev_(current_) { current_ = trace; }
ModuleTrace::Bind::~Bind() { current_ = prev_; }

}  // namespace lockstep
