#include "lockstep/model/moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/trace.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/moe/allgather_dispatcher.h"
#include "lockstep/model/moe/alltoall_dispatcher.h"
#include "lockstep/model/moe/expert_tensor_parallel.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

MoeLayer::MoeLayer(ParamStore& ps, Arena& arena, const std::string& prefix, int64_t layer, const ModelConfig& m,
                   const MoeConfig& moe, int64_t B, int64_t T, const MoeGroups& groups)
    : ops_(&ps.device().ops),
      spec_(moe),
      layer_(layer),
      B_(B),
      T_(T),
      N_(B * T),
      C_(m.hidden_size),
      E_(moe.num_experts),
      K_(moe.router_topk),
      jitter_eps_(moe.input_jitter_eps),
      expert_bias_on_(moe.router_enable_expert_bias),
      F_(moe.ffn_hidden_size ? moe.ffn_hidden_size : m.ffn_hidden()),
      tp_(groups.tp),
      cp_(groups.cp),
      Tg_(T * groups.cp.size) {
  LOCKSTEP_CHECK(N_ % tp_.size == 0, "MoE layer: ", N_, " tokens not divisible by the tensor-parallel size ", tp_.size);
  Nl_ = N_ / tp_.size;
  row0_ = tp_.rank * Nl_;
  name_ = prefix + "moe";
  router_name_ = name_ + ".router";
  experts_name_ = name_ + ".experts";
  norm_ = Norm(ps, arena, prefix + "mlp_norm", m.normalization == "rmsnorm", C_, Nl_, static_cast<float>(m.norm_eps));
  router_w_ = ps.add(prefix + "moe.router.weight", {E_, C_}, Init::normal, static_cast<float>(m.init_std), true);
  ps.set_token_sum(router_w_);  // a sum over the layer's tokens, which tensor parallelism splits
  // Capacity is per rank that routes: its Nl tokens (Megatron's, under sequence parallelism too).
  // determinism = "layout" under tensor (or context) parallelism: the micro-batch's B x Tg tokens, as
  // one process has it; every rank drops over the gathered logits (forward).
  batch_capacity_ = groups.tp.layout() && (tp_.on() || cp_.on()) && spec_.capacity_factor > 0;
  capacity_ = expert_capacity(spec_, batch_capacity_ ? B_ * Tg_ : Nl_);
  if (batch_capacity_) {
    batch_idx_.resize(static_cast<size_t>(B_ * Tg_ * K_));
    batch_probs_.resize(static_cast<size_t>(B_ * Tg_ * K_));
    batch_kept_.resize(static_cast<size_t>(B_ * Tg_ * K_));
  }
  pad_ = moe.pad_expert_input_to_capacity;
  dispatcher_kind_ = moe.token_dispatcher;
  shared_overlap_ = moe.shared_expert_overlap;
  groups_ = groups;
  bf16_payload_ = ps.precision().bf16();
  Communicator* ep = groups.ep;
  const int64_t S = ep ? ep->size() : 1, El = E_ / S, first = ep ? ep->rank() * El : 0;
  make_dispatcher();
  const int64_t R = dispatcher_->max_rows();
  ExpertShard shard{first, E_, dispatcher_->sources(), 0, 1, groups.tp.segments, tp_.size, tp_.comm, cp_.size};
  shard.inert_padding = groups.tp.layout() && pad_ && m.bias;
  if (etp_) {
    shard.sources = etp_->sources();
    shard.etp_rank = groups.etp->rank();
    shard.etp_size = groups.etp->size();
    shard.etp = groups.etp;
  }
  const int64_t expert_rows = etp_ ? etp_->max_rows() : R;
  experts_ = GroupedExperts(ps, arena, prefix + "moe.experts.", m, El, F_, expert_rows, shard);
  experts_.delay_wgrad = moe.delay_wgrad_compute;
  if (moe.shared_expert_intermediate_size > 0) {
    const int first_shared = static_cast<int>(ps.specs().size());
    shared_ = std::make_unique<SharedExpert>(ps, arena, prefix + "moe.shared.", m, moe.shared_expert_intermediate_size,
                                             moe.shared_expert_gate, Nl_);
    if (tp_.on())
      for (int i = first_shared; i < static_cast<int>(ps.specs().size()); ++i) ps.set_sequence_parallel(i);
  }
  // The norm and the router see this rank's rows only (tensor parallelism): partial gradients.
  if (tp_.on()) {
    norm_.set_sequence_parallel(ps);
    ps.set_sequence_parallel(router_w_);
    if (!tp_.sequence) own_out_ = arena.reserve(Nl_ * C_);
  }
  if (tp_.on() || cp_.on()) all_logits_ = arena.reserve(B_ * Tg_ * E_);
  if (cp_.on()) {
    if (tp_.on()) cp_logits_ = arena.reserve_scratch(N_ * E_);
    cp_buf_ = arena.reserve_scratch(B_ * Tg_ * E_);
  }
  if (etp_) {
    etp_in_ = arena.reserve(expert_rows * C_);
    etp_out_ = arena.reserve(expert_rows * C_);
  }
  normed_ = arena.reserve(Nl_ * C_);
  if (jitter_eps_ > 0) {
    router_x_ = arena.reserve(Nl_ * C_);
    jitter_ = arena.reserve(Nl_ * C_);
  }
  logits_ = arena.reserve(Nl_ * E_);
  probs_ = arena.reserve(Nl_ * K_);
  rows_in_ = arena.reserve(R * C_);
  rows_out_ = arena.reserve(R * C_);
  idx_.resize(static_cast<size_t>(Nl_ * K_));
  kept_.resize(static_cast<size_t>(Nl_ * K_));
  expert_bias_.assign(static_cast<size_t>(E_), 0.0f);
  step_counts_.assign(static_cast<size_t>(E_), 0);
  global_counts_sum_.assign(static_cast<size_t>(E_), 0);
  micro_counts_.assign(static_cast<size_t>(E_), 0);
  global_counts_.assign(static_cast<size_t>(E_), 0.0f);
  slots_.resize(1);
}

MoeLayer::~MoeLayer() = default;

void MoeLayer::make_dispatcher() {
  Communicator* ep = groups_.ep;
  const int64_t S = ep ? ep->size() : 1;
  if (S == 1) {
    auto local = std::make_unique<LocalDispatcher>(*ops_, E_, K_, C_, Nl_, capacity_, pad_);
    source_layout_ = local.get();
    dispatcher_ = std::move(local);
  } else if (dispatcher_kind_ == "alltoall") {
    auto a2a = std::make_unique<AllToAllDispatcher>(*ops_, *ep, E_, K_, C_, Nl_, capacity_, pad_);
    a2a->set_bf16_payload(bf16_payload_);
    source_layout_ = &a2a->source_layout();
    dispatcher_ = std::move(a2a);
  } else {
    auto ag = std::make_unique<AllGatherDispatcher>(*ops_, *ep, E_, K_, C_, Nl_, capacity_, pad_);
    source_layout_ = &ag->source_layout();
    dispatcher_ = std::move(ag);
  }
  if (layout_invariant_) make_layout_invariant(*dispatcher_);
  if (groups_.etp && groups_.etp->size() > 1) {
    etp_ = std::make_unique<ExpertTensorParallel>(*ops_, *groups_.etp, E_ / S, S, C_, dispatcher_->max_rows());
    if (groups_.tp.layout()) etp_->set_layout_invariant();
  }
}

void MoeLayer::swap_micro(Micro& other) {
  std::swap(other.dispatcher, dispatcher_);
  std::swap(other.etp, etp_);
  std::swap(other.source_layout, source_layout_);
  std::swap(other.idx, idx_);
  std::swap(other.kept, kept_);
  std::swap(other.counts_seq, counts_seq_);
  std::swap(other.global_counts, global_counts_);
  std::swap(other.jittered, jittered_);
  std::swap(other.aux, aux_);
  experts_.swap_shared_counts(other.shared_counts);
}

void MoeLayer::select(int k) {
  if (k == slot_) return;
  swap_micro(slots_[static_cast<size_t>(slot_)]);  // the members are now an empty slot's
  if (static_cast<int>(slots_.size()) <= k) slots_.resize(static_cast<size_t>(k + 1));
  slot_ = k;
  Micro& next = slots_[static_cast<size_t>(k)];
  if (next.dispatcher) {
    swap_micro(next);
    return;
  }
  // A new slot: the sizes of slot 0, its own routing and dispatch plan.
  make_dispatcher();
  idx_.assign(static_cast<size_t>(Nl_ * K_), 0);
  kept_.assign(static_cast<size_t>(Nl_ * K_), 0);
  global_counts_.assign(static_cast<size_t>(E_), 0.0f);
}

int64_t MoeLayer::dispatch_bytes_sent() const {
  int64_t n = dispatcher_->bytes_sent();
  for (const Micro& m : slots_)
    if (m.dispatcher) n += m.dispatcher->bytes_sent();
  return n;
}

void MoeLayer::drop_over_micro_batch(const float* batch_logits) {
  // Every token of the micro-batch routed again from its logits (each token on its own: the bits of
  // the rank that owns it), the capacity applied over all of them, then this rank's tokens' part.
  const int64_t Nb = B_ * Tg_, N = Nl_, K = K_;
  ops_->route_topk(batch_idx_.data(), batch_probs_.data(), batch_logits,
                   expert_bias_on_ ? expert_bias_.data() : nullptr, spec_, Nb);
  ops_->apply_capacity(batch_kept_.data(), batch_idx_.data(), batch_probs_.data(), spec_, Nb);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = global_row(row0_ + i);
    LOCKSTEP_CHECK(std::equal(idx_.data() + i * K, idx_.data() + (i + 1) * K, batch_idx_.data() + t * K),
                   "MoE layer: token ", t, " routed differently from the gathered logits");
    std::copy(batch_kept_.data() + t * K, batch_kept_.data() + (t + 1) * K, kept_.data() + i * K);
  }
}

int64_t MoeLayer::max_rows() const { return etp_ ? etp_->max_rows() : dispatcher_->max_rows(); }

void MoeLayer::forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in, bool training,
                       uint64_t seed, int64_t step, int64_t micro, bool replay) {
  // This rank's rows: all of resid_in under sequence parallelism (or without tp), else a slice.
  const bool slice = tp_.on() && !tp_.sequence;
  const float* in = slice ? resid_in + row0_ * C_ : resid_in;
  float* out = slice ? arena(own_out_) : resid_out;
  const int64_t N = Nl_;
  float* x = arena(normed_);
  norm_.forward(ps, arena, x, in, N);

  // Route. The jitter multiplies the router's input only; the experts see x itself.
  const float* rx = x;
  jittered_ = training && jitter_eps_ > 0;
  if (jittered_) {
    const RandomStream rng(seed,
                           mix_purpose(mix_purpose(purpose_id("moe/router_jitter"), static_cast<uint64_t>(layer_)),
                                       static_cast<uint64_t>(step)));
    const float lo = static_cast<float>(1.0 - jitter_eps_), width = static_cast<float>(2.0 * jitter_eps_);
    // Each token's row in the step's batch (of its row in the whole micro-batch): its draws'.
    const int64_t micro_rows = B_ * Tg_;
    jitter_rows_.resize(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) jitter_rows_[static_cast<size_t>(i)] = micro * micro_rows + global_row(row0_ + i);
    ops_->router_jitter(arena(jitter_), arena(router_x_), x, jitter_rows_.data(), N, C_, rng.seed(), rng.purpose(), lo,
                        width);
    rx = arena(router_x_);
  }
  float* logits = arena(logits_);
  float* probs = arena(probs_);
  gemm_f32(ps.device().ops, logits, rx, Trans::N, ps.weight(router_w_), Trans::T, N, E_, C_);
  trace_out(router_name_, logits, N * E_);
  ps.device().host_sync("moe.routing");  // top-k, capacity and the dispatch plan run on the host
  ops_->route_topk(idx_.data(), probs, logits, expert_bias_on_ ? expert_bias_.data() : nullptr, spec_, N);
  if (!batch_capacity_) ops_->apply_capacity(kept_.data(), idx_.data(), probs, spec_, N);
  // The aux losses are over the whole micro-batch: every tp (and cp) rank gets every token's logits.
  const float* batch_logits = logits;
  if (tp_.on() || cp_.on()) {
    float* rank_logits = cp_.on() ? (tp_.on() ? arena(cp_logits_) : logits) : arena(all_logits_);
    if (tp_.on()) tp_.comm->all_gather(rank_logits, logits, N * E_);
    if (cp_.on()) all_gather_sequence(*ops_, cp_, arena(all_logits_), arena(cp_buf_), rank_logits, B_, Tg_, E_);
    batch_logits = arena(all_logits_);
  }
  if (batch_capacity_) drop_over_micro_batch(batch_logits);
  // Training: the global aux loss's counts are summed over the data-parallel group (Megatron's). A
  // replay keeps the first forward's aux losses and the counts backward reads.
  if (!replay) {
    std::function<void(int64_t*, int64_t)> sum_over_dp;
    if (training && data_parallel_) sum_over_dp = [this](int64_t* c, int64_t n) { data_parallel_->all_reduce(c, n); };
    aux_ = aux_losses_forward(*ops_, batch_logits, spec_, B_, Tg_, global_counts_sum_.data(), global_micro_,
                              global_counts_.data(), counts_seq_, micro_counts_.data(), sum_over_dp);
  }

  // Dispatch, experts, combine; the shared expert while the tokens travel (moe.shared_expert_overlap).
  dispatcher_->plan(idx_.data(), kept_.data(), N);
  if (shared_ && shared_overlap_)
    dispatcher_->dispatch(arena(rows_in_), x, [&] { shared_->forward(ps, arena, out, in, x); });
  else
    dispatcher_->dispatch(arena(rows_in_), x);
  if (etp_) {
    etp_->plan(dispatcher_->segments(), dispatcher_->token_segments(), dispatcher_->token_segments_per_source());
    etp_->gather(arena(etp_in_), arena(rows_in_));
    experts_.forward(ps, arena, arena(etp_out_), arena(etp_in_), etp_->offsets(), etp_->segments(),
                     etp_->token_segments());
    etp_->reduce_scatter(arena(rows_out_), arena(etp_out_));
    if (experts_.partial()) experts_.finish_proj(ps, *groups_.etp, arena(rows_out_), dispatcher_->offsets());
  } else {
    experts_.set_token_rows(pad_ ? dispatcher_->tokens_per_expert().data() : nullptr);
    experts_.forward(ps, arena, arena(rows_out_), arena(rows_in_), dispatcher_->offsets(), dispatcher_->segments(),
                     dispatcher_->token_segments());
  }
  trace_out(experts_name_, arena(rows_out_), dispatcher_->rows() * C_);
  const float* base = in;
  if (shared_) {
    if (!shared_overlap_) shared_->forward(ps, arena, out, in, x);
    base = out;
  }
  dispatcher_->combine(out, base, arena(rows_out_), probs);
  ps.precision().round(out, N * C_);
  if (slice) tp_.comm->all_gather(resid_out, out, N * C_);
  trace_out(name_, resid_out, (slice ? N_ : N) * C_);

  if (training && !replay) {
    const std::vector<int64_t>& counts = dispatcher_->tokens_per_expert();
    for (int64_t e = 0; e < E_; ++e) step_counts_[e] += counts[e];
    for (int64_t e = 0; e < E_; ++e) global_counts_sum_[e] += micro_counts_[e];
    ++global_micro_;
  }
}

void MoeLayer::dispatch_backward(float* dx, const float* dexpert_in) {
  // moe.delay_wgrad_compute: the experts' delayed weight gradient fills the exchange's wait.
  if (experts_.delay_wgrad)
    dispatcher_->dispatch_backward(dx, dexpert_in, [this] { experts_.finish_wgrad(); });
  else
    dispatcher_->dispatch_backward(dx, dexpert_in);
}

void MoeLayer::backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                        const MoeScratch& s, float aux_scale) {
  // Without sequence parallelism dresid (N, C) is the same on every tp rank: this rank back-
  // propagates its rows, then the rows are all-gathered (the backward of taking them).
  const bool slice = tp_.on() && !tp_.sequence;
  float* dout = slice ? dresid + row0_ * C_ : dresid;
  const float* in = slice ? resid_in + row0_ * C_ : resid_in;
  const int64_t N = Nl_;
  const float* x = arena(normed_);
  const float* logits = arena(logits_);
  // moe.shared_expert_overlap: the shared expert's backward while the combine's rows travel; its input
  // gradient is added where it was without the overlap (below), so the sums keep their order.
  if (shared_ && shared_overlap_)
    dispatcher_->combine_backward(s.drows, s.dprobs, dout, arena(rows_out_), arena(probs_),
                                  [&] { shared_->branch_backward(ps, arena, dout, x, s.shared); });
  else
    dispatcher_->combine_backward(s.drows, s.dprobs, dout, arena(rows_out_), arena(probs_));
  ps.precision().round(s.drows, dispatcher_->rows() * C_);
  if (etp_) {
    // The expert outputs' gradient to every etp rank, the partial input gradients back.
    etp_->gather(arena(etp_out_), s.drows);
    experts_.backward(ps, arena, s.drows_in, arena(etp_out_), arena(etp_in_), etp_->offsets(), etp_->segments(),
                      s.experts, etp_->token_segments());
    etp_->reduce_scatter(s.drows, s.drows_in);
    if (experts_.partial()) ps.precision().round(s.drows, dispatcher_->rows() * C_);
    trace_grad_in(experts_name_, s.drows, dispatcher_->rows() * C_);
    ps.device().ops.fill(s.dnorm, N * C_, 0.0f);
    dispatch_backward(s.dnorm, s.drows);
  } else {
    experts_.set_token_rows(pad_ ? dispatcher_->tokens_per_expert().data() : nullptr);
    experts_.backward(ps, arena, s.drows_in, s.drows, arena(rows_in_), dispatcher_->offsets(), dispatcher_->segments(),
                      s.experts, dispatcher_->token_segments());
    trace_grad_in(experts_name_, s.drows_in, dispatcher_->rows() * C_);
    ps.device().ops.fill(s.dnorm, N * C_, 0.0f);
    dispatch_backward(s.dnorm, s.drows_in);
  }
  if (shared_ && shared_overlap_)
    shared_->add_input_grad(ps, arena, s.dnorm, s.shared);
  else if (shared_)
    shared_->backward(ps, arena, s.dnorm, dout, x, s.shared);

  ops_->route_topk_backward(s.dlogits, s.dprobs, logits, idx_.data(), spec_, N);
  if (!cp_.on()) {
    aux_losses_backward(*ops_, s.dlogits, tp_.on() ? arena(all_logits_) : logits, spec_, B_, T_, global_counts_.data(),
                        counts_seq_, aux_scale, row0_, N);
  } else {
    // The rank's rows are runs of consecutive positions of the whole micro-batch.
    for (int64_t i = 0, len = 1; i < N; i += len) {
      const int64_t g = global_row(row0_ + i);
      for (len = 1; i + len < N && global_row(row0_ + i + len) == g + len;) ++len;
      aux_losses_backward(*ops_, s.dlogits + i * E_, arena(all_logits_), spec_, B_, Tg_, global_counts_.data(),
                          counts_seq_, aux_scale, g, len);
    }
  }
  const float* rx = jittered_ ? arena(router_x_) : x;
  GemmOptions acc;
  acc.accumulate = true;
  // An fp32 weight gradient like any linear layer's (the router is never quantised): in token
  // segments under determinism = "layout", per token piece under context parallelism.
  ps.precision().wgrad(ps, router_w_, s.dlogits, rx, N, E_, C_);
  if (jittered_) {
    gemm_f32(ps.device().ops, s.drouter_x, s.dlogits, Trans::N, ps.weight(router_w_), Trans::N, N, C_, E_);
    ps.device().ops.add_product(s.dnorm, s.drouter_x, arena(jitter_), N * C_);
  } else {
    gemm_f32(ps.device().ops, s.dnorm, s.dlogits, Trans::N, ps.weight(router_w_), Trans::N, N, C_, E_, acc);
  }
  ps.precision().round(s.dnorm, N * C_);
  trace_grad_in(name_, s.dnorm, N * C_);
  norm_.backward(ps, arena, dout, s.dnorm, in, N);
  if (slice) {
    // dout is a slice of dresid: gather from a copy (the collective's input must not alias its output).
    ps.device().ops.copy(s.drouter_x, dout, N * C_);
    tp_.comm->all_gather(dresid, s.drouter_x, N * C_);
  }
}

void MoeLayer::state_shards(std::vector<StateShard>& out, bool writer) {
  out.push_back(whole_tensor("buffer/" + router_name_ + ".expert_bias", Shape{E_}, expert_bias_.data(), writer));
}

void MoeLayer::begin_step() {
  experts_.begin_step();
  std::fill(step_counts_.begin(), step_counts_.end(), 0);
  std::fill(global_counts_sum_.begin(), global_counts_sum_.end(), 0);
  global_micro_ = 0;
}

void MoeLayer::set_data_parallel(Communicator* dp) {
  data_parallel_ = dp && dp->size() > 1 ? dp : nullptr;
  spec_.global_replicas = data_parallel_ ? data_parallel_->size() : 1;
}

MoeTokenStats MoeLayer::finish_step(double bias_update_rate, Communicator* dp) {
  if (tp_.on()) tp_.comm->all_reduce(step_counts_.data(), E_);
  if (dp && dp->size() > 1) dp->all_reduce(step_counts_.data(), E_);
  MoeTokenStats st;
  st.layer = layer_;
  int64_t total = 0;
  st.min = step_counts_[0];
  st.max = step_counts_[0];
  for (int64_t e = 0; e < E_; ++e) {
    total += step_counts_[e];
    st.min = std::min(st.min, step_counts_[e]);
    st.max = std::max(st.max, step_counts_[e]);
  }
  const double mean = static_cast<double>(total) / static_cast<double>(E_);
  st.imbalance = mean > 0 ? static_cast<double>(st.max) / mean : 0;
  if (expert_bias_on_ && total > 0 && bias_update_rate != 0)  // 0: a skipped step (train.on_nonfinite)
    update_expert_bias(expert_bias_.data(), step_counts_.data(), E_, static_cast<float>(bias_update_rate));
  return st;
}

double MoeLayer::matmul_params_per_token() const {
  // The whole layer's (expert tensor parallelism computes a slice of each expert).
  const int64_t expert_fc = experts_.swiglu ? 2 * F_ : F_;
  double p = static_cast<double>(E_ * C_) + static_cast<double>(K_) * static_cast<double>(C_ * expert_fc + F_ * C_);
  if (shared_) p += static_cast<double>(C_ * shared_->fc_width() + shared_->F * C_ + (shared_->gate_w >= 0 ? C_ : 0));
  return p;
}

}  // namespace lockstep
