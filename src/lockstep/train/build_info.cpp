#include "lockstep/train/build_info.h"

#include <gnu/libc-version.h>
#include <xxhash.h>

#include <toml++/toml.h>
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "build_identity.h"  // generated at every build: LOCKSTEP_GIT_COMMIT (cmake/build_identity.cmake)
#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/data/dataset.h"

namespace lockstep {

namespace {

// "<bytes> bytes, xxh3 <hex>" of a file, read in 4 MiB pieces; UserError naming it when unreadable.
std::string file_checksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) user_error("data file '", path, "' cannot be read (to record its checksum)");
  Hasher h;
  std::vector<char> buf(4 << 20);
  int64_t bytes = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    if (n > 0) h.update(buf.data(), static_cast<size_t>(n));
    bytes += n;
  }
  return str(bytes, " bytes, xxh3 ", hex64(h.digest()));
}

std::string trimmed(std::string s) {
  s.erase(0, s.find_first_not_of(' '));
  s.erase(s.find_last_not_of(' ') + 1);
  return s;
}

}  // namespace

BuildInfo current_build(const DataConfig& data) {
  BuildInfo b;
  b.fields = {
      {"commit", LOCKSTEP_GIT_COMMIT},
      {"compiler", str("g++ ", __VERSION__)},
      {"build_type", LOCKSTEP_BUILD_TYPE},
      {"cxx_flags", trimmed(LOCKSTEP_CXX_FLAGS)},
      {"glibc", gnu_get_libc_version()},
      {"xxhash", str(XXH_VERSION_MAJOR, ".", XXH_VERSION_MINOR, ".", XXH_VERSION_RELEASE)},
      {"tomlplusplus", str(TOML_LIB_MAJOR, ".", TOML_LIB_MINOR, ".", TOML_LIB_PATCH)},
      {"nlohmann_json",
       str(NLOHMANN_JSON_VERSION_MAJOR, ".", NLOHMANN_JSON_VERSION_MINOR, ".", NLOHMANN_JSON_VERSION_PATCH)},
  };
  for (const std::string& f : data_files(data)) b.fields.emplace_back("data:" + f, file_checksum(f));
  return b;
}

std::string BuildInfo::json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [k, v] : fields) j[k] = v;
  return j.dump(2) + "\n";
}

BuildInfo BuildInfo::parse(const std::string& text, const std::string& file) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) user_error("'", file, "' is not a JSON object");
  BuildInfo b;
  for (const auto& [k, v] : j.items()) {
    if (!v.is_string()) user_error("'", file, "': field '", k, "' is not a string");
    b.fields.emplace_back(k, v.get<std::string>());
  }
  return b;
}

std::string BuildInfo::difference(const BuildInfo& recorded) const {
  for (const auto& [k, v] : recorded.fields) {
    const auto it = std::find_if(fields.begin(), fields.end(), [&](const auto& f) { return f.first == k; });
    if (it == fields.end()) return str(k, " was \"", v, "\", this run has none");
    if (it->second != v) return str(k, " was \"", v, "\", is \"", it->second, "\"");
  }
  for (const auto& [k, v] : fields) {
    const auto it =
        std::find_if(recorded.fields.begin(), recorded.fields.end(), [&](const auto& f) { return f.first == k; });
    if (it == recorded.fields.end()) return str(k, " is \"", v, "\", the run recorded none");
  }
  return "";
}

}  // namespace lockstep
