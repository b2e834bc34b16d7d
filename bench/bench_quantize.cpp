// Quantiser throughput (kernels/cpu/quantize.h): elements per second for each recipe on a
// 1024 x 1024 fp32 matrix, nearest and stochastic rounding, 1 and 2 threads; and dequantize(), amax().
//
//   build/bench_quantize
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/quantize.h"

namespace {

using lockstep::ElemFormat;
constexpr int64_t kRows = 1024, kCols = 1024;

enum class Recipe {
  tensorwise,
  blockwise_1x128,
  blockwise_128x1,
  blockwise_128x128,
  mxfp8,
  nvfp4,
  nvfp4_2d,
  dequantize,
  hadamard,
  amax
};

void run(lockstep::QuantizedTensor& q, const std::vector<float>& x, Recipe r, const lockstep::StochasticRounding& sr) {
  switch (r) {
    case Recipe::tensorwise:
      lockstep::quantize_tensorwise(q, x.data(), kRows, kCols, ElemFormat::e4m3, 100.0f, sr);
      break;
    case Recipe::blockwise_1x128:
      lockstep::quantize_blockwise(q, x.data(), kRows, kCols, ElemFormat::e4m3, 1, 128, sr);
      break;
    case Recipe::blockwise_128x1:
      lockstep::quantize_blockwise(q, x.data(), kRows, kCols, ElemFormat::e4m3, 128, 1, sr);
      break;
    case Recipe::blockwise_128x128:
      lockstep::quantize_blockwise(q, x.data(), kRows, kCols, ElemFormat::e4m3, 128, 128, sr);
      break;
    case Recipe::mxfp8:
      lockstep::quantize_mxfp8(q, x.data(), kRows, kCols, ElemFormat::e4m3, lockstep::ScaleRounding::up, 32, sr);
      break;
    case Recipe::nvfp4:
      lockstep::quantize_nvfp4(q, x.data(), kRows, kCols, 1, sr);
      break;
    case Recipe::nvfp4_2d:
      lockstep::quantize_nvfp4(q, x.data(), kRows, kCols, 16, sr);
      break;
    case Recipe::dequantize:
      break;
    case Recipe::hadamard:
      break;
    case Recipe::amax:
      break;
  }
}

void bm_quantize(benchmark::State& state, Recipe r, bool stochastic, int threads) {
  std::vector<float> x(static_cast<size_t>(kRows * kCols)), out(x.size());
  lockstep::RandomStream(1, lockstep::purpose_id("bench/x")).fill_normal(x.data(), kRows * kCols, 1);
  lockstep::ThreadPool pool(threads);
  lockstep::ThreadPool::Bind bind(&pool);
  lockstep::StochasticRounding sr;
  sr.enabled = stochastic;
  lockstep::QuantizedTensor q;
  lockstep::quantize_mxfp8(q, x.data(), kRows, kCols, ElemFormat::e4m3);
  for (auto _ : state) {
    if (r == Recipe::dequantize) {
      lockstep::dequantize(out.data(), q);
    } else if (r == Recipe::amax) {
      benchmark::DoNotOptimize(lockstep::amax(x.data(), kRows * kCols));
    } else if (r == Recipe::hadamard) {
      lockstep::hadamard16(out.data(), x.data(), kRows, kCols, lockstep::HadamardAxis::rows);
    } else {
      run(q, x, r, sr);
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kRows * kCols);
}

void register_all() {
  const std::pair<const char*, Recipe> recipes[] = {{"tensorwise", Recipe::tensorwise},
                                                    {"blockwise_1x128", Recipe::blockwise_1x128},
                                                    {"blockwise_128x1", Recipe::blockwise_128x1},
                                                    {"blockwise_128x128", Recipe::blockwise_128x128},
                                                    {"mxfp8", Recipe::mxfp8},
                                                    {"nvfp4", Recipe::nvfp4},
                                                    {"nvfp4_16x16", Recipe::nvfp4_2d}};
  for (int threads : {1, 2}) {
    const std::string t = "/threads:" + std::to_string(threads);
    for (const auto& [name, r] : recipes) {
      for (bool sr : {false, true}) {
        benchmark::RegisterBenchmark((std::string("quantize/") + name + (sr ? "/stochastic" : "/nearest") + t).c_str(),
                                     bm_quantize, r, sr, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.2);
      }
    }
    benchmark::RegisterBenchmark(("dequantize/mxfp8" + t).c_str(), bm_quantize, Recipe::dequantize, false, threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.2);
    benchmark::RegisterBenchmark(("amax" + t).c_str(), bm_quantize, Recipe::amax, false, threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.2);
    benchmark::RegisterBenchmark(("hadamard16/rows" + t).c_str(), bm_quantize, Recipe::hadamard, false, threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
