// lockstep replay RUN --step N [--out DIR] [key=value ...]
//
// Exit status 0 when the replay reproduces the run's fingerprints (or, with overrides, once the
// experiment ran and was compared), 1 when a replay without overrides does not reproduce the run,
// 2 on bad input (train/replay.h).
#include <charconv>
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/core/error.h"
#include "lockstep/train/replay.h"

namespace lockstep::cli {

int replay_command(const std::vector<std::string>& args) {
  ReplayOptions o;
  bool have_step = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--step") {
      const std::string v = i + 1 < args.size() ? args[++i] : "";
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), o.step);
      if (ec != std::errc() || p != v.data() + v.size() || o.step < 1)
        user_error("command line: --step needs a step number >= 1, got '", v, "'");
      have_step = true;
    } else if (a == "--out") {
      if (i + 1 >= args.size()) user_error("command line: --out needs a directory");
      o.out = args[++i];
    } else if (a.rfind("-", 0) == 0) {
      user_error("command line: unknown option '", a, "' (see `lockstep help`)");
    } else if (a.find('=') != std::string::npos) {
      o.overrides.push_back(a);
    } else if (o.run.empty()) {
      o.run = a;
    } else {
      user_error("command line: lockstep replay takes one run directory, got '", o.run, "' and '", a, "'");
    }
  }
  if (o.run.empty()) user_error("command line: lockstep replay needs a run directory");
  if (!have_step) user_error("command line: lockstep replay needs --step N (the step to reproduce)");
  const ReplayResult r = replay(o, stdout);
  std::fputs(r.report.c_str(), stdout);
  return r.reproduced || !o.overrides.empty() ? 0 : 1;
}

}  // namespace lockstep::cli
