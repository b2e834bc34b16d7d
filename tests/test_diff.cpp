// `lockstep diff`: the first differing step, rank, coordinates and field with both values; runs of
// different lengths and layouts; errors naming the directory, file and line. Fingerprint files are
// written by hand (Fingerprint::json) so that each case says exactly what differs; one case diffs
// real runs through the binary.
#include <gtest/gtest.h>

#include <bit>
#include <filesystem>

#include "lockstep/config/config.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/run_diff.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;
using testing::user_error_of;

Fingerprint line(int64_t step, int rank = 0) {
  Fingerprint f;
  f.step = step;
  f.rank = rank;
  f.tp = rank;  // a layout where ranks differ in tp
  f.loss = 5.5 - 0.1 * static_cast<double>(step);
  f.lm_loss = f.loss;
  f.grad_norm = 1.25;
  f.lr = 1e-3;
  f.params = 0x1000 + static_cast<uint64_t>(step) + 100 * static_cast<uint64_t>(rank);
  f.grads = 0x2000 + static_cast<uint64_t>(step);
  f.optimizer = 0x3000 + static_cast<uint64_t>(step);
  f.rng = 0x4000 + static_cast<uint64_t>(step);
  return f;
}

// A run directory with `ranks` fingerprint files over steps 1..steps; edit(fp) may change lines.
template <typename Edit>
std::string write_run(const TempDir& dir, const std::string& name, int ranks, int steps, Edit edit) {
  std::filesystem::create_directories(dir.path(name + "/fingerprints"));
  for (int r = 0; r < ranks; ++r) {
    std::string text;
    for (int s = 1; s <= steps; ++s) {
      Fingerprint f = line(s, r);
      edit(f);
      text += f.json();  // one line, with its newline
    }
    dir.write(name + "/fingerprints/rank-0000" + std::to_string(r) + ".jsonl", text);
  }
  return dir.path(name);
}
std::string write_run(const TempDir& dir, const std::string& name, int ranks, int steps) {
  return write_run(dir, name, ranks, steps, [](Fingerprint&) {});
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A copy of a two-rank run as an older writer would have written it: every `field` text (which
// each file must hold) removed, then edit(text) on each file.
template <typename Edit>
std::string older_copy(const TempDir& dir, const std::string& run, const std::string& name, const std::string& field,
                       Edit edit) {
  std::filesystem::create_directories(dir.path(name + "/fingerprints"));
  for (const char* file : {"/fingerprints/rank-00000.jsonl", "/fingerprints/rank-00001.jsonl"}) {
    std::string text = testing::read_file(run + file);
    EXPECT_NE(text.find(field), std::string::npos) << field;
    for (size_t at; (at = text.find(field)) != std::string::npos;) text.erase(at, field.size());
    edit(text);
    dir.write(name + file, text);
  }
  return dir.path(name);
}

TEST(Diff, IdenticalRunsSayOverHowManySteps) {
  TempDir dir;
  const RunDiff d = diff_runs(write_run(dir, "a", 2, 5), write_run(dir, "b", 2, 5));
  EXPECT_TRUE(d.identical);
  EXPECT_TRUE(contains(d.report, "identical over 5 steps (1..5)")) << d.report;
  EXPECT_EQ(d.first_step, -1);
}

TEST(Diff, NamesFirstStepRankCoordinatesAndFieldWithBothValues) {
  TempDir dir;
  const std::string a = write_run(dir, "a", 2, 6);
  // Rank 1 drifts by one ulp of the grad norm at step 4, then its parameters from step 4 on.
  const std::string b = write_run(dir, "b", 2, 6, [](Fingerprint& f) {
    if (f.rank == 1 && f.step >= 4) f.params ^= 1;
    if (f.rank == 1 && f.step == 4) f.grad_norm = std::nextafter(f.grad_norm, 2.0);
  });
  const RunDiff d = diff_runs(a, b);
  EXPECT_FALSE(d.identical);
  EXPECT_TRUE(contains(d.report, "first difference: step 4, rank 1 (dp 0, tp 1, pp 0, ep 0, cp 0, etp 0), grad_norm\n"))
      << d.report;
  EXPECT_EQ(d.first_step, 4);
  EXPECT_TRUE(contains(d.report, a + ": 3ff4000000000000 (1.25)\n")) << d.report;
  EXPECT_TRUE(contains(d.report, b + ": 3ff4000000000001 (1.2500000000000002)\n")) << d.report;
  EXPECT_TRUE(contains(d.report, "also differing at step 4 on rank 1: params")) << d.report;
}

TEST(Diff, ReportsEveryRankDifferingAtTheFirstStep) {
  TempDir dir;
  const std::string b = write_run(dir, "b", 3, 3, [](Fingerprint& f) {
    if (f.step == 2 && f.rank != 1) f.loss += 1;
  });
  const RunDiff d = diff_runs(write_run(dir, "a", 3, 3), b);
  EXPECT_TRUE(contains(d.report, "step 2, rank 0")) << d.report;
  EXPECT_TRUE(contains(d.report,
                       "ranks differing at step 2: rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), "
                       "rank 2 (dp 0, tp 2, pp 0, ep 0, cp 0, etp 0)\n"))
      << d.report;
}

// Fingerprint files from before "etp" was recorded: read, compared with new ones field by field
// (coordinates are labels), and reported with the coordinates they have.
TEST(Diff, FilesWithoutEtpStillCompare) {
  TempDir dir;
  const std::string now = write_run(dir, "now", 2, 3);
  const std::string old = older_copy(dir, now, "old", ",\"etp\":0", [](std::string&) {});
  EXPECT_TRUE(diff_runs(old, now).identical);
  const std::string drifted =
      write_run(dir, "drifted", 2, 3, [](Fingerprint& f) { f.loss += f.step == 2 && f.rank == 1; });
  const RunDiff d = diff_runs(old, drifted);
  EXPECT_FALSE(d.identical);
  EXPECT_TRUE(contains(d.report, "first difference: step 2, rank 1 (dp 0, tp 1, pp 0, ep 0, cp 0")) << d.report;
}

// Files of fingerprint format 1 (no "format" field: parameters hashed as one buffer, so other
// "params" values for the same bits) against format 2: the scalars and the RNG state compare, the
// state hashes do not, and the report says so. The same format compares everything.
TEST(Diff, OtherFingerprintFormatsCompareAllButTheStateHashes) {
  TempDir dir;
  const std::string now = write_run(dir, "now", 2, 3);
  const std::string old = older_copy(dir, now, "old", ",\"format\":2", [](std::string& text) {
    for (size_t at = 0; (at = text.find("\"params\":\"", at)) != std::string::npos; at += 10) text[at + 10] = 'f';
  });
  const RunDiff d = diff_runs(old, now);
  EXPECT_TRUE(d.identical) << d.report;
  EXPECT_TRUE(contains(d.report, "has fingerprint format 1 and " + now + " format 2: params, grads, optimizer"))
      << d.report;
  EXPECT_TRUE(contains(d.report, "identical over 3 steps (1..3), the state hashes aside (other fingerprint formats)"))
      << d.report;
  // Across layouts too (neither splits the parameters, so params would compare): the header does
  // not list the hashes it then leaves out.
  const std::string one = write_run(dir, "one", 1, 3);
  dir.write("one/config.toml", "[parallel]\n");
  dir.write("old/config.toml", "[parallel]\n");
  const RunDiff layouts = diff_runs(old, one);
  EXPECT_TRUE(layouts.identical) << layouts.report;
  EXPECT_TRUE(
      contains(layouts.report, "on rank 0 of each run: loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr, rng\n"))
      << layouts.report;
  const RunDiff same = diff_runs(old, old);
  EXPECT_FALSE(contains(same.report, "fingerprint format")) << same.report;
  const std::string drifted = write_run(dir, "drifted", 2, 3, [](Fingerprint& f) { f.grad_norm += f.step == 3; });
  const RunDiff g = diff_runs(old, drifted);
  EXPECT_FALSE(g.identical);
  EXPECT_TRUE(contains(g.report, "first difference: step 3, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), grad_norm"))
      << g.report;
  const std::string hashes = write_run(dir, "hashes", 2, 3, [](Fingerprint& f) { f.params += f.step == 2; });
  EXPECT_FALSE(diff_runs(now, hashes).identical) << "same format: the state hashes compare";
}

TEST(Diff, RunsOfDifferentLengthsCompareTheirCommonSteps) {
  TempDir dir;
  const RunDiff d = diff_runs(write_run(dir, "a", 1, 6), write_run(dir, "b", 1, 4));
  EXPECT_TRUE(d.identical);
  EXPECT_TRUE(contains(d.report, "identical over the 4 common steps (1..4); the runs have different lengths"))
      << d.report;
  const std::string c = write_run(dir, "c", 1, 4, [](Fingerprint& f) { f.optimizer += f.step == 3; });
  const RunDiff e = diff_runs(dir.path("a"), c);
  EXPECT_FALSE(e.identical);
  EXPECT_TRUE(contains(e.report, "first difference: step 3, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), optimizer"))
      << e.report;
}

TEST(Diff, DifferentRankCountsCompareTheGlobalQuantitiesOnly) {
  TempDir dir;
  // Per-rank hashes differ with the layout; the losses, grad norm, lr and RNG state do not. Without
  // a config.toml nothing says that the parameters are whole on every rank: not compared either.
  const std::string one = write_run(dir, "one", 1, 3, [](Fingerprint& f) { f.params = 7, f.grads = 8; });
  const RunDiff d = diff_runs(write_run(dir, "two", 2, 3), one);
  EXPECT_TRUE(d.identical) << d.report;
  EXPECT_TRUE(contains(d.report, "on rank 0 of each run: loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr, rng\n"))
      << d.report;
  EXPECT_TRUE(contains(d.report, "not compared: params, grads, optimizer (each rank hashes its own shard")) << d.report;
  EXPECT_TRUE(contains(d.report, one + " has no config.toml to tell its layout")) << d.report;
  EXPECT_TRUE(contains(d.report, "identical over 3 steps")) << d.report;
  const std::string moved = write_run(dir, "moved", 1, 3, [](Fingerprint& f) {
    if (f.step == 3) f.lr = 2e-3;
  });
  const RunDiff e = diff_runs(dir.path("two"), moved);
  EXPECT_FALSE(e.identical);
  EXPECT_TRUE(contains(e.report, "first difference: step 3, lr (rank 0 of each run)\n")) << e.report;
  const std::string rng = write_run(dir, "rng", 1, 3, [](Fingerprint& f) { f.rng += f.step == 2; });
  EXPECT_TRUE(contains(diff_runs(dir.path("two"), rng).report, "first difference: step 2, rng (rank 0 of each run)\n"));
}

// Real runs of other layouts (determinism = "run", where the layout changes the bits): DP 2 vs
// DP 1 part at step 1 by ~1e-8 in the grad norm (the loss agrees); every data-parallel rank holds
// every parameter, so the parameters' hash is compared too. TP 2 splits the parameters: diff says
// so and compares the global quantities only. The same layout twice is identical.
TEST(Diff, RealRunsOfOtherLayoutsCompareGlobalQuantities) {
  TempDir dir;
  auto run = [&](const std::string& name, int ranks, std::vector<std::string> keys) {
    for (const std::string& k : {std::string("train.steps=3"), std::string("train.eval_interval=0"),
                                 std::string("train.threads=1"), "train.out_dir=" + dir.path(name)})
      keys.push_back(k);
    testing::train_ranks(ranks, load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/debug.toml"), keys));
    return dir.path(name);
  };
  const std::string dp1 = run("dp1", 1, {}), dp2 = run("dp2", 2, {}), again = run("dp2_again", 2, {});
  const std::string tp2 = run("tp2", 2, {"parallel.tensor=2"});
  const RunDiff same = diff_runs(dp2, again);
  EXPECT_TRUE(same.identical) << same.report;
  EXPECT_TRUE(contains(same.report, "identical over 3 steps (1..3)")) << same.report;

  const RunDiff dp = diff_runs(dp1, dp2);
  EXPECT_FALSE(dp.identical);
  EXPECT_TRUE(contains(dp.report,
                       "different layouts (1 vs 2 ranks): comparing what every rank records alike, on rank 0 "
                       "of each run: loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr, params, rng\n"))
      << dp.report;
  EXPECT_TRUE(contains(dp.report, "not compared: grads, optimizer (")) << dp.report;
  EXPECT_TRUE(contains(dp.report, "first difference: step 1, grad_norm (rank 0 of each run)\n")) << dp.report;
  // Both values, as bits and as numbers, within 1e-7 relative of each other.
  const std::vector<FingerprintLine> l1 = read_fingerprint_lines(fingerprint_path(dp1, 0));
  const std::vector<FingerprintLine> l2 = read_fingerprint_lines(fingerprint_path(dp2, 0));
  ASSERT_EQ(*l1[0].find("loss"), *l2[0].find("loss"));
  ASSERT_NE(*l1[0].find("grad_norm"), *l2[0].find("grad_norm"));
  EXPECT_TRUE(contains(dp.report, dp1 + ": " + *l1[0].find("grad_norm") + " (")) << dp.report;
  EXPECT_TRUE(contains(dp.report, dp2 + ": " + *l2[0].find("grad_norm") + " (")) << dp.report;

  const RunDiff tp = diff_runs(tp2, dp1);
  EXPECT_FALSE(tp.identical);
  EXPECT_TRUE(contains(tp.report, "on rank 0 of each run: loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr, rng\n"))
      << tp.report;
  EXPECT_TRUE(contains(tp.report, "not compared: params, grads, optimizer (")) << tp.report;
  EXPECT_TRUE(contains(tp.report, tp2 + " splits the parameters: parallel.tensor = 2)")) << tp.report;
  EXPECT_TRUE(contains(tp.report, "first difference: step 1, loss (rank 0 of each run)\n")) << tp.report;
}

TEST(Diff, ClearErrorsForMissingOrMalformedInput) {
  TempDir dir;
  const std::string good = write_run(dir, "good", 1, 2);
  EXPECT_EQ(user_error_of([&] { diff_runs(dir.path("nope"), good); }),
            str("'", dir.path("nope"), "': no such run directory"));
  std::filesystem::create_directories(dir.path("bare"));
  EXPECT_EQ(user_error_of([&] { diff_runs(good, dir.path("bare")); }),
            str("'", dir.path("bare"), "' has no fingerprints/ directory (not a lockstep run directory?)"));
  std::filesystem::create_directories(dir.path("empty/fingerprints"));
  EXPECT_EQ(user_error_of([&] { diff_runs(good, dir.path("empty")); }),
            str("'", dir.path("empty/fingerprints"), "' has no rank-NNNNN.jsonl fingerprint files"));
  const std::string gap = write_run(dir, "gap", 3, 2);
  std::filesystem::remove(gap + "/fingerprints/rank-00001.jsonl");
  EXPECT_EQ(
      user_error_of([&] { diff_runs(good, gap); }),
      str("'", gap, "/fingerprints' has no fingerprint file for rank 1 (rank-00001.jsonl) but has one for rank 2"));
  const std::string bad = write_run(dir, "bad", 1, 2);
  dir.write("bad/fingerprints/rank-00000.jsonl", line(1).json() + "{\"step\":2,\"loss\":\n");
  EXPECT_EQ(user_error_of([&] { diff_runs(good, bad); }),
            str(bad, "/fingerprints/rank-00000.jsonl:2: not a JSON object"));
  dir.write("bad/fingerprints/rank-00000.jsonl", "{\"loss\":\"00\"}\n");
  EXPECT_EQ(user_error_of([&] { diff_runs(good, bad); }),
            str(bad, "/fingerprints/rank-00000.jsonl:1: no integer \"step\""));
  // A value of the wrong type is a corrupt file, not a difference.
  dir.write("bad/fingerprints/rank-00000.jsonl", "{\"step\":1,\"rank\":0,\"loss\":\"zz\"}\n");
  EXPECT_EQ(user_error_of([&] { diff_runs(good, bad); }),
            str(bad, "/fingerprints/rank-00000.jsonl:1: \"loss\" = \"zz\" is not 16 hex digits (the file is corrupt)"));
  dir.write("bad/fingerprints/rank-00000.jsonl", "{\"step\":1,\"rank\":0,\"params\":12}\n");
  EXPECT_EQ(user_error_of([&] { diff_runs(good, bad); }),
            str(bad, "/fingerprints/rank-00000.jsonl:1: \"params\" = 12 is not 16 hex digits (the file is corrupt)"));
  dir.write("bad/fingerprints/rank-00000.jsonl", "{\"step\":1,\"rank\":\"0\"}\n");
  EXPECT_EQ(user_error_of([&] { diff_runs(good, bad); }),
            str(bad, "/fingerprints/rank-00000.jsonl:1: \"rank\" = \"0\" is not an integer (the file is corrupt)"));
  write_run(dir, "later", 1, 0);
  dir.write("later/fingerprints/rank-00000.jsonl", line(9).json());
  EXPECT_EQ(user_error_of([&] { diff_runs(good, dir.path("later")); }),
            str("'", good, "' (2 steps (1..2)) and '", dir.path("later"), "' (1 step (9..9)) share no step"));
}

// Real runs through the binary: exit 0 when identical, 1 at a difference, 2 on bad input.
TEST(Diff, CommandLineExitStatus) {
  TempDir dir;
  const std::string train = std::string("train -c ") + LOCKSTEP_SOURCE_DIR +
                            "/configs/debug.toml train.steps=2 train.eval_interval=0 train.threads=1 ";
  ASSERT_EQ(testing::run_cli(dir, train + "train.out_dir=a").status, 0);
  ASSERT_EQ(testing::run_cli(dir, train + "train.out_dir=b").status, 0);
  ASSERT_EQ(testing::run_cli(dir, train + "train.out_dir=c train.seed=7").status, 0);
  testing::CliResult r = testing::run_cli(dir, "diff a b");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "identical over 2 steps")) << r.out;
  r = testing::run_cli(dir, "diff a c");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "first difference: step 1, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), loss")) << r.out;
  r = testing::run_cli(dir, "diff a");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lockstep: error: command line: lockstep diff needs two run directories, got 1\n");
  // A corrupt fingerprint is unreadable input (exit 2), not a difference (exit 1).
  dir.write("c/fingerprints/rank-00000.jsonl", "{\"step\":1,\"rank\":0,\"loss\":\"zz\"}\n");
  r = testing::run_cli(dir, "diff a c");
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "rank-00000.jsonl:1: \"loss\" = \"zz\" is not 16 hex digits")) << r.err;
}

}  // namespace
}  // namespace lockstep
