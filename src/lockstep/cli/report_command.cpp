// lockstep report RUN [RUN ...] [-o FILE]
//
// Writes one self-contained HTML page of the runs' metrics (train/report.h) to FILE, by default
// RUN/report.html of the first run; atomically, so that a failed report leaves no file behind.
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/core/error.h"
#include "lockstep/train/report.h"
#include "lockstep/train/run_dir.h"

namespace lockstep::cli {

int report_command(const std::vector<std::string>& args) {
  std::vector<std::string> runs;
  std::string out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-o" || args[i] == "--output") {
      if (i + 1 == args.size()) user_error("command line: ", args[i], " needs a file name");
      if (!out.empty()) user_error("command line: ", args[i], " given twice");
      out = args[++i];
    } else if (args[i].rfind("-", 0) == 0) {
      user_error("command line: unknown option '", args[i], "' (see `lockstep help`)");
    } else {
      runs.push_back(args[i]);
    }
  }
  if (runs.empty()) user_error("command line: lockstep report needs at least one run directory");
  if (out.empty()) out = runs.front() + "/report.html";
  write_file_atomic(out, report_html(runs));
  std::printf("lockstep report: wrote %s\n", out.c_str());
  return 0;
}

}  // namespace lockstep::cli
