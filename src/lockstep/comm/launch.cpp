#include "lockstep/comm/launch.h"

#include <cstdlib>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/core/error.h"
#ifdef LOCKSTEP_HAVE_MPI
#include "lockstep/comm/mpi/mpi_transport.h"
#endif

namespace lockstep {

bool under_mpi_launcher() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(var)) return true;
  return false;
}

bool mpi_available() {
#ifdef LOCKSTEP_HAVE_MPI
  return true;
#else
  return false;
#endif
}

std::string resolve_backend(const std::string& backend) {
  const std::string b = backend == "auto" ? (under_mpi_launcher() ? "mpi" : "threads") : backend;
  if (b == "mpi" && !mpi_available())
    user_error("dist.backend = \"", backend, "\"", backend == "auto" ? " (started by mpirun)" : "",
               ": this lockstep was built without MPI (install libopenmpi-dev, rerun scripts/setup.sh)");
  if (b != "mpi" && b != "threads") user_error("dist.backend = \"", backend, "\": expected auto, threads or mpi");
  return b;
}

void run_ranks(const std::string& backend, int nproc, double timeout_s, const std::function<void(Communicator&)>& fn) {
  if (nproc < 0) user_error("--nproc ", nproc, ": must be positive");
  if (resolve_backend(backend) == "threads") return run_threads(nproc > 0 ? nproc : 1, timeout_s, fn);
#ifdef LOCKSTEP_HAVE_MPI
  run_mpi(nproc, timeout_s, fn);
#endif
}

}  // namespace lockstep
