// Shared helpers for whole-model tests: a tiny model of either flavour and the directional
// finite-difference check of every parameter tensor's gradient.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "testing.h"

namespace lockstep::testing {

// 2 layers, hidden 16, 4 heads (2 key/value heads for llama), vocabulary 23: sizes below what
// load_config allows, to keep finite differences cheap. init_std 0.2, larger than usual, so every
// path carries a gradient well above float noise.
inline ModelConfig tiny_model(const std::string& preset, int64_t T = 7) {
  ModelConfig m = load_config("", {"model.preset=" + preset}).model;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_query_groups = preset == "llama" ? 2 : 0;
  m.seq_length = T;
  m.vocab_size = 23;
  m.init_std = 0.2;
  return m;
}

// For each parameter tensor p and a random unit direction d inside it (Philox, keyed by the
// name), calls check(p, analytic, numeric) with the analytic directional derivative <grad p, d>
// and the central difference (loss(p + h d) - loss(p - h d)) / 2h. `grad` is the gradient the
// model computed at the current parameters; `loss` evaluates the model; parameters are restored.
inline void for_each_directional_derivative(
    ParamStore& ps, const std::vector<float>& grad, const std::function<double()>& loss,
    const std::function<void(const ParamSpec&, double analytic, double numeric)>& check, double h = 1e-2) {
  for (const ParamSpec& p : ps.specs()) {
    const int64_t n = p.shape.numel();
    std::vector<float> d = randn(n, 11, "direction/" + p.name);
    double norm = 0;
    for (float x : d) norm += static_cast<double>(x) * x;
    for (float& x : d) x = static_cast<float>(x / std::sqrt(norm));
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += static_cast<double>(grad[p.offset + i]) * d[i];
    float* v = ps.values() + p.offset;
    const std::vector<float> saved(v, v + n);
    auto loss_at = [&](double s) {
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(saved[i] + s * d[i]);
      return loss();
    };
    const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
    std::copy(saved.begin(), saved.end(), v);
    check(p, analytic, numeric);
  }
}

// Trains c on one rank with the progress lines discarded (the sink is closed even when train throws).
inline TrainSummary quiet_train(const Config& c) {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  return train(c, sink.get());
}

// Trains c on `ranks` rank threads (the threads backend), progress lines discarded.
inline void train_ranks(int ranks, const Config& c) {
  std::FILE* sink = std::fopen("/dev/null", "w");
  run_threads(ranks, 60, [&](Communicator& comm) { train(c, sink, comm); });
  std::fclose(sink);
}

// (loss, grad norm) of every step, exact, from rank 0's fingerprints.
inline std::vector<std::pair<double, double>> trajectory(const std::string& run_dir) {
  std::vector<std::pair<double, double>> out;
  std::istringstream in(read_file(fingerprint_path(run_dir, 0)));
  auto bits = [](const nlohmann::json& j, const char* k) {
    return std::bit_cast<double>(std::stoull(j[k].get<std::string>(), nullptr, 16));
  };
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    out.emplace_back(bits(j, "loss"), bits(j, "grad_norm"));
  }
  return out;
}

// Largest relative |difference| of the losses of two runs (and that they have `steps` steps).
inline double largest_loss_difference(const std::vector<std::pair<double, double>>& a,
                                      const std::vector<std::pair<double, double>>& b, size_t steps = 4) {
  EXPECT_EQ(a.size(), steps);
  EXPECT_EQ(b.size(), a.size());
  double worst = 0;
  for (size_t s = 0; s < std::min(a.size(), b.size()); ++s)
    worst = std::max(worst, std::fabs(a[s].first - b[s].first) / std::fabs(a[s].first));
  return worst;
}

}  // namespace lockstep::testing
