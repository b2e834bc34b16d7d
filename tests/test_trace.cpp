// Module tracing (debug.trace = "modules") and one-ulp injection (debug.inject_ulp): tracing
// changes no bit of the run, traces are themselves deterministic (twice; 1 vs 2 threads), and
// `lockstep diff` on an injected run names the step, the rank and the module injected into, on
// dense, MoE and MTP models, with two ranks and with pipeline stages.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/run_diff.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::quiet_train;
using testing::read_file;
using testing::TempDir;

// A model with every kind of traced module: attention, MLP (layer 0), MoE with a shared expert
// (layer 1), an MTP depth.
const std::vector<std::string> kEveryModule = {
    "moe.num_experts=4",      "moe.layer_freq=[0,1]", "moe.shared_expert_intermediate_size=32",
    "model.mtp_num_layers=1", "train.steps=3",        "train.eval_interval=0"};

Config job(const TempDir& dir, const std::string& run, std::vector<std::string> extra) {
  for (const std::string& k : kEveryModule) extra.insert(extra.begin(), k);
  extra.push_back("train.out_dir=" + dir.path(run));
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", extra);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Trace, ChangesNoBitAndIsItselfDeterministic) {
  TempDir dir;
  quiet_train(job(dir, "plain", {"train.threads=2"}));
  quiet_train(job(dir, "t1", {"train.threads=1", "debug.trace=modules"}));
  quiet_train(job(dir, "t2", {"train.threads=2", "debug.trace=modules"}));
  const std::string fp = read_file(fingerprint_path(dir.path("plain"), 0));
  EXPECT_EQ(fp, read_file(fingerprint_path(dir.path("t1"), 0)));
  EXPECT_EQ(fp, read_file(fingerprint_path(dir.path("t2"), 0)));
  const std::string trace = read_file(trace_path(dir.path("t1"), 0));
  EXPECT_EQ(trace, read_file(trace_path(dir.path("t2"), 0)));
  // Execution order: the embedding first, every module of the stack, forward then backward.
  EXPECT_EQ(trace.rfind("{\"step\":1,\"micro\":0,\"module\":\"embedding\",\"kind\":\"out\",\"hash\":\"", 0), 0u)
      << trace;
  size_t at = 0;
  for (const char* record :
       {"\"layers.0.attn.qkv\",\"kind\":\"out\"", "\"layers.0.mlp.act\",\"kind\":\"out\"",
        "\"layers.1.moe.router\",\"kind\":\"out\"", "\"layers.1.moe.experts\",\"kind\":\"out\"",
        "\"layers.1.moe.shared.proj\",\"kind\":\"out\"", "\"layers.1.moe\",\"kind\":\"out\"",
        "\"final_norm\",\"kind\":\"out\"", "\"output\",\"kind\":\"out\"", "\"output\",\"kind\":\"grad_in\"",
        "\"mtp.layers.0.eh_proj\",\"kind\":\"out\"", "\"mtp.layers.0.eh_proj\",\"kind\":\"grad_in\"",
        "\"layers.1.moe.experts\",\"kind\":\"grad_in\"", "\"layers.1.moe\",\"kind\":\"grad_in\"",
        "\"layers.0.attn.core\",\"kind\":\"grad_in\"", "\"layers.0.attn_norm\",\"kind\":\"grad_in\"",
        "\"step\":1,\"micro\":1,", "\"step\":3,\"micro\":1,"}) {
    const size_t next = trace.find(record, at);
    ASSERT_NE(next, std::string::npos) << record << " after offset " << at;
    at = next;
  }
  // GPT::module_names (what debug.inject_ulp is checked against before the run starts) lists exactly
  // the outputs the first micro-batch traced, in order.
  std::vector<std::string> traced;
  for (size_t line = 0; line < trace.size(); line = trace.find('\n', line) + 1) {
    const std::string head = "{\"step\":1,\"micro\":0,\"module\":\"";
    if (trace.compare(line, head.size(), head) != 0) continue;
    const size_t end = trace.find('"', line + head.size());
    const std::string kind_out = "\",\"kind\":\"out\"";
    if (trace.compare(end, kind_out.size(), kind_out) == 0)
      traced.push_back(trace.substr(line + head.size(), end - line - head.size()));
  }
  const Config config = job(dir, "t1", {});
  EXPECT_EQ(GPT(config.model, config.train.micro_batch, config.moe).module_names(), traced);
  // Without debug.trace there is no trace directory.
  EXPECT_FALSE(std::filesystem::exists(dir.path("plain/trace")));
}

// One ulp injected into one module's output: diff finds the step, the rank and that module. Some
// of these ulps are absorbed by the rounding of later operations (a router logit that changes no
// choice, an expert output added to a larger residual): the fingerprints then agree, the traces
// still do not, and diff says so.
TEST(Trace, DiffNamesTheModuleAnUlpWasInjectedInto) {
  for (const char* module :
       {"layers.0.mlp.fc", "layers.1.moe.router", "layers.1.moe.experts", "mtp.layers.0.eh_proj"}) {
    SCOPED_TRACE(module);
    TempDir dir;
    quiet_train(job(dir, "a", {"train.threads=2", "debug.trace=modules"}));
    quiet_train(job(dir, "b", {"train.threads=2", "debug.trace=modules", std::string("debug.inject_ulp=2:") + module}));
    const RunDiff d = diff_runs(dir.path("a"), dir.path("b"));
    EXPECT_FALSE(d.identical);
    EXPECT_TRUE(contains(d.report, "first difference: step 2, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0)") ||
                contains(d.report, "fingerprints identical over 3 steps (1..3), but the module traces differ:"))
        << d.report;
    EXPECT_TRUE(contains(d.report, str("module trace, rank 0: first difference at step 2, micro-batch 0: ", module,
                                       " (out)\n  every record before it matches")))
        << d.report;
  }
}

TEST(Trace, InjectionWithoutTracingChangesTheFingerprintsFromThatStep) {
  TempDir dir;
  quiet_train(job(dir, "a", {}));
  quiet_train(job(dir, "b", {"debug.inject_ulp=3:layers.0.attn.proj"}));
  const RunDiff d = diff_runs(dir.path("a"), dir.path("b"));
  EXPECT_TRUE(contains(d.report, "first difference: step 3, rank 0")) << d.report;
  EXPECT_FALSE(contains(d.report, "module trace")) << d.report;
  EXPECT_FALSE(std::filesystem::exists(dir.path("b/trace")));
}

// Two ranks, data parallel and tensor parallel (a dense model: MoE under TP does not exist yet):
// the report names the rank with its coordinates, every rank that differs at that step, and the
// module injected into.
TEST(Trace, TwoRanksReportRankCoordinatesAndEveryRankThatDiffers) {
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {}, {"parallel.tensor=2", "moe.num_experts=0", "moe.shared_expert_intermediate_size=0"}}) {
    SCOPED_TRACE(layout.empty() ? "dp 2" : "tp 2");
    TempDir dir;
    for (const char* run : {"a", "b"}) {
      std::vector<std::string> keys = {"debug.trace=modules", "train.threads=1"};
      keys.insert(keys.end(), layout.begin(), layout.end());
      if (run[0] == 'b') keys.push_back("debug.inject_ulp=2:layers.0.attn.proj");
      testing::train_ranks(2, job(dir, run, keys));
    }
    const RunDiff d = diff_runs(dir.path("a"), dir.path("b"));
    EXPECT_TRUE(contains(d.report, "first difference: step 2, rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0)"))
        << d.report;
    EXPECT_TRUE(contains(d.report, layout.empty()
                                       ? "ranks differing at step 2: rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), "
                                         "rank 1 (dp 1, tp 0, pp 0, ep 0, cp 0, etp 0)\n"
                                       : "ranks differing at step 2: rank 0 (dp 0, tp 0, pp 0, ep 0, cp 0, etp 0), "
                                         "rank 1 (dp 0, tp 1, pp 0, ep 0, cp 0, etp 0)\n"))
        << d.report;
    EXPECT_TRUE(
        contains(d.report, "module trace, rank 0: first difference at step 2, micro-batch 0: layers.0.attn.proj (out)"))
        << d.report;
  }
}

// Pipeline parallelism, 1F1B and interleaved: tracing changes no bit and is deterministic on every
// stage, each record names its model chunk and pass, and an ulp injected into the first module of a
// stage's chunk is found there, with the previous chunk's last output (on the other stage) as the
// record before it, although the stages' files interleave micro-batches by the schedule.
TEST(Trace, PipelineStagesAreReadInTheOrderOfTheData) {
  struct Case {
    std::vector<std::string> keys;
    const char *module, *found, *before;
  };
  const std::vector<Case> cases = {
      {{"parallel.pipeline=2", "train.global_batch=16"},
       "layers.1.attn_norm",
       "module trace, rank 1: first difference at step 2, micro-batch 0: layers.1.attn_norm (out), in the forward of "
       "model chunk 1\n",
       "  every record before it matches; the last one is layers.0.mlp.proj out (step 2, micro-batch 0, forward of "
       "model "
       "chunk 0) on rank 0\n"},
      {{"parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4", "moe.layer_freq=[0,1,0,1]"},
       "layers.2.attn_norm",
       "module trace, rank 0: first difference at step 2, micro-batch 0: layers.2.attn_norm (out), in the forward of "
       "model chunk 2\n",
       "  every record before it matches; the last one is layers.1.moe out (step 2, micro-batch 0, forward of model "
       "chunk 1) on rank 1\n"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.module);
    TempDir dir;
    auto run = [&](const char* name, std::vector<std::string> keys) {
      keys.insert(keys.end(), c.keys.begin(), c.keys.end());
      testing::train_ranks(2, job(dir, name, keys));
    };
    run("plain", {"train.threads=1"});
    run("t1", {"train.threads=1", "debug.trace=modules"});
    run("t2", {"train.threads=2", "debug.trace=modules"});
    run("b", {"train.threads=1", "debug.trace=modules", std::string("debug.inject_ulp=2:") + c.module});
    for (int rank : {0, 1}) {
      SCOPED_TRACE(rank);
      EXPECT_EQ(read_file(fingerprint_path(dir.path("plain"), rank)),
                read_file(fingerprint_path(dir.path("t1"), rank)));
      const std::string trace = read_file(trace_path(dir.path("t1"), rank));
      EXPECT_EQ(trace, read_file(trace_path(dir.path("t2"), rank)));
      EXPECT_EQ(trace.rfind(str("{\"step\":1,\"micro\":0,\"chunk\":", rank, ",\"pass\":\"forward\",\"module\":\""), 0),
                0u)
          << trace;
      EXPECT_TRUE(contains(trace, "\"pass\":\"backward\"")) << trace;
    }
    EXPECT_TRUE(diff_runs(dir.path("t1"), dir.path("t2")).identical);
    const RunDiff d = diff_runs(dir.path("t1"), dir.path("b"));
    EXPECT_FALSE(d.identical);
    EXPECT_TRUE(contains(d.report, str(c.found, c.before))) << d.report;
  }
}

TEST(Trace, BadInjectionIsAnErrorNamingTheKey) {
  TempDir dir;
  for (const char* bad : {"layers.0.mlp.fc", "0:layers.0.mlp.fc", "x:layers.0.mlp.fc", "2:"})
    EXPECT_EQ(testing::user_error_of([&] { job(dir, "a", {std::string("debug.inject_ulp=") + bad}); }),
              str("config: debug.inject_ulp = \"", bad,
                  "\": expected \"STEP:MODULE\" with STEP >= 1, e.g. \"3:layers.1.attn.qkv\""));
  EXPECT_EQ(testing::user_error_of([&] { job(dir, "a", {"debug.inject_ulp=9:layers.0.mlp.fc"}); }),
            "config: debug.inject_ulp = \"9:layers.0.mlp.fc\": step 9 is past train.steps = 3");
  const std::string unknown =
      testing::user_error_of([&] { quiet_train(job(dir, "a", {"debug.inject_ulp=2:layers.0.mlp.fcx"})); });
  EXPECT_TRUE(contains(unknown,
                       "debug.inject_ulp = \"2:layers.0.mlp.fcx\": the model has no module 'layers.0.mlp.fcx'; "
                       "its modules are: embedding, layers.N.attn_norm, layers.N.attn.qkv,"))
      << unknown;
  EXPECT_TRUE(contains(unknown, ", output, mtp.layers.N.enorm, ")) << unknown;
  // Checked before the run starts: no run directory is left behind.
  EXPECT_FALSE(std::filesystem::exists(dir.path("a")));
  // Under pipeline parallelism against every stage's modules: the last stage's are named, and no
  // stage starts the run.
  const std::string piped = testing::user_error_of([&] {
    testing::train_ranks(
        2, job(dir, "p", {"parallel.pipeline=2", "train.threads=1", "debug.inject_ulp=2:layers.2.mlp.fc"}));
  });
  EXPECT_TRUE(contains(piped,
                       "debug.inject_ulp = \"2:layers.2.mlp.fc\": the model has no module 'layers.2.mlp.fc'; "
                       "its modules are: embedding, layers.N.attn_norm,"))
      << piped;
  EXPECT_TRUE(contains(piped, ", output, mtp.layers.N.enorm, ")) << piped;
  EXPECT_FALSE(std::filesystem::exists(dir.path("p")));
}

}  // namespace
}  // namespace lockstep
