// Starting the ranks of a job: picks the backend and runs a function on every rank.
//
//   backend "threads": `nproc` ranks as threads of this process;
//   backend "mpi":     this process is one rank of an mpirun job (MPI_COMM_WORLD);
//   backend "auto":    "mpi" when started by mpirun (OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_SIZE
//                      is set), else "threads".
#pragma once

#include <functional>
#include <string>

#include "lockstep/comm/communicator.h"

namespace lockstep {

// True when this process was started by mpirun / an MPI process manager.
bool under_mpi_launcher();
// Whether this build has the mpi backend (CMake found MPI).
bool mpi_available();

// The backend "auto" resolves to here; UserError when the choice cannot run (mpi requested or
// detected but not built in).
std::string resolve_backend(const std::string& backend);

// Runs fn on every rank (see above). nproc: ranks for the threads backend; under mpi, 0 or the
// number of mpirun processes. Errors: see run_threads and run_mpi.
void run_ranks(const std::string& backend, int nproc, double timeout_s, const std::function<void(Communicator&)>& fn);

}  // namespace lockstep
