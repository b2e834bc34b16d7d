// lockstep: the command line. Each subcommand lives in cli/<name>_command.cpp and is listed once
// in kCommands below.
//
// A user error is one line on stderr, "lockstep: error: ...", and exit status 2; a broken
// internal invariant is "lockstep: internal error: ..." and exit status 3; a training run stopped
// by its non-finite guard is one error line and exit status 4; a failed rank (a collective timed
// out, a peer failed or exited: CommError) exit status 75 (kExitRankFailure).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "lockstep/cli/commands.h"
#include "lockstep/comm/communicator.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"

namespace {

struct Command {
  const char* name;
  int (*run)(const std::vector<std::string>& args);
  const char* usage;
};

int help_command(const std::vector<std::string>& args);

const Command kCommands[] = {
    {"train", lockstep::cli::train_command,
     "lockstep train [-c FILE.toml] [--nproc N] [--max-restarts N] [key=value ...]\n"
     "      train a GPT; with no arguments, the built-in default model on the built-in corpus.\n"
     "      Keys override the file: lockstep train -c configs/debug.toml train.steps=20\n"
     "      --nproc N: N ranks as threads; under mpirun (mpirun -n N lockstep train ...) each process is a rank\n"
     "      --max-restarts N: when a rank fails, restart the job from its newest checkpoint, up to N times"},
    {"preprocess", lockstep::cli::preprocess_command,
     "lockstep preprocess --input FILE [--input FILE ...] --output PREFIX [--tokenizer SPEC] [--json-key KEY]\n"
     "                    [--append-eod] [--workers N]\n"
     "      tokenize a corpus (JSONL, or text with one document per paragraph) into PREFIX.bin/.idx\n"
     "      (Megatron's indexed dataset); SPEC: byte | gpt2:VOCAB_JSON,MERGES_TXT | hf:TOKENIZER_JSON"},
    {"diff", lockstep::cli::diff_command,
     "lockstep diff RUN_A RUN_B\n"
     "      compare two run directories' fingerprints: the first differing step, rank and field with both\n"
     "      values (exit 1), or \"identical over N steps\" (exit 0); with module traces (debug.trace), the module"},
    {"ckpt", lockstep::cli::ckpt_command,
     "lockstep ckpt inspect DIR | verify DIR | export DIR OUT.safetensors | export DIR OUT --format hf\n"
     "      [--tokenizer TOKENIZER_JSON_OR_DIR]\n"
     "      a checkpoint (RUN/checkpoints/step-NNNNNNNN; a directory of them or RUN: the newest): its tensors,\n"
     "      shapes, layout and sizes; a full check of checksums and completeness (exit 1 when bad); the\n"
     "      full model weights as safetensors (train.init_from reads them back); a Hugging Face model\n"
     "      directory (config.json, model.safetensors, the tokenizer's files: --tokenizer's, or those of\n"
     "      the train.init_from = \"hf:DIR\" the run started from)"},
    {"replay", lockstep::cli::replay_command,
     "lockstep replay RUN --step N [--out DIR] [key=value ...]\n"
     "      re-run RUN's step N from its newest checkpoint before N with module tracing and per-module\n"
     "      statistics, and check the replay reproduces RUN's fingerprints bit for bit (exit 1 when not);\n"
     "      with key=value overrides, the change-one-thing experiment (compare two with lockstep diff)"},
    {"report", lockstep::cli::report_command,
     "lockstep report RUN [RUN ...] [-o FILE]\n"
     "      one HTML page (no network) of the runs' loss, eval loss, grad norm, learning rate, tokens/s, MFU and\n"
     "      MoE expert load over the steps; for two runs, their first divergent step (as lockstep diff) marked.\n"
     "      FILE defaults to the first RUN's report.html"},
    {"launch", lockstep::cli::launch_command,
     "lockstep launch --max-restarts N -- mpirun ... lockstep train ...\n"
     "      run the command; when a rank fails (mpirun then ends the job), run it again from the newest\n"
     "      checkpoint (train.resume=auto appended), up to N times"},
    {"help", help_command,
     "lockstep help [config]\n"
     "      this text; `lockstep help config` lists every config key with its default"},
};

int help_command(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "config") {
    std::fputs(lockstep::config_help().c_str(), stdout);
    return 0;
  }
  std::fputs("usage:\n", stdout);
  for (const Command& c : kCommands) std::printf("  %s\n", c.usage);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    // No arguments: train the built-in default job.
    const std::string name = args.empty() ? "train" : args[0];
    const std::vector<std::string> rest = args.empty() ? args : std::vector<std::string>(args.begin() + 1, args.end());
    if (name == "--help" || name == "-h") return help_command({});
    for (const Command& c : kCommands)
      if (name == c.name) return c.run(rest);
    lockstep::user_error("unknown command '", name, "' (see `lockstep help`)");
  } catch (const lockstep::UserError& e) {
    std::fprintf(stderr, "lockstep: error: %s\n", e.what());
    return 2;
  } catch (const lockstep::NonFiniteError& e) {
    if (e.report()) std::fprintf(stderr, "lockstep: error: %s\n", e.what());
    return 4;
  } catch (const lockstep::InternalError& e) {
    std::fprintf(stderr, "lockstep: internal error: %s\n", e.what());
    return 3;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "lockstep: error: out of memory\n");
    return 2;
  } catch (const std::exception& e) {
    // A distributed failure (CommError: timeout, failed or exited peer; the status that restarts
    // the job under --max-restarts), or another error of a rank. A rank thread may still be running
    // (it never reached a collective): end the process without waiting for it.
    std::fprintf(stderr, "lockstep: error: %s\n", e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(dynamic_cast<const lockstep::CommError*>(&e) ? lockstep::kExitRankFailure : 1);
  }
}
