// What a run records about the program and data that produced it (RUN/build.json), so that
// `lockstep replay` can refuse, by name, to replay a run with a different build or dataset: a
// replay that differs then says nothing about the run.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "lockstep/config/config.h"

namespace lockstep {

struct BuildInfo {
  // (field, value) in a fixed order: "commit" (git HEAD, "+dirty.<hash of the diff>" when the tree
  // had uncommitted changes), "compiler", "build_type", "cxx_flags", "glibc", "xxhash", "tomlplusplus",
  // "nlohmann_json", and one "data:<file>" per data file, valued "<bytes> bytes, xxh3 <hex>".
  std::vector<std::pair<std::string, std::string>> fields;

  std::string json() const;  // one JSON object, pretty-printed
  // UserError naming `file` when it is not such an object of strings.
  static BuildInfo parse(const std::string& text, const std::string& file);
  // "" when equal; else the first field that differs, with both values, as one phrase.
  std::string difference(const BuildInfo& recorded) const;
};

// This binary's build and the data files config.data reads (their checksums: a pass over each
// file). The synthetic source has no file: the binary generates it.
BuildInfo current_build(const DataConfig& data);

}  // namespace lockstep
