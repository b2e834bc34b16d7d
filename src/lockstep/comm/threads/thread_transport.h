// The `threads` backend: every rank is a thread of one process (`lockstep train --nproc N`, tests).
//
// A message is a rendezvous: the sender posts a descriptor of its buffer, the receiver copies
// straight out of it (one copy) and marks it consumed; the sender's step ends when its messages are
// consumed and its receives are done. One mutex guards the mailbox of the whole world; each rank
// sleeps on its own condition variable with the operation's deadline.
//
// Failures: a rank whose function throws or exits, or a step that passes its deadline, records
// the world's failure (the first one wins) and wakes every rank; a rank waiting in a step then
// throws CommError naming itself, the operation and the failure.
#pragma once

#include <functional>
#include <memory>

#include "lockstep/comm/communicator.h"

namespace lockstep {

class ThreadWorld;

// Runs fn(communicator of rank r) on `nproc` threads and returns when all are done. When a rank
// fails, the others stop at their next communication (or time out); the error of the rank that
// failed first is rethrown, its message prefixed with "rank R: " when nproc > 1. A rank that has not
// stopped timeout_s after the failure is left behind (detached) and named in the error.
void run_threads(int nproc, double timeout_s, const std::function<void(Communicator&)>& fn);

}  // namespace lockstep
