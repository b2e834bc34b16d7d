// The backend interface under Communicator: moves bytes between the ranks of a group, nothing
// else. Every reduction, chunking and ordering decision lives in communicator.cpp, so that the
// backends cannot differ in arithmetic.
//
// A backend implements exchange(): post every send and every receive of one step of an operation,
// complete them all, or throw CommError by the deadline naming the peers that did not take part.
// Collective steps are matched by their position in the group's sequence of steps (every rank of a
// group runs the same steps in the same order); point-to-point messages by (peer, tag, order sent).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

class LinkModel;

struct SendSpec {
  int peer;  // rank in the group
  const void* data;
  int64_t bytes;
  int tag = 0;  // point to point: added to the operation's tag (a batch's messages differ by it)
};

struct RecvSpec {
  int peer;
  void* data;
  int64_t bytes;  // must equal what the peer sends
  int tag = 0;
};

struct OpInfo {
  const char* name;  // "all_reduce", "send", ... for messages
  std::chrono::steady_clock::time_point deadline;
  bool p2p = false;  // point to point (matched by tag and order) rather than a collective step
  int tag = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int world_rank(int r) const = 0;
  virtual int local_size() const = 0;  // ranks of the job on this machine
  virtual const char* backend() const = 0;
  virtual double timeout_s() const = 0;

  virtual void exchange(const std::vector<SendSpec>& sends, const std::vector<RecvSpec>& recvs, const OpInfo& op) = 0;

  // The group of `members` (ranks of this group, in their new order, this rank among them), which
  // every rank of this group computes from the same all-gathered (color, key): collective over
  // this group, called by every rank in the same step.
  virtual std::shared_ptr<Transport> subgroup(int color, int key, const std::vector<int>& members) = 0;

  // Bytes sent by this rank in this group's operations (counted by communicator.cpp on the
  // group's progress thread; Communicator::bytes_sent reads it between operations).
  int64_t bytes_sent = 0;
  // The wire model every step waits for (comm/link_model.h; null: none), the rank's, shared by its
  // groups.
  std::shared_ptr<LinkModel> link;

  // "rank 3: all_reduce over ranks [0, 1, 2, 3]" for error messages.
  std::string where(const OpInfo& op) const;
};

}  // namespace lockstep
