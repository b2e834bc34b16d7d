// A model of the wire between ranks (dist.link), for machines whose ranks share one host: each
// message a rank sends is delivered no earlier than its modelled time on the link it crosses, so a
// step's communication takes what it would on a cluster and overlap has something to hide.
//
// Two levels, by where the ranks are (parallel.ranks_per_node consecutive job ranks per node): a
// message of b bytes from rank s to rank d takes latency + b / bandwidth of the intra-node level
// when s and d are on one node, of the inter-node level otherwise (config/link_spec.h). Messages
// on one link (s -> d) serialise in FIFO order: one starts when the previous one on that link has
// been delivered. A step of an operation (comm/transport.h exchange: its sends and receives
// together) completes once the backend has moved its bytes and the model has delivered its last
// message; the rank's progress thread waits for that with a timer (sleep_until), using no core,
// so compute on the rank's other threads goes on. A receive is modelled from the step's start (the
// sender's queue is the sender's to model).
//
// The model only delays; the bytes, their order and every reduction are the backend's, so the bits
// never depend on it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>

#include "lockstep/config/link_spec.h"

namespace lockstep {

class LinkModel {
 public:
  using Clock = std::chrono::steady_clock;
  // One per rank (it keeps the rank's links' queues), shared by the rank's groups. ranks_per_node:
  // job ranks per node (0: all on one node).
  LinkModel(const LinkSpec& spec, int64_t ranks_per_node) : spec_(spec), ranks_per_node_(ranks_per_node) {}
  // Scales the model's speed by `factor` (dist.link_scale): both bandwidths multiplied, both
  // latencies divided, so every message's modelled time is divided by it.
  void scale_bandwidths(double factor) {
    for (LinkLevel* l : {&spec_.intra, &spec_.inter}) {
      l->bytes_per_s *= factor;
      l->latency_s /= factor;
    }
  }

  // Seconds a message of `bytes` takes on the link from job rank `from` to job rank `to`.
  double wire_seconds(int from, int to, int64_t bytes) const;
  bool same_node(int a, int b) const { return ranks_per_node_ <= 0 || a / ranks_per_node_ == b / ranks_per_node_; }
  // A message of `bytes` from this rank (`from`) to `to` entering its link at `start` (after the
  // link's earlier messages): when the model delivers it.
  Clock::time_point deliver(int from, int to, int64_t bytes, Clock::time_point start);
  const LinkSpec& spec() const { return spec_; }

 private:
  LinkSpec spec_;
  int64_t ranks_per_node_ = 0;
  std::mutex mu_;
  std::map<int, Clock::time_point> link_free_;  // per destination: when its link is free again
};

}  // namespace lockstep
