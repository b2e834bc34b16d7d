// lockstep against PyTorch. Finite differences (test_model.cpp, test_moe.cpp) prove that our
// backward matches our forward; these tests prove that the forward is the model users expect
// (GELU variant, norm epsilon, attention scaling, RoPE layout, router normalisation, aux-loss
// scaling, AdamW details). tests/reference/make_fixtures.py builds each model family in PyTorch
// from weights it draws itself and writes tests/reference/fixtures/<case>.bin: the config, one
// batch, every weight, the losses (LM, MoE aux, MTP) and every gradient, then the losses of three
// AdamW steps and the parameters after them. Here each fixture is loaded into lockstep's parameter
// table by name and run through GPT::forward_backward and the trainer's Optimizer; every tensor
// must agree within a per-tensor tolerance, and a failure names the first tensor that strays.
//
// LOCKSTEP_REFERENCE_REPORT=1 prints, per case and tensor, the largest error seen (docs/testing.md
// lists them).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/kernels/cpu/cross_entropy.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/lr_schedule.h"
#include "lockstep/train/optimizer.h"
#include "testing.h"

namespace lockstep {
namespace {

// ---- The fixture file (format: tests/reference/make_fixtures.py) ----

constexpr char kMagic[8] = {'L', 'S', 'R', 'E', 'F', 0, 0, 0};
constexpr uint32_t kVersion = 1;

enum DType : uint32_t { text = 0, f32 = 1, i32 = 2, f64 = 3 };

struct Record {
  DType dtype;
  std::vector<int64_t> dims;
  std::string bytes;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

class Fixture {
 public:
  explicit Fixture(const std::string& path) : path_(path) {
    const std::string s = testing::read_file(path);
    size_t at = 0;
    auto take = [&](size_t n) {
      if (at + n > s.size()) throw std::runtime_error(path + ": truncated at byte " + std::to_string(at));
      const std::string out = s.substr(at, n);
      at += n;
      return out;
    };
    auto u32 = [&] {
      uint32_t v;
      std::memcpy(&v, take(4).data(), 4);
      return v;
    };
    if (take(8) != std::string(kMagic, 8)) throw std::runtime_error(path + ": not a reference fixture (bad magic)");
    const uint32_t version = u32();
    if (version != kVersion)
      throw std::runtime_error(path + ": fixture version " + std::to_string(version) + ", expected " +
                               std::to_string(kVersion) + " (regenerate with tests/reference/make_fixtures.py)");
    const uint32_t count = u32();
    for (uint32_t r = 0; r < count; ++r) {
      const std::string name = take(u32());
      Record rec;
      rec.dtype = static_cast<DType>(u32());
      rec.dims.resize(u32());
      for (int64_t& d : rec.dims) std::memcpy(&d, take(8).data(), 8);
      const size_t width = rec.dtype == text ? 1 : rec.dtype == f64 ? 8 : 4;
      rec.bytes = take(static_cast<size_t>(rec.numel()) * width);
      order_.push_back(name);
      records_[name] = std::move(rec);
    }
    if (at != s.size()) throw std::runtime_error(path + ": trailing bytes");
  }

  bool has(const std::string& name) const { return records_.count(name) > 0; }
  const Record& at(const std::string& name, DType dtype) const {
    const auto it = records_.find(name);
    if (it == records_.end()) throw std::runtime_error(path_ + ": no record " + name);
    if (it->second.dtype != dtype) throw std::runtime_error(path_ + ": record " + name + " has another dtype");
    return it->second;
  }
  std::string text_of(const std::string& name) const { return at(name, text).bytes; }
  template <typename T>
  std::vector<T> values(const std::string& name, DType dtype) const {
    const Record& r = at(name, dtype);
    std::vector<T> v(static_cast<size_t>(r.numel()));
    std::memcpy(v.data(), r.bytes.data(), r.bytes.size());
    return v;
  }
  std::vector<float> floats(const std::string& name) const { return values<float>(name, f32); }
  std::vector<double> doubles(const std::string& name) const { return values<double>(name, f64); }
  std::vector<int32_t> ints(const std::string& name) const { return values<int32_t>(name, i32); }
  // Names of the records that start with prefix, in file order.
  std::vector<std::string> names(const std::string& prefix) const {
    std::vector<std::string> out;
    for (const std::string& n : order_)
      if (n.rfind(prefix, 0) == 0) out.push_back(n.substr(prefix.size()));
    return out;
  }

 private:
  std::string path_;
  std::vector<std::string> order_;
  std::map<std::string, Record> records_;
};

std::string fixture_path(const std::string& name) {
  return std::string(LOCKSTEP_SOURCE_DIR) + "/tests/reference/fixtures/" + name + ".bin";
}

// ---- Comparison ----

// Per tensor: the largest |got - ref| relative to the tensor's largest |ref| (so that elements
// near zero, whose relative error means nothing, are judged on the tensor's scale).
struct Tolerances {
  double loss = 2e-6;   // relative, losses and the gradient norm
  double grad = 2e-5;   // gradients after one forward/backward
  double param = 2e-5;  // parameters after the AdamW steps
  double xent = 1e-6;   // per-token cross-entropy of the fixture's logits
};

class Checker {
 public:
  explicit Checker(std::string case_name) : case_(std::move(case_name)) {}

  void tensor(const std::string& what, const float* got, const std::vector<float>& ref, double tol) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      err = std::max(err, std::abs(static_cast<double>(got[i]) - ref[i]));
      scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
      if (!std::isfinite(got[i])) err = INFINITY;
    }
    note(what, err, err / std::max(scale, 1e-30), tol);
  }
  void scalar(const std::string& what, double got, double ref, double tol) {
    const double err = std::abs(got - ref);
    note(what, err, err / std::max(std::abs(ref), 1e-30), tol);
  }

  // One failure naming the first tensor that strayed (and how many did).
  void verdict() const {
    if (report_) {
      std::printf("reference %s:\n", case_.c_str());
      for (const std::string& line : lines_) std::printf("  %s\n", line.c_str());
    }
    if (!first_bad_.empty())
      ADD_FAILURE() << case_ << ": " << bad_ << " tensor(s) differ from PyTorch; the first is " << first_bad_;
  }

 private:
  void note(const std::string& what, double err, double rel, double tol) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%-48s max abs err %.3e  rel %.3e  (tol %.0e)", what.c_str(), err, rel, tol);
    lines_.push_back(buf);
    if (!(rel <= tol)) {
      if (first_bad_.empty()) first_bad_ = buf;
      ++bad_;
    }
  }

  std::string case_;
  std::vector<std::string> lines_;
  std::string first_bad_;
  int bad_ = 0;
  bool report_ = std::getenv("LOCKSTEP_REFERENCE_REPORT") != nullptr;
};

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

// Loads the fixture into a lockstep model, then checks the loss and every gradient of one
// forward/backward, then the trainer's step (begin_step, forward_backward, Optimizer::step at
// learning_rate, finish_step) three times: the step losses, gradient norms, final parameters and
// expert biases.
void check_case(const std::string& name, const Tolerances& tol = Tolerances{}) {
  const Fixture fx(fixture_path(name));
  const Config c = load_config("", lines_of(fx.text_of("config")));
  const int64_t B = c.train.micro_batch, T = c.model.seq_length, N = B * T, V = c.model.vocab_size;
  GPT model(c.model, B, c.moe);
  ParamStore& ps = model.params();
  Checker check(name);

  // Every lockstep parameter has a PyTorch counterpart of the same size, and no fixture weight is
  // left over: a renamed or missing parameter fails here, by name.
  const std::vector<std::string> fixture_params = fx.names("param/");
  ASSERT_EQ(fixture_params.size(), ps.specs().size()) << name << ": parameter count differs from the fixture";
  for (const ParamSpec& p : ps.specs()) {
    ASSERT_TRUE(fx.has("param/" + p.name)) << name << ": the fixture has no parameter " << p.name;
    const std::vector<float> v = fx.floats("param/" + p.name);
    ASSERT_EQ(static_cast<int64_t>(v.size()), p.shape.numel()) << name << ": size of " << p.name;
    std::copy(v.begin(), v.end(), ps.value(ps.find(p.name)));
  }
  const std::vector<int32_t> tokens = fx.ints("tokens"), targets = fx.ints("targets");
  ASSERT_EQ(static_cast<int64_t>(tokens.size()), N);

  // Our cross-entropy kernel on PyTorch's logits gives PyTorch's per-token losses.
  const std::vector<float> logits = fx.floats("logits");
  std::vector<float> token_losses(static_cast<size_t>(N));
  cross_entropy_forward(token_losses.data(), logits.data(), targets.data(), N, V, V);
  check.tensor("token losses (our xent on torch logits)", token_losses.data(), fx.floats("token_losses"), tol.xent);

  Optimizer optimizer(ps, c.optimizer);
  const std::vector<double> step_loss = fx.doubles("step_loss"), step_norm = fx.doubles("step_grad_norm");
  for (int64_t step = 1; step <= static_cast<int64_t>(step_loss.size()); ++step) {
    ps.zero_grads();
    model.begin_step(c.train.seed, step);
    const double lm = model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N));
    const double aux = model.aux_loss(), mtp = model.mtp_loss();
    const std::string s = "step " + std::to_string(step) + " ";
    if (step == 1) {
      check.scalar("loss", lm + aux + mtp, fx.doubles("loss")[0], tol.loss);
      check.scalar("lm loss", lm, fx.doubles("lm_loss")[0], tol.loss);
      if (c.moe.num_experts > 0) check.scalar("aux loss", aux, fx.doubles("aux_loss")[0], tol.loss);
      if (c.model.mtp_num_layers > 0) check.scalar("mtp loss", mtp, fx.doubles("mtp_loss")[0], tol.loss);
      for (const ParamSpec& p : ps.specs())
        check.tensor("grad " + p.name, ps.grad(ps.find(p.name)), fx.floats("grad/" + p.name), tol.grad);
    }
    check.scalar(s + "loss", lm + aux + mtp, step_loss[step - 1], tol.loss);
    const double norm = optimizer.step(ps, step, learning_rate(c.train, step));
    check.scalar(s + "grad norm", norm, step_norm[step - 1], tol.loss * 10);
    model.finish_step(c.moe.router_bias_update_rate);
  }
  for (const ParamSpec& p : ps.specs())
    check.tensor("final " + p.name, ps.value(ps.find(p.name)), fx.floats("final/" + p.name), tol.param);
  for (const std::string& layer : fx.names("final_expert_bias/")) {
    const auto& moe = model.moe_layers().at(static_cast<size_t>(std::stoll(layer)));
    ASSERT_TRUE(moe) << name << ": layer " << layer << " is not an MoE layer";
    check.tensor("final expert bias " + layer, moe->expert_bias().data(), fx.floats("final_expert_bias/" + layer),
                 1e-6);
  }
  check.verdict();
}

TEST(Reference, Gpt2FlavourMatchesPyTorch) { check_case("gpt2"); }
TEST(Reference, LlamaFlavourMatchesPyTorch) { check_case("llama"); }
TEST(Reference, MoeSoftmaxTop2MatchesPyTorch) { check_case("moe_softmax"); }
TEST(Reference, MoeSigmoidGroupLimitedExpertBiasMatchesPyTorch) { check_case("moe_sigmoid"); }
// One MTP depth (model/mtp.h) on the GPT-2 flavour: the rolled inputs, the masked tail targets,
// enorm / hnorm / eh_proj, the depth's layer and final norm, the tied embedding shared by the main
// input, the MTP input and both heads, and the loss scaling factor.
TEST(Reference, MtpMatchesPyTorch) { check_case("mtp"); }

// The comparison itself can fail: a fixture whose weights are nudged by one part in 10^3 in one
// tensor is rejected, and the message names that tensor.
TEST(Reference, CheckerNamesTheFirstTensorThatStrays) {
  Checker check("synthetic");
  const std::vector<float> ref = {1.0f, -2.0f, 0.5f};
  const std::vector<float> good = {1.0f, -2.0f, 0.5f}, bad = {1.0f, -2.002f, 0.5f};
  check.tensor("grad a", good.data(), ref, 2e-5);
  check.tensor("grad b", bad.data(), ref, 2e-5);
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    check.verdict();
  }
  ASSERT_EQ(failures.size(), 1);
  EXPECT_NE(std::string(failures.GetTestPartResult(0).message()).find("grad b"), std::string::npos);
}

TEST(Reference, FixtureWithWrongMagicIsRejected) {
  testing::TempDir dir;
  const std::string path = dir.write("bad.bin", "NOTAFIXTURE-----");
  try {
    Fixture fx(path);
    FAIL() << "accepted a file without the magic";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad magic"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep
