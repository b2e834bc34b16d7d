// The Trainer's set-up and its loop; the step is in step.cpp, evaluation in evaluate.cpp,
// checkpoints in checkpointing.cpp, the parallel plan in parallelize.cpp, reporting in metrics.cpp.
#include "lockstep/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/link_model.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/link_spec.h"
#include "lockstep/train/build_info.h"

namespace lockstep {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Ranks on one machine share its cores.
int rank_threads(const TrainConfig& tc, const Communicator& world) {
  return tc.threads ? static_cast<int>(tc.threads)
                    : static_cast<int>(std::max(
                          1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world.local_size())));
}

}  // namespace

TrainSummary train(const Config& config, std::FILE* out) {
  TrainSummary summary;
  run_threads(1, config.dist.timeout_s, [&](Communicator& comm) { summary = train(config, out, comm); });
  return summary;
}

TrainSummary train(const Config& config, std::FILE* out, Communicator& comm) {
  // The wire model (comm/link_model.h) before the groups are split from the world: they share it.
  if (const LinkSpec link = parse_link_spec(config.dist.link, "dist.link"); link.on()) {
    auto model = std::make_shared<LinkModel>(link, config.parallel.ranks_per_node);
    if (const double scale = parse_link_scale(config.dist.link_scale, "dist.link_scale"); scale > 0)
      model->scale_bandwidths(scale);
    comm.set_link_model(std::move(model));
  }
  Trainer trainer(config, out, comm);
  return trainer.run();
}

// The weights are initialised after the parallel plan is applied, as torchtitan does; nothing in
// the plan reads them.
Trainer::Trainer(const Config& config, std::FILE* out, Communicator& world)
    : config_(config),
      groups_(world, config),
      progress_(out, world.rank() == 0),
      threads_(rank_threads(config.train, world)),
      pool_(threads_),
      bind_pool_(&pool_),
      device_(Device::cpu()),
      data_(open_dataset(config.data, config.model.seq_length, config.model.vocab_size, config.train.seed,
                         config.packing_pad_multiple())),
      model_(config.model, config.train.micro_batch, config.moe, config.precision, groups_.tp, groups_.ep(),
             groups_.etp(), stage_part(config, groups_), groups_.cp, device_.get(), Recompute::of(config.train)),
      dp_(model_.params(), groups_.dense_dp, groups_.expert_dp, config.ddp, config.optimizer.distributed),
      pipeline_(parallelize(model_, dp_, groups_, config)),
      optimizer_(model_.params(), config.optimizer, dp_.optimizer_ranges()),
      accum_(config.train.global_batch / (config.train.micro_batch * groups_.mesh.dp())),
      first_micro_(groups_.coords.dp * accum_),
      tokens_(static_cast<size_t>(config.train.micro_batch * config.model.seq_length)),
      targets_(tokens_.size()),
      faults_(config.debug, config.train.out_dir, world.rank()),
      stragglers_(config.train.straggler_threshold) {
  model_.params().init(config.train.seed);
  const DataConfig& dc = config.data;
  if (dc.reset_position_ids || dc.reset_attention_mask || dc.thd())
    model_.set_documents(static_cast<int32_t>(dc.eod_token), dc.reset_position_ids || dc.thd(),
                         dc.reset_attention_mask || dc.thd(), config.packing_pad_multiple());
  restore();
  open_run_dir();
  peak_gflops_ = measure_gemm_peak(device_->ops);
  // dist.link_scale = "h100": the wire's bandwidths times this CPU's GEMM peak / the H100 SXM's dense
  // bf16 peak, so that communication / compute here is a cluster's.
  constexpr double kH100Bf16Flops = 989.4e12;
  if (LinkModel* link = groups_.world.link_model();
      link && parse_link_scale(config.dist.link_scale, "dist.link_scale") == 0)
    link->scale_bandwidths(peak_gflops_ * 1e9 / kH100Bf16Flops);
  flops_per_token_ = model_.flops_per_token();
  if (pipeline_) groups_.pp_group.all_reduce(&flops_per_token_, 1);  // the stages' parts of the model
  print_banner();
}

Trainer::~Trainer() = default;

void Trainer::open_run_dir() {
  const TrainConfig& tc = config_.train;
  const DebugConfig& dbg = config_.debug;
  const int rank = groups_.world.rank();
  const std::vector<std::string> my_modules = model_.module_names();  // this rank's part's
  if (dbg.inject_step() > 0)
    check_injection(pipeline_ ? stages_module_names(groups_.pp_group, my_modules) : my_modules, dbg);
  create_run_dir(tc.out_dir);
  const bool resuming = !resume_dir_.empty();
  if (rank == 0) {
    write_file_atomic(tc.out_dir + "/config.toml", config_to_toml(config_));
    write_file_atomic(tc.out_dir + "/build.json", current_build(config_.data).json());  // what replay checks
    if (resuming) cut_jsonl_after_step(tc.out_dir + "/metrics.jsonl", resumed_.step);
    metrics_ = std::make_unique<LineLog>(tc.out_dir + "/metrics.jsonl", resuming);
    if (resuming) cut_tensorboard_after_step(tc.out_dir + "/tensorboard", resumed_.step);
    if (tc.tensorboard) tensorboard_ = std::make_unique<TensorBoardWriter>(tc.out_dir + "/tensorboard");
  }
  if (resuming) cut_jsonl_after_step(fingerprint_path(tc.out_dir, rank), resumed_.step);
  fingerprints_ = std::make_unique<LineLog>(fingerprint_path(tc.out_dir, rank), resuming);
  saver_ = std::make_unique<CheckpointSaver>(checkpoints_root(), tc.keep_last, tc.async_save, groups_.world);
  trace_ = std::make_unique<StepTrace>(dbg, my_modules, tc.out_dir, rank, resuming, resumed_.step);
}

void Trainer::print_banner() const {
  const ModelConfig& mc = config_.model;
  const TrainConfig& tc = config_.train;
  const Mesh& mesh = groups_.mesh;
  const Communicator& world = groups_.world;
  std::FILE* out = progress_.out();
  std::fprintf(out, "lockstep: %s model, %lld layers, hidden %lld, %lld heads, %.2fM parameters; %s\n",
               mc.preset.c_str(), (long long)mc.num_layers, (long long)mc.hidden_size, (long long)mc.num_heads,
               static_cast<double>(model_.params().total()) / 1e6, data_->description().c_str());
  std::fprintf(out,
               "lockstep: %lld steps x %lld sequences x %lld tokens (%lld micro-batches of %lld per rank), %d threads, "
               "GEMM peak %.1f GFLOP/s, run dir %s\n",
               (long long)tc.steps, (long long)tc.global_batch, (long long)mc.seq_length, (long long)accum_,
               (long long)tc.micro_batch, threads_, peak_gflops_, tc.out_dir.c_str());
  if (world.size() > 1)
    std::fprintf(
        out,
        "lockstep: %d ranks (%s backend): tp %d x cp %d x dp %d x pp %d; experts: etp %d x ep %d x edp %d x pp %d\n",
        world.size(), world.backend().c_str(), mesh.tp(), mesh.cp(), mesh.dp(), mesh.pp(), mesh.etp(), mesh.ep(),
        mesh.edp(), mesh.pp());
  std::fprintf(out,
               "lockstep: data parallel %lld, %lld micro-batches per rank; %s optimizer: %.2f MiB of Adam state on "
               "rank 0; %lld gradient buckets, overlap grad reduce %s, param gather %s\n",
               (long long)mesh.dp(), (long long)accum_, config_.optimizer.distributed ? "distributed" : "replicated",
               static_cast<double>(optimizer_.state_bytes()) / (1 << 20), (long long)dp_.num_buckets(),
               config_.ddp.overlap_grad_reduce ? "on" : "off", config_.ddp.overlap_param_gather ? "on" : "off");
  if (!resume_dir_.empty())
    std::fprintf(out, "lockstep: resumed from %s (step %lld, %lld samples consumed)\n", resume_dir_.c_str(),
                 (long long)resumed_.step, (long long)resumed_.samples_consumed);
  else if (!tc.init_from.empty())
    std::fprintf(out, "lockstep: initial weights from %s\n", tc.init_from.c_str());
  std::fflush(out);
}

TrainSummary Trainer::run() {
  const TrainConfig& tc = config_.train;
  const auto start = Clock::now();
  for (int64_t step = start_step_; step <= tc.steps; ++step) {
    const StepOutcome outcome = train_step(step);
    guard_nonfinite(outcome.metrics, log_step(outcome));
    std::optional<double> eval_loss;
    if (tc.eval_interval > 0 && (step % tc.eval_interval == 0 || step == tc.steps)) eval_loss = evaluate_and_log(step);
    progress_.step(tc, outcome.metrics, seconds_since(start), eval_loss);
    const bool exit_now = tc.exit_interval > 0 && step % tc.exit_interval == 0 && step < tc.steps;
    save_checkpoint(step, outcome.metrics.lr, exit_now);
    if (exit_now) {
      write_pending_fingerprint();
      progress_.stopping(step, tc.exit_interval);
      break;
    }
  }
  saver_->finish();

  std::vector<double> sorted = step_seconds_;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.empty() ? 0 : sorted[sorted.size() / 2];
  const double tokens_per_step = static_cast<double>(tc.global_batch * config_.model.seq_length);
  summary_.tokens_per_s = median > 0 ? tokens_per_step / median : 0;
  summary_.mfu = peak_gflops_ > 0 ? summary_.tokens_per_s * flops_per_token_ / (peak_gflops_ * 1e9) : 0;
  progress_.done(summary_, seconds_since(start));
  return summary_;
}

// The step's line of metrics.jsonl (rank 0's), with every stage's and every rank's fields.
int Trainer::log_step(const StepOutcome& outcome) {
  const StepMetrics& m = outcome.metrics;
  JsonLine line = metrics_line(m);
  if (pipeline_) add_stage_metrics(line, groups_.pp_group, outcome.stage);
  const RankTimes times = add_rank_metrics(line, groups_.world, *device_, m);
  const std::string text = line.str();
  if (metrics_) metrics_->write(text);
  if (tensorboard_) tensorboard_->write(text);
  const std::string straggler = stragglers_.add(m.step, times.step_ms, times.comm_wait_ms);
  if (!straggler.empty()) progress_.warning(straggler);
  if (m.step == start_step_) summary_.first_loss = m.loss;
  summary_.last_loss = m.loss;
  summary_.steps = m.step;
  return times.first_nonfinite;
}

// Stops the job (every rank the same way: the loss, grad norm and the gathered flags are global)
// before anything saves the step's state; a save already under way in the background is of an
// earlier, finite step and is completed. With module tracing, names the first module whose
// output went non-finite on this rank.
void Trainer::guard_nonfinite(const StepMetrics& m, int nonfinite_rank) {
  const bool skip = config_.train.on_nonfinite == "skip_step";
  std::string what;
  if (!m.nonfinite.empty() && !skip) {
    const double v = m.nonfinite == "loss" ? m.loss : m.grad_norm;
    what = str("the ", m.nonfinite == "loss" ? "loss" : "gradient norm", " is ",
               std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"), "; the update was not applied");
  } else if (nonfinite_rank >= 0)
    what = str("the parameters AdamW updated are not finite (rank ", nonfinite_rank, " first)");
  if (what.empty()) return;
  write_pending_fingerprint();
  saver_->finish();
  const std::string& module = trace_->first_nonfinite();
  throw NonFiniteError(str("step ", m.step, ": ", what, module.empty() ? "" : str("; first non-finite: ", module),
                           " (train.on_nonfinite = \"", config_.train.on_nonfinite, "\"); no checkpoint of this state"),
                       groups_.world.rank() == 0);
}

}  // namespace lockstep
