#include "lockstep/cli/supervisor.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/json_line.h"
#include "lockstep/train/run_dir.h"

namespace lockstep::cli {

namespace {

namespace fs = std::filesystem;

// Set by the signal handler: the signal that asked the supervisor to stop, and the child it passes
// the signal on to.
volatile std::sig_atomic_t stop_signal = 0;
volatile pid_t child_pid = 0;

void on_stop(int sig) {
  stop_signal = sig;
  const pid_t child = child_pid;
  if (child > 0) ::kill(child, sig);
}

const int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

void handle_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: waitpid returns with EINTR, and the loop looks again
  for (int sig : kStopSignals) sigaction(sig, &sa, nullptr);
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return str("signal ", sig, abbrev ? str(" (SIG", abbrev, ")") : "");
}

// How a child ended, and whether that is a rank failure to restart after.
struct Ending {
  int status;  // the exit status to pass on: 128 + signal for one killed by a signal
  bool rank_failure;
  std::string cause;
};

Ending classify(int raw) {
  if (WIFSIGNALED(raw)) {
    const int sig = WTERMSIG(raw);
    return {128 + sig, true, "was killed by " + signal_name(sig)};
  }
  const int code = WEXITSTATUS(raw);
  if (code == kExitRankFailure) return {code, true, str("exited with status ", code, " (a rank failed)")};
  if (code > 128 && code <= 128 + 64)
    return {code, true,
            str("exited with status ", code, " (a process of it was killed by ", signal_name(code - 128), ")")};
  return {code, false, str("exited with status ", code)};
}

// Starts command as a child process; the stop signals reach it once child_pid is set, so they are
// blocked until then. Returns 0, starting nothing, when a stop signal has come already.
pid_t start(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  sigset_t stops, old;
  sigemptyset(&stops);
  for (int sig : kStopSignals) sigaddset(&stops, sig);
  sigprocmask(SIG_BLOCK, &stops, &old);
  if (stop_signal) {
    sigprocmask(SIG_SETMASK, &old, nullptr);
    return 0;
  }
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int sig : kStopSignals) ::signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old, nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "lockstep: error: cannot run '%s': %s\n", argv[0], std::strerror(errno));
    std::_Exit(127);
  }
  const int fork_error = errno;
  if (pid > 0) child_pid = pid;
  sigprocmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) user_error("cannot start '", command[0], "': ", std::strerror(fork_error));
  return pid;
}

int wait_for(pid_t pid) {
  int raw = 0;
  while (::waitpid(pid, &raw, 0) < 0) LOCKSTEP_CHECK(errno == EINTR, "waitpid: ", std::strerror(errno));
  child_pid = 0;
  return raw;
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

int parse_max_restarts(const std::string& value) {
  int n = -1;
  const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (ec != std::errc() || p != value.data() + value.size() || n < 0)
    user_error("command line: --max-restarts needs a number of restarts >= 0, got '", value, "'");
  return n;
}

int supervise(const SupervisedJob& job) {
  const std::string log_path = job.out_dir + "/restarts.jsonl";
  std::error_code ec;
  if (job.fresh) fs::remove(log_path, ec);
  handle_stop_signals();
  std::vector<std::string> command = job.command;
  for (int restarts = 0;; ++restarts) {
    const pid_t child = start(command);
    if (!child) return 128 + stop_signal;  // asked to stop while restarting
    const Ending end = classify(wait_for(child));
    if (end.status == 0) return 0;
    if (stop_signal) return end.status;  // the user stopped the job; its own error line said why
    if (!end.rank_failure) return end.status;
    if (restarts == job.max_restarts) {
      std::fprintf(stderr, "lockstep: error: the job %s; not restarted: --max-restarts %d %s\n", end.cause.c_str(),
                   job.max_restarts, job.max_restarts ? "reached" : "allows none");
      return end.status;
    }
    // The newest complete checkpoint, if the job has written one: train.resume=auto (later keys win)
    // takes it. Without one, the job starts again as it first did.
    const std::string latest = latest_checkpoint(job.out_dir + "/checkpoints");
    const int64_t step = latest.empty() ? 0 : std::stoll(latest.substr(latest.size() - 8));
    if (!latest.empty() && (command.empty() || command.back() != "train.resume=auto"))
      command.push_back("train.resume=auto");
    std::printf("lockstep: restart %d of %d: the job %s; %s\n", restarts + 1, job.max_restarts, end.cause.c_str(),
                latest.empty() ? "it wrote no checkpoint yet: starting it again from the beginning"
                               : str("resuming from ", latest, " (step ", step, ")").c_str());
    std::fflush(stdout);
    fs::create_directories(job.out_dir, ec);
    JsonLine record;
    record.add("restart", restarts + 1)
        .add("max_restarts", job.max_restarts)
        .add("cause", end.cause)
        .add("exit_status", end.status)
        .add("resume_step", step)
        .add("resume_from", latest)
        .add("unix_time", unix_time(), 15);
    LineLog(log_path, /*append=*/true).write(record.str());
  }
}

}  // namespace lockstep::cli
