#include "lockstep/train/run_diff.h"

#include <toml++/toml.h>
#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/train/fingerprint.h"

namespace lockstep {

namespace {

namespace fs = std::filesystem;

// Older fingerprint files lack etp: absent coordinates are left out of the report.
const char* const kCoordinates[] = {"rank", "dp", "tp", "pp", "ep", "cp", "etp"};

bool is_coordinate(const std::string& key) {
  for (const char* k : kCoordinates)
    if (key == k) return true;
  return false;
}

// Fields every rank records alike whatever the layout: the step's fp64 scalars and the RNG state
// (the seed and the global position in the data stream).
bool is_global(const std::string& key) { return is_fingerprint_scalar(key) || key == "rng"; }

// Why a rank's "params" hash may not cover every parameter in the run of `dir`, to follow the
// directory's name: the sizes in its config.toml that split them (tensor, pipeline, expert or
// expert-tensor parallelism; data and context parallel ranks hold whole replicas), or that no
// config.toml says; "" when nothing splits them.
std::string parameter_split(const std::string& dir) {
  const std::string path = dir + "/config.toml";
  std::error_code ec;
  if (!fs::exists(path, ec)) return "has no config.toml to tell its layout";
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error&) {
    return "has a config.toml that does not parse";
  }
  std::string split;
  for (const char* key : {"tensor", "pipeline", "expert", "expert_tensor"}) {
    const int64_t size = t["parallel"][key].value_or(int64_t{1});
    if (size != 1) split += str(split.empty() ? "" : ", ", "parallel.", key, " = ", size);
  }
  return split.empty() ? split : "splits the parameters: " + split;
}

// One run's fingerprints: per rank, its lines by step (a step written twice, e.g. by a resumed
// run, counts with its last line).
struct Run {
  std::string dir;
  std::string parameter_split;                                     // parameter_split(dir)
  std::vector<std::vector<FingerprintLine>> lines;                 // [rank]
  std::vector<std::map<int64_t, const FingerprintLine*>> by_step;  // [rank]

  int ranks() const { return static_cast<int>(lines.size()); }
  std::string steps_text() const {
    std::set<int64_t> steps;
    for (const auto& m : by_step)
      for (const auto& [s, line] : m) steps.insert(s);
    if (steps.empty()) return "no steps";
    return str(steps.size(), steps.size() == 1 ? " step" : " steps", " (", *steps.begin(), "..", *steps.rbegin(), ")");
  }
};

Run read_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    user_error("'", dir, "': ",
               fs::exists(dir, ec) ? "not a directory (lockstep diff takes run directories)" : "no such run directory");
  const fs::path fp_dir = fs::path(dir) / "fingerprints";
  if (!fs::is_directory(fp_dir, ec))
    user_error("'", dir, "' has no fingerprints/ directory (not a lockstep run directory?)");
  std::map<int, std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(fp_dir, ec)) {
    const std::string name = e.path().filename().string();
    int rank = -1;
    if (name.size() != 16 || name.rfind("rank-", 0) != 0 || name.substr(10) != ".jsonl") continue;
    const auto [p, err] = std::from_chars(name.data() + 5, name.data() + 10, rank);
    if (err != std::errc() || p != name.data() + 10) continue;
    files[rank] = e.path().string();
  }
  if (files.empty()) user_error("'", fp_dir.string(), "' has no rank-NNNNN.jsonl fingerprint files");
  Run run;
  run.dir = dir;
  run.parameter_split = parameter_split(dir);
  for (const auto& [rank, path] : files) {
    if (rank != run.ranks())
      user_error("'", fp_dir.string(), "' has no fingerprint file for rank ", run.ranks(), " (",
                 fs::path(fingerprint_path(dir, run.ranks())).filename().string(), ") but has one for rank ", rank);
    run.lines.push_back(read_fingerprint_lines(path));
  }
  for (const auto& lines : run.lines) {
    run.by_step.emplace_back();
    for (const FingerprintLine& l : lines) run.by_step.back()[l.step] = &l;
  }
  return run;
}

// "rank 1 (dp 0, tp 1, pp 0, ep 0, cp 0, etp 0)" from the line's own coordinate fields.
std::string where(const FingerprintLine& line, int rank) {
  std::string s = str("rank ", rank);
  std::string coords;
  for (const char* k : kCoordinates) {
    if (std::string(k) == "rank") continue;
    if (const std::string* v = line.find(k)) coords += str(coords.empty() ? "" : ", ", k, " ", *v);
  }
  return coords.empty() ? s : s + " (" + coords + ")";
}

// A field's value for the report: fp64 bits also as the number they hold.
std::string shown(const std::string& key, const std::string* value) {
  if (!value) return "(absent)";
  uint64_t bits = 0;
  if (is_fingerprint_scalar(key) && value->size() == 16) {
    const auto [p, ec] = std::from_chars(value->data(), value->data() + 16, bits, 16);
    if (ec == std::errc() && p == value->data() + 16) {
      char num[40];
      std::snprintf(num, sizeof num, "%.17g", std::bit_cast<double>(bits));
      return *value + " (" + num + ")";
    }
  }
  return *value;
}

// The fields of a and b (a's order, then b's extra ones), coordinates aside, for which compared(key).
template <typename Compared>
std::vector<std::string> fields_of(const FingerprintLine& a, const FingerprintLine& b, Compared compared) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : a.fields) keys.push_back(k);
  for (const auto& [k, v] : b.fields)
    if (!a.find(k)) keys.push_back(k);
  std::vector<std::string> out;
  for (const std::string& k : keys)
    if (!is_coordinate(k) && k != "format" && compared(k)) out.push_back(k);
  return out;
}

// A line's fingerprint format (train/fingerprint.h): 1 where the file predates the field.
int format_of(const FingerprintLine& line) {
  const std::string* f = line.find("format");
  return f ? std::atoi(f->c_str()) : 1;
}

// Those of the compared fields that differ; the state hashes only where both lines have the same
// format.
template <typename Compared>
std::vector<std::string> differing_fields(const FingerprintLine& a, const FingerprintLine& b, Compared compared) {
  std::vector<std::string> diff;
  const bool same_format = format_of(a) == format_of(b);
  for (const std::string& k : fields_of(a, b, compared)) {
    if (!same_format && is_state_hash_field(k)) continue;
    const std::string *va = a.find(k), *vb = b.find(k);
    if (!va || !vb || *va != *vb) diff.push_back(k);
  }
  return diff;
}

bool same_layout(const Run& a, const Run& b) {
  if (a.ranks() != b.ranks()) return false;
  for (int r = 0; r < a.ranks(); ++r) {
    if (a.lines[r].empty() || b.lines[r].empty()) continue;
    // The coordinates both files record (an older file has no etp).
    for (const char* k : kCoordinates) {
      const std::string *va = a.lines[r].front().find(k), *vb = b.lines[r].front().find(k);
      if (va && vb && *va != *vb) return false;
    }
  }
  return true;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// A trace record's place in the order of the data: by step, then micro-batch (a step's
// micro-batches do not read each other's values: the parameters change between steps), then, under
// pipeline parallelism, the forward actions model chunk by model chunk and the backward actions in
// reverse, and within an action (or a run without a pipeline) the order the rank executed it in.
struct TracePlace {
  int64_t step = 0, micro = 0, pass = 0, chunk = 0;  // pass 0: forward; chunk: negated for the backward
  size_t index = 0;                                  // in the rank's file
  auto operator<=>(const TracePlace&) const = default;
};

int64_t integer_field(const FingerprintLine& l, const char* key, int64_t absent) {
  const std::string* v = l.find(key);
  if (!v) return absent;
  int64_t x = absent;
  std::from_chars(v->data(), v->data() + v->size(), x);
  return x;
}

TracePlace place_of(const FingerprintLine& l, size_t index) {
  const std::string* pass = l.find("pass");
  const int64_t backward = pass && *pass == "backward" ? 1 : 0, chunk = integer_field(l, "chunk", 0);
  return {l.step, integer_field(l, "micro", 0), backward, backward ? -chunk : chunk, index};
}

struct TraceDiff {
  bool differs = false;
  std::string text;
};

// The module traces of every rank: the first record in the order of the data (up to and
// including step last_step; all steps when last_step < 0) that differs, with the record before it,
// which matches; no text when they agree.
TraceDiff trace_report(const Run& a, const Run& b, int ranks, int64_t last_step) {
  auto upto = [&](const std::string& path) {
    std::vector<FingerprintLine> lines = read_fingerprint_lines(path);
    if (last_step >= 0)
      lines.erase(
          std::remove_if(lines.begin(), lines.end(), [&](const FingerprintLine& l) { return l.step > last_step; }),
          lines.end());
    return lines;
  };
  auto field = [](const FingerprintLine& l, const char* key) {
    const std::string* v = l.find(key);
    return v ? *v : std::string("?");
  };
  auto name = [&](const FingerprintLine& l) {
    return str(field(l, "module"), " ", field(l, "kind"), " (step ", l.step, ", micro-batch ", field(l, "micro"),
               l.find("chunk") ? str(", ", field(l, "pass"), " of model chunk ", field(l, "chunk")) : std::string(),
               ")");
  };
  std::vector<std::vector<FingerprintLine>> ta(static_cast<size_t>(ranks)), tb(static_cast<size_t>(ranks));
  std::optional<std::pair<TracePlace, int>> first;  // the first differing record and its rank
  std::optional<int> longer;                        // a rank whose traces agree but one is longer
  for (int r = 0; r < ranks; ++r) {
    const std::string pa = trace_path(a.dir, r), pb = trace_path(b.dir, r);
    std::error_code ec;
    const bool has_a = fs::exists(pa, ec), has_b = fs::exists(pb, ec);
    if (!has_a && !has_b) continue;
    if (!has_a || !has_b)
      return {false, str("module trace: only ", has_a ? a.dir : b.dir, " has one (", has_a ? pa : pb,
                         "); trace both runs with debug.trace = \"modules\" to find the module\n")};
    const std::vector<FingerprintLine>& x = ta[static_cast<size_t>(r)] = upto(pa);
    const std::vector<FingerprintLine>& y = tb[static_cast<size_t>(r)] = upto(pb);
    const size_t n = std::min(x.size(), y.size());
    for (size_t i = 0; i < n; ++i) {
      if (name(x[i]) != name(y[i]))
        return {true,
                str("module trace, rank ", r, ": the traces differ in structure at record ", i + 1, ": ", name(x[i]),
                    " in ", a.dir, ", ", name(y[i]), " in ", b.dir, " (different models or configs)\n")};
      const std::string *hx = x[i].find("hash"), *hy = y[i].find("hash");
      if (hx && hy && *hx == *hy) continue;
      const std::pair<TracePlace, int> here{place_of(x[i], i), r};
      if (!first || here < *first) first = here;
    }
    if (x.size() != y.size() && last_step < 0 && !longer) longer = r;
  }
  if (!first) {
    if (!longer) return {};
    const auto& x = ta[static_cast<size_t>(*longer)];
    const auto& y = tb[static_cast<size_t>(*longer)];
    return {true, str("module trace, rank ", *longer, ": the traces agree over their first ",
                      std::min(x.size(), y.size()), " records; ", x.size() > y.size() ? a.dir : b.dir, " has more\n")};
  }
  const auto [at, rank] = *first;
  const FingerprintLine& x = ta[static_cast<size_t>(rank)][at.index];
  const FingerprintLine& y = tb[static_cast<size_t>(rank)][at.index];
  const std::string *hx = x.find("hash"), *hy = y.find("hash");
  std::string s =
      str("module trace, rank ", rank, ": first difference at step ", x.step, ", micro-batch ", field(x, "micro"), ": ",
          field(x, "module"), " (", field(x, "kind"), ")",
          x.find("chunk") ? str(", in the ", field(x, "pass"), " of model chunk ", field(x, "chunk")) : std::string(),
          "\n");
  // The record just before it in the order of the data, within the step. Forward records follow
  // the data (the record before an output is the module's input; under a pipeline, for a chunk's
  // first module, the previous chunk's last output on its stage); in backward, the record before a
  // grad_in is the gradient the module received. An action's records are contiguous in its rank's
  // file: the one before, if it is the same action's; else the last record of the latest earlier
  // action of the step, on this rank where it ran there (replicas: tp, dp, ...), else on the lowest.
  std::vector<std::vector<TracePlace>> actions(static_cast<size_t>(ranks));  // each record's, index 0
  for (int r = 0; r < ranks; ++r)
    for (const FingerprintLine& l : ta[static_cast<size_t>(r)])
      actions[static_cast<size_t>(r)].push_back(place_of(l, 0));
  const TracePlace here = place_of(x, 0);
  std::optional<std::pair<size_t, int>> before;  // (index, rank)
  if (at.index > 0 && actions[static_cast<size_t>(rank)][at.index - 1] == here) before = {at.index - 1, rank};
  std::optional<TracePlace> latest;
  for (int r = 0; r < ranks && !before; ++r)
    for (const TracePlace& p : actions[static_cast<size_t>(r)])
      if (p.step == at.step && p < here && (!latest || *latest < p)) latest = p;
  auto last_of = [&](int r) -> std::optional<std::pair<size_t, int>> {
    const std::vector<TracePlace>& ps = actions[static_cast<size_t>(r)];
    for (size_t i = ps.size(); i-- > 0;)
      if (ps[i] == *latest) return std::pair{i, r};
    return std::nullopt;
  };
  if (latest) before = last_of(rank);
  for (int r = 0; latest && !before && r < ranks; ++r) before = last_of(r);
  if (before) {
    const FingerprintLine& prev = ta[static_cast<size_t>(before->second)][before->first];
    s += str("  every record before it matches; the last one is ", name(prev),
             before->second == rank ? std::string() : str(" on rank ", before->second), "\n");
  } else {
    s += str("  it is the step's first record: its input is the step's data\n");
  }
  s += str("  ", a.dir, ": ", hx ? *hx : "(no hash)", "\n  ", b.dir, ": ", hy ? *hy : "(no hash)", "\n");
  return {true, s};
}

}  // namespace

RunDiff diff_runs(const std::string& dir_a, const std::string& dir_b) {
  const Run a = read_run(dir_a), b = read_run(dir_b);
  const bool per_rank = same_layout(a, b);
  // Different layouts share the global quantities, which every rank records alike: rank 0's.
  const int ranks = per_rank ? a.ranks() : 1;
  std::set<int64_t> steps;
  for (int r = 0; r < ranks; ++r)
    for (const auto& [s, line] : a.by_step[r])
      if (b.by_step[r].count(s)) steps.insert(s);
  if (steps.empty())
    user_error("'", a.dir, "' (", a.steps_text(), ") and '", b.dir, "' (", b.steps_text(), ") share no step");

  RunDiff out;
  auto say = [&](const std::string& line) { out.report += line + "\n"; };
  say(str("lockstep diff: ", a.dir, " (", a.ranks(), a.ranks() == 1 ? " rank, " : " ranks, ", a.steps_text(), ") vs ",
          b.dir, " (", b.ranks(), b.ranks() == 1 ? " rank, " : " ranks, ", b.steps_text(), ")"));
  // Across layouts: the global fields, and the parameters' hash where every rank of both runs holds
  // every parameter (data and context parallel replicas).
  const bool whole_params = a.parameter_split.empty() && b.parameter_split.empty();
  auto compared = [&](const std::string& key) {
    return per_rank || is_global(key) || (whole_params && key == "params");
  };
  if (!per_rank) {
    const FingerprintLine &fa = *a.by_step[0].at(*steps.begin()), &fb = *b.by_step[0].at(*steps.begin());
    // The state hashes of lines of other formats are not compared (the note below says so).
    const bool same_format = format_of(fa) == format_of(fb);
    const auto listed = [&](const std::string& k) { return compared(k) && (same_format || !is_state_hash_field(k)); };
    say(str("different layouts (", a.ranks(), " vs ", b.ranks(), " ranks",
            a.ranks() == b.ranks() ? ", other coordinates" : "",
            "): comparing what every rank records alike, on rank 0 of each run: ", join(fields_of(fa, fb, listed))));
    const std::vector<std::string> skipped = fields_of(fa, fb, [&](const std::string& k) { return !compared(k); });
    std::string why =
        "each rank hashes its own shard of the gradients and optimizer state, which depends on the layout";
    for (const Run* run : {&a, &b})
      if (!run->parameter_split.empty()) why += str("; ", run->dir, " ", run->parameter_split);
    if (!skipped.empty()) say(str("  not compared: ", join(skipped), " (", why, ")"));
  }
  const bool same_steps = a.steps_text() == b.steps_text();
  // Files of different formats (e.g. a run of an older binary) share the scalars, not the hashes.
  std::set<std::pair<int, int>> formats;
  for (const int64_t step : steps)
    for (int r = 0; r < ranks; ++r) {
      const auto ia = a.by_step[r].find(step), ib = b.by_step[r].find(step);
      if (ia == a.by_step[r].end() || ib == b.by_step[r].end()) continue;
      const int fa = format_of(*ia->second), fb = format_of(*ib->second);
      if (fa != fb) formats.insert({fa, fb});
    }
  for (const auto& [fa, fb] : formats)
    say(str("  not compared where ", a.dir, " has fingerprint format ", fa, " and ", b.dir, " format ", fb,
            ": params, grads, optimizer (the formats cut the state into hash blocks differently)"));

  for (const int64_t step : steps) {
    std::vector<int> ranks_differing;
    int first_rank = -1;
    std::vector<std::string> first_fields;
    for (int r = 0; r < ranks; ++r) {
      const auto ia = a.by_step[r].find(step), ib = b.by_step[r].find(step);
      if (ia == a.by_step[r].end() || ib == b.by_step[r].end()) continue;
      const std::vector<std::string> diff = differing_fields(*ia->second, *ib->second, compared);
      if (diff.empty()) continue;
      ranks_differing.push_back(r);
      if (first_rank < 0) first_rank = r, first_fields = diff;
    }
    if (first_rank < 0) continue;
    const FingerprintLine& la = *a.by_step[first_rank].at(step);
    const FingerprintLine& lb = *b.by_step[first_rank].at(step);
    const std::string& key = first_fields.front();
    out.first_step = step;
    if (per_rank)
      say(str("first difference: step ", step, ", ", where(la, first_rank), ", ", key));
    else
      say(str("first difference: step ", step, ", ", key, " (rank 0 of each run)"));
    say(str("  ", a.dir, ": ", shown(key, la.find(key))));
    say(str("  ", b.dir, ": ", shown(key, lb.find(key))));
    if (first_fields.size() > 1)
      say(str("  also differing at step ", step, per_rank ? str(" on rank ", first_rank) : std::string(), ": ",
              join(std::vector<std::string>(first_fields.begin() + 1, first_fields.end()))));
    if (ranks_differing.size() > 1) {
      std::vector<std::string> rs;
      for (int r : ranks_differing) rs.push_back(where(*a.by_step[r].at(step), r));
      say(str("  ranks differing at step ", step, ": ", join(rs)));
    }
    if (per_rank) {
      const TraceDiff trace = trace_report(a, b, ranks, step);
      if (!trace.text.empty())
        out.report += trace.text;
      else if (fs::exists(trace_path(a.dir, first_rank)))
        say(str("module traces: every rank's module outputs and input gradients up to step ", step,
                " match: the difference arises after the backward pass (gradient reduction, clipping or "
                "the optimizer)"));
    }
    return out;
  }

  // Equal fingerprints with different traces: a change that the rounding of later operations
  // absorbed (or that reaches the fingerprints only after the common steps).
  std::string traces;
  out.identical = true;
  if (per_rank) {
    const TraceDiff trace = trace_report(a, b, ranks, same_steps ? -1 : *steps.rbegin());
    if (trace.differs) {  // a run without a trace is worth a note only where runs differ
      traces = trace.text;
      out.identical = false;
    }
  }
  say(str(out.identical ? "identical over " : "fingerprints identical over ", same_steps ? "" : "the ", steps.size(),
          same_steps ? "" : " common", steps.size() == 1 ? " step" : " steps", " (", *steps.begin(), "..",
          *steps.rbegin(), ")", same_steps ? "" : "; the runs have different lengths",
          formats.empty() ? "" : ", the state hashes aside (other fingerprint formats)",
          out.identical ? "" : ", but the module traces differ:"));
  out.report += traces;
  return out;
}

}  // namespace lockstep
