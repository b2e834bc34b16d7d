// The trainer's checkpoints (the format and the saver are checkpoint.h): the state a rank holds,
// resuming it, and saving it at the step boundaries train.save_interval asks for.
#include "lockstep/comm/communicator.h"
#include "lockstep/config/hf_config.h"
#include "lockstep/train/hf_checkpoint.h"
#include "lockstep/train/safetensors.h"
#include "lockstep/train/trainer.h"
#include "lockstep/train/upcycling.h"

namespace lockstep {

// Replicas (parameters over data-parallel ranks, the replicated optimizer's moments) are written
// by the first data-parallel, context-parallel rank; tensor and pipeline ranks hold different
// pieces and each write theirs.
void Trainer::restore() {
  const TrainConfig& tc = config_.train;
  const MeshCoordinates& c = groups_.coords;
  const bool dp_first = c.dp == 0 && c.cp == 0, tp_first = c.tp == 0;
  const bool edp_first = c.edp == 0;
  model_.state_shards(state_, dp_first, tp_first, edp_first, c.etp == 0);
  // A distributed optimizer's ranks own disjoint ranges: each writes its own.
  const bool distributed = config_.optimizer.distributed;
  optimizer_.state_shards(model_.params(), state_, dp_first || distributed, tp_first, edp_first || distributed);
  // Rank 0 decides which checkpoint to resume ("auto" looks at the directory), so all ranks agree.
  if (!tc.resume.empty()) {
    Communicator& world = groups_.world;
    if (world.rank() == 0) resume_dir_ = resolve_resume(tc.resume, checkpoints_root());
    int64_t n = static_cast<int64_t>(resume_dir_.size());
    world.broadcast(&n, 1, 0);
    resume_dir_.resize(static_cast<size_t>(n));
    if (n) world.broadcast(resume_dir_.data(), n, 0);
  }
  if (!resume_dir_.empty())
    resumed_ = load_checkpoint(resume_dir_, state_);
  else if (!tc.init_from.empty())
    init_weights();
  start_step_ = resumed_.step + 1;
  skipped_steps_ = resumed_.skipped_steps;
}

// train.init_from: lockstep's safetensors or a Hugging Face directory, as the model or upcycled.
void Trainer::init_weights() {
  const std::string& from = config_.train.init_from;
  const std::string hf = hf_model_dir(from);
  ParamStore& ps = model_.params();
  if (!config_.moe.use_upcycling) {
    if (hf.empty())
      load_safetensors(from, ps);
    else
      load_hf_checkpoint(hf, ps, config_.model, config_.moe, state_);  // state_: the buffers too
    return;
  }
  if (!hf.empty()) {
    upcycle(ps, config_.model, config_.moe, hf_dense_tensors(hf, config_.model));
    return;
  }
  SafetensorsFile file(from);
  upcycle(ps, config_.model, config_.moe, [&](const std::string& name, const Shape& shape) {
    if (!file.has(name)) user_error("moe.use_upcycling: '", from, "' has no tensor '", name, "' (the dense model's)");
    if (file.entry(name).shape != shape)
      user_error("'", from, "': tensor '", name, "' has shape ", file.entry(name).shape.to_string(),
                 ", the dense model's is ", shape.to_string());
    return file.floats(name);
  });
}

// The data stream continues at the checkpoint's position (0 for a fresh run).
uint64_t Trainer::first_sample_of(int64_t step) const {
  return static_cast<uint64_t>(resumed_.samples_consumed + (step - start_step_) * config_.train.global_batch);
}

// A finished asynchronous save is committed at a step boundary every rank agrees on.
void Trainer::save_checkpoint(int64_t step, double lr, bool exit_now) {
  const TrainConfig& tc = config_.train;
  saver_->poll();
  if (!(tc.save_interval > 0 && (step % tc.save_interval == 0 || step == tc.steps || exit_now))) return;
  const Mesh& mesh = groups_.mesh;
  CheckpointInfo info;
  info.step = step;
  info.samples_consumed = static_cast<int64_t>(first_sample_of(step + 1));
  info.tokens_consumed = info.samples_consumed * config_.model.seq_length;
  info.skipped_steps = skipped_steps_;
  info.seed = tc.seed;
  info.lr_schedule = tc.lr_schedule;
  info.lr = lr;
  info.config_toml = config_to_toml(config_);
  info.layout = {groups_.world.size(),         mesh.tp(), mesh.cp(), mesh.dp(), mesh.pp(), mesh.ep(), mesh.etp(),
                 config_.optimizer.distributed};
  dp_.wait_params();  // the replicas written are complete (ddp.overlap_param_gather)
  saver_->save(info, state_, [this, step] { faults_.in_save(step); });
}

}  // namespace lockstep
