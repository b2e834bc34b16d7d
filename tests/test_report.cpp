// `lockstep report` (train/report.h) through the binary: the page's structure for a tiny MoE run (one
// <svg> per plot with its title, a heatmap cell per MoE layer and step), the first divergent step
// marked for two runs that differ and not for two that do not, long runs thinned, and bad input as one
// error line with nothing written.
#include <gtest/gtest.h>

#include <filesystem>

#include "lockstep/config/config.h"
#include "lockstep/train/report.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using testing::quiet_train;
using testing::read_file;
using testing::run_cli;
using testing::TempDir;

// moe-debug (2 MoE layers) for `steps` steps, evaluated every 3, in dir/name.
void train_moe(const TempDir& dir, const std::string& name, int steps) {
  quiet_train(load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml",
                          {"train.steps=" + std::to_string(steps), "train.eval_interval=3", "train.threads=1",
                           "train.out_dir=" + dir.path(name)}));
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

const char* const kCurveTitles[] = {"Loss (solid: train, dashed: eval)", "Grad norm", "Learning rate", "Tokens/s",
                                    "MFU (of the measured GEMM peak)"};

// The runs share their data and model. moe-debug warms up for 5 steps, then decays over the rest: a
// run of 6 steps and one of 8 have the same learning rates, and so the same bits, up to step 5, and
// differ in the learning rate at step 6. `same` repeats the 6-step run.
class Report : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    train_moe(*dir_, "six", 6);
    train_moe(*dir_, "same", 6);
    train_moe(*dir_, "eight", 8);
  }
  static void TearDownTestSuite() { delete dir_; }
  static TempDir* dir_;
};
TempDir* Report::dir_ = nullptr;

TEST_F(Report, OneRunHasAPlotPerCurveAndAnExpertLoadHeatmap) {
  const auto r = run_cli(*dir_, "report six");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "lockstep report: wrote six/report.html\n");
  const std::string html = read_file(dir_->path("six/report.html"));
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(count(html, "<svg "), 5u + 1u);
  EXPECT_EQ(count(html, "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\""), 5u);
  for (const char* title : kCurveTitles) EXPECT_EQ(count(html, str("\">", title, "</text>")), 1u) << title;
  EXPECT_EQ(count(html, "\">Expert load, six: max / mean tokens per expert</text>"), 1u);
  EXPECT_EQ(count(html, "class=\"cell\""), 2u * 6u);  // layers x steps
  EXPECT_EQ(count(html, ">layer 0</text>") + count(html, ">layer 1</text>"), 2u);
  EXPECT_EQ(count(html, "class=\"series\" d=\"M"), 5u + 1u);  // a curve per plot, and eval loss
  EXPECT_EQ(count(html, "class=\"divergence\""), 0u);
  // Self-contained: no script, no fetched resource.
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_EQ(count(html, "src="), 0u);
  EXPECT_EQ(count(html, "https:"), 0u);
  EXPECT_EQ(count(html, "http:"), count(html, "<svg "));  // the SVG namespace only
}

TEST_F(Report, TwoRunsThatDifferMarkTheFirstDivergentStep) {
  const auto r = run_cli(*dir_, "report six eight -o both.html");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string html = read_file(dir_->path("both.html"));
  EXPECT_NE(html.find("First divergent step: <b>6</b>"), std::string::npos);
  EXPECT_NE(html.find("first difference: step 6, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), lr"), std::string::npos);
  EXPECT_EQ(count(html, "<line class=\"divergence\""), 5u);  // on every curve
  EXPECT_EQ(count(html, "<title>first divergent step: 6</title>"), 5u);
  EXPECT_EQ(count(html, ">first divergent step (6)</text>"), 5u);  // in every legend
  EXPECT_EQ(count(html, "<svg "), 5u + 2u);                        // a heatmap per run
  EXPECT_EQ(count(html, "class=\"cell\""), 2u * 6u + 2u * 8u);
  EXPECT_EQ(count(html, ">six</text>"), 5u);  // the legends name both runs
  EXPECT_EQ(count(html, ">eight</text>"), 5u);
}

TEST_F(Report, TwoIdenticalRunsMarkNothing) {
  const auto r = run_cli(*dir_, "report six same -o same.html");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string html = read_file(dir_->path("same.html"));
  EXPECT_NE(html.find("No step differs in the fingerprints."), std::string::npos);
  EXPECT_NE(html.find("identical over 6 steps (1..6)"), std::string::npos);
  EXPECT_EQ(count(html, "class=\"divergence\""), 0u);
  EXPECT_EQ(count(html, "first divergent"), 0u);
}

TEST_F(Report, BadInputIsOneLineAndWritesNothing) {
  fs::create_directories(dir_->path("empty"));
  const std::pair<std::string, std::string> cases[] = {
      {"report nowhere", "lockstep: error: 'nowhere': no such run directory\n"},
      {"report six nowhere -o out.html", "lockstep: error: 'nowhere': no such run directory\n"},
      {"report empty", "lockstep: error: 'empty/metrics.jsonl': no such file (not a lockstep run directory?)\n"},
      {"report six/metrics.jsonl -o out.html",
       "lockstep: error: 'six/metrics.jsonl': not a directory (lockstep report takes run directories)\n"},
      {"report", "lockstep: error: command line: lockstep report needs at least one run directory\n"},
      {"report six --fast", "lockstep: error: command line: unknown option '--fast' (see `lockstep help`)\n"},
      {"report six -o", "lockstep: error: command line: -o needs a file name\n"},
      {"report six -o missing/dir/out.html",
       "lockstep: error: cannot write 'missing/dir/out.html.tmp': No such file or directory\n"},
  };
  for (const auto& [args, err] : cases) {
    const auto r = run_cli(*dir_, args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(r.err, err) << args;
    EXPECT_EQ(r.out, "") << args;
  }
  EXPECT_FALSE(fs::exists(dir_->path("out.html")));
  EXPECT_FALSE(fs::exists(dir_->path("empty/report.html")));
  for (const auto& e : fs::recursive_directory_iterator(dir_->path()))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();

  dir_->write("empty/metrics.jsonl", "{\"step\":1,\"loss\":5}\n[1,2]\n");
  const auto r = run_cli(*dir_, "report empty");
  EXPECT_EQ(r.err,
            "lockstep: error: 'empty/metrics.jsonl' line 2: not a metrics line (a JSON object with an integer "
            "\"step\")\n");
  EXPECT_FALSE(fs::exists(dir_->path("empty/report.html")));
}

// A long run, written by hand: 3000 steps, three MoE layers, a NaN loss. The heatmap bins the steps
// into 600 columns, the curves keep about two points per pixel column, and the NaN breaks the line; a
// torn last line (a run killed mid-write) is left out.
TEST(ReportHtml, LongRunsAreThinnedAndGapsKept) {
  TempDir dir;
  std::string lines;
  for (int s = 1; s <= 3000; ++s) {
    lines += str("{\"step\":", s, ",\"loss\":", s == 700 ? "null" : std::to_string(5.0 - s * 1e-4),
                 ",\"grad_norm\":1,\"lr\":0.001,\"tokens_per_s\":1000,\"mfu\":0.5");
    for (int l = 0; l < 3; ++l) lines += str(",\"moe.", l, ".imbalance\":", 1 + (s % 7) * 0.1);
    lines += "}\n";
  }
  dir.write("metrics.jsonl", lines + "{\"step\":3001,\"lo");
  const std::string html = report_html({dir.path()});
  EXPECT_EQ(count(html, "class=\"cell\""), 3u * 600u);
  EXPECT_NE(html.find("steps 1..5: max/mean"), std::string::npos);  // a column of five steps
  const size_t loss = html.find("class=\"series\" d=\"");
  const std::string path = html.substr(loss, html.find('"', loss + 19) - loss);
  EXPECT_EQ(count(path, "M"), 2u);     // broken once, at the NaN
  EXPECT_LT(count(path, "L"), 1800u);  // 868 pixel columns
  EXPECT_EQ(count(html, "nan"), 0u);
  EXPECT_NE(html.find("<td>1..3000</td>"), std::string::npos);
}

}  // namespace
}  // namespace lockstep
