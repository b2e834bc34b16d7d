// The compute seam (kernels/ops.h, kernels/device.h): the op table, the backends' binding of it,
// the start-up refusal of a backend that lacks an op, and the device's memory accounting.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "lockstep/core/tensor.h"
#include "lockstep/kernels/device.h"
#include "testing.h"

namespace lockstep {
namespace {

// Every Op has the same size; the table holds nothing else. So `each` visits every op exactly when
// it visits sizeof(Ops) / sizeof(Op) of them with distinct names: an op added to a family but not to
// its each() fails here (and would otherwise escape the start-up check).
TEST(Ops, EachVisitsEveryOpOnceByName) {
  Ops ops;
  std::set<std::string> names;
  int64_t visited = 0;
  ops.each([&](const auto& op) {
    ++visited;
    names.insert(op.name());
  });
  EXPECT_EQ(visited * static_cast<int64_t>(sizeof(Op<void()>)), static_cast<int64_t>(sizeof(Ops)));
  EXPECT_EQ(static_cast<int64_t>(names.size()), visited);
}

TEST(Ops, TheCpuBackendBindsEveryOp) {
  const std::unique_ptr<Device> cpu = Device::cpu();
  EXPECT_EQ(unbound_ops(cpu->ops), "");
  EXPECT_STREQ(cpu->name(), "cpu");
}

TEST(Ops, AnUnboundOpIsNamed) {
  Ops ops;
  const std::string all = unbound_ops(ops);
  EXPECT_NE(all.find("gemm"), std::string::npos);
  EXPECT_NE(all.find("attention_backward"), std::string::npos);
  EXPECT_NE(all.find("quantize_nvfp4"), std::string::npos);
}

TEST(Device, MemoryCountsWhatItHoldsAndItsPeak) {
  const std::unique_ptr<Device> cpu = Device::cpu();
  DeviceMemory& m = cpu->memory();
  EXPECT_EQ(m.bytes_in_use(), 0);
  {
    FloatBuffer a(1000, &m), b(24, &m);
    EXPECT_EQ(m.bytes_in_use(), 4096);
    a.resize(10);
    EXPECT_EQ(m.bytes_in_use(), 136);
  }
  EXPECT_EQ(m.bytes_in_use(), 0);
  EXPECT_EQ(m.peak_bytes(), 4096);
}

TEST(Device, HostSyncsAreCountedByPoint) {
  const std::unique_ptr<Device> cpu = Device::cpu();
  cpu->host_sync("loss");
  cpu->host_sync("moe.dispatch");
  cpu->host_sync("moe.dispatch");
  EXPECT_EQ(cpu->take_host_syncs(), 3);
  EXPECT_EQ(cpu->take_host_syncs(), 0);
  EXPECT_EQ(cpu->host_sync_points().at("moe.dispatch"), 2);
}

}  // namespace
}  // namespace lockstep
