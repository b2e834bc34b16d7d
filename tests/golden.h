// Golden fingerprints: the per-step fingerprints of a fixed set of jobs, committed under
// tests/golden/, that every later build must reproduce bit for bit. They pin the numerics of whole
// training runs across refactors (the determinism matrix checks a build against itself; this checks
// it against the build that wrote the files).
//
// Compared per line: step, the rank coordinates, and the exact bits of loss, lm_loss, aux_loss,
// mtp_loss, grad_norm and lr; the state hashes (params, grads, optimizer, rng) too while
// kGoldenStateHashes holds. They depend on the parameter table's order and the fingerprint format
// (train/fingerprint.h), so a change to either that keeps every trajectory turns them off here and
// says why in its commit.
//
// LOCKSTEP_UPDATE_GOLDEN=1 rewrites the files instead of comparing (only for a change that is meant
// to move the bits: its commit says which and why).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/train/fingerprint.h"
#include "testing.h"

namespace lockstep::testing {

inline constexpr bool kGoldenStateHashes = true;

inline std::string golden_path(const std::string& group, const std::string& name) {
  return std::string(LOCKSTEP_SOURCE_DIR) + "/tests/golden/" + group + "/" + name + ".jsonl";
}

// Every rank's fingerprint lines of run_dir, rank 0 first.
inline std::string read_fingerprints(const std::string& run_dir, int ranks) {
  std::string all;
  for (int r = 0; r < ranks; ++r) all += read_file(fingerprint_path(run_dir, r));
  return all;
}

// Compares `got` (fingerprint lines) with the golden file of (group, name), or rewrites the file
// under LOCKSTEP_UPDATE_GOLDEN=1. Fails naming the first line and field that differ.
inline ::testing::AssertionResult matches_golden(const std::string& group, const std::string& name,
                                                 const std::string& got) {
  const std::string path = golden_path(group, name);
  const char* update = std::getenv("LOCKSTEP_UPDATE_GOLDEN");
  if (update && std::string(update) == "1") {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path, std::ios::binary) << got;
    return ::testing::AssertionSuccess();
  }
  if (!std::filesystem::exists(path)) return ::testing::AssertionFailure() << path << ": no golden file";
  auto lines = [](const std::string& text) {
    std::vector<nlohmann::json> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  const std::vector<nlohmann::json> want = lines(read_file(path)), have = lines(got);
  if (want.size() != have.size())
    return ::testing::AssertionFailure() << path << ": " << have.size() << " lines, golden " << want.size();
  const char* const always[] = {"step", "rank",    "dp",       "tp",       "pp",        "ep", "cp",    "etp",
                                "loss", "lm_loss", "aux_loss", "mtp_loss", "grad_norm", "lr", "format"};
  const char* const state[] = {"params", "grads", "optimizer", "rng"};
  std::vector<std::string> fields(std::begin(always), std::end(always));
  if (kGoldenStateHashes) fields.insert(fields.end(), std::begin(state), std::end(state));
  for (size_t i = 0; i < want.size(); ++i) {
    for (const std::string& f : fields) {
      const std::string w = want[i].contains(f) ? want[i][f].dump() : "(missing)";
      const std::string h = have[i].contains(f) ? have[i][f].dump() : "(missing)";
      if (w != h)
        return ::testing::AssertionFailure()
               << path << " line " << i + 1 << ": " << f << " is " << h << ", golden " << w;
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace lockstep::testing
