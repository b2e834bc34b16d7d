// Reduced precision (model/precision.h, docs/precision.md): BF16 mixed precision against a
// double-precision reference that rounds the same tensors; the master/compute weight copies;
// training in each mode learns and is bitwise deterministic run to run and across thread counts;
// bad keys and combinations fail with one clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>

#include "lockstep/config/config.h"
#include "lockstep/core/dtype.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using Vec = std::vector<double>;

// Round-to-nearest-even onto the bf16 grid, straight from double (no float in between, so no
// double rounding): 8 significant bits.
double bf16_of(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  const double ulp = std::ldexp(1.0, std::ilogb(x) - 7);
  return std::nearbyint(x / ulp) * ulp;
}

// The GPT-2 flavour (LayerNorm, learned positions, GELU, biases, tied head) in double, reading the
// model's parameters by name. With bf16 on, the weights are rounded to bf16 and so is every tensor
// model/precision.h lists as rounded in the forward: embedding output, norm outputs, linear outputs
// (the residual add fused into the projections), attention output, GELU output, logits.
struct Gpt2Reference {
  const ParamStore& ps;
  const ModelConfig& m;
  bool bf16;

  Vec param(const std::string& name) const {
    const int i = ps.find(name);
    EXPECT_GE(i, 0) << name;
    const ParamSpec& p = ps.specs()[i];
    Vec v(ps.values() + p.offset, ps.values() + p.offset + p.shape.numel());
    return round(v);
  }
  Vec round(Vec v) const {
    if (bf16)
      for (double& x : v) x = bf16_of(x);
    return v;
  }
  // y (N, O) = x (N, I) W^T + b (+ residual), then rounded.
  Vec linear(const Vec& x, const std::string& name, int64_t N, int64_t I, int64_t O, const Vec* residual = nullptr) const {
    const Vec w = param(name + ".weight"), b = param(name + ".bias");
    Vec y(static_cast<size_t>(N * O));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) {
        double s = b[o] + (residual ? (*residual)[n * O + o] : 0.0);
        for (int64_t i = 0; i < I; ++i) s += x[n * I + i] * w[o * I + i];
        y[n * O + o] = s;
      }
    return round(y);
  }
  Vec layernorm(const Vec& x, const std::string& name, int64_t N, int64_t C) const {
    const Vec w = param(name + ".weight"), b = param(name + ".bias");
    Vec y(x.size());
    for (int64_t n = 0; n < N; ++n) {
      double mean = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mean += x[n * C + c] / static_cast<double>(C);
      for (int64_t c = 0; c < C; ++c) var += (x[n * C + c] - mean) * (x[n * C + c] - mean) / static_cast<double>(C);
      const double rstd = 1 / std::sqrt(var + m.norm_eps);
      for (int64_t c = 0; c < C; ++c) y[n * C + c] = (x[n * C + c] - mean) * rstd * w[c] + b[c];
    }
    return round(y);
  }
  // Mean cross-entropy over the B x T tokens.
  double loss(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, int64_t B) const {
    const int64_t T = m.seq_length, C = m.hidden_size, V = m.vocab_size, N = B * T, NH = m.num_heads, HS = C / NH;
    const Vec wte = param("embedding.word.weight"), wpe = param("embedding.position.weight");
    Vec x(static_cast<size_t>(N * C));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) x[n * C + c] = wte[tokens[n] * C + c] + wpe[(n % T) * C + c];
    x = round(x);
    for (int64_t l = 0; l < m.num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      const Vec qkv = linear(layernorm(x, p + "attn_norm", N, C), p + "attn.qkv", N, C, 3 * C);
      Vec att(static_cast<size_t>(N * C));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < NH; ++h)
          for (int64_t t = 0; t < T; ++t) {
            const double* q = &qkv[(b * T + t) * 3 * C + h * HS];
            Vec s(static_cast<size_t>(t + 1));
            double mx = -1e300, sum = 0;
            for (int64_t j = 0; j <= t; ++j) {
              const double* k = &qkv[(b * T + j) * 3 * C + C + h * HS];
              double d = 0;
              for (int64_t e = 0; e < HS; ++e) d += q[e] * k[e];
              s[j] = d / std::sqrt(static_cast<double>(HS));
              mx = std::max(mx, s[j]);
            }
            for (double& v : s) sum += (v = std::exp(v - mx));
            for (int64_t e = 0; e < HS; ++e) {
              double o = 0;
              for (int64_t j = 0; j <= t; ++j) o += s[j] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * HS + e];
              att[(b * T + t) * C + h * HS + e] = o;
            }
          }
      x = linear(round(att), p + "attn.proj", N, C, C, &x);
      const int64_t F = m.ffn_hidden();
      Vec fc = linear(layernorm(x, p + "mlp_norm", N, C), p + "mlp.fc", N, C, F);
      for (double& v : fc) v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      x = linear(round(fc), p + "mlp.proj", N, F, C, &x);
    }
    const Vec h = layernorm(x, "final_norm", N, C);
    double total = 0;
    for (int64_t n = 0; n < N; ++n) {
      Vec logits(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v) {
        double s = 0;
        for (int64_t c = 0; c < C; ++c) s += h[n * C + c] * wte[v * C + c];
        logits[v] = s;
      }
      logits = round(logits);
      double mx = -1e300, sum = 0;
      for (double v : logits) mx = std::max(mx, v);
      for (double v : logits) sum += std::exp(v - mx);
      total += mx + std::log(sum) - logits[targets[n]];
    }
    return total / static_cast<double>(N);
  }
};

TEST(PrecisionBf16, ForwardMatchesADoubleReferenceThatRoundsTheSameTensors) {
  const ModelConfig m = testing::tiny_model("gpt2", 8);
  const int64_t B = 2, N = B * m.seq_length;
  PrecisionConfig pc;
  pc.params = "bf16";
  GPT model(m, B, MoeConfig{}, pc), fp32(m, B);
  // Float arithmetic between the rounding points can put a value on the other side of a bf16
  // rounding boundary than the double reference does; each such flip moves the loss by about as
  // much as one rounding. So: over 11 draws, most match the bf16 reference to float noise (1e-3 of
  // the bf16-vs-fp32 gap), and none is as far from it as from the unrounded reference.
  std::vector<double> ratios;
  for (int seed = 1; seed <= 11; ++seed) {
    model.params().init(seed);
    fp32.params().init(seed);
    const auto tokens = testing::random_ints(N, m.vocab_size, seed, "tokens");
    const auto targets = testing::random_ints(N, m.vocab_size, seed, "targets");
    const double got = model.evaluate(tokens.data(), targets.data());
    const double ref_bf16 = Gpt2Reference{model.params(), m, true}.loss(tokens, targets, B);
    const double ref_fp32 = Gpt2Reference{model.params(), m, false}.loss(tokens, targets, B);
    const double gap = std::abs(ref_bf16 - ref_fp32);
    EXPECT_GT(gap, 1e-4) << "bf16 rounding moves the loss";
    EXPECT_LT(std::abs(got - ref_bf16), gap / 2) << "seed " << seed << ": got " << got << ", bf16 reference "
                                                  << ref_bf16 << ", fp32 reference " << ref_fp32;
    ratios.push_back(std::abs(got - ref_bf16) / gap);
    EXPECT_NEAR(fp32.evaluate(tokens.data(), targets.data()), ref_fp32, 1e-5) << "the reference is the fp32 model";
  }
  std::sort(ratios.begin(), ratios.end());
  EXPECT_LT(ratios[ratios.size() / 2], 1e-3) << "median distance to the bf16 reference, in units of the bf16 gap";
}

TEST(PrecisionBf16, ComputeWeightsAreTheRoundedMasterWhichStaysFp32) {
  const ModelConfig m = testing::tiny_model("llama");
  PrecisionConfig pc;
  pc.params = "bf16";
  GPT model(m, 2, MoeConfig{}, pc);
  ParamStore& ps = model.params();
  ps.init(5);
  const auto tokens = testing::random_ints(2 * m.seq_length, m.vocab_size, 2, "tokens");
  Optimizer opt(ps, OptimizerConfig{});
  for (int64_t step = 1; step <= 2; ++step) {
    model.begin_step(1, step);
    ps.zero_grads();
    model.forward_backward(tokens.data(), tokens.data(), 1.0f / static_cast<float>(tokens.size()));
    opt.step(ps, step, 1e-2);
    model.finish_step(0);
  }
  model.begin_step(1, 3);
  model.forward_backward(tokens.data(), tokens.data(), 1.0f);
  int64_t not_bf16 = 0;
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) {
    const int64_t n = ps.specs()[i].shape.numel();
    for (int64_t j = 0; j < n; ++j) {
      const float master = ps.value(i)[j];
      ASSERT_EQ(std::bit_cast<uint32_t>(ps.weight(i)[j]), std::bit_cast<uint32_t>(to_f32(to_bf16(master))))
          << ps.specs()[i].name << "[" << j << "]";
      not_bf16 += to_f32(to_bf16(master)) != master;
    }
  }
  EXPECT_GT(not_bf16, ps.total() / 2) << "the master weights keep fp32 precision after updates";
}

TEST(PrecisionBf16, GradientsFollowTheFp32Ones) {
  const ModelConfig m = testing::tiny_model("llama");
  const auto tokens = testing::random_ints(2 * m.seq_length, m.vocab_size, 4, "tokens");
  std::vector<std::vector<float>> grads;
  for (const char* params : {"fp32", "bf16"}) {
    PrecisionConfig pc;
    pc.params = params;
    GPT model(m, 2, MoeConfig{}, pc);
    model.params().init(6);
    model.params().zero_grads();
    model.forward_backward(tokens.data(), tokens.data(), 1.0f / static_cast<float>(tokens.size()));
    grads.emplace_back(model.params().grads(), model.params().grads() + model.params().total());
  }
  double dot = 0, a2 = 0, b2 = 0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    dot += static_cast<double>(grads[0][i]) * grads[1][i];
    a2 += static_cast<double>(grads[0][i]) * grads[0][i];
    b2 += static_cast<double>(grads[1][i]) * grads[1][i];
  }
  EXPECT_GT(dot / std::sqrt(a2 * b2), 0.999) << "bf16 gradients point where the fp32 ones do";
  EXPECT_NE(grads[0], grads[1]) << "bf16 changes the bits";
}

// ---- Training in each mode: learns, and bitwise deterministic ----

Config moe_job(const std::string& out_dir, std::vector<std::string> extra) {
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
}

TrainSummary quiet_train(const Config& c) {
  std::FILE* sink = std::fopen("/dev/null", "w");
  const TrainSummary s = train(c, sink);
  std::fclose(sink);
  return s;
}

// A few steps of the MoE debug model in one precision mode, twice on one thread and once on two:
// the fingerprints (loss, grad norm, parameter / gradient / optimizer hashes of every step) agree
// bit for bit, the loss falls, and the run differs from the fp32 one.
void check_mode_trains_deterministically(const std::vector<std::string>& mode) {
  testing::TempDir dir;
  auto job = [&](const char* run, const char* threads, std::vector<std::string> keys) {
    keys.insert(keys.end(), {"train.steps=8", "train.eval_interval=0", "train.warmup_steps=2",
                             std::string("train.threads=") + threads});
    return quiet_train(moe_job(dir.path(run), keys));
  };
  const TrainSummary a = job("a", "1", mode);
  job("b", "1", mode);
  job("c", "2", mode);
  job("fp32", "1", {});
  const std::string fa = testing::read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(std::count(fa.begin(), fa.end(), '\n'), 8);
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("b"), 0))) << "run to run";
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("c"), 0))) << "1 vs 2 threads";
  EXPECT_NE(fa, testing::read_file(fingerprint_path(dir.path("fp32"), 0))) << "the mode changes the numerics";
  EXPECT_LT(a.last_loss, a.first_loss - 0.5) << "loss falls";
}

TEST(PrecisionTraining, Bf16) { check_mode_trains_deterministically({"precision.params=bf16"}); }

TEST(PrecisionConfig, BadValuesNameTheKey) {
  const std::string e = testing::user_error_of([] { load_config("", {"precision.params=fp16"}); });
  EXPECT_NE(e.find("precision.params"), std::string::npos) << e;
  EXPECT_NE(e.find("fp16"), std::string::npos) << e;
}

}  // namespace
}  // namespace lockstep
