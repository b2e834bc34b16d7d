#include "lockstep/model/gpt.h"

#include <algorithm>
#include <cstring>

#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/trace.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/data/documents.h"
#include "lockstep/kernels/device.h"
#include "lockstep/kernels/rope.h"

namespace lockstep {

namespace {
// Logits held at once by the fused head + loss: about 16 MiB.
constexpr int64_t kHeadChunkFloats = int64_t{1} << 22;
}  // namespace

GPT::GPT(const ModelConfig& m, int64_t B, const MoeConfig& moe, const PrecisionConfig& precision,
         const TensorParallel& tp, Communicator* ep, Communicator* etp, const StagePart& part,
         const ContextParallel& cp, Device* device, const Recompute& recompute)
    : own_device_(device ? nullptr : Device::cpu()),
      device_(device ? device : own_device_.get()),
      m_(m),
      part_(part),
      tp_(tp),
      cp_(cp),
      B_(B),
      T_(cp.local(m.seq_length)),
      C_(m.hidden_size),
      V_(m.vocab_size),
      L_(m.num_layers),
      N_(B * T_),
      Tg_(m.seq_length),
      heads_width_(m.num_heads * (m.head_dim() + m.value_dim()) / 2),
      Vl_(V_ / tp.size),
      Nl_(tp.rows(N_)) {
  params_.set_device(device_);
  arena_.set_allocator(&device_->memory());
  LOCKSTEP_CHECK(!cp_.on() || Tg_ % (2 * cp_.size) == 0, "context parallelism: seq_length ", Tg_,
                 " must split into 2 x ", cp_.size, " chunks");
  // config validate() names the keys; these guard other callers.
  LOCKSTEP_CHECK(V_ % tp_.size == 0 && N_ % tp_.size == 0,
                 "vocabulary or tokens not divisible by the tensor-parallel size");
  LOCKSTEP_CHECK(tp_.segments % tp_.size == 0, "layout segments ", tp_.segments,
                 " not divisible by the tensor-parallel size");
  // determinism = "layout": the token sums' segments (ParamStore::token_segments).
  params_.set_layout_segments(tp_.segments, tp_.size, tp_.rank);
  if (part_.chunks.empty()) part_.chunks = {{0, L_}};
  const bool whole = part_.first && part_.last && part_.chunks.size() == 1;
  const float std = static_cast<float>(m.init_std);
  // The last stage's copies of the first stage's embedding: the tied head's and the MTP depths'.
  const bool copies = part_.last && (!part_.first || part_.split_embedding);
  if (part_.first) {
    wte_ = tp_.vocab_weight(params_, "embedding.word.weight", V_, C_, std);
    if (m.position_embedding == "learned")
      wpe_ = params_.add("embedding.position.weight", {Tg_, C_}, Init::normal, std, true);
  }
  embed_end_ = static_cast<int>(params_.specs().size());
  layer_first_.assign(static_cast<size_t>(L_), -1);
  layer_end_.assign(static_cast<size_t>(L_), -1);
  attn_.resize(static_cast<size_t>(L_));
  mlp_.resize(static_cast<size_t>(L_));
  moe_.resize(static_cast<size_t>(L_));
  // Activation recompute's groups (Recompute), per model chunk.
  group_start_.assign(static_cast<size_t>(L_), -1);
  group_end_.assign(static_cast<size_t>(L_), -1);
  sublayer_recompute_.assign(static_cast<size_t>(L_), 0);
  const int64_t per_group = recompute.num_layers;
  for (const auto& [first, end] : part_.chunks)
    for (int64_t a = first; per_group > 0 && a < end; ++a) {
      if (recompute.method == "block" && a >= first + per_group) break;
      const int64_t b = recompute.method == "uniform" ? std::min(a + per_group, end) : a + 1;
      LOCKSTEP_CHECK(recompute.method == "uniform" || recompute.method == "block", "recompute method ",
                     recompute.method);
      for (int64_t l = a; l < b; ++l) group_start_[l] = a, group_end_[l] = b;
      a = b - 1;
    }
  // Activations: resid[l] is layer l's input (N, C), resid[L] the last output; mid[l] the residual
  // between the attention and MLP sublayers (under recompute a group's are in its region but its input).
  resid_.resize(static_cast<size_t>(L_ + 1));
  mid_.resize(static_cast<size_t>(L_));
  const AttentionLayer* cp_scratch = nullptr;  // the first layer's scratch (context parallelism, QK norm), shared
  for (const auto& [first, end] : part_.chunks) {
    for (int64_t l = first; l < end; ++l) {
      const bool grouped = group_start_[l] >= 0;
      if (resid_[l].offset < 0 && !(grouped && l > group_start_[l])) resid_[l] = arena_.reserve(Nl_ * C_);
      if (grouped && l == group_start_[l]) arena_.begin_recompute();
      if (grouped && l > group_start_[l]) resid_[l] = arena_.reserve(Nl_ * C_);
      mid_[l] = arena_.reserve(Nl_ * C_);
      const std::string prefix = "layers." + std::to_string(l) + ".";
      layer_first_[l] = static_cast<int>(params_.specs().size());
      attn_[l] = AttentionLayer(params_, arena_, prefix, m, B_, T_, tp_, cp_, cp_scratch);
      cp_scratch = &attn_[l];
      const bool moe_layer = moe.is_moe_layer(l, L_);
      sublayer_recompute_[l] = !grouped && (moe_layer ? recompute.moe : recompute.mlp);
      if (sublayer_recompute_[l]) arena_.begin_recompute();
      if (moe_layer)
        moe_[l] = std::make_unique<MoeLayer>(params_, arena_, prefix, l, m, moe, B_, T_, MoeGroups{tp_, ep, etp, cp_});
      else
        mlp_[l] = MlpLayer(params_, arena_, prefix, m, N_, tp_);
      if (sublayer_recompute_[l]) arena_.end_recompute();
      layer_end_[l] = static_cast<int>(params_.specs().size());
      if (grouped && l + 1 == group_end_[l]) arena_.end_recompute();
    }
    if (resid_[end].offset < 0) resid_[end] = arena_.reserve(Nl_ * C_);
  }
  head_first_ = static_cast<int>(params_.specs().size());
  if (part_.last) {
    final_norm_ =
        Norm(params_, arena_, "final_norm", m.normalization == "rmsnorm", C_, Nl_, static_cast<float>(m.norm_eps));
    if (tp_.sequence) final_norm_.set_sequence_parallel(params_);
    head_wte_ = wte_;
    head_wpe_ = wpe_;
    if (copies && (m.tie_embeddings || m.mtp_num_layers > 0)) {
      head_wte_ =
          part_.first ? params_.add_copy(wte_) : tp_.vocab_weight(params_, "embedding.word.weight", V_, C_, std);
      params_.set_stage_copy(head_wte_);
    }
    if (copies && m.mtp_num_layers > 0 && m.position_embedding == "learned") {
      head_wpe_ = part_.first ? params_.add_copy(wpe_)
                              : params_.add("embedding.position.weight", {Tg_, C_}, Init::normal, std, true);
      params_.set_stage_copy(head_wpe_);
    }
    out_ = m.tie_embeddings ? head_wte_ : tp_.vocab_weight(params_, "output.weight", V_, C_, std);
    // The depths are built like the last decoder layer (model/mtp.h): MoE when it is.
    const bool moe_depths = moe.num_experts > 0 && moe.is_moe_layer(L_ - 1, L_);
    for (int64_t k = 0; k < m.mtp_num_layers; ++k)
      mtp_.push_back(std::make_unique<MtpLayer>(params_, arena_, k, m, B_, T_, tp_, cp_, moe_depths ? &moe : nullptr,
                                                MoeGroups{tp_, ep, etp, cp_}));
  }
  // layout_token_segments: every gradient is computed in token segments (ParamStore::token_segments).
  if (tp_.token_segments)
    for (int i = 0; i < static_cast<int>(params_.specs().size()); ++i) params_.set_token_sum(i);
  // Context parallelism: the rank's two chunks of each sample are its 2B pieces of those sums.
  // Under sequence parallelism the sequence-parallel parameters' rows are a tp rank's share of them,
  // and so are an MoE layer's under tensor parallelism (its norm, router, shared expert and experts:
  // each tp rank routes its share of the rows, model/moe/moe_layer.h): cp_.sequence_tp, the tp size
  // when the trainer gave the tp x cp group for them, else 1.
  if (tp_.token_segments && cp_.on()) params_.set_token_pieces(2 * B_, cp_.size, cp_.rank, Tg_, cp_.sequence_tp);
  // With MTP the output head's weight gets a tree from every head, and the depths' embedding copies
  // one from every depth: folded one by one (fold_token_pieces).
  if (params_.pieced() && !mtp_.empty())
    for (int i : {out_, head_wte_, head_wpe_}) {
      // The lookups of the first stage's embedding are combined by the hook (layout keeps copies).
      LOCKSTEP_CHECK(i < 0 || (i != wte_ && i != wpe_),
                     "MTP under context parallelism folds the head's embedding "
                     "copies, not the embedding (StagePart::split_embedding)");
      if (i >= 0 &&
          std::find_if(folded_.begin(), folded_.end(), [i](const auto& f) { return f.first == i; }) == folded_.end()) {
        params_.set_folded(i);
        folded_.emplace_back(i, std::vector<float>(static_cast<size_t>(params_.specs()[i].shape.numel()), 0.0f));
      }
    }
  // The pieces live from a grads-ready range's first gradient to its combine (complete_micro_batch_grads):
  // one window of the largest range (the embedding, a layer, the head with MTP) instead of the table.
  if (params_.pieced()) {
    // (Every piece of a range written in its own backward: the head writes its own copy of a tied
    // embedding, StagePart::split_embedding; the MTP depths' lookups too, checked above.)
    LOCKSTEP_CHECK(!part_.last || out_ >= head_first_,
                   "context parallelism's token pieces: the output head's weight must be the head range's own");
    std::vector<std::pair<int, int>> runs;
    if (part_.first) runs.emplace_back(0, embed_end_);
    for (const auto& [first, end] : part_.chunks)
      for (int64_t l = first; l < end; ++l) runs.emplace_back(layer_first_[l], layer_end_[l]);
    if (part_.last) runs.emplace_back(head_first_, static_cast<int>(params_.specs().size()));
    params_.set_piece_windows(runs);
  }
  params_.allocate();
  precision_ = Precision(precision, params_, L_);
  params_.set_precision(&precision_);
  if (precision_.bf16()) params_.use_bf16_weights();
  weights_stale_.assign(part_.chunks.size(), 1);

  if (!whole)
    for (size_t c = 0; c < part_.chunks.size(); ++c) grad_in_.push_back(arena_.reserve(Nl_ * C_));
  if (part_.last) final_out_ = arena_.reserve(Nl_ * C_);
  if (tp_.on()) {
    emb_partial_ = arena_.reserve_scratch(N_ * C_);
    local_tokens_.resize(static_cast<size_t>(N_));
  }
  if (tp_.sequence && part_.last) {
    final_full_ = arena_.reserve_scratch(N_ * C_);
    head_dfull_ = arena_.reserve_scratch(N_ * C_);
  }
  head_rows_ = std::clamp<int64_t>(kHeadChunkFloats / Vl_, 1, N_);
  head_segments_ = tp_.k_segments({V_});
  if (part_.last) {
    logits_ = arena_.reserve_scratch(head_rows_ * Vl_);
    // The head's weight gradient in token segments: its plan, and the leaf and partial sums it needs.
    const int64_t per_piece = params_.token_segments(out_);
    if (tp_.token_segments && per_piece > 0) {
      head_plan_ = plan_head(N_, head_rows_, canonical_segments(N_, params_.token_pieces(out_) * per_piece), per_piece);
      bool leaf = false;
      head_first_level_ = 64;
      for (const HeadChunk& chunk : head_plan_)
        for (const HeadStep& st : chunk.steps) {
          leaf = leaf || !st.whole;
          if (st.push)
            head_first_level_ = std::min(head_first_level_, std::countr_zero(static_cast<uint64_t>(st.count)));
        }
      const int64_t levels = std::max<int64_t>(0, tree_sum_stack(per_piece) - head_first_level_);
      if (leaf) head_leaf_ = arena_.reserve_scratch((1 + levels) * Vl_ * C_);
    }
    losses_ = arena_.reserve_scratch(N_);
  }
  int64_t F = 0, fcw = 0, qkvw = 0;
  for (const MlpLayer& mlp : mlp_) F = std::max(F, mlp.F), fcw = std::max(fcw, mlp.F ? mlp.fc_width() : 0);
  for (const auto& d : mtp_) F = std::max(F, d->mlp.F), fcw = std::max(fcw, d->mlp.fc_width());
  int64_t attw = C_;  // the attention output's width (this rank's heads), when wider than the model
  for (const AttentionLayer& a : attn_) qkvw = std::max(qkvw, a.qkv_width()), attw = std::max(attw, a.NH * a.HS);
  for (const auto& d : mtp_) qkvw = std::max(qkvw, d->attn.qkv_width()), attw = std::max(attw, d->attn.NH * d->attn.HS);
  dresid_ = arena_.reserve_scratch(Nl_ * C_);
  dfinal_ = arena_.reserve_scratch(N_ * C_);
  dnorm_ = arena_.reserve_scratch(N_ * C_);
  datt_ = arena_.reserve_scratch(N_ * attw);
  dqkv_ = arena_.reserve_scratch(N_ * qkvw);
  dact_ =
      arena_.reserve_scratch(N_ * (tp_.sequence ? std::max(F, C_) : F));  // sequence parallelism: also d(norm)'s rows
  dfc_ = arena_.reserve_scratch(N_ * fcw);
  if (!mtp_.empty()) {
    const int64_t D = static_cast<int64_t>(mtp_.size());
    mtp_tokens_.resize(static_cast<size_t>(D * N_));
    mtp_targets_.resize(static_cast<size_t>(D * N_));
    if (cp_.on()) mtp_shifted_.resize(static_cast<size_t>(2 * B_ * Tg_));
    for (ArenaSlice* sl : {&mtp_dh_, &mtp_dnext_, &mtp_dx_, &mtp_de_, &mtp_dhn_, &mtp_demb_})
      *sl = arena_.reserve_scratch(Nl_ * C_);
  }
  for (const auto& layer : moe_) moe_all_.push_back(layer.get());
  for (const auto& d : mtp_)
    if (d->moe) moe_all_.push_back(d->moe.get());
  const MoeLayer* first_moe = nullptr;
  for (MoeLayer* layer : moe_all_)
    if (layer && !first_moe) first_moe = layer;
  if (first_moe) {
    // Every MoE layer has the same sizes, so one set of backward scratch serves them all.
    const int64_t R = first_moe->max_rows();
    moe_dnorm_ = arena_.reserve_scratch(N_ * C_);
    moe_drouter_ = arena_.reserve_scratch(N_ * C_);
    moe_dlogits_ = arena_.reserve_scratch(N_ * moe.num_experts);
    moe_dprobs_ = arena_.reserve_scratch(N_ * moe.router_topk);
    moe_drows_ = arena_.reserve_scratch(R * C_);
    moe_drows_in_ = arena_.reserve_scratch(R * C_);
    moe_dact_ = arena_.reserve_scratch(R * first_moe->expert_ffn());
    moe_dfc_ = arena_.reserve_scratch(R * first_moe->expert_fc_width());
    sh_dout_ = arena_.reserve_scratch(N_ * C_);
    sh_dact_ = arena_.reserve_scratch(N_ * first_moe->shared_ffn());
    sh_dfc_ = arena_.reserve_scratch(N_ * first_moe->shared_fc_width());
    sh_dx_ = arena_.reserve_scratch(N_ * C_);
  }
  arena_.allocate();
  if (first_moe)
    moe_scratch_ = MoeScratch{arena_(moe_dnorm_),
                              arena_(moe_drouter_),
                              arena_(moe_dlogits_),
                              arena_(moe_dprobs_),
                              arena_(moe_drows_),
                              arena_(moe_drows_in_),
                              ExpertsScratch{arena_(moe_dact_), arena_(moe_dfc_)},
                              SharedExpertScratch{arena_(sh_dout_), arena_(sh_dact_), arena_(sh_dfc_), arena_(sh_dx_)}};
  order_.resize(static_cast<size_t>(N_));

  if (m.position_embedding == "rope") {
    const int64_t HS = m.rope_dim();
    rope_cos_.resize(static_cast<size_t>(Tg_ * HS / 2));
    rope_sin_.resize(rope_cos_.size());
    rope_table(rope_cos_.data(), rope_sin_.data(), Tg_, HS, m.rope_theta, rope_scaling_of(m));
  }
  if (cp_.on()) {
    positions_.resize(static_cast<size_t>(N_));
    cp_.positions(positions_.data(), B_, Tg_);
    cp_tokens_.resize(static_cast<size_t>(N_));
    cp_targets_.resize(static_cast<size_t>(N_));
  }
}

const int32_t* GPT::local(const int32_t* global, std::vector<int32_t>& buf) const {
  if (!cp_.on()) return global;
  cp_.take_local(buf.data(), global, B_, Tg_);
  return buf.data();
}

void GPT::set_documents(int32_t eod, bool reset_position_ids, bool reset_attention_mask, int64_t cp_pad) {
  eod_ = eod;
  cp_pad_ = cp_pad;
  reset_positions_ = reset_position_ids;
  if (!cp_.on()) positions_.assign(reset_position_ids ? static_cast<size_t>(N_) : 0, 0);
  if (cp_.on() && reset_position_ids) full_positions_.assign(static_cast<size_t>(B_ * Tg_), 0);
  doc_start_.assign(reset_attention_mask ? static_cast<size_t>(B_ * Tg_) : 0, 0);
}

void GPT::select_slot(int k) {
  arena_.select(k);
  precision_.select_slot(k);
  for (MoeLayer* layer : moe_all_)
    if (layer) layer->select(k);
}

std::vector<int> GPT::shared_params() const {
  if (part_.first && part_.last) return {};
  std::vector<int> shared;
  if (part_.first && part_.chunks.size() && (m_.tie_embeddings || m_.mtp_num_layers > 0)) {
    shared.push_back(wte_);
    if (m_.mtp_num_layers > 0 && wpe_ >= 0) shared.push_back(wpe_);
  }
  if (part_.last)
    for (int i : {head_wte_, head_wpe_})
      if (i >= 0 && params_.specs()[static_cast<size_t>(i)].role.stage_copy) shared.push_back(i);
  return shared;
}

std::vector<std::pair<int, int>> GPT::split_params() const {
  std::vector<std::pair<int, int>> pairs;
  if (part_.first && part_.last)
    for (const auto& [owner, copy] : {std::pair{wte_, head_wte_}, std::pair{wpe_, head_wpe_}})
      if (owner >= 0 && copy != owner) pairs.push_back({owner, copy});
  return pairs;
}

void GPT::sum_split_grads() {
  for (const auto& [owner, copy] : split_params()) {
    float* a = params_.grad(owner);
    const int64_t n = params_.specs()[static_cast<size_t>(owner)].shape.numel();
    device_->ops.add(a, a, params_.grad(copy), n);
    device_->ops.copy(params_.grad(copy), a, n);
  }
}

void GPT::forward_chunk(int c, const int32_t* tokens, int64_t micro, bool training) {
  micro_ = first_micro_ + micro;
  if (training) precision_.begin_micro_batch(seed_, step_, micro_);
  aux_loss_ = 0;
  aux_exact_ = ExactSum();
  const auto [l0, l1] = part_.chunks[static_cast<size_t>(c)];
  const bool stale = weights_stale_[static_cast<size_t>(c)];
  layout_documents(tokens);
  tokens = local(tokens, cp_tokens_);
  if (part_.first && c == 0) {
    need_params(0, embed_end_, stale);
    // Tensor parallelism: each rank looks up the tokens of its vocabulary range.
    if (tp_.on())
      vocab_parallel_embedding(device_->ops, tp_, arena_(resid_[0]), arena_(emb_partial_), local_tokens_.data(), tokens,
                               params_.weight(wte_), wpe_ >= 0 ? params_.weight(wpe_) : nullptr, positions(), N_, T_,
                               C_, V_);
    else
      device_->ops.embedding_forward(arena_(resid_[0]), tokens, params_.weight(wte_),
                                     wpe_ >= 0 ? params_.weight(wpe_) : nullptr, B_, T_, C_, V_, positions(), Tg_);
    precision_.round(arena_(resid_[0]), Nl_ * C_);
    trace_out("embedding", arena_(resid_[0]), Nl_ * C_);
  }
  for (int64_t l = l0; l < l1; ++l) {
    need_params(layer_first_[l], layer_end_[l], stale);
    attn_[l].forward(params_, arena_, arena_(mid_[l]), arena_(resid_[l]), rope_cos_.data(), rope_sin_.data(),
                     positions(), doc_start());
    mlp_or_moe_forward(l, training, false);
    if (moe_[l]) {
      aux_loss_ += moe_[l]->aux_losses().total();
      aux_exact_.add(moe_[l]->aux_losses().total());
    }
  }
  if (part_.last && c == num_chunks() - 1) {
    // The final norm, the untied head and the MTP depths.
    need_params(head_first_, static_cast<int>(params_.specs().size()), stale);
    final_norm_.forward(params_, arena_, arena_(final_out_), arena_(resid_[L_]), Nl_);
  }
  weights_stale_[static_cast<size_t>(c)] = 0;
}

void GPT::layout_documents(const int32_t* tokens) {
  // Packed documents under context parallelism: the micro-batch's chunks are per document.
  if (cp_.per_document()) cp_.set_documents(tokens, Tg_, eod_, cp_pad_);
  if (!reset_positions_ && !doc_start()) return;
  int32_t* pos = !reset_positions_ ? nullptr : cp_.on() ? full_positions_.data() : positions_.data();
  document_layout(pos, doc_start_.empty() ? nullptr : doc_start_.data(), tokens, B_, Tg_, eod_);
  if (cp_.on() && reset_positions_) cp_.take_local(positions_.data(), full_positions_.data(), B_, Tg_);
}

void GPT::recompute(int64_t first, int64_t end) {
  ModuleTrace::Replay replay;  // the outputs are the first forward's: not traced again
  for (int64_t l = first; l < end; ++l) {
    attn_[l].forward(params_, arena_, arena_(mid_[l]), arena_(resid_[l]), rope_cos_.data(), rope_sin_.data(),
                     positions(), doc_start());
    mlp_or_moe_forward(l, true, true);
  }
}

void GPT::recompute_sublayer(int64_t l) {
  ModuleTrace::Replay replay;
  mlp_or_moe_forward(l, true, true);
}

void GPT::mlp_or_moe_forward(int64_t l, bool training, bool replay) {
  if (moe_[l])
    moe_[l]->forward(params_, arena_, arena_(resid_[l + 1]), arena_(mid_[l]), training, seed_, step_, micro_, replay);
  else
    mlp_[l].forward(params_, arena_, arena_(resid_[l + 1]), arena_(mid_[l]));
}

void GPT::need_params(int first, int end, bool stale) {
  if (params_needed_) params_needed_(first, end);
  // The bf16 copy of a range is refreshed once its master values are final for this step.
  if (stale) params_.sync_weights(first, end);
}

// The head's weight gradient with the key (GPT::head_plan_): rows [0, N) in chunks of at most
// head_rows that end on the last segment bound in them (a segment longer than head_rows goes over
// several chunks), and in each chunk, from segment seg on: the largest aligned block of whole
// segments of seg's piece that the chunk holds (a whole piece, or one pushed through the piece's
// tree), or a part of a long segment. wseg: the S + 1 segment bounds, per_piece segments a piece.
std::vector<GPT::HeadChunk> GPT::plan_head(int64_t N, int64_t head_rows, const std::vector<int64_t>& wseg,
                                           int64_t per_piece) {
  std::vector<HeadChunk> plan;
  const auto at = [&](int64_t k) { return wseg[static_cast<size_t>(k)]; };
  int64_t seg = 0;
  for (int64_t r0 = 0, rows = 0; r0 < N; r0 += rows) {
    rows = std::min(head_rows, N - r0);
    if (r0 + rows < N) {  // end on the last segment bound in the chunk, if there is one
      const int64_t bound = *(std::upper_bound(wseg.begin(), wseg.end(), r0 + rows) - 1);
      if (bound > r0) rows = bound - r0;
    }
    HeadChunk chunk{r0, rows, {}};
    const int64_t e = r0 + rows;
    for (int64_t b0 = r0; b0 < e;) {
      const int64_t c = seg % per_piece;
      const bool starts = b0 == at(seg), block = starts && at(seg + 1) <= e;
      int64_t count = 1;
      if (block)
        while (c % (2 * count) == 0 && c + 2 * count <= per_piece && at(seg + 2 * count) <= e) count *= 2;
      const int64_t end = block ? at(seg + count) : std::min(e, at(seg + 1));
      const bool done = end == at(seg + count), whole = block && count == per_piece;
      HeadStep st{b0, end, seg / per_piece, c, count, {}, whole, !starts, done && !whole, c + count == per_piece};
      if (whole || count > 1)
        for (int64_t k = 0; k <= count; ++k) st.bounds.push_back(at(seg + k) - b0);
      chunk.steps.push_back(std::move(st));
      if (done) seg += count;
      b0 = end;
    }
    plan.push_back(std::move(chunk));
  }
  return plan;
}

void GPT::head(const float* x_rows, const int32_t* targets, float* dx, bool backward, float grad_scale) {
  const float* w = params_.weight(out_);
  float* logits = arena_(logits_);
  float* losses = arena_(losses_);
  // Tensor parallelism: the full input, this rank's vocabulary columns of the logits, and a partial
  // input gradient (summed over the group below).
  const float* x = enter_column_parallel(tp_, tp_.sequence ? arena_(final_full_) : nullptr, x_rows, N_, C_);
  float* dfull = tp_.sequence && backward ? arena_(head_dfull_) : dx;
  const int64_t V = Vl_;
  GemmOptions acc;
  acc.accumulate = true;
  // K of the input gradient is the vocabulary: under "layout", its canonical segments, each rank's
  // part left unrounded until the group has summed it (as one process rounds the whole).
  GemmOptions dgrad;
  dgrad.k_segments = head_segments_;
  const bool partial = tp_.on() && tp_.layout();
  const Ops& ops = device_->ops;
  // The weight gradient in token segments (layout_token_segments), as planned (plan_head): each
  // aligned block of 2^j whole segments of a piece is one product with k_segments, the canonical
  // tree over them (a complete subtree); a block that is a whole piece adds its tree to the piece's
  // gradient in the product itself (C = C + tree), a smaller one is pushed as one block through the
  // piece's tree (tree_sum_push_block), whose root is then added; a segment longer than a chunk
  // accumulates its parts into its leaf from zero. Context parallelism: per piece of the rank's rows
  // (ParamStore::token_pieces), each its own tree.
  const bool planned = backward && !head_plan_.empty();
  float* leaf = head_leaf_.size ? arena_(head_leaf_) : nullptr;
  const int64_t n = V * C_;
  auto weight_gradient = [&](int64_t r0, const HeadStep& st) {
    const float* dlogits = logits + (st.b0 - r0) * V;
    const float* xb = x + st.b0 * C_;
    GemmOptions opt;
    opt.k_segments = st.bounds;  // the block's segments (empty: one chain)
    if (st.whole) {
      opt.accumulate = true;
      gemm_f32(ops, params_.grad_piece(out_, st.piece), dlogits, Trans::T, xb, Trans::N, V, C_, st.end - st.b0, opt);
      return;
    }
    opt.accumulate = st.accumulate;
    gemm_f32(ops, leaf, dlogits, Trans::T, xb, Trans::N, V, C_, st.end - st.b0, opt);
    if (!st.push) return;
    const int level = std::countr_zero(static_cast<uint64_t>(st.count)), first = head_first_level_;
    float* g = st.last ? params_.grad_piece(out_, st.piece) : nullptr;
    ops.tree_push_block(leaf, leaf, st.c, level, st.last, n, leaf + n, first);
    if (g) ops.add(g, g, leaf, n);
  };
  // Rows [r0, r0 + rows): the logits, the loss and (backward) the input gradient.
  auto chunk = [&](int64_t r0, int64_t rows) {
    gemm_f32(ops, logits, x + r0 * C_, Trans::N, w, Trans::T, rows, V, C_);
    precision_.round(logits, rows * V);
    if (tp_.on() || tp_.layout())
      vocab_parallel_cross_entropy(ops, tp_, losses + r0, logits, targets + r0, rows, V_, V, backward, grad_scale,
                                   loss_scratch_);
    else if (!backward)
      ops.cross_entropy_forward(losses + r0, logits, targets + r0, rows, V, V);
    else
      ops.cross_entropy_forward_backward(losses + r0, logits, targets + r0, rows, V, V, grad_scale);
    if (!backward) return;
    precision_.round(logits, rows * V);
    gemm_f32(ops, dfull + r0 * C_, logits, Trans::N, w, Trans::N, rows, C_, V, dgrad);
    if (!partial) precision_.round(dfull + r0 * C_, rows * C_);
  };
  if (planned) {
    for (const HeadChunk& ch : head_plan_) {
      chunk(ch.r0, ch.rows);
      for (const HeadStep& st : ch.steps) weight_gradient(ch.r0, st);
    }
  } else {
    for (int64_t r0 = 0, rows = 0; r0 < N_; r0 += rows) {
      rows = std::min(head_rows_, N_ - r0);
      chunk(r0, rows);
      if (backward) gemm_f32(ops, params_.grad(out_), logits, Trans::T, x + r0 * C_, Trans::N, V, C_, rows, acc);
    }
  }
  if (backward) {
    float* sum = enter_column_parallel_backward(tp_, dx, dfull, N_, C_);
    if (partial) precision_.round(sum, Nl_ * C_);
  }
}

void GPT::mtp(const int32_t* tokens, const int32_t* targets, bool backward, float aux_scale) {
  const int64_t D = static_cast<int64_t>(mtp_.size());
  // Depth k reads t_{i+k} (rolled within the sequence, as Megatron) and predicts t_{i+k+1}: shifted
  // over the whole sequence, then (context parallelism) this rank's positions of it. valid: each
  // depth's targets in the micro-batch, the denominator of its mean on every cp rank.
  std::vector<int64_t> valid(static_cast<size_t>(D));
  for (int64_t k = 1; k <= D; ++k) {
    int32_t* tk = mtp_tokens_.data() + (k - 1) * N_;
    int32_t* gk = mtp_targets_.data() + (k - 1) * N_;
    int32_t* st = cp_.on() ? mtp_shifted_.data() : tk;
    int32_t* sg = cp_.on() ? mtp_shifted_.data() + B_ * Tg_ : gk;
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t i = 0; i < Tg_; ++i) {
        st[b * Tg_ + i] = tokens[b * Tg_ + (i + k) % Tg_];
        sg[b * Tg_ + i] = i + k < Tg_ ? targets[b * Tg_ + i + k] : -1;
      }
    valid[static_cast<size_t>(k - 1)] = count_targets(sg, B_ * Tg_);
    if (cp_.on()) {
      cp_.take_local(tk, st, B_, Tg_);
      cp_.take_local(gk, sg, B_, Tg_);
    }
  }
  const int wte = head_wte_, wpe = head_wpe_;
  const float* prev = arena_(final_out_);
  const MtpPass pass{backward, seed_, step_, micro_};
  mtp_aux_exact_ = ExactSum();
  for (int64_t k = 0; k < D; ++k) {
    mtp_[k]->forward(params_, arena_, mtp_tokens_.data() + k * N_, prev, wte, wpe, positions(), doc_start(),
                     rope_cos_.data(), rope_sin_.data(), pass, local_tokens_.data());
    prev = mtp_[k]->out(arena_);
    if (const MoeLayer* moe = mtp_[k]->moe.get()) {
      aux_loss_ += moe->aux_losses().total();
      aux_exact_.add(moe->aux_losses().total());
      mtp_aux_exact_.add(moe->aux_losses().total());
    }
  }
  const double weight = m_.mtp_loss_scaling_factor / static_cast<double>(D);
  float* dh = arena_(mtp_dh_);
  float* dnext = arena_(mtp_dnext_);
  const MtpScratch s{arena_(mtp_dx_),
                     arena_(mtp_de_),
                     arena_(mtp_dhn_),
                     arena_(mtp_demb_),
                     MlpScratch{arena_(dnorm_), arena_(dact_), arena_(dfc_)},
                     AttentionScratch{arena_(dnorm_), arena_(datt_), arena_(dqkv_)},
                     &moe_scratch_};
  std::vector<double> depth_loss(static_cast<size_t>(D), 0.0);
  // Deepest first: depth k's input gradient (dnext) joins depth k-1's head gradient.
  for (int64_t k = D - 1; k >= 0; --k) {
    const int32_t* gk = mtp_targets_.data() + k * N_;
    const int64_t n = valid[static_cast<size_t>(k)];
    const float scale = n ? static_cast<float>(weight * aux_scale / static_cast<double>(n)) : 0.0f;
    head(mtp_[k]->out(arena_), gk, dh, backward, scale);
    depth_loss[static_cast<size_t>(k)] = micro_batch_mean(n);
    if (!backward) continue;
    fold_pieces(out_);
    if (k + 1 < D) {
      device_->ops.add(dh, dh, dnext, Nl_ * C_);
    }
    device_->ops.fill(dnext, Nl_ * C_, 0.0f);
    const float* h_prev = k == 0 ? arena_(final_out_) : mtp_[k - 1]->out(arena_);
    mtp_[k]->backward(params_, arena_, dnext, dh, mtp_tokens_.data() + k * N_, h_prev, wte, wpe, positions(),
                      doc_start(), rope_cos_.data(), rope_sin_.data(), s, order_.data(), aux_scale,
                      local_tokens_.data());
    fold_pieces(wte);  // the depth's embedding lookup
    if (wpe >= 0) fold_pieces(wpe);
  }
  if (backward) {
    float* dfinal = arena_(dfinal_);
    device_->ops.add(dfinal, dfinal, dnext, Nl_ * C_);
  }
  mtp_loss_ = 0;
  for (double l : depth_loss) mtp_loss_ += weight * l;
}

void GPT::fold_pieces(int param) {
  for (auto& [i, acc] : folded_)
    if (i == param) fold_token_pieces(cp_, params_, i, acc.data(), piece_scratch_);
}

void GPT::complete_micro_batch_grads(int first, int end) {
  reduce_sequence_parallel_grads(tp_, params_, first, end);
  combine_token_pieces(cp_, params_, first, end, piece_scratch_);
}

double GPT::micro_batch_mean(int64_t count) const {
  // Context parallelism under layout (layout_token_segments): a rank's share divided by the count is
  // rounded, and the shares' exact sum is not the one-process mean. The per-token losses are
  // gathered in position order and cp rank 0 takes the one-process mean; the others count 0.
  device_->host_sync("loss");  // the per-token losses, summed on the host
  const float* x = arena_(losses_);
  int64_t n = N_;
  if (cp_.on() && tp_.token_segments) {
    n = B_ * Tg_;
    cp_losses_.resize(static_cast<size_t>(n + cp_.size * N_));
    all_gather_sequence(device_->ops, cp_, cp_losses_.data(), cp_losses_.data() + n, x, B_, Tg_, 1);
    if (cp_.rank != 0) return 0.0;
    x = cp_losses_.data();
  }
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return count ? s / static_cast<double>(count) : 0.0;
}

double GPT::lm_loss(const int32_t* targets) const { return micro_batch_mean(count_targets(targets, B_ * Tg_)); }

double GPT::backward_chunk(int c, const int32_t* tokens, const int32_t* targets, float grad_scale, int64_t micro) {
  micro_ = first_micro_ + micro;
  // Pipeline parallelism: the forwards since this micro-batch's keyed other micro-batches' draws.
  precision_.begin_micro_batch(seed_, step_, micro_);
  const float aux_scale = grad_scale * static_cast<float>(B_ * Tg_);  // the micro-batch's tokens
  const auto [l0, l1] = part_.chunks[static_cast<size_t>(c)];
  float* dresid = arena_(dresid_);
  // Pipeline parallelism: another micro-batch's forward may have run since this one's.
  const bool whole = part_.first && part_.last && num_chunks() == 1;
  if (!whole) layout_documents(tokens);
  const int32_t *all_tokens = tokens, *all_targets = targets;
  tokens = local(tokens, cp_tokens_);
  targets = local(targets, cp_targets_);
  double lm = 0;
  if (part_.last && c == num_chunks() - 1) {
    head(arena_(final_out_), targets, arena_(dfinal_), true, grad_scale);
    fold_pieces(out_);
    trace_out("output", arena_(losses_), N_);  // the per-token losses
    trace_grad_in("output", arena_(dfinal_), Nl_ * C_);
    // Taken before the MTP depths, whose heads reuse the per-token loss buffer.
    lm = lm_loss(all_targets);
    if (!mtp_.empty()) mtp(all_tokens, all_targets, true, aux_scale);
    device_->ops.fill(dresid, Nl_ * C_, 0.0f);
    final_norm_.backward(params_, arena_, dresid, arena_(dfinal_), arena_(resid_[L_]), Nl_);
    // The head and the MTP depths ran their backward before this one.
    for (auto& [i, acc] : folded_) finish_folded_pieces(cp_, params_, i, acc.data());
    if (grads_ready_) grads_ready_(head_first_, static_cast<int>(params_.specs().size()));
  } else {
    device_->ops.copy(dresid, chunk_output_grad(c), Nl_ * C_);
  }
  const MlpScratch ms{arena_(dnorm_), arena_(dact_), arena_(dfc_)};
  const AttentionScratch as{arena_(dnorm_), arena_(datt_), arena_(dqkv_)};
  for (int64_t l = l1 - 1; l >= l0; --l) {
    if (group_start_[l] >= 0 && l + 1 == group_end_[l]) recompute(group_start_[l], l + 1);
    if (sublayer_recompute_[l]) recompute_sublayer(l);
    if (moe_[l])
      moe_[l]->backward(params_, arena_, dresid, arena_(mid_[l]), moe_scratch_, aux_scale);
    else
      mlp_[l].backward(params_, arena_, dresid, arena_(mid_[l]), ms);
    attn_[l].backward(params_, arena_, dresid, arena_(resid_[l]), rope_cos_.data(), rope_sin_.data(), as, positions(),
                      doc_start());
    if (grads_ready_) grads_ready_(layer_first_[l], layer_end_[l]);
  }
  if (part_.first && c == 0) {
    vocab_parallel_embedding_backward(tp_, params_, wte_, wpe_, order_.data(), arena_(dnorm_), dresid,
                                      local_tokens_.data(), tokens, positions(), B_, T_, C_, V_, Tg_);
    if (grads_ready_) grads_ready_(0, embed_end_);
  }
  if (part_.first && c == 0) precision_.end_micro_batch();
  return lm;
}

double GPT::forward_backward(const int32_t* tokens, const int32_t* targets, float grad_scale) {
  const int64_t micro = micro_ - first_micro_;
  forward_chunk(0, tokens, micro);
  const double lm = backward_chunk(0, tokens, targets, grad_scale, micro);
  micro_ = first_micro_ + micro + 1;
  return lm;
}

void GPT::begin_evaluation() {
  // Evaluation may follow an optimizer step with no begin_step in between.
  std::fill(weights_stale_.begin(), weights_stale_.end(), 1);
  precision_.begin_evaluation();
}

double GPT::evaluate_head(const int32_t* tokens, const int32_t* targets) {
  head(arena_(final_out_), local(targets, cp_targets_), nullptr, false, 0.0f);
  const double lm = lm_loss(targets);
  if (!mtp_.empty()) mtp(tokens, targets, false, 0.0f);
  return lm;
}

double GPT::evaluate(const int32_t* tokens, const int32_t* targets) {
  begin_evaluation();
  forward_chunk(0, tokens, 0, false);
  return evaluate_head(tokens, targets);
}

std::vector<std::string> GPT::module_names() const {
  std::vector<std::string> names;
  if (part_.first) names.push_back("embedding");
  for (const auto& [l0, l1] : part_.chunks)
    for (int64_t l = l0; l < l1; ++l) {
      attn_[l].trace_names(names);
      if (moe_[l])
        moe_[l]->trace_names(names);
      else
        mlp_[l].trace_names(names);
    }
  if (part_.last) {
    names.push_back(final_norm_.name);
    names.push_back("output");
    for (const auto& depth : mtp_) depth->trace_names(names);
  }
  return names;
}

double GPT::flops_per_token() const {
  // This rank's part: under pipeline parallelism the stages' counts add up to the model's.
  double matmul = part_.last ? static_cast<double>(V_ * C_) : 0.0;
  // The whole model's: each tensor-parallel rank holds 1 / tp of the attention and MLP matmuls.
  const double tp = static_cast<double>(tp_.size);
  int64_t attn_layers = static_cast<int64_t>(mtp_.size());
  for (int64_t l = 0; l < L_; ++l) {
    if (layer_first_[l] < 0) continue;
    ++attn_layers;
    matmul += tp * static_cast<double>(attn_[l].qkv.in * attn_[l].qkv.out + attn_[l].proj.in * attn_[l].proj.out);
    if (moe_[l])
      matmul += moe_[l]->matmul_params_per_token();
    else
      matmul += tp * static_cast<double>(mlp_[l].fc.in * mlp_[l].fc.out + mlp_[l].proj.in * mlp_[l].proj.out);
  }
  for (const auto& d : mtp_)
    matmul += static_cast<double>(2 * C_ * C_ + V_ * C_) +
              tp * static_cast<double>(d->attn.qkv.in * d->attn.qkv.out + d->attn.proj.in * d->attn.proj.out) +
              (d->moe ? d->moe->matmul_params_per_token()
                      : tp * static_cast<double>(d->mlp.fc.in * d->mlp.fc.out + d->mlp.proj.in * d->mlp.proj.out));
  // Scores and the weighted sum of values: 2 x (T x head size) per head, x3 with backward.
  return 6.0 * matmul + 6.0 * static_cast<double>(attn_layers * Tg_ * heads_width_);
}

void GPT::begin_step(uint64_t seed, int64_t step, int64_t first_micro) {
  seed_ = seed;
  step_ = step;
  micro_ = first_micro_ = first_micro;
  std::fill(weights_stale_.begin(), weights_stale_.end(), 1);
  for (MoeLayer* layer : moe_all_)
    if (layer) layer->begin_step();
}

std::vector<MoeTokenStats> GPT::finish_step(double bias_update_rate, Communicator* dp) {
  precision_.end_step();
  if (!moe_.empty()) device_->host_sync("moe.token_stats");  // the step's counts, for the expert bias
  std::vector<MoeTokenStats> stats;
  for (MoeLayer* layer : moe_all_)
    if (layer) stats.push_back(layer->finish_step(bias_update_rate, dp));
  return stats;
}

void GPT::state_shards(std::vector<StateShard>& out, bool dp_first, bool tp_first, bool edp_first, bool etp_first) {
  params_.state_shards(out, dp_first, tp_first, edp_first);
  for (MoeLayer* layer : moe_all_)
    if (layer) layer->state_shards(out, dp_first && tp_first);
  for (const Precision::NamedHistory& h : precision_.amax_histories()) {
    const int64_t H = static_cast<int64_t>(h.history->amax.size());
    const bool writer = h.expert ? edp_first && etp_first : dp_first && tp_first;
    out.push_back(
        whole_tensor("buffer/fp8." + h.global_name + ".amax_history", Shape{H}, h.history->amax.data(), writer));
    out.push_back(whole_tensor("buffer/fp8." + h.global_name + ".scale", Shape{1}, &h.history->scale, writer));
  }
}

std::vector<uint64_t> GPT::param_block_hashes() const {
  BlockHasher h;
  for (size_t i = 0; i < params_.specs().size(); ++i)
    h.update(params_.value(static_cast<int>(i)), static_cast<size_t>(params_.specs()[i].shape.numel()) * sizeof(float));
  return h.block_hashes();
}

namespace {
// The state hash from the parameters' block pairs, those of parameter i kept when keep(i), then
// the expert biases' when `biases`.
template <typename Keep>
uint64_t combine_state(const ParamStore& ps, const std::vector<uint64_t>& param_blocks, Keep keep,
                       const std::vector<MoeLayer*>& moe, bool biases) {
  std::vector<uint64_t> pairs;
  size_t at = 0;
  for (size_t i = 0; i < ps.specs().size(); ++i) {
    const size_t n = 2 * hash_block_count(static_cast<size_t>(ps.specs()[i].shape.numel()) * sizeof(float));
    LOCKSTEP_CHECK(at + n <= param_blocks.size(), "parameter block hashes for another table");
    if (keep(i))
      pairs.insert(pairs.end(), param_blocks.begin() + static_cast<std::ptrdiff_t>(at),
                   param_blocks.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  LOCKSTEP_CHECK(at == param_blocks.size(), "parameter block hashes for another table");
  if (biases) {
    BlockHasher h;
    for (const MoeLayer* layer : moe)
      if (layer) h.update(layer->expert_bias().data(), layer->expert_bias().size() * sizeof(float));
    const std::vector<uint64_t> b = h.block_hashes();
    pairs.insert(pairs.end(), b.begin(), b.end());
  }
  return combine_block_hashes(pairs);
}
}  // namespace

uint64_t GPT::state_hash(const std::vector<uint64_t>& param_blocks) const {
  return combine_state(
      params_, param_blocks, [](size_t) { return true; }, moe_all_, true);
}

uint64_t GPT::state_hash(const std::vector<uint64_t>& param_blocks, bool experts) const {
  return combine_state(
      params_, param_blocks, [&](size_t i) { return params_.specs()[i].expert == experts; }, moe_all_, !experts);
}

}  // namespace lockstep
