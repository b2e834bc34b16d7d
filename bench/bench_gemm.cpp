// lockstep gemm against OpenBLAS cblas_sgemm, side by side: each shape runs lockstep then OpenBLAS
// at the same thread count, so machine noise hits both. Counter FLOPS = 2*M*N*K per second.
//
//   env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE build/bench_gemm [--benchmark_filter=...]
//
// Shapes: the square/rectangular references at 1 and 2 threads (and at 2 threads with the
// micro-kernels gemm() does not pick on this CPU), then every linear layer of the GPT-2 peer model
// (1024 tokens, hidden 256) in its three products, at 2 threads:
//   forward y = x W^T        NT  M=tokens N=out K=in
//   input grad dx = dy W     NN  M=tokens N=in  K=out
//   weight grad dW += dy^T x TN  M=out    N=in  K=tokens (accumulate)
// Then lowp/: the same GEMM with both operands stored in bf16, FP8 (E4M3 per tensor, MXFP8) or
// NVFP4, decoded while packing (gemm.h GemmOperand), against fp32 operands through the same call:
//   build/bench_gemm --benchmark_filter=lowp/
// And segmented/: layout mode's products in canonical K segments against one chain.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/kernels/cpu/quantize.h"

extern "C" {
void openblas_set_num_threads(int num_threads);
char* openblas_get_corename(void);
}

namespace {

using lockstep::Trans;

struct Shape {
  int64_t M, N, K;
  Trans ta, tb;
  bool accumulate;
};

struct Operands {
  std::vector<float> A, B, C;
  explicit Operands(const Shape& s)
      : A(static_cast<size_t>(s.M * s.K)), B(static_cast<size_t>(s.K * s.N)), C(static_cast<size_t>(s.M * s.N)) {
    lockstep::RandomStream(1, lockstep::purpose_id("bench/A")).fill_normal(A.data(), s.M * s.K, 1);
    lockstep::RandomStream(1, lockstep::purpose_id("bench/B")).fill_normal(B.data(), s.K * s.N, 1);
    // Accumulating runs repeat on the same C: keep it small so it stays finite.
    lockstep::RandomStream(1, lockstep::purpose_id("bench/C")).fill_normal(C.data(), s.M * s.N, 1e-3f);
  }
};

void set_flops(benchmark::State& state, const Shape& s) {
  state.counters["FLOPS"] = benchmark::Counter(2.0 * s.M * s.N * s.K, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::OneK::kIs1000);
}

// kernel: one of detail::gemm_kernels(), the one gemm() picks when empty. segments > 0: K in that
// many canonical segments (GemmOptions::k_segments), else one chain.
void bm_lockstep(benchmark::State& state, Shape s, int threads, const std::string& kernel, int64_t segments = 0) {
  Operands op(s);
  lockstep::ThreadPool pool(threads);
  lockstep::ThreadPool::Bind bind(&pool);
  std::vector<int64_t> bounds;
  for (int64_t k = 0; segments > 0 && k <= segments; ++k) bounds.push_back(k * s.K / segments);
  lockstep::GemmOptions opt;
  opt.accumulate = s.accumulate;
  opt.k_segments = bounds;
  const int64_t lda = s.ta == Trans::N ? s.K : s.M, ldb = s.tb == Trans::N ? s.N : s.K;
  for (auto _ : state) {
    if (kernel.empty()) {
      lockstep::gemm(op.C.data(), op.A.data(), s.ta, op.B.data(), s.tb, s.M, s.N, s.K, opt);
    } else {
      lockstep::detail::gemm_with_kernel(kernel, op.C.data(), s.N, op.A.data(), lda, s.ta, op.B.data(), ldb, s.tb, s.M,
                                         s.N, s.K, opt);
    }
    benchmark::ClobberMemory();
  }
  set_flops(state, s);
}

void bm_openblas(benchmark::State& state, Shape s, int threads) {
  Operands op(s);
  openblas_set_num_threads(threads);
  const auto ta = s.ta == Trans::N ? CblasNoTrans : CblasTrans;
  const auto tb = s.tb == Trans::N ? CblasNoTrans : CblasTrans;
  const int64_t lda = s.ta == Trans::N ? s.K : s.M, ldb = s.tb == Trans::N ? s.N : s.K;
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, ta, tb, s.M, s.N, s.K, 1.0f, op.A.data(), lda, op.B.data(), ldb,
                s.accumulate ? 1.0f : 0.0f, op.C.data(), s.N);
    benchmark::ClobberMemory();
  }
  set_flops(state, s);
}

// The MoE experts' first projection as one grouped GEMM (gemm_batch: expert e computes its rows
// x_e W_e^T), against one dense GEMM of the same FLOPs (all rows through one weight). The
// moe-peer model: 1024 tokens x top-2 = 2048 rows over 8 experts, hidden 256, expert hidden 512.
void bm_grouped(benchmark::State& state, std::vector<int64_t> rows, int threads, bool dense) {
  constexpr int64_t C = 256, H = 512;
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  const int64_t E = static_cast<int64_t>(rows.size());
  std::vector<float> x(static_cast<size_t>(total * C)), w(static_cast<size_t>(E * H * C)),
      y(static_cast<size_t>(total * H));
  lockstep::RandomStream(1, lockstep::purpose_id("bench/x")).fill_normal(x.data(), total * C, 1);
  lockstep::RandomStream(1, lockstep::purpose_id("bench/w")).fill_normal(w.data(), E * H * C, 1);
  std::vector<lockstep::GemmBatchItem> items;
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    items.push_back(
        {y.data() + r0 * H, H, x.data() + r0 * C, C, Trans::N, w.data() + e * H * C, C, Trans::T, rows[e], H, C});
    r0 += rows[e];
  }
  lockstep::ThreadPool pool(threads);
  lockstep::ThreadPool::Bind bind(&pool);
  for (auto _ : state) {
    if (dense)
      lockstep::gemm(y.data(), x.data(), Trans::N, w.data(), Trans::T, total, H, C);
    else
      lockstep::gemm_batch(items.data(), E);
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * total * H * C, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::OneK::kIs1000);
}

void register_grouped() {
  const std::vector<int64_t> balanced(8, 256);
  const std::vector<int64_t> skewed = {400, 320, 288, 256, 224, 192, 224, 144};
  for (int threads : {1, 2}) {
    const std::string t = "/threads:" + std::to_string(threads);
    for (const auto& [name, rows] : {std::pair{"balanced", balanced}, std::pair{"skewed", skewed}})
      benchmark::RegisterBenchmark(("grouped/gemm_batch/" + std::string(name) + t).c_str(), bm_grouped, rows, threads,
                                   false)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.3);
    benchmark::RegisterBenchmark(("grouped/dense_same_flops" + t).c_str(), bm_grouped, balanced, threads, true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.3);
  }
}

// Both operands of a shape in one storage, through the GemmOperand overload of gemm().
enum class Storage { f32, bf16, e4m3, mxfp8, nvfp4 };
const char* storage_name(Storage st) {
  switch (st) {
    case Storage::f32:
      return "f32";
    case Storage::bf16:
      return "bf16";
    case Storage::e4m3:
      return "e4m3";
    case Storage::mxfp8:
      return "mxfp8";
    case Storage::nvfp4:
      break;
  }
  return "nvfp4";
}

struct StoredMatrix {
  std::vector<float> f32;
  std::vector<lockstep::bf16> half;
  lockstep::QuantizedTensor q;
  StoredMatrix(Storage st, const std::vector<float>& x, int64_t rows, int64_t cols) {
    using lockstep::ElemFormat;
    switch (st) {
      case Storage::f32:
        f32 = x;
        break;
      case Storage::bf16:
        for (float v : x) half.push_back(lockstep::to_bf16(v));
        break;
      case Storage::e4m3:
        lockstep::quantize_tensorwise(
            q, x.data(), rows, cols, ElemFormat::e4m3,
            lockstep::fp8_scale_from_amax(lockstep::amax(x.data(), rows * cols), ElemFormat::e4m3));
        break;
      case Storage::mxfp8:
        lockstep::quantize_mxfp8(q, x.data(), rows, cols, ElemFormat::e4m3);
        break;
      case Storage::nvfp4:
        lockstep::quantize_nvfp4(q, x.data(), rows, cols);
        break;
    }
  }
  lockstep::GemmOperand operand(Storage st, int64_t cols, Trans t) const {
    if (st == Storage::f32) return lockstep::gemm_operand(f32.data(), cols, t);
    if (st == Storage::bf16) return lockstep::gemm_operand(half.data(), cols, t);
    return lockstep::gemm_operand(q, t);
  }
};

void bm_lowp(benchmark::State& state, Shape s, Storage st, int threads) {
  Operands op(s);
  const int64_t a_cols = s.ta == Trans::N ? s.K : s.M, b_cols = s.tb == Trans::N ? s.N : s.K;
  const StoredMatrix A(st, op.A, s.M * s.K / a_cols, a_cols), B(st, op.B, s.K * s.N / b_cols, b_cols);
  const lockstep::GemmOperand a = A.operand(st, a_cols, s.ta), b = B.operand(st, b_cols, s.tb);
  lockstep::ThreadPool pool(threads);
  lockstep::ThreadPool::Bind bind(&pool);
  lockstep::GemmOptions opt;
  opt.accumulate = s.accumulate;
  for (auto _ : state) {
    lockstep::gemm(op.C.data(), s.N, a, b, s.M, s.N, s.K, opt);
    benchmark::ClobberMemory();
  }
  set_flops(state, s);
}

std::string shape_name(const Shape& s) {
  return std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) + "/" +
         (s.ta == Trans::N ? "N" : "T") + (s.tb == Trans::N ? "N" : "T");
}

void register_pair(const std::string& group, const Shape& s, int threads) {
  // (Built by appending: "/" + a temporary string trips GCC 12's -Wrestrict false positive.)
  std::string suffix = "/";
  suffix += shape_name(s) + "/threads:" + std::to_string(threads);
  for (const bool lockstep : {true, false}) {
    const std::string name = group + (lockstep ? "/lockstep" : "/openblas") + suffix;
    auto* b = lockstep ? benchmark::RegisterBenchmark(name.c_str(), bm_lockstep, s, threads, "", 0)
                       : benchmark::RegisterBenchmark(name.c_str(), bm_openblas, s, threads);
    b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
  }
}

// The micro-kernels gemm() does not pick here (AVX2 on an AVX-512 machine, portable): what a CPU
// without AVX-512, or a portable build, would get.
void register_other_kernels(const Shape& s, int threads) {
  const std::vector<std::string> kernels = lockstep::detail::gemm_kernels();
  for (size_t k = 1; k < kernels.size(); ++k) {
    const std::string name = "kernel/" + kernels[k] + "/" + shape_name(s) + "/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark(name.c_str(), bm_lockstep, s, threads, kernels[k], 0)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.3);
  }
}

// determinism = "layout"'s segmented products (GemmOptions::k_segments,
// docs/design/reductions.md#one-fma-chain-per-gemm-element): the same shape as one chain over K (segments 0), as one
// segment (C = init + the chain), and in 8 canonical segments summed along the tree (the fold in the kernel's
// epilogue). The shapes of moe-peer's layout-mode GEMMs: the attention proj forward (K = 256: segments of 32), an
// expert's proj forward (256 rows, K = 512: 64), an expert's weight gradient (K = its 256 rows: 32).
void register_segmented() {
  const Shape shapes[] = {{1024, 256, 256, Trans::N, Trans::T, false},
                          {256, 256, 512, Trans::N, Trans::T, false},
                          {512, 256, 256, Trans::T, Trans::N, true}};
  for (const Shape& s : shapes)
    for (int threads : {1, 2})
      for (int64_t segments : {0, 1, 8}) {
        std::string name = "segmented/";
        name += shape_name(s);
        name += "/segments:" + std::to_string(segments);
        name += "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), bm_lockstep, s, threads, std::string(), segments)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.3);
      }
}

void register_lowp() {
  const Shape shapes[] = {{1024, 1024, 1024, Trans::N, Trans::T, false},
                          {1024, 1024, 256, Trans::N, Trans::T, false},  // fc forward
                          {1024, 256, 1024, Trans::N, Trans::N, false},  // fc input grad
                          {1024, 256, 1024, Trans::T, Trans::N, true},   // fc weight grad
                          {32, 4096, 4096, Trans::N, Trans::T, false}};  // few rows: streams W
  for (const Shape& s : shapes) {
    for (int threads : {1, 2}) {
      for (Storage st : {Storage::f32, Storage::bf16, Storage::e4m3, Storage::mxfp8, Storage::nvfp4}) {
        const std::string name =
            std::string("lowp/") + storage_name(st) + "/" + shape_name(s) + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), bm_lowp, s, st, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.3);
      }
    }
  }
}

void register_all() {
  const Shape reference[] = {{1024, 1024, 1024, Trans::N, Trans::N, false},
                             {256, 4096, 1024, Trans::N, Trans::N, false},
                             {256, 1024, 4096, Trans::N, Trans::N, false}};
  for (const Shape& s : reference) {
    for (int threads : {1, 2}) register_pair("ref", s, threads);
  }
  for (const Shape& s : reference) register_other_kernels(s, 2);
  constexpr int64_t tokens = 1024;
  // (out, in) of the peer's linear layers: qkv, attention proj, fc, fc proj, lm head.
  const int64_t layers[][2] = {{768, 256}, {256, 256}, {1024, 256}, {256, 1024}, {8192, 256}};
  for (const auto& l : layers) {
    const int64_t out = l[0], in = l[1];
    register_pair("model", {tokens, out, in, Trans::N, Trans::T, false}, 2);
    register_pair("model", {tokens, in, out, Trans::N, Trans::N, false}, 2);
    register_pair("model", {out, in, tokens, Trans::T, Trans::N, true}, 2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("lockstep_gemm_kernel", lockstep::gemm_kernel_name());
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  register_all();
  register_grouped();
  register_lowp();
  register_segmented();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
