// The op harness (op_harness.h): the backends, the runner, and the registration of every family's
// cases as gtest tests.
#include "op_harness.h"

#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "lockstep/core/thread_pool.h"

namespace lockstep::harness {

// ---- Backends

namespace {

void with_pool(int threads, const std::function<void()>& f) {
  static ThreadPool two(2), three(3);
  ThreadPool::Bind bind(threads == 2 ? &two : &three);
  f();
}

Backend cpu_backend() {
  Backend b;
  b.name = "cpu";
  b.make_device = [](std::string*) { return Device::cpu(); };
  b.allocate = [](Device& d, size_t bytes) { return d.memory().allocate(bytes); };
  b.release = [](Device& d, void* p, size_t bytes) { d.memory().release(p, bytes); };
  b.upload = [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
  b.download = [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
  // The contracts: bits independent of the thread count (serial: no pool bound).
  b.settings = {{"serial", [](const std::function<void()>& f) { f(); }},
                {"2 threads", [](const std::function<void()>& f) { with_pool(2, f); }},
                {"3 threads", [](const std::function<void()>& f) { with_pool(3, f); }}};
  return b;
}

}  // namespace

const std::vector<Backend>& built_backends() {
  static const std::vector<Backend> backends = [] {
    std::vector<Backend> b;
    b.push_back(cpu_backend());
    // A CUDA build adds its backend here (LOCKSTEP_HAVE_CUDA): its device (or the reason it has
    // none: no GPU, no driver), cudaMalloc / cudaFree / cudaMemcpy, and one setting.
    return b;
  }();
  return backends;
}

// ---- Outputs

const Output* Result::find(const std::string& name) const {
  for (const Output& o : outputs)
    if (o.name == name) return &o;
  return nullptr;
}

std::string Result::text(const std::string& name) const {
  const Output* o = find(name);
  if (!o) {
    ADD_FAILURE() << "no output " << name;
    return {};
  }
  return std::string(o->raw.begin(), o->raw.end());
}

void Run::out_text(const std::string& name, const std::string& s, Match m) {
  add(Output{name, 's', std::vector<uint8_t>(s.begin(), s.end()), m});
}

void Run::add(Output o) {
  if (result.find(o.name)) ADD_FAILURE() << "output " << o.name << " recorded twice";
  result.outputs.push_back(std::move(o));
}

namespace {

size_t elem_size(char type) {
  switch (type) {
    case 'f':
    case 'i':
      return 4;
    case 'd':
    case 'u':
      return 8;
    default:
      return 1;
  }
}

std::string elem_string(const Output& o, size_t i) {
  const uint8_t* p = o.raw.data() + i * elem_size(o.type);
  std::ostringstream s;
  s.precision(9);
  switch (o.type) {
    case 'f': {
      float v;
      std::memcpy(&v, p, 4);
      s << v;
      break;
    }
    case 'd': {
      double v;
      std::memcpy(&v, p, 8);
      s.precision(17);
      s << v;
      break;
    }
    case 'i': {
      int32_t v;
      std::memcpy(&v, p, 4);
      s << v;
      break;
    }
    case 'u': {
      uint64_t v;
      std::memcpy(&v, p, 8);
      s << v;
      break;
    }
    default:
      s << static_cast<int>(*p);
  }
  return s.str();
}

double elem_value(const Output& o, size_t i) {
  const uint8_t* p = o.raw.data() + i * elem_size(o.type);
  if (o.type == 'f') {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  double v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

::testing::AssertionResult same_output(const Output& got, const Output& want, bool use_match) {
  if (got.type != want.type || got.raw.size() != want.raw.size())
    return ::testing::AssertionFailure() << got.name << ": type or size differs (" << got.raw.size() << " vs "
                                         << want.raw.size() << " bytes)";
  const Match m = use_match ? want.match : bitwise();
  if (m.kind == Match::Kind::none) return ::testing::AssertionSuccess();
  const size_t es = elem_size(got.type), n = got.raw.size() / es;
  const bool close = m.kind == Match::Kind::close && (got.type == 'f' || got.type == 'd');
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(got.raw.data() + i * es, want.raw.data() + i * es, es) == 0) continue;
    if (close) {
      const double a = elem_value(got, i), b = elem_value(want, i);
      if (std::abs(a - b) <= m.atol + m.rtol * std::abs(b) || (std::isnan(a) && std::isnan(b))) continue;
      return ::testing::AssertionFailure()
             << got.name << "[" << i << "]: " << elem_string(got, i) << " vs " << elem_string(want, i)
             << " (beyond atol " << m.atol << " + rtol " << m.rtol << ")";
    }
    return ::testing::AssertionFailure() << got.name << "[" << i << "]: " << elem_string(got, i) << " vs "
                                         << elem_string(want, i) << " differ in bits";
  }
  return ::testing::AssertionSuccess();
}

// Every output of `want` in `got` (and nothing else): bitwise, or (use_match) as each output says.
::testing::AssertionResult same_outputs(const Result& got, const Result& want, bool use_match) {
  if (got.outputs.size() != want.outputs.size())
    return ::testing::AssertionFailure() << got.outputs.size() << " outputs vs " << want.outputs.size();
  for (const Output& w : want.outputs) {
    const Output* g = got.find(w.name);
    if (!g) return ::testing::AssertionFailure() << "no output " << w.name;
    if (auto r = same_output(*g, w, use_match); !r) return r;
  }
  return ::testing::AssertionSuccess();
}

// ---- Running cases

namespace {

struct Skips {
  std::map<std::string, int64_t> count;
  std::map<std::string, std::string> why;
};
Skips& skips() {
  static Skips s;
  return s;
}
int64_t& cases_run() {
  static int64_t n = 0;
  return n;
}

}  // namespace

RunCounts run_cases_on(const std::vector<const Case*>& cases, const std::vector<Backend>& backends) {
  RunCounts counts;
  // Each backend's device, or why it has none.
  std::vector<std::unique_ptr<Device>> devices;
  for (const Backend& b : backends) {
    std::string reason;
    devices.push_back(b.make_device(&reason));
    if (!devices.back()) counts.why[b.name] = reason.empty() ? "no device" : reason;
  }
  for (const Case* c : cases) {
    SCOPED_TRACE(c->info.label);
    try {
      const Case::Instance inst = c->instantiate();
      Result cpu;
      bool have_cpu = false;
      for (size_t bi = 0; bi < backends.size(); ++bi) {
        const Backend& b = backends[bi];
        Device* d = devices[bi].get();
        if (!d) {
          ++counts.skipped[b.name];
          continue;
        }
        SCOPED_TRACE("backend " + b.name);
        Result first;
        for (size_t s = 0; s < b.settings.size(); ++s) {
          Run r(b, *d);
          b.settings[s].apply([&] { inst.run(r); });
          if (s == 0) {
            first = std::move(r.result);
          } else {
            EXPECT_TRUE(same_outputs(r.result, first, false))
                << b.settings[s].name << " vs " << b.settings[0].name << ": the bits depend on the setting";
          }
        }
        inst.check(first);
        // Against the CPU backend (on the CPU itself trivially equal; the path the others take).
        if (b.name == "cpu") {
          cpu = first;
          have_cpu = true;
        }
        if (have_cpu) {
          EXPECT_TRUE(same_outputs(first, cpu, true)) << b.name << " vs cpu";
        }
        ++counts.ran[b.name];
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the case threw: " << e.what();
    }
  }
  // Never silently absent: what each backend skipped, and why.
  for (const auto& [name, n] : counts.skipped) {
    std::cout << "[ SKIPPED  ] op harness: " << n << " case" << (n == 1 ? "" : "s") << " on backend " << name << ": "
              << counts.why[name] << std::endl;
    ::testing::Test::RecordProperty("skipped_on_" + name, static_cast<int>(n));
  }
  return counts;
}

void run_cases(const std::vector<const Case*>& cases) {
  const RunCounts counts = run_cases_on(cases, built_backends());
  for (const auto& [name, n] : counts.ran) cases_run() += n;
  for (const auto& [name, n] : counts.skipped) {
    skips().count[name] += n;
    skips().why[name] = counts.why.at(name);
  }
}

// ---- The registry, every family listed once

// The families without a declaration in op_harness.h (tests/ops/<family>.cpp).

const Registry& registry() {
  static const Registry r = [] {
    Registry r;
    add_gemm_cases(r);
    add_attention_cases(r);
    add_norm_cases(r);
    add_activation_cases(r);
    add_embedding_cases(r);
    add_rope_cases(r);
    add_cross_entropy_cases(r);
    add_permute_cases(r);
    add_quantize_cases(r);
    add_optimizer_cases(r);
    add_copy_cases(r);
    add_elementwise_cases(r);
    add_reduce_cases(r);
    add_router_cases(r);
    add_gate_cases(r);
    return r;
  }();
  return r;
}

namespace {

class CasesTest : public ::testing::Test {
 public:
  explicit CasesTest(std::vector<const Case*> cases) : cases_(std::move(cases)) {}
  void TestBody() override { run_cases(cases_); }

 private:
  std::vector<const Case*> cases_;
};

// At the end of the program: what ran, and what every backend skipped and why.
class Summary : public ::testing::Environment {
 public:
  void TearDown() override {
    if (cases_run() == 0 && skips().count.empty()) return;
    std::cout << "[ harness  ] op cases run: " << cases_run() << " (case x backend)" << std::endl;
    for (const auto& [name, n] : skips().count)
      std::cout << "[ SKIPPED  ] op harness: " << n << " cases on backend " << name << ": " << skips().why[name]
                << std::endl;
  }
};

// Each (suite, test) of the registry becomes the gtest test Harness<suite>.<test>, in the order
// the families declare them.
const bool registered = [] {
  std::vector<std::pair<std::string, std::string>> order;
  std::map<std::pair<std::string, std::string>, std::vector<const Case*>> groups;
  for (const Case& c : registry().cases()) {
    const auto key = std::make_pair(c.info.suite, c.info.test);
    if (!groups.count(key)) order.push_back(key);
    groups[key].push_back(&c);
  }
  for (const auto& key : order) {
    const std::vector<const Case*> cases = groups[key];
    ::testing::RegisterTest(("Harness" + key.first).c_str(), key.second.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                            [cases]() -> CasesTest* { return new CasesTest(cases); });
  }
  ::testing::AddGlobalTestEnvironment(new Summary);
  return true;
}();

}  // namespace

}  // namespace lockstep::harness
