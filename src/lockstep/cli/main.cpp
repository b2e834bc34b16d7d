// lockstep: the command line.
//
//   lockstep train [-c FILE.toml] [key=value ...]   train (no arguments: the built-in default job)
//   lockstep help [config]                           usage, or every config key with its default
//
// A user error is one line on stderr, "lockstep: error: ...", and exit status 2; a broken
// internal invariant is "lockstep: internal error: ..." and exit status 3.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/train/trainer.h"

namespace {

constexpr const char* kUsage =
    "usage: lockstep train [-c FILE.toml] [key=value ...]\n"
    "       lockstep help [config]\n"
    "\n"
    "  train   train a GPT; with no arguments, the built-in default model on the built-in corpus.\n"
    "          Keys override the file: lockstep train -c configs/debug.toml train.steps=20\n"
    "  help    this text; `lockstep help config` lists every config key with its default\n";

int cmd_train(const std::vector<std::string>& args) {
  std::string file;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-c" || a == "--config") {
      if (i + 1 >= args.size()) lockstep::user_error("command line: ", a, " needs a file name");
      if (!file.empty()) lockstep::user_error("command line: more than one config file (", file, ", ", args[i + 1], ")");
      file = args[++i];
    } else if (a.rfind("-", 0) == 0) {
      lockstep::user_error("command line: unknown option '", a, "' (see `lockstep help`)");
    } else {
      overrides.push_back(a);
    }
  }
  const lockstep::Config config = lockstep::load_config(file, overrides);
  lockstep::train(config, stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "train") {
      return cmd_train(args.empty() ? args : std::vector<std::string>(args.begin() + 1, args.end()));
    }
    if (args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      if (args.size() > 1 && args[1] == "config") std::fputs(lockstep::config_help().c_str(), stdout);
      else std::fputs(kUsage, stdout);
      return 0;
    }
    lockstep::user_error("unknown command '", args[0], "' (see `lockstep help`)");
  } catch (const lockstep::UserError& e) {
    std::fprintf(stderr, "lockstep: error: %s\n", e.what());
    return 2;
  } catch (const lockstep::InternalError& e) {
    std::fprintf(stderr, "lockstep: internal error: %s\n", e.what());
    return 3;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "lockstep: error: out of memory\n");
    return 2;
  }
}
