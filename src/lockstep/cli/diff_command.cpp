// lockstep diff RUN_A RUN_B
//
// Exit status 0 when the runs are bitwise identical over their common steps, 1 at the first
// difference (train/run_diff.h says what is compared and reported), 2 on bad input.
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/core/error.h"
#include "lockstep/train/run_diff.h"

namespace lockstep::cli {

int diff_command(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a.rfind("-", 0) == 0) user_error("command line: unknown option '", a, "' (see `lockstep help`)");
  if (args.size() != 2) user_error("command line: lockstep diff needs two run directories, got ", args.size());
  const RunDiff d = diff_runs(args[0], args[1]);
  std::fputs(d.report.c_str(), stdout);
  return d.identical ? 0 : 1;
}

}  // namespace lockstep::cli
