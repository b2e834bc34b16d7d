#include "lockstep/parallel/pipeline/pipeline.h"

#include <chrono>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/trace.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
// Message tags: an activation for model chunk c is 2c, a gradient for it 2c + 1; the shared
// embedding's gradient above every chunk's.
int activation_tag(int64_t c) { return static_cast<int>(2 * c); }
int gradient_tag(int64_t c) { return static_cast<int>(2 * c + 1); }
constexpr int kSharedGradTag = 1 << 20;
}  // namespace

StagePart pipeline_part(const ParallelConfig& pc, int64_t num_layers, int stage) {
  const std::vector<int64_t> n = pc.chunk_layers(num_layers);
  std::vector<int64_t> start(n.size() + 1, 0);
  for (size_t i = 0; i < n.size(); ++i) start[i + 1] = start[i] + n[i];
  const int p = static_cast<int>(pc.pipeline);
  StagePart part;
  part.first = stage == 0;
  part.last = stage == p - 1;
  for (int64_t c = 0; c < pc.virtual_pipeline; ++c) {
    const size_t mc = static_cast<size_t>(c * p + stage);
    part.chunks.push_back({start[mc], start[mc + 1]});
  }
  return part;
}

Pipeline::Pipeline(Communicator& pp, const ParallelConfig& pc, int64_t micro_batches, int64_t tokens)
    : pp_(pp),
      p_(static_cast<int>(pc.pipeline)),
      v_(static_cast<int>(pc.virtual_pipeline)),
      stage_(pp.rank()),
      m_(micro_batches),
      tokens_per_micro_(tokens) {
  LOCKSTEP_CHECK(pp.size() == p_, "pipeline group of ", pp.size(), " ranks for parallel.pipeline = ", p_);
  actions_ = pipeline_schedule(pc.pipeline_schedule, p_, v_, m_, stage_);
  in_flight_ = lockstep::max_in_flight(actions_);
  tokens_.resize(static_cast<size_t>(in_flight_));
  targets_.resize(static_cast<size_t>(in_flight_));
}

Pipeline::StepResult Pipeline::run_step(PipelineStage& model, float grad_scale, const Fetch& fetch,
                                        const std::function<void()>& before_last_backward) {
  const auto t0 = Clock::now();
  StepResult res;
  res.lm_loss.assign(static_cast<size_t>(m_), 0.0);
  res.counted.assign(static_cast<size_t>(m_), -1);
  const int64_t bytes = model.activation_floats() * static_cast<int64_t>(sizeof(float));
  const int next = (stage_ + 1) % p_, prev = (stage_ + p_ - 1) % p_;
  const int64_t last_chunk = static_cast<int64_t>(p_) * v_ - 1;
  std::vector<Communicator::Message> sends, recvs;
  // What action i receives: its input from the previous stage, or its output gradient from the next.
  auto receive_for = [&](size_t i) {
    const PipelineAction& x = actions_[i];
    const int64_t mc = model_chunk(x.chunk);
    model.select_slot(slot(x.micro));
    if (x.forward && mc > 0) recvs.push_back({prev, activation_tag(mc), model.chunk_input(x.chunk), bytes});
    if (!x.forward && mc < last_chunk)
      recvs.push_back({next, gradient_tag(mc), model.chunk_output_grad(x.chunk), bytes});
  };
  auto exchange = [&]() {
    if (!sends.empty() || !recvs.empty()) {
      const auto w0 = Clock::now();
      pp_.send_recv_batch_async(sends, recvs).wait();
      res.wait_seconds += seconds_since(w0);
    }
    sends.clear();
    recvs.clear();
  };
  // A step: one action, or an interleaved steady-state forward and backward pair; after each step
  // one batch with what it produced and what the next step needs.
  auto step_end = [&](size_t i) { return i + (actions_[i].with_next ? 2 : 1); };
  auto receive_for_step = [&](size_t i) {
    for (size_t j = i; j < step_end(i); ++j) receive_for(j);
  };
  receive_for_step(0);
  exchange();
  bool armed = false;
  for (size_t i = 0; i < actions_.size();) {
    const size_t end = step_end(i);
    for (; i < end; ++i) {
      const PipelineAction& x = actions_[i];
      const int64_t mc = model_chunk(x.chunk);
      const int k = slot(x.micro);
      model.select_slot(k);
      std::vector<int32_t>& tokens = tokens_[static_cast<size_t>(k)];
      std::vector<int32_t>& targets = targets_[static_cast<size_t>(k)];
      int64_t& counted = res.counted[static_cast<size_t>(x.micro)];
      if (counted < 0) {  // the micro-batch's first action on this rank
        tokens.resize(static_cast<size_t>(tokens_per_micro_));
        targets.resize(static_cast<size_t>(tokens_per_micro_));
        counted = fetch(x.micro, tokens.data(), targets.data());
      }
      if (ModuleTrace* trace = ModuleTrace::current()) trace->set_action(x.micro, mc, !x.forward);
      if (x.forward) {
        model.forward_chunk(x.chunk, tokens.data(), x.micro);
        res.aux_loss += model.aux_loss();
        res.aux_exact.merge(model.aux_loss_exact());
        if (mc < last_chunk)
          sends.push_back({next, activation_tag(mc + 1), const_cast<float*>(model.chunk_output(x.chunk)), bytes});
      } else {
        if (x.micro == m_ - 1 && !armed) {
          before_last_backward();
          armed = true;
        }
        final_backward_ = x.micro == m_ - 1;
        backward_micro_ = x.micro;
        const double lm = model.backward_chunk(x.chunk, tokens.data(), targets.data(), grad_scale, x.micro);
        final_backward_ = false;
        backward_micro_ = -1;
        if (mc == last_chunk) {
          res.lm_loss[static_cast<size_t>(x.micro)] = lm;
          res.mtp_loss += model.mtp_loss();
          res.mtp_exact.add(model.mtp_loss());
          res.aux_loss += model.mtp_aux_loss();  // the depths' MoE sublayers ran in this backward
          res.aux_exact.merge(model.mtp_aux_loss_exact());
        }
        // The input gradient lives in scratch the next backward overwrites: a pair's backward is
        // its last action, so the batch below still reads this one's.
        if (mc > 0) sends.push_back({prev, gradient_tag(mc - 1), const_cast<float*>(model.chunk_input_grad()), bytes});
      }
    }
    if (i < actions_.size()) receive_for_step(i);
    exchange();
  }
  res.seconds = seconds_since(t0);
  return res;
}

double Pipeline::evaluate(PipelineStage& model, const int32_t* tokens, const int32_t* targets) {
  model.begin_evaluation();
  model.select_slot(0);
  const int64_t n = model.activation_floats();
  const int next = (stage_ + 1) % p_, prev = (stage_ + p_ - 1) % p_;
  const int64_t last_chunk = static_cast<int64_t>(p_) * v_ - 1;
  double loss = 0;
  // Model chunk by model chunk; each stage waits for its input, so the chain cannot cross itself.
  for (int c = 0; c < v_; ++c) {
    const int64_t mc = model_chunk(c);
    if (mc > 0) pp_.recv(model.chunk_input(c), n, prev, activation_tag(mc));
    model.forward_chunk(c, tokens, 0, false);
    if (mc < last_chunk)
      pp_.send(model.chunk_output(c), n, next, activation_tag(mc + 1));
    else
      loss = model.evaluate_head(tokens, targets);
  }
  return loss;
}

void Pipeline::sum_shared_grads(PipelineStage& model) {
  ParamStore& ps = model.params();
  const int peer = stage_ == 0 ? p_ - 1 : 0;
  for (int i : model.shared_params()) {
    const int64_t n = ps.specs()[static_cast<size_t>(i)].shape.numel();
    float* g = ps.grad(i);
    std::vector<float> other(static_cast<size_t>(n));
    pp_.send_recv(g, n, peer, other.data(), n, peer, kSharedGradTag);
    // first stage's + last stage's on both (float addition commutes: the same bits).
    for (int64_t j = 0; j < n; ++j) g[j] += other[static_cast<size_t>(j)];
  }
}

}  // namespace lockstep
