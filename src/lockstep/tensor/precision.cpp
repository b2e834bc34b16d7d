#include "lockstep/tensor/precision.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/dtype.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = to_f32(to_bf16(x[i]));
}

std::vector<int64_t> layout_cut(std::span<const int64_t> segments, std::span<const int64_t> sections) {
  std::vector<int64_t> b;
  if (segments.empty()) return b;
  if (sections.empty()) return {segments.begin(), segments.end()};
  const size_t per = segments.size() / sections.size();
  int64_t at = 0;
  b.push_back(0);
  for (size_t j = 0; j < sections.size(); ++j) {
    for (size_t k = 1; k < per; ++k) b.push_back(at + segments[j * per + k]);
    at += sections[j];
  }
  return b;
}

namespace {

Precision::Recipe recipe_of(const PrecisionConfig& pc) {
  using R = Precision::Recipe;
  if (pc.fp4 == "nvfp4") return R::nvfp4;
  if (pc.fp8 == "delayed") return R::delayed;
  if (pc.fp8 == "tensorwise") return R::tensorwise;
  if (pc.fp8 == "blockwise") return R::blockwise;
  if (pc.fp8 == "mxfp8") return R::mxfp8;
  return R::none;
}

Trans flip(Trans t) { return t == Trans::N ? Trans::T : Trans::N; }

// out (cols, rows) = x (rows, cols)^T.
void transpose(const Ops& ops, std::vector<float>& out, const float* x, int64_t rows, int64_t cols) {
  out.resize(static_cast<size_t>(rows * cols));
  ops.transpose(out.data(), x, rows, cols);
}

// out (padded, cols) = the random Hadamard transform along the rows of x (rows, cols) padded with
// zero rows to a multiple of 16; returns padded.
int64_t hadamard_rows(const Ops& ops, std::vector<float>& out, const float* x, int64_t rows, int64_t cols) {
  const int64_t padded = (rows + 15) / 16 * 16;
  out.resize(static_cast<size_t>(padded * cols));
  ops.copy(out.data(), x, rows * cols);
  ops.fill(out.data() + rows * cols, (padded - rows) * cols, 0.0f);
  if (padded > 0) ops.hadamard16(out.data(), out.data(), padded, cols, HadamardAxis::rows);
  return padded;
}

}  // namespace

Precision::Precision(const PrecisionConfig& pc, const ParamStore& ps, int64_t L)
    : device_(&ps.device()),
      bf16_(pc.params == "bf16"),
      recipe_(recipe_of(pc)),
      bwd_(pc.fp8_format == "e4m3" ? ElemFormat::e4m3 : ElemFormat::e5m2),
      history_len_(pc.fp8_amax_history_len),
      most_recent_(pc.fp8_amax_compute_algo == "most_recent"),
      margin_(static_cast<int>(pc.fp8_margin)) {
  first_site_.assign(ps.specs().size(), -1);
  if (recipe_ == Recipe::none) return;
  static const std::regex quantised(
      R"(layers\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj|moe\.shared\.fc|moe\.shared\.proj|moe\.experts\.fc|moe\.experts\.proj)\.weight)");
  const int64_t keep = recipe_ == Recipe::nvfp4 ? pc.fp4_high_precision_layers : 0;
  for (size_t i = 0; i < ps.specs().size(); ++i) {
    const ParamSpec& p = ps.specs()[i];
    std::smatch m;
    if (!std::regex_match(p.name, m, quantised)) continue;
    const int64_t layer = std::stoll(m[1].str());
    if (layer < keep || layer >= L - keep) continue;  // selective high precision
    first_site_[i] = static_cast<int64_t>(sites_.size());
    const int64_t E = p.shape.rank() == 3 ? p.shape[0] : 1, first = p.shape.rank() == 3 ? p.boxes[0].offset[0] : 0;
    // An expert tensor's boxes may cut an expert in several (SwiGLU's fc under expert tensor parallelism:
    // one box per (expert, gate / up section), the local shape's dimension 0 summed over them, so E
    // counts sections and the sites past the experts go unused, not saved; kept so that run mode's site
    // numbers, which key stochastic rounding, stay): the experts, each holding local rows out / experts.
    const int64_t experts =
        p.shape.rank() == 3 ? p.boxes.back().offset[0] + p.boxes.back().shape[0] - p.boxes[0].offset[0] : 1;
    for (int64_t e = 0; e < E; ++e) {
      Site s;
      s.global_name = p.shape.rank() == 3 ? p.name + "." + std::to_string(first + e) : p.name;
      s.global_key = purpose_id(s.global_name);
      s.expert = p.expert;
      s.unused = e >= experts;
      const int out_dim = p.shape.rank() - 2, in_dim = p.shape.rank() - 1;
      if (!p.expert) {
        const bool tokens_split = ps.pieced() || ps.rows_tokens(static_cast<int>(i), 1) != 1;
        const bool out_split = p.shape[out_dim] < p.global_shape[out_dim],
                   in_split = p.shape[in_dim] < p.global_shape[in_dim];
        s.whole[input] = !tokens_split && !in_split;
        s.whole[weight] = !out_split && !in_split;
        s.whole[grad] = !tokens_split && !out_split;
      }
      if (p.role.cut_dim == in_dim) s.cut_in = p.role.cut;
      if (p.role.cut_dim == out_dim) {
        s.cut_out = p.role.cut;
        s.out_len = p.global_shape[out_dim];
        // This rank's out rows (the first expert's boxes: every expert's are alike) in the whole tensor.
        for (const ParamBox& b : p.boxes)
          if (out_dim == 0 || b.offset[0] == p.boxes[0].offset[0])
            for (int64_t i = 0; i < b.shape[out_dim]; ++i) s.out_global.push_back(b.offset[out_dim] + i);
        LOCKSTEP_CHECK(static_cast<int64_t>(s.out_global.size()) * experts * p.shape[in_dim] == p.shape.numel(), p.name,
                       ": boxes along out");
      }
      if (recipe_ == Recipe::delayed)
        for (AmaxHistory& h : s.state) h.amax.assign(static_cast<size_t>(history_len_), 0.0f);
      sites_.push_back(std::move(s));
    }
  }
}

void Precision::round(float* x, int64_t n) const {
  if (!bf16_) return;
  device_->ops.round_bf16(x, x, n);
}

Precision::Recipe Precision::recipe(int w) const {
  return w >= 0 && static_cast<size_t>(w) < first_site_.size() && first_site_[w] >= 0 ? recipe_ : Recipe::none;
}

void Precision::begin_micro_batch(uint64_t seed, int64_t step, int64_t micro) {
  seed_ = seed;
  step_ = step;
  micro_ = micro;
  recording_ = true;
}

namespace {

void max_reduce(Communicator* g, float* a, int64_t n) {
  if (g && g->size() > 1 && n > 0) g->all_reduce(a, n, ReduceOp::max);
}

}  // namespace

void Precision::reduce_amax(float* a, int64_t n, bool expert) {
  max_reduce(
      recording_ ? (expert ? groups_.expert : groups_.dense) : (expert ? groups_.expert_eval : groups_.dense_eval), a,
      n);
}

std::vector<float> Precision::current_amaxes(const std::vector<AmaxOf>& of) {
  device_->host_sync("fp8.amax");  // the current amaxes, max-reduced and turned into scales on the host
  std::vector<float> a(of.size());
  for (size_t i = 0; i < of.size(); ++i) a[i] = of[i].n > 0 ? device_->ops.amax(of[i].x, of[i].n) : 0.0f;
  if (!of.empty())
    reduce_amax(a.data(), static_cast<int64_t>(a.size()), sites_[static_cast<size_t>(of[0].site)].expert);
  for (size_t i = 0; i < of.size(); ++i) sites_[static_cast<size_t>(of[i].site)].now[of[i].r] = a[i];
  return a;
}

QuantizedTensor& Precision::kept(Site& s, Role r, int64_t blk) {
  auto at = [](auto& v, size_t i) -> auto& {
    if (v.size() <= i) v.resize(i + 1);
    return v[i];
  };
  const auto k = static_cast<size_t>(slot_);
  if (blk < 0) return r == input ? at(s.x, k) : s.dy;
  return at(r == input ? at(s.block_x, k) : s.block_dy, static_cast<size_t>(blk));
}

void Precision::end_micro_batch() {
  if (recipe_ == Recipe::delayed && recording_ && !groups_.per_step) update_histories(groups_.dense, groups_.expert);
  recording_ = false;
}

void Precision::end_step() {
  if (recipe_ == Recipe::delayed && groups_.per_step) update_histories(groups_.dense_step, groups_.expert_step);
}

void Precision::update_histories(Communicator* dense, Communicator* expert_group) {
  // The staged amax of every tensor, reduced over its group: one all-reduce per group.
  for (const bool expert : {false, true}) {
    std::vector<float> staged;
    for (const Site& s : sites_)
      if (s.expert == expert)
        for (const AmaxHistory& h : s.state) staged.push_back(h.amax[0]);
    max_reduce(expert ? expert_group : dense, staged.data(), static_cast<int64_t>(staged.size()));
    size_t i = 0;
    for (Site& s : sites_)
      if (s.expert == expert)
        for (AmaxHistory& h : s.state) h.amax[0] = staged[i++];
  }
  for (Site& s : sites_)
    for (int r = 0; r < 3; ++r) {
      AmaxHistory& h = s.state[r];
      float a = h.amax[0];
      if (!most_recent_)
        for (float v : h.amax) a = std::isnan(a) || std::isnan(v) ? NAN : std::max(a, v);
      h.scale = fp8_scale_from_amax(a, r == grad ? bwd_ : fwd_, margin_, h.scale);
      std::rotate(h.amax.begin(), h.amax.begin() + 1, h.amax.end());
      h.amax[0] = 0.0f;
    }
}

std::vector<Precision::NamedHistory> Precision::amax_histories() {
  std::vector<NamedHistory> out;
  if (recipe_ != Recipe::delayed) return out;
  static const char* const kRole[3] = {"input", "weight", "grad"};
  for (Site& s : sites_)
    for (int r = 0; r < 3 && !s.unused; ++r) out.push_back({s.global_name + "." + kRole[r], s.expert, &s.state[r]});
  return out;
}

bool Precision::in_pieces(const Site& s) const {
  return groups_.layout && (recipe_ == Recipe::blockwise || recipe_ == Recipe::mxfp8 || recipe_ == Recipe::nvfp4) &&
         (!s.cut_out.empty() || !s.cut_in.empty());
}

const float* Precision::nvfp4_tensor_amax(float& a, const float* x, int64_t n, const Site& s, Role r) {
  if (!groups_.layout) return nullptr;
  if (nvfp4_amax_ == Nvfp4Amax::staged) return &s.now[r];
  device_->host_sync("nvfp4.amax");  // the tensor amax, reduced on the host
  a = device_->ops.amax(x, n);
  if (nvfp4_amax_ == Nvfp4Amax::gathered) {
    max_reduce(gathered_group_, &a, 1);
    return &a;
  }
  if (!s.whole[r]) reduce_amax(&a, 1, s.expert);
  return &a;
}

StochasticRounding Precision::nvfp4_rounding(int64_t site, uint64_t usage, int64_t grows, int64_t gcols, int64_t grow,
                                             int64_t gcol) const {
  StochasticRounding sr;
  sr.enabled = true;
  sr.seed = seed_;
  sr.step = static_cast<uint64_t>(step_);
  // The site's key from its name in the whole model (an expert's index in its layer): the same on
  // any expert-parallel or pipeline layout, and no two tensors of a run share one (pipeline stages
  // or expert-parallel ranks counting their own sites would).
  sr.tensor_id = sites_[static_cast<size_t>(site)].global_key * 4 + usage;
  sr.index_base = micro_ * grows * gcols + grow * gcols + gcol;
  sr.global_cols = gcols;
  return sr;
}

GemmOperand Precision::quantise_pieces(std::vector<float>& dst, const float* x, int64_t rows, int64_t cols, Trans t,
                                       bool k_along_cols, Role r, int64_t site, uint64_t usage, Dim rd, Dim cd,
                                       const TokenShare& tokens) {
  const Site& s = sites_[static_cast<size_t>(site)];
  // Scratch per (rank) thread, kept across calls: no allocation per quantised operand in steady state.
  thread_local std::vector<float> tr;
  if (!k_along_cols && recipe_ != Recipe::blockwise) {  // mxfp8 and nvfp4 block along rows: the transpose
    transpose(device_->ops, tr, x, rows, cols);
    x = tr.data();
    std::swap(rows, cols);
    std::swap(rd, cd);
    t = flip(t);
    k_along_cols = true;
  }
  auto bounds = [&](Dim d, int64_t n) {
    const std::vector<int64_t> c = d == Dim::out  ? s.cut_out
                                   : d == Dim::in ? s.cut_in
                                                  : std::vector<int64_t>(tokens.cut.begin(), tokens.cut.end());
    LOCKSTEP_CHECK(c.empty() || c.back() == n, "canonical pieces of ", c.back(), " for ", n, " elements");
    return c.empty() ? std::vector<int64_t>{0, n} : c;
  };
  const std::vector<int64_t> rb = bounds(rd, rows), cb = bounds(cd, cols);
  // Global coordinates (stochastic rounding keys): a column-parallel shard's out rows are the whole
  // tensor's rows out_global, a cp rank's token pieces their micro-batch tokens (i: a piece's start).
  auto global = [&](Dim d, int64_t i) {
    if (d == Dim::tokens && !tokens.first.empty()) {
      const auto at = std::lower_bound(tokens.cut.begin(), tokens.cut.end(), i);
      LOCKSTEP_CHECK(at != tokens.cut.end() && *at == i, "token ", i, " starts no token piece");
      return tokens.first[static_cast<size_t>(at - tokens.cut.begin())];
    }
    return d == Dim::out && !s.out_global.empty() ? s.out_global[i] : i;
  };
  auto length = [&](Dim d, int64_t n) {
    if (d == Dim::tokens && tokens.total) return tokens.total;
    return d == Dim::out && !s.out_global.empty() ? s.out_len : n;
  };
  const ElemFormat f = r == grad ? bwd_ : fwd_;
  float a = 0.0f;
  const float* whole = recipe_ == Recipe::nvfp4 ? nvfp4_tensor_amax(a, x, rows * cols, s, r) : nullptr;
  dst.resize(static_cast<size_t>(rows * cols));
  // The pieces are independent (each quantised from its own values): many of them are split over the
  // threads, each piece quantised on one (the quantisers inside run serially there), a few go one at a
  // time, each quantiser parallel. The same bits either way.
  const int64_t nj = static_cast<int64_t>(cb.size()) - 1, np = (static_cast<int64_t>(rb.size()) - 1) * nj;
  const auto pieces = [&](int64_t p0, int64_t p1) {
    // Scratch per thread, kept across calls.
    thread_local std::vector<float> copy;
    QuantizedTensor q;
    for (int64_t p = p0; p < p1; ++p) {
      const size_t i = static_cast<size_t>(p / nj), j = static_cast<size_t>(p % nj);
      const int64_t r0 = rb[i], c0 = cb[j], pr = rb[i + 1] - r0, pc = cb[j + 1] - c0;
      if (pr == 0 || pc == 0) continue;
      // The piece, contiguous: whole rows are already; a column range is copied out.
      const float* piece = x + r0 * cols;
      if (pc != cols) {
        copy.resize(static_cast<size_t>(pr * pc));
        device_->ops.copy_rows(copy.data(), pc, x + r0 * cols + c0, cols, pr, pc);
        piece = copy.data();
      }
      switch (recipe_) {
        case Recipe::blockwise: {
          const int64_t br = r == weight || !k_along_cols ? 128 : 1, bc = r == weight || k_along_cols ? 128 : 1;
          device_->ops.quantize_blockwise(q, piece, pr, pc, f, br, bc, {});
          break;
        }
        case Recipe::mxfp8:
          device_->ops.quantize_mxfp8(q, piece, pr, pc, f, ScaleRounding::up, 32, {});
          break;
        case Recipe::nvfp4: {
          StochasticRounding sr;
          if (r == grad)
            sr = nvfp4_rounding(site, usage, length(rd, rows), length(cd, cols), global(rd, r0), global(cd, c0));
          device_->ops.quantize_nvfp4(q, piece, pr, pc, r == weight ? 16 : 1, sr, whole);
          break;
        }
        default:
          LOCKSTEP_CHECK(false, "pieces need a block recipe");
      }
      // Decoded straight into place (over the threads when the pieces go one at a time; serial
      // inside a worker).
      device_->ops.dequantize(dst.data() + r0 * cols + c0, cols, q);
    }
  };
  if (np >= 4 * current_threads())
    parallel_for(np, pieces);
  else
    pieces(0, np);
  return gemm_operand(dst.data(), cols, t);
}

GemmOperand Precision::quantise(QuantizedTensor& q, std::vector<float>& scratch, const float* x, int64_t rows,
                                int64_t cols, Trans t, bool k_along_cols, Role r, int64_t site, uint64_t usage, Dim rd,
                                Dim cd, const TokenShare& tokens) {
  const bool blocks = recipe_ == Recipe::blockwise || recipe_ == Recipe::mxfp8 || recipe_ == Recipe::nvfp4;
  if (in_pieces(sites_[static_cast<size_t>(site)]) || (groups_.layout && blocks && !tokens.cut.empty()))
    return quantise_pieces(scratch, x, rows, cols, t, k_along_cols, r, site, usage, rd, cd, tokens);
  const int64_t n = rows * cols;
  const ElemFormat f = r == grad ? bwd_ : fwd_;
  switch (recipe_) {
    case Recipe::delayed: {
      AmaxHistory& h = sites_[static_cast<size_t>(site)].state[r];
      if (recording_) {
        device_->host_sync("fp8.amax");  // staged into the history on the host
        const float a = device_->ops.amax(x, n);
        if (!(a <= h.amax[0]) && !std::isnan(h.amax[0])) h.amax[0] = a;  // also stages a NaN, which stays
      }
      device_->ops.quantize_tensorwise(q, x, rows, cols, f, h.scale, {});
      return gemm_operand(q, t);
    }
    case Recipe::tensorwise:  // the amax staged by current_amaxes
      device_->ops.quantize_tensorwise(q, x, rows, cols, f,
                                       fp8_scale_from_amax(sites_[static_cast<size_t>(site)].now[r], f), {});
      return gemm_operand(q, t);
    case Recipe::blockwise: {
      const int64_t br = r == weight || !k_along_cols ? 128 : 1, bc = r == weight || k_along_cols ? 128 : 1;
      device_->ops.quantize_blockwise(q, x, rows, cols, f, br, bc, {});
      return gemm_operand(q, t);
    }
    case Recipe::mxfp8:
      if (k_along_cols) {
        device_->ops.quantize_mxfp8(q, x, rows, cols, f, ScaleRounding::up, 32, {});
        return gemm_operand(q, t);
      }
      transpose(device_->ops, scratch, x, rows, cols);
      device_->ops.quantize_mxfp8(q, scratch.data(), cols, rows, f, ScaleRounding::up, 32, {});
      return gemm_operand(q, flip(t));
    case Recipe::nvfp4: {
      if (r == weight) {  // 16x16 blocks: the same codes serve both directions of K
        float a = 0.0f;
        device_->ops.quantize_nvfp4(q, x, rows, cols, 16, {},
                                    nvfp4_tensor_amax(a, x, n, sites_[static_cast<size_t>(site)], r));
        return gemm_operand(q, t);
      }
      float a = 0.0f;
      const float* whole = nvfp4_tensor_amax(a, x, n, sites_[static_cast<size_t>(site)], r);
      // 1x16 blocks along K: K along the rows is quantised transposed.
      const float* src = x;
      int64_t qr = rows, qc = cols;
      if (!k_along_cols) {
        transpose(device_->ops, scratch, x, rows, cols);
        src = scratch.data();
        std::swap(qr, qc);
      }
      StochasticRounding sr;
      if (r == grad) sr = nvfp4_rounding(site, usage, qr, qc, 0, 0);
      device_->ops.quantize_nvfp4(q, src, qr, qc, 1, sr, whole);
      return gemm_operand(q, k_along_cols ? t : flip(t));
    }
    case Recipe::none:
      break;
  }
  LOCKSTEP_CHECK(false, "quantise without a low-precision recipe");
  return {};
}

bool Precision::per_tensor() const { return recipe_ == Recipe::delayed || recipe_ == Recipe::tensorwise; }

void Precision::gemm_fprop(int64_t site, const float* w, float* y, int64_t ldy, const float* x, int64_t N, int64_t out,
                           int64_t in, const GemmOptions& opt, int64_t blk) {
  Site& s = sites_[static_cast<size_t>(site)];
  const GemmOperand A = quantise(per_tensor() ? kept(s, input, blk) : qa_, ta_, x, N, in, Trans::N, true, input, site,
                                 0, Dim::tokens, Dim::in);
  const GemmOperand B =
      quantise(s.w, in_pieces(s) ? s.wf : tb_, w, out, in, Trans::T, true, weight, site, 0, Dim::out, Dim::in);
  device_->ops.gemm(y, ldy, A, B, N, out, in, opt);
}

void Precision::gemm_dgrad(int64_t site, const float* w, float* dx, const float* dy, int64_t N, int64_t out, int64_t in,
                           const GemmOptions& opt, int64_t blk, const TokenShare& tokens) {
  Site& s = sites_[static_cast<size_t>(site)];
  const GemmOperand A = quantise(per_tensor() ? kept(s, grad, blk) : qa_, ta_, dy, N, out, Trans::N, true, grad, site,
                                 0, Dim::tokens, Dim::out, tokens);
  // MXFP8 blocks the weight along in for fprop and along out here; every other recipe's weight
  // quantisation is the same both ways, so fprop's serves.
  const GemmOperand B = recipe_ == Recipe::mxfp8
                            ? quantise(qb_, tb_, w, out, in, Trans::N, false, weight, site, 0, Dim::out, Dim::in)
                        : in_pieces(s) ? gemm_operand(s.wf.data(), in, Trans::N)
                                       : gemm_operand(s.w, Trans::N);
  device_->ops.gemm(dx, in, A, B, N, in, out, opt);
}

void Precision::gemm_wgrad(int64_t site, float* dw, const float* dy, const float* x, int64_t N, int64_t out, int64_t in,
                           std::span<const int64_t> k_segments, int64_t blk, int64_t row0, bool accumulate) {
  GemmOptions acc;
  acc.accumulate = accumulate;
  acc.k_segments = k_segments;
  if (recipe_ == Recipe::nvfp4) {
    LOCKSTEP_CHECK(accumulate, "nvfp4 weight gradients accumulate");
    gemm_wgrad_nvfp4(site, std::span<float* const>(&dw, 1), dy, x, N, out, in, k_segments);
    return;
  }
  if (per_tensor()) {  // one scale for the whole tensor: the quantisations of fprop and dgrad serve
    Site& s = sites_[static_cast<size_t>(site)];
    device_->ops.gemm(dw, in, gemm_operand(kept(s, grad, blk), Trans::T, row0),
                      gemm_operand(kept(s, input, blk), Trans::N, row0), out, in, N, acc);
    return;
  }
  // Blocks along the tokens stop at the token segments (k_segments).
  const TokenShare segments{k_segments, {}, 0};
  const GemmOperand A = quantise(qa_, ta_, dy, N, out, Trans::T, false, grad, site, 1, Dim::tokens, Dim::out, segments);
  const GemmOperand B = quantise(qb_, tb_, x, N, in, Trans::N, false, input, site, 1, Dim::tokens, Dim::in, segments);
  device_->ops.gemm(dw, in, A, B, out, in, N, acc);
}

void Precision::gemm_wgrad_nvfp4(int64_t site, std::span<float* const> dw, const float* dy, const float* x, int64_t N,
                                 int64_t out, int64_t in, std::span<const int64_t> k_segments,
                                 const TokenShare& tokens) {
  // (Q dy)^T (Q x) = dy^T x: the transform cancels, the quantisation sees the spread values.
  const int64_t K = hadamard_rows(device_->ops, ha_, dy, N, out);
  hadamard_rows(device_->ops, hb_, x, N, in);
  GemmOptions acc;
  acc.accumulate = true;
  // The zero rows that pad K belong to the last token segment (they add nothing; token pieces: the
  // segments are each piece's, and nothing pads).
  std::vector<int64_t> padded(k_segments.begin(), k_segments.end());
  if (!padded.empty() && dw.size() == 1) padded.back() = K;
  acc.k_segments = padded;
  LOCKSTEP_CHECK(tokens.cut.empty() || K == N, "nvfp4 weight gradient: a share of ", N, " tokens pads to ", K);
  const GemmOperand A =
      quantise(qa_, ta_, ha_.data(), K, out, Trans::T, false, grad, site, 1, Dim::tokens, Dim::out, tokens);
  const GemmOperand B =
      quantise(qb_, tb_, hb_.data(), K, in, Trans::N, false, input, site, 1, Dim::tokens, Dim::in, tokens);
  if (dw.size() == 1) {
    device_->ops.gemm(dw[0], in, A, B, out, in, K, acc);
    return;
  }
  // Token pieces: each output reads its rows, K along the columns of both operands' fp32 storage
  // (quantise_pieces: A as (out, K), B as (in, K) transposed), 16-row aligned, so nothing pads.
  const int64_t P = static_cast<int64_t>(dw.size()), rows = N / P;
  LOCKSTEP_CHECK(K == N && rows * P == N && A.kind == GemmOperand::Kind::f32 && B.kind == GemmOperand::Kind::f32 &&
                     A.trans == Trans::N && B.trans == Trans::T,
                 "nvfp4 weight gradient of ", N, " rows in ", P, " token pieces");
  for (int64_t p = 0; p < P; ++p) {
    GemmOperand a = A, b = B;
    a.data = static_cast<const float*>(A.data) + p * rows;
    b.data = static_cast<const float*>(B.data) + p * rows;
    device_->ops.gemm(dw[static_cast<size_t>(p)], in, a, b, out, in, rows, acc);
  }
}

TokenShare Precision::piece_tokens(const ParamStore& ps, int w, int64_t N) {
  const int64_t K = ps.token_pieces(w);
  if (recipe_ != Recipe::nvfp4 || !groups_.layout) return {};
  if (!ps.pieced()) {  // a tp rank's rows of a sequence-parallel parameter (the MoE shared expert)
    if (ps.rows_tokens(w, N) == N) return {};
    piece_cut_ = {0, N};
    piece_first_ = {ps.rows_token(w, N)};
    return {piece_cut_, piece_first_, ps.rows_tokens(w, N)};
  }
  // (A tp rank's share of the cp rank's rows, the MoE shared expert's under tensor parallelism: its
  // units, one piece even when a unit is part of a chunk.)
  if (K == 1 && !ps.sequence_tp(w)) return {};
  piece_cut_.resize(static_cast<size_t>(K + 1));
  piece_first_.resize(static_cast<size_t>(K));
  for (int64_t k = 0; k <= K; ++k) piece_cut_[static_cast<size_t>(k)] = k * N / K;
  for (int64_t k = 0; k < K; ++k) piece_first_[static_cast<size_t>(k)] = ps.unit_token(w, k);
  return {piece_cut_, piece_first_, ps.micro_batch_tokens()};
}

void Precision::fprop(const ParamStore& ps, int w, float* y, const float* x, int64_t N, int64_t out, int64_t in,
                      const GemmOptions& opt, bool partial) {
  if (recipe(w) == Recipe::tensorwise)
    current_amaxes({{first_site_[w], input, x, N * in}, {first_site_[w], weight, ps.weight(w), out * in}});
  if (recipe(w) == Recipe::none)
    gemm_f32(ps.device().ops, y, x, Trans::N, ps.weight(w), Trans::T, N, out, in, opt);
  else
    gemm_fprop(first_site_[w], ps.weight(w), y, out, x, N, out, in, opt);
  if (!partial) round(y, N * out);
}

void Precision::dgrad(const ParamStore& ps, int w, float* dx, const float* dy, int64_t N, int64_t out, int64_t in,
                      const GemmOptions& opt, bool partial) {
  if (recipe(w) == Recipe::tensorwise) current_amaxes({{first_site_[w], grad, dy, N * out}});
  if (recipe(w) == Recipe::none)
    gemm_f32(ps.device().ops, dx, dy, Trans::N, ps.weight(w), Trans::N, N, in, out, opt);
  else
    gemm_dgrad(first_site_[w], ps.weight(w), dx, dy, N, out, in, opt, -1, piece_tokens(ps, w, N));
  if (!partial) round(dx, N * in);
}

void Precision::wgrad(const ParamStore& ps, int w, const float* dy, const float* x, int64_t N, int64_t out,
                      int64_t in) {
  // determinism = "layout": a sum over tokens that a layout may split (ParamStore::token_segments)
  // runs in canonical token segments, K of this GEMM.
  // Under context parallelism each piece of the rank's rows separately (ParamStore::token_pieces).
  const int64_t K = ps.token_pieces(w), rows = N / K;
  LOCKSTEP_CHECK(K * rows == N, "wgrad: ", K, " token pieces of ", rows, " rows for ", N, " rows");
  const std::vector<int64_t> bounds = canonical_segments(rows, ps.token_segments(w));
  const TokenShare share = piece_tokens(ps, w, N);
  if (recipe(w) == Recipe::nvfp4 && !share.first.empty()) {
    // NVFP4 on a share of the micro-batch's tokens (context parallelism's pieces, a tp rank's rows of
    // the shared expert): the rank's rows transformed and quantised at once (one tensor amax, each
    // piece's tokens keyed as the micro-batch's), then multiplied piece by piece.
    piece_grads_.resize(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) piece_grads_[static_cast<size_t>(k)] = ps.grad_piece(w, k);
    gemm_wgrad_nvfp4(first_site_[w], piece_grads_, dy, x, N, out, in, bounds, share);
    return;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* dyk = dy + k * rows * out;
    const float* xk = x + k * rows * in;
    if (recipe(w) != Recipe::none) {
      // Per-tensor scaling reads the piece's rows of the operands fprop and dgrad quantised whole.
      gemm_wgrad(first_site_[w], ps.grad_piece(w, k), dyk, xk, rows, out, in, bounds, -1, k * rows);
      continue;
    }
    GemmOptions acc;
    acc.accumulate = true;
    acc.k_segments = bounds;
    gemm_f32(ps.device().ops, ps.grad_piece(w, k), dyk, Trans::T, xk, Trans::N, out, in, rows, acc);
  }
}

bool Precision::row_share_amaxes(const RowShare* share, const ExpertBlocks* blocks, int w) const {
  if (!share || recipe(w) != Recipe::nvfp4) return false;
  // (With a group of G > 1 ranks, one block per expert: its rows are the expert's.)
  LOCKSTEP_CHECK((!blocks || blocks->sources == 1) && groups_.layout,
                 "a share of the experts' rows needs nvfp4 under layout, one block per expert");
  return true;
}

template <typename F>
void Precision::for_each_block(const int64_t* offsets, const ExpertBlocks* blocks, int64_t E, F f) {
  const int64_t S = blocks ? blocks->sources : 1;
  const int64_t* seg = blocks ? blocks->segments : offsets;
  const int64_t own = micro_;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r0 = seg[e * S + s], rows = seg[e * S + s + 1] - r0;
      if (rows == 0) continue;
      if (blocks) micro_ = own + (s - blocks->self) * blocks->micros;  // the block's micro-batch keys its draws
      f(e, blocks ? s : -1, r0, rows);
    }
  micro_ = own;
}

void Precision::grouped_fprop(const ParamStore& ps, int w, int b, float* y, const float* x, const int64_t* offsets,
                              int64_t E, int64_t out, int64_t in, const ExpertBlocks* blocks, const KSegments& seg,
                              bool partial, const RowShare* share) {
  const float* bias = b >= 0 && !partial ? ps.weight(b) : nullptr;
  if (recipe(w) == Recipe::none) {
    LOCKSTEP_CHECK(!blocks, "per-source expert blocks need a quantised recipe");
    if (seg.on())
      ps.device().ops.grouped_gemm_segmented(y, gemm_operand(x, in, Trans::N), gemm_operand(ps.weight(w), in, Trans::T),
                                             bias, offsets, E, out, in, seg);
    else
      ps.device().ops.grouped_gemm(y, gemm_operand(x, in, Trans::N), gemm_operand(ps.weight(w), in, Trans::T), bias,
                                   offsets, E, out, in, false);
  } else {
    const KSegmentBounds bounds = seg.on() ? k_segment_bounds(seg, in) : KSegmentBounds{};
    const int64_t S = blocks ? blocks->sources : 1;
    const int64_t* seg = blocks ? blocks->segments : offsets;
    // Tensorwise, and NVFP4 under a RowShare (its tensor amax): per expert each block's input amax,
    // then the weight's, reduced at once into Site::now.
    const bool shared = row_share_amaxes(share, blocks, w);
    const Nvfp4AmaxScope scope(*this, shared ? Nvfp4Amax::staged : Nvfp4Amax::reduce);
    std::vector<float> now;
    if (recipe(w) == Recipe::tensorwise || shared) {
      std::vector<AmaxOf> of;
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t s = 0; s < S; ++s) {
          const int64_t r0 = seg[e * S + s], rows = seg[e * S + s + 1] - r0;
          of.push_back({first_site_[w] + e, input, x + r0 * in, rows * in});
        }
        of.push_back({first_site_[w] + e, weight, ps.weight(w) + e * out * in, out * in});
      }
      now = current_amaxes(of);
    }
    for_each_block(offsets, blocks, E, [&](int64_t e, int64_t s, int64_t r0, int64_t rows) {
      if (s >= 0 && !now.empty()) sites_[static_cast<size_t>(first_site_[w] + e)].now[input] = now[e * (S + 1) + s];
      GemmOptions opt;
      if (bias) opt.bias = bias + e * out;
      bounds.apply(opt);
      gemm_fprop(first_site_[w] + e, ps.weight(w) + e * out * in, y + r0 * out, out, x + r0 * in, rows, out, in, opt,
                 s);
    });
  }
  if (!partial) round(y, offsets[E] * out);
}

void Precision::grouped_dgrad(const ParamStore& ps, int w, float* dx, const float* dy, const int64_t* offsets,
                              int64_t E, int64_t out, int64_t in, const ExpertBlocks* blocks, const KSegments& seg,
                              bool partial, const RowShare* share) {
  if (recipe(w) == Recipe::none) {
    LOCKSTEP_CHECK(!blocks, "per-source expert blocks need a quantised recipe");
    if (seg.on())
      ps.device().ops.grouped_gemm_segmented(dx, gemm_operand(dy, out, Trans::N),
                                             gemm_operand(ps.weight(w), in, Trans::N), nullptr, offsets, E, in, out,
                                             seg);
    else
      ps.device().ops.grouped_gemm(dx, gemm_operand(dy, out, Trans::N), gemm_operand(ps.weight(w), in, Trans::N),
                                   nullptr, offsets, E, in, out, false);
  } else {
    GemmOptions opt;
    const KSegmentBounds bounds = seg.on() ? k_segment_bounds(seg, out) : KSegmentBounds{};
    bounds.apply(opt);
    const int64_t S = blocks ? blocks->sources : 1;
    const int64_t* seg = blocks ? blocks->segments : offsets;
    // Tensorwise, and NVFP4 under a RowShare: each block's gradient amax, reduced at once.
    const bool shared = row_share_amaxes(share, blocks, w);
    const Nvfp4AmaxScope scope(*this, shared ? Nvfp4Amax::staged : Nvfp4Amax::reduce);
    std::vector<float> now;
    if (recipe(w) == Recipe::tensorwise || shared) {
      std::vector<AmaxOf> of;
      for (int64_t k = 0; k < E * S; ++k)
        of.push_back({first_site_[w] + k / S, grad, dy + seg[k] * out, (seg[k + 1] - seg[k]) * out});
      now = current_amaxes(of);
    }
    for_each_block(offsets, blocks, E, [&](int64_t e, int64_t s, int64_t r0, int64_t rows) {
      if (s >= 0 && !now.empty()) sites_[static_cast<size_t>(first_site_[w] + e)].now[grad] = now[e * S + s];
      // Under a RowShare the gradient's rows are the micro-batch's rows [first, first + rows) of e's.
      const int64_t cut[2] = {0, rows}, first = shared ? share->first[e] : 0;
      const TokenShare tokens =
          shared ? TokenShare{cut, std::span<const int64_t>(&first, 1), share->total[e]} : TokenShare{};
      gemm_dgrad(first_site_[w] + e, ps.weight(w) + e * out * in, dx + r0 * in, dy + r0 * out, rows, out, in, opt, s,
                 tokens);
    });
  }
  if (!partial) round(dx, offsets[E] * in);
}

void Precision::grouped_wgrad(const ParamStore& ps, int w, int b, const float* dy, const float* x,
                              const int64_t* offsets, int64_t E, int64_t out, int64_t in) {
  float* dbias = b >= 0 ? ps.grad(b) : nullptr;
  if (recipe(w) == Recipe::none) {
    const Ops& ops = ps.device().ops;
    ops.grouped_gemm_wgrad(ps.grad(w), gemm_operand(dy, out, Trans::T), gemm_operand(x, in, Trans::N), offsets, E, out,
                           in);
    if (dbias) ops.grouped_bias_grad(dbias, dy, offsets, E, out);
    return;
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    gemm_wgrad(first_site_[w] + e, ps.grad(w) + e * out * in, dy + r0 * out, x + r0 * in, rows, out, in);
    if (dbias) device_->ops.bias_backward(dbias + e * out, dy + r0 * out, rows, out, 0);
  }
}

void Precision::grouped_wgrad_gathered(int w, float* dw, float* db, const float* dy, const float* x,
                                       const int64_t* offsets, int64_t e0, int64_t e1, int64_t out, int64_t in,
                                       Communicator* etp) {
  LOCKSTEP_CHECK(recipe(w) == Recipe::nvfp4 && groups_.layout,
                 "gathered expert weight gradients need nvfp4 under layout");
  const Nvfp4AmaxScope scope(*this, Nvfp4Amax::gathered, etp);
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t r0 = offsets[e - e0], rows = offsets[e - e0 + 1] - r0;
    float* g = dw + e * out * in;
    // What one process accumulates into: the micro-batch's gradient starts from zero.
    device_->ops.fill(g, out * in, 0.0f);
    if (db) device_->ops.fill(db + e * out, out, 0.0f);
    if (rows == 0) continue;
    gemm_wgrad(first_site_[w] + e, g, dy + r0 * out, x + r0 * in, rows, out, in);
    if (db) device_->ops.bias_backward(db + e * out, dy + r0 * out, rows, out, 0);
  }
}

void Precision::grouped_wgrad_blocks(int w, float* dw, float* db, const float* dy, const float* x,
                                     const ExpertBlocks& blocks, int64_t E, int64_t out, int64_t in) {
  LOCKSTEP_CHECK(recipe(w) != Recipe::none, "per-source expert blocks need a quantised recipe");
  const int64_t S = blocks.sources;
  for_each_block(nullptr, &blocks, E, [&](int64_t e, int64_t s, int64_t r0, int64_t rows) {
    const int64_t k = e * S + s;
    if (blocks.whole)  // run mode: the block's rows of the expert's tensors (ExpertBlocks)
      gemm_wgrad(first_site_[w] + e, dw + k * out * in, dy + r0 * out, x + r0 * in, rows, out, in, {}, -1,
                 r0 - blocks.whole[e]);
    else
      gemm_wgrad(first_site_[w] + e, dw + k * out * in, dy + r0 * out, x + r0 * in, rows, out, in, {}, s);
    if (db) device_->ops.bias_backward(db + k * out, dy + r0 * out, rows, out, 0);
  });
}

void Precision::grouped_wgrad_segments(int w, float* const* dw, const float* dy, const float* x, const int64_t* rows,
                                       int64_t leaves, int64_t per, const ExpertBlocks* blocks, const int64_t* offsets,
                                       int64_t E, int64_t out, int64_t in) {
  LOCKSTEP_CHECK(recipe(w) != Recipe::none && recipe_ != Recipe::nvfp4 && leaves % E == 0 &&
                     (!blocks || (leaves / E) % blocks->sources == 0),
                 "token-segment expert weight gradients: ", leaves, " leaves of ", E, " experts need an FP8 recipe");
  const int64_t P = leaves / E, per_block = blocks ? P / blocks->sources : 1;
  std::vector<int64_t> bounds(static_cast<size_t>(per + 1));
  for (int64_t g = 0; g < leaves; ++g) {
    const int64_t e = g / P, r0 = rows[g * per], n = rows[(g + 1) * per] - r0;
    if (n == 0) {  // what the chains from zero give
      float* d = dw[g];
      device_->ops.fill(d, out * in, 0.0f);
      continue;
    }
    for (int64_t s = 0; s <= per; ++s) bounds[static_cast<size_t>(s)] = rows[g * per + s] - r0;
    // The block's kept operands (per-tensor scaling) start at its first row; without blocks the
    // expert's tensor starts at offsets[e]. A block may hold several leaves (the partners' token
    // units under context parallelism, model/moe/experts.h), each from its first row on.
    const int64_t blk = blocks ? g % P / per_block : -1;
    const int64_t row0 = r0 - (blocks ? blocks->segments[e * blocks->sources + blk] : offsets[e]);
    const int64_t block_end = blocks ? blocks->segments[e * blocks->sources + blk + 1] : offsets[e + 1];
    LOCKSTEP_CHECK(row0 >= 0 && r0 + n <= block_end && (!blocks || g % per_block != 0 || row0 == 0),
                   "token-segment expert weight gradient: leaf ", g, " starts at ", r0);
    gemm_wgrad(first_site_[w] + e, dw[g], dy + r0 * out, x + r0 * in, n, out, in, bounds, blk, row0, false);
  }
}

}  // namespace lockstep
