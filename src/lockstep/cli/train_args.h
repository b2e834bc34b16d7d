// The arguments of `lockstep train` (train_command.cpp), also read by `lockstep launch` from the
// command it supervises.
#pragma once

#include <string>
#include <vector>

namespace lockstep::cli {

struct TrainArgs {
  std::string file;                    // -c FILE
  std::vector<std::string> overrides;  // key=value
  int nproc = 0;                       // --nproc N; 0: not given
  int max_restarts = -1;               // --max-restarts N; -1: not given (no supervisor)
  std::vector<std::string> job;        // the arguments without --max-restarts: the supervised child's
};

// UserError naming the bad argument.
TrainArgs parse_train_args(const std::vector<std::string>& args);

}  // namespace lockstep::cli
