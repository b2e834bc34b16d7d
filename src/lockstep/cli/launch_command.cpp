// lockstep launch --max-restarts N -- COMMAND ...
//
// Supervises a whole job, typically `mpirun ... lockstep train ...`: mpirun ends every process of
// the job when one dies, so the supervisor runs the command again, resuming from the newest complete
// checkpoint (train.resume=auto appended to the command, whose last arguments must be lockstep
// train's). supervisor.h says which endings are restarted.
#include <filesystem>

#include "lockstep/cli/commands.h"
#include "lockstep/cli/supervisor.h"
#include "lockstep/cli/train_args.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"

namespace lockstep::cli {

int launch_command(const std::vector<std::string>& args) {
  const char* usage = "lockstep launch --max-restarts N -- mpirun -n 2 build/lockstep train ...";
  int max_restarts = -1;
  size_t at = 0;
  for (; at < args.size() && args[at] != "--"; ++at) {
    if (args[at] == "--max-restarts")
      max_restarts = parse_max_restarts(at + 1 < args.size() ? args[++at] : "");
    else
      user_error("command line: launch: unexpected '", args[at], "' before `--` (usage: ", usage, ")");
  }
  if (at == args.size()) user_error("command line: launch: the command to run goes after `--` (usage: ", usage, ")");
  if (max_restarts < 0) user_error("command line: launch: --max-restarts N is missing (usage: ", usage, ")");
  const std::vector<std::string> command(args.begin() + static_cast<std::ptrdiff_t>(at) + 1, args.end());
  // lockstep train's arguments are the command's last: train.resume=auto is appended to them.
  size_t train = 0;
  for (size_t i = 1; i < command.size() && !train; ++i)
    if (command[i] == "train" && std::filesystem::path(command[i - 1]).filename().string().rfind("lockstep", 0) == 0)
      train = i;
  if (!train) {
    std::string text;
    for (const std::string& a : command) text += (text.empty() ? "" : " ") + a;
    user_error(
        "command line: launch: the command must run `lockstep train ...`, with lockstep train's arguments "
        "last (got '",
        text, "')");
  }
  const TrainArgs t = parse_train_args(
      std::vector<std::string>(command.begin() + static_cast<std::ptrdiff_t>(train) + 1, command.end()));
  if (t.max_restarts >= 0)
    user_error("command line: launch: the supervised lockstep train has --max-restarts too: give it to launch only");
  const Config config = load_config(t.file, t.overrides);
  return supervise({command, config.train.out_dir, config.train.resume.empty(), max_restarts});
}

}  // namespace lockstep::cli
