// Reduced precision (tensor/precision.h, docs/precision.md): BF16 mixed precision against a
// double-precision reference that rounds the same tensors; the master/compute weight copies; each
// FP8 / NVFP4 recipe's linear layer against the fp32 GEMM on operands quantised as the recipe says,
// bit for bit; delayed scaling's history on a hand-checked case; selective high precision; training
// in each mode learns and is bitwise deterministic run to run and across thread counts; bad keys
// and combinations fail with one clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/dtype.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/trace.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "lockstep/model/gpt.h"
#include "lockstep/model/linear.h"
#include "lockstep/tensor/precision.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::quiet_train;

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
// tensor/precision.h lists as rounded in the forward: embedding output, norm outputs, linear outputs
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
  Vec linear(const Vec& x, const std::string& name, int64_t N, int64_t I, int64_t O,
             const Vec* residual = nullptr) const {
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
    EXPECT_LT(std::abs(got - ref_bf16), gap / 2)
        << "seed " << seed << ": got " << got << ", bf16 reference " << ref_bf16 << ", fp32 reference " << ref_fp32;
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

// ---- FP8 / NVFP4 linear layers: the recipe's operands, bit for bit ----

// A linear layer "layers.0.mlp.fc" (in -> out, with bias) in a store of its own, under a recipe.
struct QuantisedLinear {
  int64_t N = 32, in = 64, out = 48;
  ParamStore ps;
  Linear lin;
  Precision precision;
  explicit QuantisedLinear(const std::vector<std::string>& keys, int64_t out_features = 48) : out(out_features) {
    lin = Linear(ps, "layers.0.mlp.fc", in, out, true, 0.5f);
    ps.allocate();
    ps.init(8);
    for (int64_t i = 0; i < out; ++i) ps.value(lin.b)[i] = 0.01f * static_cast<float>(i);
    precision = Precision(load_config("", keys).precision, ps, 1);
    ps.set_precision(&precision);
    ps.use_bf16_weights();
    ps.sync_weights(0, static_cast<int>(ps.specs().size()));
  }
};

std::vector<float> bf16_randn(int64_t n, uint64_t seed, float scale) {
  std::vector<float> v = testing::randn(n, seed);
  for (float& x : v) x = to_f32(to_bf16(x * scale));
  return v;
}

std::vector<float> dequantized(const QuantizedTensor& q) {
  std::vector<float> v(static_cast<size_t>(q.rows * q.cols));
  dequantize(v.data(), q);
  return v;
}

std::vector<float> transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  return t;
}

// The dequantised operand a recipe gives x (rows, cols) when the GEMM's K runs along its columns
// (k_along_cols) or rows, written from the recipe's definition (tensor/precision.h).
struct RecipeRef {
  std::string recipe;
  uint64_t seed = 0;
  int64_t step = 0, micro = 0;
  std::vector<float> operand(const std::vector<float>& x, int64_t rows, int64_t cols, bool k_along_cols, bool weight,
                             bool grad, uint64_t sr_usage) const {
    const ElemFormat f = grad ? ElemFormat::e5m2 : ElemFormat::e4m3;  // hybrid
    QuantizedTensor q;
    if (recipe == "delayed") {  // the first micro-batch: every scale is still 1
      quantize_tensorwise(q, x.data(), rows, cols, f, 1.0f);
      return dequantized(q);
    }
    if (recipe == "tensorwise") {
      quantize_tensorwise(q, x.data(), rows, cols, f, fp8_scale_from_amax(amax(x.data(), rows * cols), f));
      return dequantized(q);
    }
    if (recipe == "blockwise") {
      quantize_blockwise(q, x.data(), rows, cols, f, weight || !k_along_cols ? 128 : 1,
                         weight || k_along_cols ? 128 : 1);
      return dequantized(q);
    }
    if (recipe == "nvfp4" && weight) {
      quantize_nvfp4(q, x.data(), rows, cols, 16);
      return dequantized(q);
    }
    // 1-D blocks along K: along the rows means along the transpose's columns.
    const std::vector<float> src = k_along_cols ? x : transposed(x, rows, cols);
    const int64_t r = k_along_cols ? rows : cols, c = k_along_cols ? cols : rows;
    if (recipe == "mxfp8") {
      quantize_mxfp8(q, src.data(), r, c, f);
    } else {
      StochasticRounding sr;
      // The site's key: its weight's name (Precision::Site::global_key).
      if (grad)
        sr = {true,
              seed,
              static_cast<uint64_t>(step),
              purpose_id("layers.0.mlp.fc.weight") * 4 + sr_usage,
              micro * rows * cols,
              0};
      quantize_nvfp4(q, src.data(), r, c, 1, sr);
    }
    const std::vector<float> v = dequantized(q);
    return k_along_cols ? v : transposed(v, r, c);
  }
};

TEST(PrecisionLowp, LinearLayerEqualsTheFp32GemmOnTheRecipesOperands) {
  for (const char* recipe : {"delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"}) {
    SCOPED_TRACE(recipe);
    const bool fp4 = std::string(recipe) == "nvfp4";
    QuantisedLinear t({"precision.params=bf16", fp4 ? "precision.fp4=nvfp4" : std::string("precision.fp8=") + recipe});
    const int64_t N = t.N, in = t.in, out = t.out;
    EXPECT_NE(t.precision.recipe(t.lin.w), Precision::Recipe::none);
    const std::vector<float> x = bf16_randn(N * in, 1, 1.0f), dy = bf16_randn(N * out, 2, 1e-3f);
    std::vector<float> y(static_cast<size_t>(N * out)), dx(static_cast<size_t>(N * in));
    t.precision.begin_micro_batch(77, 5, 3);
    t.lin.forward(t.ps, y.data(), x.data(), N);
    t.lin.backward(t.ps, dx.data(), dy.data(), x.data(), N);
    t.precision.end_micro_batch();

    const RecipeRef ref{recipe, 77, 5, 3};
    const std::vector<float> w(t.ps.weight(t.lin.w), t.ps.weight(t.lin.w) + out * in);
    const std::vector<float> qx = ref.operand(x, N, in, true, false, false, 0),
                             qw = ref.operand(w, out, in, true, true, false, 0);
    std::vector<float> y_ref(y.size()), dx_ref(dx.size()), dw_ref(static_cast<size_t>(out * in), 0.0f);
    GemmOptions bias;
    bias.bias = t.ps.weight(t.lin.b);
    gemm(y_ref.data(), qx.data(), Trans::N, qw.data(), Trans::T, N, out, in, bias);
    round_to_bf16(y_ref.data(), N * out);
    EXPECT_TRUE(testing::bitwise_equal(y, y_ref)) << "fprop";

    const std::vector<float> qdy = ref.operand(dy, N, out, true, false, true, 0);
    const std::vector<float> qw_k = ref.operand(w, out, in, false, true, false, 0);
    gemm(dx_ref.data(), qdy.data(), Trans::N, qw_k.data(), Trans::N, N, in, out);
    round_to_bf16(dx_ref.data(), N * in);
    EXPECT_TRUE(testing::bitwise_equal(dx, dx_ref)) << "dgrad";

    // wgrad: NVFP4 first mixes 16 tokens at a time by the random Hadamard transform (N = 32: no padding).
    std::vector<float> dy_w = dy, x_w = x;
    if (fp4) {
      hadamard16(dy_w.data(), dy.data(), N, out, HadamardAxis::rows);
      hadamard16(x_w.data(), x.data(), N, in, HadamardAxis::rows);
    }
    const std::vector<float> qdy_t = ref.operand(dy_w, N, out, false, false, true, 1);
    const std::vector<float> qx_t = ref.operand(x_w, N, in, false, false, false, 0);
    GemmOptions acc;
    acc.accumulate = true;
    gemm(dw_ref.data(), qdy_t.data(), Trans::T, qx_t.data(), Trans::N, out, in, N, acc);
    EXPECT_TRUE(testing::bitwise_equal(t.ps.grad(t.lin.w), dw_ref.data(), out * in)) << "wgrad";
    // And the quantisation is real: the fp32 GEMM on the bf16 operands gives other bits.
    std::vector<float> y_bf16(y.size());
    gemm(y_bf16.data(), x.data(), Trans::N, w.data(), Trans::T, N, out, in, bias);
    round_to_bf16(y_bf16.data(), N * out);
    EXPECT_NE(y, y_bf16);
  }
}

TEST(PrecisionLowp, DelayedScalingFollowsItsHistory) {
  // History of 3, algo max, margin 1: the scale of micro-batch m comes from the amaxes staged
  // before it; hand-computed below for the input tensor (amax of x: 2, 4, 1, 1, 1).
  for (const char* algo : {"max", "most_recent"}) {
    SCOPED_TRACE(algo);
    QuantisedLinear t({"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=3",
                       std::string("precision.fp8_amax_compute_algo=") + algo, "precision.fp8_margin=1"});
    const int64_t N = t.N, in = t.in, out = t.out;
    const bool max = std::string(algo) == "max";
    // amax staged: 2, 4, 1, 1, 1. History after each update (rotated, slot 0 zeroed) and the scale
    // (448 / a) / 2 for a = max over [staged, rest] (max) or the staged one (most_recent).
    const float amaxes[5] = {2, 4, 1, 1, 1};
    const std::vector<std::vector<float>> history = {{0, 0, 2}, {0, 2, 4}, {0, 4, 1}, {0, 1, 1}, {0, 1, 1}};
    const float scale_max[5] = {112, 56, 56, 56, 224}, scale_recent[5] = {112, 56, 224, 224, 224};
    std::vector<float> dy(static_cast<size_t>(N * out), 1e-3f), y(dy.size()), dx(static_cast<size_t>(N * in));
    for (int m = 0; m < 5; ++m) {
      std::vector<float> x = bf16_randn(N * in, 10 + m, 0.1f);
      x[5] = amaxes[m];  // the largest magnitude by far
      t.precision.begin_micro_batch(1, 1, m);
      t.lin.forward(t.ps, y.data(), x.data(), N);
      t.lin.backward(t.ps, dx.data(), dy.data(), x.data(), N);
      t.precision.end_micro_batch();
      const AmaxHistory* x_state = nullptr;
      for (const Precision::NamedHistory& h : t.precision.amax_histories())
        if (h.global_name == "layers.0.mlp.fc.weight.input") x_state = h.history;
      ASSERT_TRUE(x_state);
      EXPECT_EQ(x_state->amax, history[m]) << "micro-batch " << m;
      EXPECT_EQ(x_state->scale, max ? scale_max[m] : scale_recent[m]) << "micro-batch " << m;
    }
  }
}

// determinism = "layout" (AmaxGroups::layout): the scale stays the step's first one through all
// of the step's micro-batches, slot 0 collects the max over them, and end_step updates once.
// History of 2, algo max, margin 1; two micro-batches a step with input amaxes (2, 4), (1, 1),
// (1, 0.5): the step amaxes 4, 1, 1, hand-computed as in DelayedScalingFollowsItsHistory. The
// output of each micro-batch is the GEMM on operands quantised with the step's scale.
TEST(PrecisionLowp, DelayedScalingPerStepUpdatesOnceFromTheStepsMax) {
  QuantisedLinear t(
      {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=2", "precision.fp8_margin=1"});
  Precision::AmaxGroups groups;
  groups.per_step = true;
  t.precision.set_amax_groups(groups);
  const int64_t N = t.N, in = t.in, out = t.out;
  const float amaxes[3][2] = {{2, 4}, {1, 1}, {1, 0.5f}};
  const std::vector<std::vector<float>> history = {{0, 4}, {0, 1}, {0, 1}};
  const float scale[4] = {1, 56, 56, 224};  // at the start of each step; (448 / a) / 2
  std::vector<float> dy(static_cast<size_t>(N * out), 1e-3f), y(dy.size()), dx(static_cast<size_t>(N * in)),
      y_ref(dy.size());
  auto state = [&](const char* role) {
    for (const Precision::NamedHistory& h : t.precision.amax_histories())
      if (h.global_name == std::string("layers.0.mlp.fc.weight.") + role) return h.history;
    return static_cast<AmaxHistory*>(nullptr);
  };
  ASSERT_TRUE(state("input") && state("weight"));
  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < 2; ++m) {
      std::vector<float> x = bf16_randn(N * in, 10 + 2 * step + m, 0.1f);
      x[5] = amaxes[step][m];  // the largest magnitude by far
      t.precision.begin_micro_batch(1, step + 1, 2 * step + m);
      t.lin.forward(t.ps, y.data(), x.data(), N);
      t.lin.backward(t.ps, dx.data(), dy.data(), x.data(), N);
      t.precision.end_micro_batch();
      EXPECT_EQ(state("input")->scale, scale[step]) << "step " << step << " micro-batch " << m;
      EXPECT_EQ(state("input")->amax[0], std::max(amaxes[step][0], amaxes[step][m])) << "staged: the max so far";
      QuantizedTensor qx, qw;
      quantize_tensorwise(qx, x.data(), N, in, ElemFormat::e4m3, scale[step]);
      quantize_tensorwise(qw, t.ps.weight(t.lin.w), out, in, ElemFormat::e4m3, state("weight")->scale);
      GemmOptions bias;
      bias.bias = t.ps.weight(t.lin.b);
      gemm(y_ref.data(), dequantized(qx).data(), Trans::N, dequantized(qw).data(), Trans::T, N, out, in, bias);
      round_to_bf16(y_ref.data(), N * out);
      EXPECT_TRUE(testing::bitwise_equal(y, y_ref)) << "step " << step << " micro-batch " << m;
    }
    t.precision.end_step();
    EXPECT_EQ(state("input")->amax, history[step]) << "step " << step;
    EXPECT_EQ(state("input")->scale, scale[step + 1]) << "step " << step;
  }
}

// Pipeline parallelism: two micro-batches' forwards, then their backwards, each under its own slot,
// give what the two one after the other give: each slot keeps its micro-batch's quantised input for
// the weight gradient, and the delayed scales (once per step) and NVFP4's draws (keyed by the
// micro-batch begun) are those of the serial order.
TEST(PrecisionLowp, EachPipelineSlotKeepsItsMicroBatchesOperands) {
  for (const char* recipe : {"precision.fp8=tensorwise", "precision.fp8=delayed", "precision.fp4=nvfp4"}) {
    const std::vector<std::string> keys = {"precision.params=bf16", recipe};
    QuantisedLinear serial(keys), piped(keys);
    Precision::AmaxGroups groups;
    groups.per_step = true;
    for (QuantisedLinear* t : {&serial, &piped}) t->precision.set_amax_groups(groups);
    const int64_t N = serial.N, in = serial.in, out = serial.out;
    std::vector<std::vector<float>> x, dy, y(4, std::vector<float>(static_cast<size_t>(N * out))),
        dx(4, std::vector<float>(static_cast<size_t>(N * in)));
    for (int m = 0; m < 2; ++m) {
      x.push_back(bf16_randn(N * in, 20 + m, m ? 3.0f : 0.1f));  // far apart: different scales
      dy.push_back(bf16_randn(N * out, 30 + m, 1e-3f));
    }
    Precision& p = piped.precision;
    for (int step = 1; step <= 2; ++step) {
      for (int m = 0; m < 2; ++m) {
        serial.precision.begin_micro_batch(1, step, m);
        serial.lin.forward(serial.ps, y[m].data(), x[m].data(), N);
        serial.lin.backward(serial.ps, dx[m].data(), dy[m].data(), x[m].data(), N);
        serial.precision.end_micro_batch();
      }
      for (int m = 0; m < 2; ++m) {
        p.select_slot(m);
        p.begin_micro_batch(1, step, m);
        piped.lin.forward(piped.ps, y[2 + m].data(), x[m].data(), N);
      }
      for (int m = 0; m < 2; ++m) {
        p.select_slot(m);
        p.begin_micro_batch(1, step, m);
        piped.lin.backward(piped.ps, dx[2 + m].data(), dy[m].data(), x[m].data(), N);
        p.end_micro_batch();
      }
      serial.precision.end_step();
      p.end_step();
      for (int m = 0; m < 2; ++m) {
        EXPECT_TRUE(testing::bitwise_equal(y[m], y[2 + m])) << recipe << " step " << step << " micro-batch " << m;
        EXPECT_TRUE(testing::bitwise_equal(dx[m], dx[2 + m])) << recipe << " step " << step << " micro-batch " << m;
      }
      EXPECT_TRUE(testing::bitwise_equal(std::vector<float>(serial.ps.grads(), serial.ps.grads() + serial.ps.total()),
                                         std::vector<float>(piped.ps.grads(), piped.ps.grads() + piped.ps.total())))
          << recipe << " step " << step << ": the weight gradients";
    }
    for (size_t i = 0; i < serial.precision.amax_histories().size(); ++i)
      EXPECT_EQ(serial.precision.amax_histories()[i].history->amax, p.amax_histories()[i].history->amax) << recipe;
  }
}

TEST(PrecisionLowp, DelayedScalingScaleIsTheOneQuantisationUses) {
  QuantisedLinear t({"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=2"});
  const int64_t N = t.N, in = t.in, out = t.out;
  std::vector<float> y(static_cast<size_t>(N * out)), y_ref(y.size());
  const std::vector<float> x = bf16_randn(N * in, 3, 1.0f);
  for (int m = 0; m < 2; ++m) {
    float sx = 0, sw = 0;
    for (const Precision::NamedHistory& h : t.precision.amax_histories()) {
      if (h.global_name == "layers.0.mlp.fc.weight.input") sx = h.history->scale;
      if (h.global_name == "layers.0.mlp.fc.weight.weight") sw = h.history->scale;
    }
    t.precision.begin_micro_batch(1, 1, m);
    t.lin.forward(t.ps, y.data(), x.data(), N);
    t.precision.end_micro_batch();
    QuantizedTensor qx, qw;
    quantize_tensorwise(qx, x.data(), N, in, ElemFormat::e4m3, sx);
    quantize_tensorwise(qw, t.ps.weight(t.lin.w), out, in, ElemFormat::e4m3, sw);
    GemmOptions bias;
    bias.bias = t.ps.weight(t.lin.b);
    gemm(y_ref.data(), dequantized(qx).data(), Trans::N, dequantized(qw).data(), Trans::T, N, out, in, bias);
    round_to_bf16(y_ref.data(), N * out);
    EXPECT_TRUE(testing::bitwise_equal(y, y_ref)) << "micro-batch " << m << " scales " << sx << " " << sw;
    if (m == 0)
      EXPECT_EQ(sx, 1.0f) << "the initial scale";
    else
      EXPECT_EQ(sx, 448.0f / amax(x.data(), N * in)) << "from the first micro-batch's amax";
  }
}

// rows [r0, r0 + rows) x columns [c0, c0 + cols) of a row-major matrix with C columns.
std::vector<float> block(const float* m, int64_t C, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  std::vector<float> b;
  for (int64_t r = r0; r < r0 + rows; ++r) b.insert(b.end(), m + r * C + c0, m + r * C + c0 + cols);
  return b;
}

// TE's reduce_amax: two ranks hold halves of a linear layer's tokens (data / sequence parallelism:
// x, dy and so dx split by rows) or of its weight (tensor parallelism, column-parallel: W's rows, so
// dy's and y's columns). With the amax reduced over both, each rank quantises its piece with the
// scale of the whole tensor: its block of y (and of dx, when tokens are split) is bitwise the one
// process's, and delayed scaling's histories and scales are the one process's on every rank.
TEST(PrecisionLowp, AmaxReducedOverTheGroupQuantisesEachPieceAsTheWholeTensor) {
  for (const char* recipe : {"delayed", "tensorwise"}) {
    for (const bool split_tokens : {true, false}) {
      SCOPED_TRACE(std::string(recipe) + (split_tokens ? ", tokens split" : ", weight rows split"));
      const std::vector<std::string> keys = {"precision.params=bf16", std::string("precision.fp8=") + recipe};
      QuantisedLinear full(keys);
      const int64_t N = full.N, in = full.in, out = full.out, Np = split_tokens ? N / 2 : N,
                    outp = split_tokens ? out : out / 2;
      constexpr int kMicro = 2;  // delayed: the second micro-batch quantises with the reduced amax
      std::vector<std::vector<float>> x, dy, y(kMicro), dx(kMicro);
      for (int m = 0; m < kMicro; ++m) {
        x.push_back(bf16_randn(N * in, 20 + m, 1.0f));
        dy.push_back(bf16_randn(N * out, 30 + m, 1e-3f));
        y[m].resize(static_cast<size_t>(N * out));
        dx[m].resize(static_cast<size_t>(N * in));
        full.precision.begin_micro_batch(1, 1, m);
        full.lin.forward(full.ps, y[m].data(), x[m].data(), N);
        full.lin.backward(full.ps, dx[m].data(), dy[m].data(), x[m].data(), N);
        full.precision.end_micro_batch();
      }
      for (const bool reduced : {true, false}) {
        std::vector<int> same(2, 0);
        run_threads(2, 30, [&](Communicator& comm) {
          const int r = comm.rank();
          QuantisedLinear part(keys, outp);
          const int64_t t0 = split_tokens ? r * Np : 0, o0 = split_tokens ? 0 : r * outp;
          const std::vector<float> w = block(full.ps.value(full.lin.w), in, o0, outp, 0, in);
          std::copy(w.begin(), w.end(), part.ps.value(part.lin.w));
          std::copy(full.ps.value(full.lin.b) + o0, full.ps.value(full.lin.b) + o0 + outp, part.ps.value(part.lin.b));
          part.ps.sync_weights(0, static_cast<int>(part.ps.specs().size()));
          if (reduced) part.precision.set_amax_groups({&comm, nullptr, &comm, nullptr});
          bool all = true;
          for (int m = 0; m < kMicro; ++m) {
            const std::vector<float> xp = block(x[m].data(), in, t0, Np, 0, in),
                                     dyp = block(dy[m].data(), out, t0, Np, o0, outp);
            std::vector<float> yp(static_cast<size_t>(Np * outp)), dxp(static_cast<size_t>(Np * in));
            part.precision.begin_micro_batch(1, 1, m);
            part.lin.forward(part.ps, yp.data(), xp.data(), Np);
            part.lin.backward(part.ps, dxp.data(), dyp.data(), xp.data(), Np);
            part.precision.end_micro_batch();
            all = all && yp == block(y[m].data(), out, t0, Np, o0, outp);
            if (split_tokens) all = all && dxp == block(dx[m].data(), in, t0, Np, 0, in);
          }
          if (std::string(recipe) == "delayed") {
            const auto mine = part.precision.amax_histories(), one = full.precision.amax_histories();
            for (size_t i = 0; i < one.size(); ++i)
              all = all && mine[i].history->amax == one[i].history->amax &&
                    mine[i].history->scale == one[i].history->scale;
          }
          same[r] = all;
        });
        // Without the reduction a rank that lacks the whole tensor's largest magnitude scales differently.
        if (reduced)
          EXPECT_EQ(same, std::vector<int>(2, 1)) << "amax reduced";
        else
          EXPECT_NE(same, std::vector<int>(2, 1)) << "per-rank amax (the test can fail)";
      }
    }
  }
}

TEST(PrecisionLowp, SelectiveLayersStayHighPrecision) {
  ModelConfig m = testing::tiny_model("llama", 16);
  m.num_layers = 3;
  MoeConfig moe;
  moe.num_experts = 2;
  moe.router_topk = 1;
  moe.layer_freq = "[0,1,0]";
  const Config c = load_config("", {"model.num_layers=3", "precision.params=bf16", "precision.fp4=nvfp4",
                                    "precision.fp4_high_precision_layers=1"});
  GPT fp4(m, 2, moe, c.precision);
  PrecisionConfig bf16;
  bf16.params = "bf16";
  GPT ref(m, 2, moe, bf16);
  const ParamStore& ps = fp4.params();
  Precision& p = ps.precision();
  int quantised = 0;
  for (size_t i = 0; i < ps.specs().size(); ++i) {
    const std::string& name = ps.specs()[i].name;
    const bool middle = name.rfind("layers.1.", 0) == 0 && name.find("norm") == std::string::npos &&
                        name.find("router") == std::string::npos && name.find("bias") == std::string::npos;
    EXPECT_EQ(p.recipe(static_cast<int>(i)) == Precision::Recipe::nvfp4, middle) << name;
    quantised += middle;
  }
  EXPECT_EQ(quantised, 4) << "attn.qkv, attn.proj, moe.experts.fc, moe.experts.proj";

  // The module outputs of layer 0 are the BF16 model's bit for bit; layer 1's are not.
  fp4.params().init(2);
  ref.params().init(2);
  const auto tokens = testing::random_ints(2 * m.seq_length, m.vocab_size, 3, "tokens");
  std::vector<std::vector<ModuleTrace::Record>> records;
  for (GPT* model : {&fp4, &ref}) {
    ModuleTrace trace(true, 0, "");
    ModuleTrace::Bind bind(&trace);
    model->begin_step(1, 1);
    model->forward_backward(tokens.data(), tokens.data(), 1e-2f);
    records.push_back(trace.take_records());
  }
  ASSERT_EQ(records[0].size(), records[1].size());
  int same0 = 0, differ1 = 0;
  for (size_t i = 0; i < records[0].size(); ++i) {
    const ModuleTrace::Record &a = records[0][i], &b = records[1][i];
    if (a.grad_in) continue;
    if (a.module.rfind("layers.0.", 0) == 0) {
      EXPECT_EQ(a.hash, b.hash) << a.module;
      ++same0;
    }
    if (a.module == "layers.1.attn.qkv" || a.module == "layers.1.attn.proj") differ1 += a.hash != b.hash;
  }
  EXPECT_GT(same0, 3);
  EXPECT_EQ(differ1, 2);
}

// ---- Training in each mode: learns, and bitwise deterministic ----

Config moe_job(const std::string& out_dir, std::vector<std::string> extra) {
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
}

// A few steps of the MoE debug model (two micro-batches a step) in one precision mode, twice on
// one thread and once on two: the fingerprints (loss, grad norm, parameter / gradient / optimizer
// hashes of every step) agree bit for bit, the loss falls, and the run differs from the one in
// `baseline` (the mode changes the numerics).
void check_mode_trains_deterministically(const std::vector<std::string>& mode,
                                         const std::vector<std::string>& baseline) {
  testing::TempDir dir;
  auto job = [&](const char* run, const char* threads, std::vector<std::string> keys) {
    keys.insert(keys.end(), {"train.steps=6", "train.global_batch=4", "train.micro_batch=2", "train.eval_interval=0",
                             "train.warmup_steps=2", "train.lr=4e-3", std::string("train.threads=") + threads});
    return quiet_train(moe_job(dir.path(run), keys));
  };
  const TrainSummary a = job("a", "1", mode);
  job("b", "1", mode);
  job("c", "2", mode);
  job("baseline", "1", baseline);
  const std::string fa = testing::read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(std::count(fa.begin(), fa.end(), '\n'), 6);
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("b"), 0))) << "run to run";
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("c"), 0))) << "1 vs 2 threads";
  EXPECT_NE(fa, testing::read_file(fingerprint_path(dir.path("baseline"), 0))) << "the mode changes the numerics";
  EXPECT_LT(a.last_loss, a.first_loss - 0.5) << "loss falls";
}

const std::vector<std::string> kBf16 = {"precision.params=bf16"};
std::vector<std::string> bf16_and(const std::string& key) { return {"precision.params=bf16", key}; }

TEST(PrecisionTraining, Bf16) { check_mode_trains_deterministically(kBf16, {}); }
TEST(PrecisionTraining, Fp8Delayed) { check_mode_trains_deterministically(bf16_and("precision.fp8=delayed"), kBf16); }
TEST(PrecisionTraining, Fp8Tensorwise) {
  check_mode_trains_deterministically(bf16_and("precision.fp8=tensorwise"), kBf16);
}
TEST(PrecisionTraining, Fp8Blockwise) {
  check_mode_trains_deterministically(bf16_and("precision.fp8=blockwise"), kBf16);
}
TEST(PrecisionTraining, Mxfp8) { check_mode_trains_deterministically(bf16_and("precision.fp8=mxfp8"), kBf16); }
TEST(PrecisionTraining, Nvfp4) { check_mode_trains_deterministically(bf16_and("precision.fp4=nvfp4"), kBf16); }

TEST(PrecisionConfig, BadValuesAndCombinationsNameTheKeys) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"precision.params=fp16"}, {"precision.params", "fp16"}},
      {{"precision.fp8=e4m3"}, {"precision.fp8", "e4m3"}},
      {{"precision.fp8=delayed"}, {"precision.fp8 = \"delayed\" needs precision.params = \"bf16\""}},
      {{"precision.fp4=nvfp4"}, {"precision.fp4 = \"nvfp4\" needs precision.params = \"bf16\""}},
      {{"precision.params=bf16", "precision.fp8=mxfp8", "precision.fp4=nvfp4"}, {"choose one"}},
      {{"precision.fp8_amax_history_len=0"}, {"precision.fp8_amax_history_len = 0"}},
      {{"precision.fp8_amax_compute_algo=mean"}, {"precision.fp8_amax_compute_algo", "mean"}},
      {{"precision.fp8_margin=-1"}, {"precision.fp8_margin = -1"}},
      {{"precision.fp8_format=e5m2"}, {"precision.fp8_format", "e5m2"}},
      {{"model.num_layers=4", "precision.params=bf16", "precision.fp4=nvfp4", "precision.fp4_high_precision_layers=2"},
       {"precision.fp4_high_precision_layers = 2", "model.num_layers = 4"}},
  };
  for (const auto& [keys, expected] : cases) {
    const std::string e = testing::user_error_of([&] { load_config("", keys); });
    for (const std::string& part : expected) EXPECT_NE(e.find(part), std::string::npos) << e;
  }
  EXPECT_NO_THROW(load_config("", {"precision.params=bf16", "precision.fp8=blockwise", "precision.fp8_format=e4m3"}));
}

}  // namespace
}  // namespace lockstep
