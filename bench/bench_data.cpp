// Data loader throughput: GPT-style samples/s from Megatron indexed datasets (one, and a blend
// of two), on a generated 16M-token dataset in the temp directory. Preprocessing throughput is
// measured by bench/preprocess_bench.sh through the CLI.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>
#include <vector>

#include "lockstep/core/philox.h"
#include "lockstep/data/dataset.h"
#include "lockstep/data/indexed_dataset.h"

namespace {

using namespace lockstep;

constexpr int64_t kVocab = 50257;

// Documents of 50..2050 tokens (Philox), 16M tokens in all, uint16 like a GPT-2 corpus.
std::string make_dataset(const std::string& name, uint64_t seed) {
  const std::string prefix = (std::filesystem::temp_directory_path() / ("lockstep-bench-data-" + name)).string();
  if (std::filesystem::exists(prefix + ".idx")) return prefix;
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  const RandomStream rng(seed, purpose_id("bench/data"));
  std::vector<int32_t> doc;
  uint64_t k = 0;
  for (int64_t total = 0; total < (int64_t(1) << 24);) {
    doc.resize(50 + rng.bits(k++) % 2000);
    for (int32_t& t : doc) t = static_cast<int32_t>(rng.bits(k++) % kVocab);
    w.add_document(doc.data(), static_cast<int64_t>(doc.size()));
    total += static_cast<int64_t>(doc.size());
  }
  w.finish();
  return prefix;
}

void run_loader(benchmark::State& state, const std::string& source) {
  DataConfig dc;
  dc.source = source;
  const int64_t T = state.range(0), B = 8;
  const auto data = open_dataset(dc, T, kVocab, 1234);
  std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(tokens.size());
  uint64_t first = 0;
  for (auto _ : state) {
    data->batch(tokens.data(), targets.data(), Split::train, first, B);
    first += static_cast<uint64_t>(B);
    benchmark::DoNotOptimize(tokens.data());
  }
  state.SetItemsProcessed(state.iterations() * B);  // samples
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * B * T), benchmark::Counter::kIsRate);
}

void BM_LoaderIndexed(benchmark::State& state) { run_loader(state, "indexed:" + make_dataset("a", 1)); }
void BM_LoaderBlend(benchmark::State& state) {
  run_loader(state, "indexed:" + make_dataset("a", 1) + ":0.7,indexed:" + make_dataset("b", 2) + ":0.3");
}

BENCHMARK(BM_LoaderIndexed)->Arg(1024)->Arg(4096);
BENCHMARK(BM_LoaderBlend)->Arg(1024)->Arg(4096);

}  // namespace

BENCHMARK_MAIN();
