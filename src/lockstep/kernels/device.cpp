#include "lockstep/kernels/device.h"

#include <string>

#include "lockstep/core/error.h"
#include "lockstep/kernels/cpu/backend.h"

namespace lockstep {

void* DeviceMemory::allocate(size_t bytes) {
  void* p = host_allocate(bytes);
  in_use_ += static_cast<int64_t>(bytes);
  if (in_use_ > peak_) peak_ = in_use_;
  return p;
}

void DeviceMemory::release(void* p, size_t bytes) noexcept {
  if (!p && bytes == 0) return;
  host_release(p);
  in_use_ -= static_cast<int64_t>(bytes);
}

Device::Device(Kind kind) : kind_(kind) {
  ops.each([&](auto& op) { op.attach(this); });
}

const char* Device::name() const {
  switch (kind_) {
    case Kind::cpu:
      break;
  }
  return "cpu";
}

std::string unbound_ops(Ops& ops) {
  std::string missing;
  ops.each([&](const auto& op) {
    if (!op.bound()) missing += std::string(missing.empty() ? "" : ", ") + op.name();
  });
  return missing;
}

std::unique_ptr<Device> Device::cpu() {
  std::unique_ptr<Device> d(new Device(Kind::cpu));
  bind_cpu_ops(d->ops);
  const std::string missing = unbound_ops(d->ops);
  if (!missing.empty()) throw UserError(str("the ", d->name(), " backend has no implementation of: ", missing));
  return d;
}

}  // namespace lockstep
