// The op harness (docs/testing.md "The op harness"), in the manner of ggml's test-backend-ops: every
// op of the compute seam (kernels/ops.h) is tested through `device.ops` by cases declared once in a
// registry, and each case runs on every backend the build has.
//
// A case (Registry::add) is
//   - what it is: the gtest test that runs it (Harness<suite>.<test>), the ops it calls, a label
//     (its shapes and options, shown with every failure);
//   - make():            its inputs, on the host, made once per run of the case;
//   - run(Run&, in):     calls the ops on one backend: uploads inputs (Run::in), calls
//                        `r.ops.<op>(...)` on the backend's buffers, records the outputs (Run::out),
//                        each with how it must compare with the CPU backend's (Match);
//   - check(Result&, in): the expectations on one backend's outputs: a double-precision reference
//                        (tolerance per output), finite differences, exact formulas.
// On each backend the harness runs the case under every setting of the backend (the CPU: serial,
// 2 and 3 threads), requires every setting's outputs to be the first one's bits, checks the first
// with check(), and compares its outputs with the CPU backend's: bitwise where the op's contract
// promises it (the fp32 path), else within the output's tolerance. A built backend without a device
// skips its cases, and the harness says how many and why.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/kernels/device.h"

namespace lockstep::harness {

// ---- Backends

struct Backend {
  std::string name;
  // The backend's device, or null with *why saying why there is none (built, but no device present).
  std::function<std::unique_ptr<Device>(std::string* why)> make_device;
  // Memory the ops read and write (zeroed), and the copies between it and the host.
  std::function<void*(Device&, size_t bytes)> allocate;
  std::function<void(Device&, void* p, size_t bytes)> release;
  std::function<void(void* device_dst, const void* host_src, size_t bytes)> upload;
  std::function<void(void* host_dst, const void* device_src, size_t bytes)> download;
  // The settings under which every case runs and must give the same bits (the contracts' "for any
  // thread count"); the first is the one checked against the references and the CPU backend.
  struct Setting {
    std::string name;
    std::function<void(const std::function<void()>&)> apply;
  };
  std::vector<Setting> settings;
};

// Every backend this build has, "cpu" first.
const std::vector<Backend>& built_backends();

// ---- How an output of a backend compares with the CPU backend's

struct Match {
  enum class Kind : uint8_t { bitwise, close, none };
  Kind kind = Kind::bitwise;
  double rtol = 0, atol = 0;
};
// The contract promises the CPU's bits (the fp32 path).
inline Match bitwise() { return {}; }
// Within rtol * |cpu| + atol (a fast path: bf16 / FP8 tensor cores).
inline Match close(double rtol, double atol) { return {Match::Kind::close, rtol, atol}; }
// Not compared (an error message: check() says what it must hold).
inline Match unmatched() { return {Match::Kind::none}; }

// ---- A case's outputs on one backend

struct Output {
  std::string name;
  char type;  // 'f' float, 'd' double, 'i' int32, 'u' uint64, 'b' bytes, 's' text
  std::vector<uint8_t> raw;
  Match match;
};

class Result {
 public:
  const Output* find(const std::string& name) const;
  // Output `name` as values of T (its bytes reinterpreted); a missing output fails the test.
  template <class T>
  std::vector<T> get(const std::string& name) const {
    const Output* o = find(name);
    if (!o) {
      ADD_FAILURE() << "no output " << name;
      return {};
    }
    std::vector<T> v(o->raw.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), o->raw.data(), v.size() * sizeof(T));
    return v;
  }
  std::vector<float> operator[](const std::string& name) const { return get<float>(name); }
  double f64(const std::string& name) const {
    const auto v = get<double>(name);
    return v.empty() ? 0.0 : v[0];
  }
  std::string text(const std::string& name) const;
  std::vector<Output> outputs;
};

// ---- Running a case on one backend

class Run;

// n elements of T in a backend's memory; converts to T* (a pointer the ops take).
template <class T>
class Buf {
 public:
  Buf() = default;
  Buf(Run& run, int64_t n);
  Buf(Buf&& o) noexcept { *this = std::move(o); }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(run_, o.run_), std::swap(p_, o.p_), std::swap(n_, o.n_);
    return *this;
  }
  ~Buf();
  T* p() const { return p_; }
  operator T*() const { return p_; }
  int64_t size() const { return n_; }

 private:
  Run* run_ = nullptr;
  T* p_ = nullptr;
  int64_t n_ = 0;
};

class Run {
 public:
  Run(const Backend& backend, Device& device) : backend(backend), device(device), ops(device.ops) {}
  const Backend& backend;
  Device& device;
  Ops& ops;

  // Backend memory holding a copy of host data.
  template <class T>
  Buf<T> in(const T* host, int64_t n) {
    Buf<T> b(*this, n);
    if (n > 0) backend.upload(b.p(), host, static_cast<size_t>(n) * sizeof(T));
    return b;
  }
  template <class T>
  Buf<T> in(const std::vector<T>& host) {
    return in(host.data(), static_cast<int64_t>(host.size()));
  }
  // n elements, each `value`.
  template <class T>
  Buf<T> full(int64_t n, T value) {
    return in(std::vector<T>(static_cast<size_t>(n), value));
  }
  template <class T = float>
  Buf<T> zeros(int64_t n) {
    return full<T>(n, T{});
  }
  // Overwrites b's first n (all) elements with host data.
  template <class T>
  void put(Buf<T>& b, const std::vector<T>& host) {
    if (!host.empty()) backend.upload(b.p(), host.data(), host.size() * sizeof(T));
  }
  // A copy of backend memory on the host.
  template <class T>
  std::vector<T> get(const T* p, int64_t n) const {
    std::vector<T> v(static_cast<size_t>(n));
    if (n > 0) backend.download(v.data(), p, static_cast<size_t>(n) * sizeof(T));
    return v;
  }
  template <class T>
  std::vector<T> get(const Buf<T>& b) const {
    return get(b.p(), b.size());
  }

  // Records an output of the case (downloaded from the backend, or host values).
  template <class T>
  void out(const std::string& name, const Buf<T>& b, Match m = bitwise()) {
    out(name, get(b), m);
  }
  template <class T>
  void out(const std::string& name, const std::vector<T>& v, Match m = bitwise()) {
    static_assert(std::is_trivially_copyable_v<T>);
    Output o{name, type_of<T>(), std::vector<uint8_t>(v.size() * sizeof(T)), m};
    if (!v.empty()) std::memcpy(o.raw.data(), v.data(), o.raw.size());
    add(std::move(o));
  }
  void out(const std::string& name, double v, Match m = bitwise()) { out(name, std::vector<double>{v}, m); }
  void out(const std::string& name, float v, Match m = bitwise()) { out(name, std::vector<float>{v}, m); }
  void out_text(const std::string& name, const std::string& s, Match m = unmatched());

  Result result;

 private:
  template <class T>
  static char type_of() {
    if constexpr (std::is_same_v<T, float>) return 'f';
    if constexpr (std::is_same_v<T, double>) return 'd';
    if constexpr (std::is_same_v<T, int32_t>) return 'i';
    if constexpr (std::is_same_v<T, uint64_t>) return 'u';
    return 'b';
  }
  void add(Output o);
};

template <class T>
Buf<T>::Buf(Run& run, int64_t n) : run_(&run), n_(n) {
  p_ = static_cast<T*>(run.backend.allocate(run.device, static_cast<size_t>(n) * sizeof(T)));
}
template <class T>
Buf<T>::~Buf() {
  if (run_) run_->backend.release(run_->device, p_, static_cast<size_t>(n_) * sizeof(T));
}

// ---- The registry

struct CaseInfo {
  std::string suite, test;       // the gtest test that runs the case: Harness<suite>.<test>
  std::vector<std::string> ops;  // the ops of Ops it calls
  std::string label;             // its shapes and options
};

struct Case {
  CaseInfo info;
  struct Instance {
    std::function<void(Run&)> run;
    std::function<void(const Result&)> check;
  };
  // Makes the inputs; the instance runs and checks the case with them.
  std::function<Instance()> instantiate;
};

class Registry {
 public:
  // make() -> In; run(Run&, const In&); check(const Result&, const In&).
  template <class Make, class RunF, class CheckF>
  void add(CaseInfo info, Make make, RunF run, CheckF check) {
    using In = std::decay_t<decltype(make())>;
    cases_.push_back({std::move(info), [make, run, check] {
                        auto in = std::make_shared<In>(make());
                        return Case::Instance{[in, run](Run& r) { run(r, *in); },
                                              [in, check](const Result& got) { check(got, *in); }};
                      }});
  }
  // A case without inputs: run(Run&); check(const Result&).
  template <class RunF, class CheckF>
  void add(CaseInfo info, RunF run, CheckF check) {
    add(
        std::move(info), [] { return 0; }, [run](Run& r, int) { run(r); },
        [check](const Result& got, int) { check(got); });
  }
  const std::vector<Case>& cases() const { return cases_; }

 private:
  std::vector<Case> cases_;
};

// Every case of every family (op_harness.cpp lists the families).
const Registry& registry();

// The families' cases (tests/ops/<family>.cpp). They run at static initialisation, when the tests
// are registered with gtest: they only declare cases (no inputs, no globals of other files).
void add_gemm_cases(Registry&);
void add_attention_cases(Registry&);
void add_norm_cases(Registry&);
void add_activation_cases(Registry&);
void add_embedding_cases(Registry&);
void add_rope_cases(Registry&);
void add_cross_entropy_cases(Registry&);
void add_permute_cases(Registry&);
void add_quantize_cases(Registry&);
void add_optimizer_cases(Registry&);
void add_copy_cases(Registry&);
void add_elementwise_cases(Registry&);
void add_reduce_cases(Registry&);
void add_router_cases(Registry&);
void add_gate_cases(Registry&);

// Runs the cases on every built backend (what each registered test does).
void run_cases(const std::vector<const Case*>& cases);
// The same on the given backends: per backend, the cases it ran and those it skipped (a backend
// without a device), with the reason; the skips are printed.
struct RunCounts {
  std::map<std::string, int64_t> ran, skipped;
  std::map<std::string, std::string> why;
};
RunCounts run_cases_on(const std::vector<const Case*>& cases, const std::vector<Backend>& backends);

// got's output equals want's: bitwise, or (use_match) as want's Match says.
::testing::AssertionResult same_output(const Output& got, const Output& want, bool use_match);
// Every output of want is in got, and equal as above; no other outputs.
::testing::AssertionResult same_outputs(const Result& got, const Result& want, bool use_match);

}  // namespace lockstep::harness
