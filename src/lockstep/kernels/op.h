// One op of the compute seam (kernels/ops.h): its name, and the function of the backend that runs
// it. A backend binds every op when its device is made (kernels/device.h); a device whose backend
// leaves an op unbound is refused at start-up, naming the op, so nothing fails mid-step.
#pragma once

namespace lockstep {

class Device;

template <class Sig>
class Op;

template <class R, class... A>
class Op<R(A...)> {
 public:
  explicit Op(const char* name) : name_(name) {}
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

  const char* name() const { return name_; }
  bool bound() const { return with_device_ || host_; }
  // A backend function that takes the device context (a GPU's stream, handles and workspace).
  void bind(R (*fn)(Device&, A...)) {
    with_device_ = fn;
    host_ = nullptr;
  }
  // One that needs no more context than the calling thread: the CPU kernels, whose context (the
  // rank's thread pool) is bound to the rank's thread (core/thread_pool.h).
  void bind(R (*fn)(A...)) {
    host_ = fn;
    with_device_ = nullptr;
  }
  void attach(Device* device) { device_ = device; }

  R operator()(A... args) const { return host_ ? host_(args...) : with_device_(*device_, args...); }

 private:
  const char* name_;
  R (*with_device_)(Device&, A...) = nullptr;
  R (*host_)(A...) = nullptr;
  Device* device_ = nullptr;
};

}  // namespace lockstep
