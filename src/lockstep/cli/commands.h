// The subcommands of `lockstep`, one file each (cli/<name>_command.cpp), listed once in main.cpp.
// A command takes its arguments (after the command name) and returns the exit status; it reports
// bad input by throwing UserError, which main turns into one line and exit status 2.
#pragma once

#include <string>
#include <vector>

namespace lockstep::cli {

int train_command(const std::vector<std::string>& args);
int preprocess_command(const std::vector<std::string>& args);
int diff_command(const std::vector<std::string>& args);
int ckpt_command(const std::vector<std::string>& args);
int replay_command(const std::vector<std::string>& args);
int report_command(const std::vector<std::string>& args);
int launch_command(const std::vector<std::string>& args);

}  // namespace lockstep::cli
