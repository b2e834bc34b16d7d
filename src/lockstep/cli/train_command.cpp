// lockstep train [-c FILE.toml] [key=value ...]
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/trainer.h"

namespace lockstep::cli {

int train_command(const std::vector<std::string>& args) {
  std::string file;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-c" || a == "--config") {
      if (i + 1 >= args.size()) user_error("command line: ", a, " needs a file name");
      if (!file.empty()) user_error("command line: more than one config file (", file, ", ", args[i + 1], ")");
      file = args[++i];
    } else if (a.rfind("-", 0) == 0) {
      user_error("command line: unknown option '", a, "' (see `lockstep help`)");
    } else {
      overrides.push_back(a);
    }
  }
  const Config config = load_config(file, overrides);
  train(config, stdout);
  return 0;
}

}  // namespace lockstep::cli
