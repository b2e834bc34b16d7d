// A rank's compute device: the op table its backend bound (kernels/ops.h), the allocator its
// buffers come from, and the count of the points where the host waits for the device's data.
//
// Memory: the parameter, gradient and optimizer store, the activation arena and the communication
// buffers allocate through memory(); it counts what they hold and the high-water mark, the
// metrics' alloc_peak_mb (one value per rank, which the process's RSS cannot give for thread ranks).
//
// Host syncs: every place where the host must read data the device computed (token counts to size
// a dispatch, the step's loss and grad norm, fingerprints) calls host_sync with its name. On the
// CPU it costs nothing; on a GPU it is a stream synchronisation, so a step should have as few as
// possible (docs/architecture.md lists them). The metrics record their count per step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "lockstep/core/memory.h"
#include "lockstep/kernels/ops.h"

namespace lockstep {

// An allocator that counts the bytes it holds and their high-water mark.
class DeviceMemory final : public Allocator {
 public:
  void* allocate(size_t bytes) override;
  void release(void* p, size_t bytes) noexcept override;
  int64_t bytes_in_use() const { return in_use_; }
  int64_t peak_bytes() const { return peak_; }

 private:
  int64_t in_use_ = 0, peak_ = 0;
};

// The names of the ops `ops` leaves unbound, comma-separated (empty when every op is bound).
std::string unbound_ops(Ops& ops);

class Device {
 public:
  enum class Kind : uint8_t { cpu };
  // The CPU device: its ops run on the calling thread's pool (core/thread_pool.h: each rank binds
  // its own), so a device is used by one rank's thread.
  static std::unique_ptr<Device> cpu();

  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  Kind kind() const { return kind_; }
  const char* name() const;
  Ops ops;
  DeviceMemory& memory() { return memory_; }
  const DeviceMemory& memory() const { return memory_; }

  // The host is about to read device data at `point` (a static name, "moe.dispatch.counts").
  void host_sync(const char* point) {
    ++syncs_;
    ++by_point_[point];
  }
  // Syncs since the last take_host_syncs (the trainer takes them once per step).
  int64_t take_host_syncs() {
    const int64_t n = syncs_;
    syncs_ = 0;
    return n;
  }
  // Every point seen so far and how often it synced.
  const std::map<std::string, int64_t>& host_sync_points() const { return by_point_; }

 private:
  explicit Device(Kind kind);
  Kind kind_;
  DeviceMemory memory_;
  int64_t syncs_ = 0;
  std::map<std::string, int64_t> by_point_;
};

}  // namespace lockstep
