// The gradient norm's sum of squares in each determinism mode: `run`'s fixed-lane double sum
// (kernels/cpu/optimizer.h: sum_of_squares) against `layout`'s exact one (core/exact_sum.h:
// exact_sum_of_squares, the same value for any split of the gradient over ranks), on a
// gradient-like buffer of 10M floats (what one moe-peer rank holds at TP 2 + SP: 10.07M, its 76.80
// MiB of Adam state in the run's header), 1 and 2 threads.
//
//   build/bench_grad_norm
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "lockstep/core/exact_sum.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/optimizer.h"

namespace {

constexpr int64_t kN = 10000000;

const std::vector<float>& gradient() {
  static const std::vector<float> g = [] {
    std::vector<float> x(static_cast<size_t>(kN));
    lockstep::RandomStream(1, lockstep::purpose_id("bench/grad")).fill_normal(x.data(), kN, 1e-3f);
    return x;
  }();
  return g;
}

void bm_sum_of_squares(benchmark::State& state, bool exact, int threads) {
  const std::vector<float>& g = gradient();
  lockstep::ThreadPool pool(threads);
  lockstep::ThreadPool::Bind bind(&pool);
  double sink = 0;
  for (auto _ : state) {
    sink += exact ? lockstep::exact_sum_of_squares(g.data(), kN).value() : lockstep::sum_of_squares(g.data(), kN);
    benchmark::DoNotOptimize(sink);
  }
  state.SetItemsProcessed(state.iterations() * kN);
}

}  // namespace

BENCHMARK_CAPTURE(bm_sum_of_squares, run_fixed_lanes_1t, false, 1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_sum_of_squares, layout_exact_1t, true, 1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_sum_of_squares, run_fixed_lanes_2t, false, 2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_sum_of_squares, layout_exact_2t, true, 2)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
