#include "lockstep/train/fingerprint.h"

#include <bit>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/train/json_line.h"

namespace lockstep {

std::string Fingerprint::json() const {
  auto bits = [](double v) { return hex64(std::bit_cast<uint64_t>(v)); };
  return JsonLine()
      .add("step", step)
      .add("rank", rank)
      .add("dp", dp)
      .add("tp", tp)
      .add("pp", pp)
      .add("ep", ep)
      .add("cp", cp)
      .add("etp", etp)
      .add("loss", bits(loss))
      .add("lm_loss", bits(lm_loss))
      .add("aux_loss", bits(aux_loss))
      .add("mtp_loss", bits(mtp_loss))
      .add("grad_norm", bits(grad_norm))
      .add("lr", bits(lr))
      .add("params", hex64(params))
      .add("grads", hex64(grads))
      .add("optimizer", hex64(optimizer))
      .add("rng", hex64(rng))
      .add("format", kFingerprintFormat)
      .str();
}

namespace {
std::string rank_file(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.jsonl", rank);
  return name;
}
}  // namespace

std::string fingerprint_path(const std::string& run_dir, int rank) {
  return run_dir + "/fingerprints/" + rank_file(rank);
}
std::string trace_path(const std::string& run_dir, int rank) { return run_dir + "/trace/" + rank_file(rank); }

std::string trace_lines(const std::vector<ModuleTrace::Record>& records) {
  std::string s;
  for (const ModuleTrace::Record& r : records) {
    JsonLine line;
    line.add("step", r.step).add("micro", r.micro);
    if (r.chunk >= 0) line.add("chunk", r.chunk).add("pass", r.backward ? "backward" : "forward");
    line.add("module", r.module).add("kind", r.grad_in ? "grad_in" : "out").add("hash", hex64(r.hash));
    line.add("norm", r.norm, 9).add("max_abs", static_cast<double>(r.max_abs), 9);
    if (r.nonfinite) line.add("nonfinite", true);
    s += line.str();
  }
  return s;
}

bool is_fingerprint_scalar(const std::string& key) {
  for (const char* k : {"loss", "lm_loss", "aux_loss", "mtp_loss", "grad_norm", "lr"})
    if (key == k) return true;
  return false;
}

bool is_state_hash_field(const std::string& key) { return key == "params" || key == "grads" || key == "optimizer"; }

const std::string* FingerprintLine::find(const std::string& key) const {
  for (const auto& [k, v] : fields)
    if (k == key) return &v;
  return nullptr;
}

namespace {
// The fields Fingerprint::json and trace_lines write as hex64 (fp64 bits or hashes).
bool is_hex64_field(const std::string& key) {
  if (is_fingerprint_scalar(key)) return true;
  for (const char* k : {"params", "grads", "optimizer", "rng", "hash"})
    if (key == k) return true;
  return false;
}
// The fields written as integers: the coordinates, a trace's micro-batch, the format.
bool is_integer_field(const std::string& key) {
  for (const char* k : {"rank", "dp", "tp", "pp", "ep", "cp", "etp", "micro", "format"})
    if (key == k) return true;
  return false;
}
bool is_hex64(const nlohmann::ordered_json& value) {
  if (!value.is_string()) return false;
  const std::string& s = value.get_ref<const std::string&>();
  return s.size() == 16 && s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
}
}  // namespace

std::vector<FingerprintLine> read_fingerprint_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) user_error("cannot read '", path, "'");
  std::vector<FingerprintLine> lines;
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.empty()) continue;
    auto bad = [&](const std::string& why) { user_error(path, ":", number, ": ", why); };
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) bad("not a JSON object");
    const auto step = j.find("step");
    if (step == j.end() || !step->is_number_integer()) bad("no integer \"step\"");
    FingerprintLine line;
    line.step = step->get<int64_t>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step") continue;
      // A field the writer gives a type must have it: a corrupt value is the file's fault, not a
      // difference between two runs.
      if (is_hex64_field(key) && !is_hex64(value))
        bad(str("\"", key, "\" = ", value.dump(), " is not 16 hex digits (the file is corrupt)"));
      if (is_integer_field(key) && !value.is_number_integer())
        bad(str("\"", key, "\" = ", value.dump(), " is not an integer (the file is corrupt)"));
      line.fields.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace lockstep
