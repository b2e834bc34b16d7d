// lockstep train [-c FILE.toml] [--nproc N] [key=value ...]
//
// --nproc N runs N ranks as threads of this process; under mpirun each process is one rank
// (dist.backend, comm/launch.h).
#include <charconv>
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/comm/launch.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/trainer.h"

namespace lockstep::cli {

int train_command(const std::vector<std::string>& args) {
  std::string file;
  std::vector<std::string> overrides;
  int nproc = 0;  // 0: not given
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-c" || a == "--config") {
      if (i + 1 >= args.size()) user_error("command line: ", a, " needs a file name");
      if (!file.empty()) user_error("command line: more than one config file (", file, ", ", args[i + 1], ")");
      file = args[++i];
    } else if (a == "--nproc") {
      const std::string v = i + 1 < args.size() ? args[++i] : "";
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), nproc);
      if (ec != std::errc() || p != v.data() + v.size() || nproc < 1)
        user_error("command line: --nproc needs a positive number of ranks, got '", v, "'");
    } else if (a.rfind("-", 0) == 0) {
      user_error("command line: unknown option '", a, "' (see `lockstep help`)");
    } else {
      overrides.push_back(a);
    }
  }
  const Config config = load_config(file, overrides);
  if (resolve_backend(config.dist.backend) == "threads") checked_mesh(config, nproc > 0 ? nproc : 1);
  run_ranks(config.dist.backend, nproc, config.dist.timeout_s,
            [&](Communicator& comm) { train(config, stdout, comm); });
  return 0;
}

}  // namespace lockstep::cli
