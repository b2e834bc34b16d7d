// lockstep train [-c FILE.toml] [--nproc N] [--max-restarts N] [key=value ...]
//
// --nproc N runs N ranks as threads of this process; under mpirun each process is one rank
// (dist.backend, comm/launch.h). --max-restarts N runs the job in a supervised child process that is
// restarted from its newest checkpoint when a rank fails (supervisor.h).
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "lockstep/cli/commands.h"
#include "lockstep/cli/supervisor.h"
#include "lockstep/cli/train_args.h"
#include "lockstep/comm/launch.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/trainer.h"

namespace lockstep::cli {

namespace {

// This binary, for the supervised child.
std::string self_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) user_error("--max-restarts: cannot find this program (/proc/self/exe): ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

TrainArgs parse_train_args(const std::vector<std::string>& args) {
  TrainArgs t;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-c" || a == "--config") {
      if (i + 1 >= args.size()) user_error("command line: ", a, " needs a file name");
      if (!t.file.empty()) user_error("command line: more than one config file (", t.file, ", ", args[i + 1], ")");
      t.file = args[++i];
      t.job.insert(t.job.end(), {a, t.file});
    } else if (a == "--nproc") {
      const std::string v = i + 1 < args.size() ? args[++i] : "";
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), t.nproc);
      if (ec != std::errc() || p != v.data() + v.size() || t.nproc < 1)
        user_error("command line: --nproc needs a positive number of ranks, got '", v, "'");
      t.job.insert(t.job.end(), {a, v});
    } else if (a == "--max-restarts") {
      t.max_restarts = parse_max_restarts(i + 1 < args.size() ? args[++i] : "");
    } else if (a.rfind("-", 0) == 0) {
      user_error("command line: unknown option '", a, "' (see `lockstep help`)");
    } else {
      t.overrides.push_back(a);
      t.job.push_back(a);
    }
  }
  return t;
}

int train_command(const std::vector<std::string>& args) {
  const TrainArgs a = parse_train_args(args);
  const Config config = load_config(a.file, a.overrides);
  const bool threads = resolve_backend(config.dist.backend) == "threads";
  if (threads) checked_mesh(config, a.nproc > 0 ? a.nproc : 1);
  if (a.max_restarts >= 0) {
    if (!threads)
      user_error(
          "--max-restarts under mpirun would restart one process of the job: supervise the whole job with "
          "`lockstep launch --max-restarts N -- mpirun ... lockstep train ...`");
    std::vector<std::string> command = {self_path(), "train"};
    command.insert(command.end(), a.job.begin(), a.job.end());
    return supervise({command, config.train.out_dir, config.train.resume.empty(), a.max_restarts});
  }
  run_ranks(config.dist.backend, a.nproc, config.dist.timeout_s,
            [&](Communicator& comm) { train(config, stdout, comm); });
  return 0;
}

}  // namespace lockstep::cli
