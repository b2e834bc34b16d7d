#include "lockstep/core/trace.h"

#include <bit>
#include <cstring>

#include "lockstep/core/hash.h"

namespace lockstep {

ModuleTrace::ModuleTrace(bool record, int64_t inject_step, std::string inject_module)
    : record_(record), inject_step_(inject_step), inject_module_(std::move(inject_module)) {}

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

void ModuleTrace::out(std::string_view module, float* y, int64_t n) {
  if (step_ == first_step_ && micro_ == 0) modules_.emplace_back(module);
  if (step_ == inject_step_ && micro_ == 0 && n > 0 && module == inject_module_) {
    y[0] = std::bit_cast<float>(std::bit_cast<uint32_t>(y[0]) ^ 1u);
    injected_ = true;
  }
  if (record_)
    records_.push_back({step_, micro_, std::string(module), false, hash_floats_blocks(y, n), chunk_, backward_});
}

void ModuleTrace::grad_in(std::string_view module, const float* dx, int64_t n) {
  if (record_)
    records_.push_back({step_, micro_, std::string(module), true, hash_floats_blocks(dx, n), chunk_, backward_});
}

ModuleTrace::Bind::Bind(ModuleTrace* trace) : prev_(current_) { current_ = trace; }
ModuleTrace::Bind::~Bind() { current_ = prev_; }

}  // namespace lockstep
