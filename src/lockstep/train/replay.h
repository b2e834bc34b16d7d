// `lockstep replay RUN --step N [--out DIR] [key=value ...]`: reproduce a run's step N (a loss
// spike, a NaN) from its newest checkpoint before N, with module tracing and per-module
// statistics, and check that the replay gives the run's recorded fingerprints bit for bit; with
// overrides, the "change one thing" experiment (docs/faults.md).
//
// The replay is a resumed run in DIR (default RUN/replay-step-N): RUN/config.toml with the
// overrides, resumed from the checkpoint on as many ranks (threads) as saved it, stopping after
// step N (train.exit_interval = N, so the schedule's train.steps is unchanged), saving nothing,
// tracing every module (debug.trace = "modules": each record with its output's norm and max |x|).
// It refuses, by name, a run whose RUN/build.json (commit, compiler, flags, libraries, data
// checksums) differs from this binary's and data's, a step past the run's last one, and a run
// with no complete checkpoint before N (listing those it has).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {

struct ReplayOptions {
  std::string run;
  int64_t step = 0;
  std::string out;  // "" = RUN/replay-step-N
  std::vector<std::string> overrides;
};

struct ReplayResult {
  std::string out;          // the replay's run directory
  int64_t from_step = 0;    // the checkpoint's step: the replay ran steps from_step + 1 .. step
  bool reproduced = false;  // its fingerprints equal the run's over those steps
  std::string report;       // for the user: what was replayed, the comparison, the statistics
};

// Progress of the replayed steps goes to `progress`. UserError on bad input (above).
ReplayResult replay(const ReplayOptions& options, std::FILE* progress);

}  // namespace lockstep
