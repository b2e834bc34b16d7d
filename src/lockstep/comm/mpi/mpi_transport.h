// The `mpi` backend: one process per rank (`mpirun -n N lockstep train ...`), OpenMPI.
//
// Only point-to-point messages are used (MPI_Isend / MPI_Irecv, polled with MPI_Testsome until the
// deadline): MPI's own reductions are never called, since their summation order is the library's
// choice (communicator.cpp does every sum, in rank order). Polling rather than blocking is what
// gives every step a timeout and lets the error name the peers that did not answer.
#pragma once

#include <functional>

#include "lockstep/comm/communicator.h"

namespace lockstep {

// Initialises MPI, runs fn(communicator of MPI_COMM_WORLD), finalises. When fn throws in a job of
// more than one process, prints "lockstep: error: rank R: ..." and ends the whole job with
// MPI_Abort (exit status 2 for a UserError, 1 otherwise): the other ranks would otherwise wait for
// this one until their timeout. In a job of one process the error is rethrown.
void run_mpi(int expected_size, double timeout_s, const std::function<void(Communicator&)>& fn);

}  // namespace lockstep
