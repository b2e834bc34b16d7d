// Supervised jobs (docs/faults.md): `lockstep train --max-restarts N` and `lockstep launch
// --max-restarts N -- COMMAND` run the job as a child process and, when it dies of a rank failure,
// start it again from its newest complete checkpoint (train.resume=auto added), up to N times. Each
// restart is one line on stdout and one line of RUN/restarts.jsonl.
//
// Restarted: a child killed by a signal; exit status 75 (kExitRankFailure: a collective timed out,
// a peer failed or exited); exit status 129-192, which is how mpirun and shells report a process of
// the job killed by signal (status - 128). Not restarted: success; a user error (2); any other
// status (an internal error, a non-finite stop, ...); a child that ends after the supervisor was
// asked to stop (SIGINT, SIGTERM or SIGHUP, which it passes on to the child).
#pragma once

#include <string>
#include <vector>

namespace lockstep::cli {

struct SupervisedJob {
  std::vector<std::string> command;  // argv; command[0] is looked up on PATH
  std::string out_dir;               // the job's train.out_dir: its checkpoints, restarts.jsonl
  bool fresh = true;                 // started without train.resume: an old restarts.jsonl is removed
  int max_restarts = 0;
};

// Runs the job to its end; returns the exit status to give: the child's (128 + the signal for one
// killed by a signal).
int supervise(const SupervisedJob& job);

// --max-restarts's value; UserError unless it is an integer >= 0.
int parse_max_restarts(const std::string& value);

}  // namespace lockstep::cli
