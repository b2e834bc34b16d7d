// The op harness itself (op_harness.h, docs/testing.md "The op harness"): every op of the seam has
// a case, the backends, the comparisons, and what happens with a second backend that differs from
// the CPU or has no device.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/kernels/device.h"
#include "op_harness.h"

namespace lockstep::harness {
namespace {

std::set<std::string> op_names() {
  Ops ops;
  std::set<std::string> names;
  ops.each([&](const auto& op) { names.insert(op.name()); });
  return names;
}

// The harness runs every op: an op of Ops (kernels/ops.h) without a case in the registry fails
// here, naming it; so does a case naming an op that Ops does not have.
TEST(OpHarness, RunsEveryOp) {
  std::set<std::string> covered;
  for (const Case& c : registry().cases()) {
    EXPECT_FALSE(c.info.ops.empty()) << "Harness" << c.info.suite << "." << c.info.test << " (" << c.info.label
                                     << ") names no op";
    covered.insert(c.info.ops.begin(), c.info.ops.end());
  }
  const std::set<std::string> names = op_names();
  for (const std::string& op : names)
    EXPECT_TRUE(covered.count(op)) << "the op " << op << " has no case in the op harness (tests/ops/)";
  for (const std::string& op : covered)
    EXPECT_TRUE(names.count(op)) << "a harness case names " << op << ", which is no op of Ops";
  EXPECT_GT(registry().cases().size(), 100u);
}

// "cpu" is built and first (the others compare with it); a built backend without a device is
// reported as a skip, never silently absent.
TEST(OpHarness, BuiltBackendsAndTheirDevices) {
  const std::vector<Backend>& backends = built_backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends.front().name, "cpu");
  std::string absent;
  for (const Backend& b : backends) {
    EXPECT_FALSE(b.settings.empty()) << b.name;
    std::string why;
    if (!b.make_device(&why)) absent += b.name + " (" + why + ") ";
  }
  if (!absent.empty()) GTEST_SKIP() << "built backends without a device, whose op cases skip: " << absent;
}

Output output(const std::string& name, std::vector<float> v, Match m) {
  Output o{name, 'f', std::vector<uint8_t>(v.size() * 4), m};
  std::memcpy(o.raw.data(), v.data(), o.raw.size());
  return o;
}

TEST(OpHarness, ComparesBitsOrWithinTheTolerance) {
  const float one_ulp_more = std::nextafter(1.0f, 2.0f);
  const Output a = output("x", {1.0f, 2.0f}, bitwise()), b = output("x", {one_ulp_more, 2.0f}, bitwise());
  EXPECT_TRUE(same_output(a, a, true));
  EXPECT_FALSE(same_output(b, a, true));
  EXPECT_FALSE(same_output(output("x", {-0.0f, 2.0f}, bitwise()), output("x", {0.0f, 2.0f}, bitwise()), true));
  const Output tol = output("x", {1.0f, 2.0f}, close(1e-6, 0));
  EXPECT_TRUE(same_output(b, tol, true));
  EXPECT_FALSE(same_output(b, tol, false));  // across settings: always bitwise
  EXPECT_FALSE(same_output(output("x", {1.001f, 2.0f}, bitwise()), tol, true));
  EXPECT_TRUE(same_output(output("x", {5.0f, 6.0f}, bitwise()), output("x", {1.0f, 2.0f}, unmatched()), true));
  EXPECT_FALSE(same_output(output("x", {1.0f}, bitwise()), a, true));  // sizes differ
  Result r, s;
  r.outputs = {a};
  s.outputs = {a, b};
  EXPECT_FALSE(same_outputs(r, s, true));
}

// The cases of one harness test.
std::vector<const Case*> cases_of(const std::string& suite, const std::string& test) {
  std::vector<const Case*> out;
  for (const Case& c : registry().cases())
    if (c.info.suite == suite && c.info.test == test) out.push_back(&c);
  return out;
}

Backend renamed_cpu(const std::string& name) {
  Backend b = built_backends().front();
  b.name = name;
  return b;
}

// A second backend runs every case and is compared with the CPU: one that gives the CPU's bits
// passes; one whose op computes something else fails (the reference and the CPU comparison).
TEST(OpHarness, ASecondBackendIsComparedWithTheCpu) {
  const std::vector<const Case*> cases = cases_of("Norms", "RMSNormForwardMatchesReference");
  ASSERT_FALSE(cases.empty());
  const RunCounts same = run_cases_on(cases, {built_backends().front(), renamed_cpu("cpu-again")});
  EXPECT_EQ(same.ran.at("cpu-again"), static_cast<int64_t>(cases.size()));
  EXPECT_TRUE(same.skipped.empty());

  Backend wrong = renamed_cpu("wrong");
  wrong.make_device = [](std::string*) {
    std::unique_ptr<Device> d = Device::cpu();
    d->ops.rmsnorm_forward.bind(
        +[](float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float) {
          for (int64_t n = 0; n < N; ++n) {
            rstd[n] = 1.0f;
            for (int64_t c = 0; c < C; ++c) out[n * C + c] = inp[n * C + c] * weight[c];
          }
        });
    return d;
  };
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    run_cases_on(cases, {built_backends().front(), wrong});
  }
  bool vs_cpu = false;
  for (int i = 0; i < failures.size(); ++i)
    vs_cpu |= std::string(failures.GetTestPartResult(i).message()).find("wrong vs cpu") != std::string::npos;
  EXPECT_GT(failures.size(), 0);
  EXPECT_TRUE(vs_cpu) << "the CPU comparison did not fail";
}

// A backend that is built but has no device skips its cases, counts them, and says why.
TEST(OpHarness, ABackendWithoutADeviceSkipsItsCasesAndSaysSo) {
  Backend absent = renamed_cpu("absent");
  absent.make_device = [](std::string* why) {
    *why = "no device present (test)";
    return std::unique_ptr<Device>();
  };
  const std::vector<const Case*> cases = cases_of("Norms", "LayerNormForwardMatchesReference");
  ::testing::internal::CaptureStdout();
  const RunCounts counts = run_cases_on(cases, {built_backends().front(), absent});
  const std::string printed = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(counts.ran.at("cpu"), static_cast<int64_t>(cases.size()));
  EXPECT_EQ(counts.ran.count("absent"), 0u);
  EXPECT_EQ(counts.skipped.at("absent"), static_cast<int64_t>(cases.size()));
  EXPECT_EQ(counts.why.at("absent"), "no device present (test)");
  EXPECT_NE(printed.find(str("op harness: ", cases.size(), " cases on backend absent: no device present (test)")),
            std::string::npos)
      << printed;
}

}  // namespace
}  // namespace lockstep::harness
