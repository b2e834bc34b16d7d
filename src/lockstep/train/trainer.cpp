#include "lockstep/train/trainer.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/tensor.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/data/dataset.h"
#include "lockstep/data/documents.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/gpt.h"
#include "lockstep/core/trace.h"
#include "lockstep/parallel/data_parallel.h"
#include "lockstep/parallel/pipeline/pipeline.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/json_line.h"
#include "lockstep/train/lr_schedule.h"
#include "lockstep/train/metrics.h"
#include "lockstep/train/module_trace.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/parallelize.h"
#include "lockstep/train/run_dir.h"
#include "lockstep/train/safetensors.h"

namespace lockstep {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

TrainSummary train(const Config& config, std::FILE* out) {
  TrainSummary summary;
  run_threads(1, config.dist.timeout_s, [&](Communicator& comm) { summary = train(config, out, comm); });
  return summary;
}

TrainSummary train(const Config& config, std::FILE* out, Communicator& comm) {
  const ModelConfig& mc = config.model;
  const TrainConfig& tc = config.train;
  ParallelGroups groups(comm, config);
  const Mesh& mesh = groups.mesh;
  const MeshCoordinates& coords = groups.coords;
  const bool leader = comm.rank() == 0;
  const int64_t dp_size = mesh.dp();
  Communicator& dense_dp = groups.dense_dp;
  Communicator& expert_dp = groups.expert_dp;
  Communicator& tp_group = groups.tp_group;
  Communicator& cp_group = groups.cp_group;
  Communicator& dp_only = groups.dp_group;
  Communicator& etp_group = groups.etp_group;
  Communicator& pp_group = groups.pp_group;
  const TensorParallel& tp = groups.tp;
  const ContextParallel& cp = groups.cp;
  Communicator* ep = groups.ep();
  Communicator* etp = groups.etp();
  const bool experts_split = groups.experts_split();
  const bool pipelined = groups.pipelined();
  Progress progress(out, leader);
  out = progress.out();
  // Ranks on one machine share its cores.
  const int threads = tc.threads ? static_cast<int>(tc.threads)
                                 : static_cast<int>(std::max(1u, std::thread::hardware_concurrency() /
                                                                     static_cast<unsigned>(comm.local_size())));
  ThreadPool pool(threads);
  ThreadPool::Bind bind(&pool);
  // The rank's device: its ops run on the pool bound above; the model's memory comes from it.
  const std::unique_ptr<Device> device = Device::cpu();

  const std::unique_ptr<Dataset> data = open_dataset(config.data, mc.seq_length, mc.vocab_size, tc.seed);
  GPT model(mc, tc.micro_batch, config.moe, config.precision, tp, ep, etp, stage_part(config, groups), cp, device.get());
  DataParallel dp(model.params(), dense_dp, expert_dp, config.ddp, config.optimizer.distributed);
  const std::unique_ptr<Pipeline> pipeline = parallelize(model, dp, groups, config);
  // The weights are initialised after the parallel plan is applied, as torchtitan does; nothing in
  // the plan reads them.
  model.params().init(tc.seed);
  const DataConfig& dc = config.data;
  const auto eod = static_cast<int32_t>(dc.eod_token);
  if (dc.reset_position_ids || dc.reset_attention_mask)
    model.set_documents(eod, dc.reset_position_ids, dc.reset_attention_mask);
  const bool layout = config.determinism == "layout";
  const int64_t accum = tc.global_batch / (tc.micro_batch * dp_size);  // micro-batches per rank and step
  Optimizer optimizer(model.params(), config.optimizer, dp.optimizer_ranges());

  // The state a checkpoint holds. Replicas (parameters over data-parallel ranks, the replicated
  // optimizer's moments) are written by the first data-parallel, context-parallel rank; tensor and
  // pipeline ranks will hold different pieces and each write theirs.
  std::vector<StateShard> state;
  const bool dp_first = coords.dp == 0 && coords.cp == 0, tp_first = coords.tp == 0;
  const bool edp_first = coords.edp == 0;
  model.state_shards(state, dp_first, tp_first, edp_first, coords.etp == 0);
  // A distributed optimizer's ranks own disjoint ranges: each writes its own.
  optimizer.state_shards(model.params(), state, dp_first || config.optimizer.distributed, tp_first,
                         edp_first || config.optimizer.distributed);
  const std::string checkpoints_root = tc.out_dir + "/checkpoints";
  // Rank 0 decides which checkpoint to resume ("auto" looks at the directory), so all ranks agree.
  std::string resume_dir;
  if (!tc.resume.empty()) {
    if (leader) resume_dir = resolve_resume(tc.resume, checkpoints_root);
    int64_t n = static_cast<int64_t>(resume_dir.size());
    comm.broadcast(&n, 1, 0);
    resume_dir.resize(static_cast<size_t>(n));
    if (n) comm.broadcast(resume_dir.data(), n, 0);
  }
  CheckpointInfo resumed;
  if (!resume_dir.empty()) resumed = load_checkpoint(resume_dir, state);
  else if (!tc.init_from.empty()) load_safetensors(tc.init_from, model.params());
  const int64_t start_step = resumed.step + 1;
  // The data stream continues at the checkpoint's position (0 for a fresh run).
  auto first_sample_of = [&](int64_t step) {
    return static_cast<uint64_t>(resumed.samples_consumed + (step - start_step) * tc.global_batch);
  };

  const std::vector<std::string> my_modules = model.module_names();  // this rank's part's
  if (config.debug.inject_step() > 0)
    check_injection(pipelined ? stages_module_names(pp_group, my_modules) : my_modules, config.debug);
  create_run_dir(tc.out_dir);
  std::unique_ptr<LineLog> metrics;
  const bool resuming = !resume_dir.empty();
  if (leader) {
    write_file_atomic(tc.out_dir + "/config.toml", config_to_toml(config));
    if (resuming) cut_jsonl_after_step(tc.out_dir + "/metrics.jsonl", resumed.step);
    metrics = std::make_unique<LineLog>(tc.out_dir + "/metrics.jsonl", resuming);
  }
  if (resuming) cut_jsonl_after_step(fingerprint_path(tc.out_dir, comm.rank()), resumed.step);
  LineLog fingerprints(fingerprint_path(tc.out_dir, comm.rank()), resuming);
  CheckpointSaver saver(checkpoints_root, tc.keep_last, tc.async_save, comm);
  StepTrace trace(config.debug, my_modules, tc.out_dir, comm.rank(), resuming, resumed.step);

  const double peak_gflops = measure_gemm_peak(device->ops);
  const int64_t B = tc.micro_batch, T = mc.seq_length, N = B * T;
  const int64_t tokens_per_step = tc.global_batch * T;
  double flops_per_token = model.flops_per_token();
  if (pipelined) pp_group.all_reduce(&flops_per_token, 1);  // the stages' parts of the model
  std::fprintf(out, "lockstep: %s model, %lld layers, hidden %lld, %lld heads, %.2fM parameters; %s\n",
               mc.preset.c_str(), (long long)mc.num_layers, (long long)mc.hidden_size, (long long)mc.num_heads,
               static_cast<double>(model.params().total()) / 1e6, data->description().c_str());
  std::fprintf(out, "lockstep: %lld steps x %lld sequences x %lld tokens (%lld micro-batches of %lld per rank), %d threads, "
               "GEMM peak %.1f GFLOP/s, run dir %s\n",
               (long long)tc.steps, (long long)tc.global_batch, (long long)T, (long long)accum, (long long)B,
               threads, peak_gflops, tc.out_dir.c_str());
  if (comm.size() > 1)
    std::fprintf(out, "lockstep: %d ranks (%s backend): tp %d x cp %d x dp %d x pp %d; experts: etp %d x ep %d x edp %d x pp %d\n",
                 comm.size(), comm.backend().c_str(), mesh.tp(), mesh.cp(), mesh.dp(), mesh.pp(), mesh.etp(), mesh.ep(),
                 mesh.edp(), mesh.pp());
  std::fprintf(out, "lockstep: data parallel %lld, %lld micro-batches per rank; %s optimizer: %.2f MiB of Adam state on "
               "rank 0; %lld gradient buckets, overlap grad reduce %s, param gather %s\n",
               (long long)dp_size, (long long)accum, config.optimizer.distributed ? "distributed" : "replicated",
               static_cast<double>(optimizer.state_bytes()) / (1 << 20), (long long)dp.num_buckets(),
               config.ddp.overlap_grad_reduce ? "on" : "off", config.ddp.overlap_param_gather ? "on" : "off");
  if (resuming)
    std::fprintf(out, "lockstep: resumed from %s (step %lld, %lld samples consumed)\n", resume_dir.c_str(),
                 (long long)resumed.step, (long long)resumed.samples_consumed);
  else if (!tc.init_from.empty())
    std::fprintf(out, "lockstep: initial weights from %s\n", tc.init_from.c_str());
  std::fflush(out);

  std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  // Data-parallel ranks evaluate every dp_size-th batch; the mean is over all of them. Under expert
  // (tensor) parallelism every forward is collective over the ep / etp group, whose ranks may be
  // different data-parallel ranks, so each rank runs as many forwards as the busiest one (the extra
  // ones count nothing).
  auto evaluate = [&]() {
    double sum = 0;
    ExactSum exact;
    const int64_t rounds = experts_split ? (tc.eval_batches + dp_size - 1) / dp_size : 0;
    for (int64_t i = coords.dp, round = 0; i < tc.eval_batches || round < rounds; i += dp_size, ++round) {
      const bool counted = i < tc.eval_batches;
      data->batch(tokens.data(), targets.data(), Split::eval, static_cast<uint64_t>((counted ? i : 0) * B), B);
      if (dc.eod_mask_loss) mask_eod_targets(targets.data(), tokens.data(), N, eod);
      const double loss = pipelined ? pipeline->evaluate(model, tokens.data(), targets.data())
                                    : model.evaluate(tokens.data(), targets.data());
      if (counted) sum += loss, exact.add(loss);
    }
    if (pipelined) pp_group.all_reduce(&sum, 1);  // the last stage's losses
    if (layout) {
      if (pipelined) all_reduce_exact(pp_group, &exact, 1);
      all_reduce_exact(dense_dp, &exact, 1);
      sum = exact.value();
    } else if (dense_dp.size() > 1) {
      dense_dp.all_reduce(&sum, 1);
    }
    return sum / static_cast<double>(tc.eval_batches);
  };

  // Writes a step's fingerprint line once the parameters are complete. Data-parallel replicas hold
  // the same parameters, expert biases and loss, bit for bit: they agree exactly when max(h) and
  // max(~h) over the group are h and ~h (one tiny all-reduce). Under expert parallelism the dense
  // replicas (dp) hold different experts: the dense part is compared over dp, the experts over edp.
  // param_blocks: the parameters' block hashes taken in the update (the replicated optimizer), or
  // empty for a pass over them here (the distributed one: complete only after the all-gather).
  const bool gather_in_background = config.optimizer.distributed && config.ddp.overlap_param_gather;
  std::optional<Fingerprint> pending_fingerprint;
  auto write_fingerprint = [&](Fingerprint fp, std::vector<uint64_t> param_blocks) {
    device->host_sync("fingerprint");
    dp.wait_params();
    if (param_blocks.empty()) param_blocks = model.param_block_hashes();
    fp.params = model.state_hash(param_blocks);
    fingerprints.write(fp.json());
    auto check_replicas = [&](Communicator& group, uint64_t params) {
      if (group.size() == 1) return;
      const uint64_t fields[] = {params, std::bit_cast<uint64_t>(fp.loss), std::bit_cast<uint64_t>(fp.grad_norm)};
      const uint64_t h = hash_bytes(fields, sizeof fields);
      uint64_t agree[2] = {h, ~h};
      group.all_reduce(agree, 2, ReduceOp::max);
      if (agree[0] != h || agree[1] != ~h)
        throw CommError(str("rank ", comm.rank(), ": step ", fp.step, ": the data-parallel replicas' parameters or loss differ"));
    };
    if (!experts_split) {
      check_replicas(dense_dp, fp.params);
    } else {
      check_replicas(dense_dp, model.state_hash(param_blocks, /*experts=*/false));
      check_replicas(expert_dp, model.state_hash(param_blocks, /*experts=*/true));
    }
  };

  TrainSummary summary;
  std::vector<double> step_seconds;
  // Bytes this rank's token dispatchers have sent (training steps only: evaluation's are skipped).
  auto dispatch_total = [&]() {
    int64_t n = 0;
    for (const auto& layer : model.moe_layers())
      if (layer) n += layer->dispatch_bytes_sent();
    return n;
  };
  int64_t dispatch_bytes_before = 0;
  const auto start = Clock::now();
  for (int64_t step = start_step; step <= tc.steps; ++step) {
    const auto t0 = Clock::now();
    const int64_t tp_bytes_before = tp_group.bytes_sent(), etp_bytes_before = etp_group.bytes_sent(),
                  cp_bytes_before = cp_group.bytes_sent();
    ParamStore& ps = model.params();
    ps.zero_grads();
    const uint64_t first_sample = first_sample_of(step);
    // This rank's micro-batches of the global batch: the step's micro-batches first_micro ... +
    // accum - 1, a pure function of (step, dp rank, micro).
    const int64_t first_micro = coords.dp * accum;
    // Returns the micro-batch's tokens that carry a loss.
    auto fetch_into = [&](int64_t micro, int32_t* tok, int32_t* tgt) {
      data->batch(tok, tgt, Split::train, first_sample + static_cast<uint64_t>((first_micro + micro) * B), B);
      return dc.eod_mask_loss ? mask_eod_targets(tgt, tok, N, eod) : N;
    };
    auto fetch = [&](int64_t micro) { return fetch_into(micro, tokens.data(), targets.data()); };
    // The loss is the mean over the global batch's unmasked tokens, so they are counted (over every
    // data-parallel rank) before any backward (the loader is a pure function of the sample index:
    // fetching twice is exact).
    int64_t loss_tokens = N * accum * dp_size;
    if (dc.eod_mask_loss) {
      loss_tokens = 0;
      for (int64_t micro = 0; micro < accum; ++micro) loss_tokens += fetch(micro);
      if (dp_size > 1) dp_only.all_reduce(&loss_tokens, 1);
    }
    const float grad_scale = 1.0f / static_cast<float>(std::max<int64_t>(loss_tokens, 1));
    // Sums over this rank's micro-batches of the LM loss (token-weighted with eod_mask_loss), aux
    // and MTP losses, then over the data-parallel ranks.
    double sums[3] = {0, 0, 0};
    ExactSum exact_sums[3];  // the same, exactly (layout mode)
    model.begin_step(tc.seed, step, first_micro);
    // Every rank of a cp group computes the whole micro-batch's aux losses: counted once, on cp rank 0.
    const bool aux_here = coords.cp == 0;
    Pipeline::StepResult piped;
    if (pipelined) {
      trace.set_position(step, 0);
      {
        ModuleTrace::Bind bind_trace(trace.get());
        piped = pipeline->run_step(model, grad_scale, fetch_into, [&dp] { dp.begin_last_micro(); });
      }
      trace.after_traced(step == start_step);
      for (int64_t micro = 0; micro < accum; ++micro) {
        const double lm = piped.lm_loss[static_cast<size_t>(micro)];
        const double term = dc.eod_mask_loss ? lm * static_cast<double>(piped.counted[static_cast<size_t>(micro)]) : lm;
        sums[0] += term;
        exact_sums[0].add(term);  // 0 on the stages without the head
      }
      sums[1] = aux_here ? piped.aux_loss : 0.0;
      sums[2] = piped.mtp_loss;
      if (aux_here) exact_sums[1] = piped.aux_exact;
      exact_sums[2] = piped.mtp_exact;
      if (!layout) {
        pipeline->sum_shared_grads(model);
        for (int i : model.shared_params()) dp.post_ready(i, i + 1);
      }
      if (pending_fingerprint) {
        write_fingerprint(*pending_fingerprint, {});
        pending_fingerprint.reset();
      }
    }
    for (int64_t micro = 0; micro < accum && !pipelined; ++micro) {
      const int64_t counted = fetch(micro);
      dp.begin_micro(micro);
      if (micro == accum - 1) dp.begin_last_micro();
      trace.set_position(step, micro);
      double micro_loss = 0;
      {
        ModuleTrace::Bind bind_trace(trace.get());
        micro_loss = model.forward_backward(tokens.data(), targets.data(), grad_scale);
      }
      trace.after_traced(step == start_step);
      if (pending_fingerprint) {
        write_fingerprint(*pending_fingerprint, {});
        pending_fingerprint.reset();
      }
      const double micro_sums[3] = {dc.eod_mask_loss ? micro_loss * static_cast<double>(counted) : micro_loss,
                                    aux_here ? model.aux_loss() : 0.0, model.mtp_loss()};
      for (int k = 0; k < 3; ++k) sums[k] += micro_sums[k];
      // The aux losses layer by layer, as pipeline stages that hold some of the layers add them.
      exact_sums[0].add(micro_sums[0]);
      if (aux_here) exact_sums[1].merge(model.aux_loss_exact());
      exact_sums[2].add(micro_sums[2]);
    }
    dp.finish_grad_sync();
    // Layout mode: the word (and position) embedding's lookup part and its head / MTP part, each the
    // canonical tree over the step's micro-batches, are added now (docs/design/reductions.md#the-shared-word-embedding).
    if (layout && pipelined) pipeline->sum_shared_grads(model);
    if (layout) model.sum_split_grads();
    if (!layout) reduce_sequence_parallel_grads(tp, ps);  // layout: per micro-batch, in the grads-ready hook
    if (pipelined) pp_group.all_reduce(sums, 3);  // the LM and MTP losses of the last stage, each stage's aux losses
    if (layout) {
      if (pipelined) all_reduce_exact(pp_group, exact_sums, 3);
      all_reduce_exact(dense_dp, exact_sums, 3);
      for (int k = 0; k < 3; ++k) sums[k] = exact_sums[k].value();
    } else if (dense_dp.size() > 1) {
      dense_dp.all_reduce(sums, 3);
    }
    const double micros = static_cast<double>(accum * dp_size);
    const double lm_loss = sums[0] / (dc.eod_mask_loss ? static_cast<double>(std::max<int64_t>(loss_tokens, 1)) : micros);
    const double aux_loss = sums[1] / micros, mtp_loss = sums[2] / micros;
    // The training loss: Megatron adds each micro-batch's aux (and MTP) losses with weight 1 / micro-batches.
    const double loss = lm_loss + aux_loss + mtp_loss;
    const double lr = learning_rate(tc, step);
    const double grad_norm = dp.grad_norm();
    // The summed gradients and the moments of this rank's shard (the same elements with either
    // optimizer), and with the replicated optimizer every parameter, hashed in the update's pass.
    ShardHashes shard_hashes(dp.shard(), dp.updates_whole() ? &model.params() : nullptr);
    const float clip = optimizer.clip_scale(grad_norm);
    dp.step([&](const std::vector<ParamRange>& ranges) {
      optimizer.update(model.params(), step, lr, clip, ranges, &shard_hashes);
    });
    const std::vector<MoeTokenStats> moe_stats =
        model.finish_step(config.moe.router_bias_update_rate, dense_dp.size() > 1 ? &dense_dp : nullptr);
    const double secs = seconds_since(t0);
    if (step > start_step || start_step == tc.steps) step_seconds.push_back(secs);
    const int64_t dispatch_bytes = dispatch_total() - dispatch_bytes_before;  // this step's
    dispatch_bytes_before += dispatch_bytes;

    Fingerprint fp;
    fp.step = step;
    fp.loss = loss;
    fp.lm_loss = lm_loss;
    fp.aux_loss = aux_loss;
    fp.mtp_loss = mtp_loss;
    fp.grad_norm = grad_norm;
    fp.lr = lr;
    fp.grads = shard_hashes.grads();
    fp.optimizer = shard_hashes.moments();
    // The random state of a step: the seed and where the data stream stands.
    const uint64_t rng_state[2] = {tc.seed, first_sample + static_cast<uint64_t>(tc.global_batch)};
    fp.rng = hash_bytes(rng_state, sizeof rng_state);
    fp.rank = comm.rank(), fp.dp = coords.dp, fp.tp = coords.tp, fp.pp = coords.pp, fp.ep = coords.ep, fp.cp = coords.cp;
    fp.etp = coords.etp;
    // With the parameter gather overlapped, the parameters are complete once the next step's
    // first forward has run: the line waits until then.
    if (gather_in_background && step < tc.steps) pending_fingerprint = fp;
    else write_fingerprint(fp, shard_hashes.has_params() ? shard_hashes.params() : std::vector<uint64_t>{});

    StepMetrics m;
    m.step = step;
    m.loss = loss, m.lm_loss = lm_loss, m.aux_loss = aux_loss, m.mtp_loss = mtp_loss, m.grad_norm = grad_norm, m.lr = lr;
    m.seconds = secs;
    m.tokens_per_s = static_cast<double>(tokens_per_step) / secs;
    m.mfu = peak_gflops > 0 ? m.tokens_per_s * flops_per_token / (peak_gflops * 1e9) : 0;
    m.moe = moe_stats;
    if (tp.on()) m.tp_bytes = tp_group.bytes_sent() - tp_bytes_before;
    if (ep) m.ep_bytes = dispatch_bytes;
    if (etp) m.etp_bytes = etp_group.bytes_sent() - etp_bytes_before;
    if (cp.on()) m.cp_bytes = cp_group.bytes_sent() - cp_bytes_before;
    JsonLine metrics_line = lockstep::metrics_line(m);
    if (pipelined) {
      const StageMetrics stage{piped.seconds > 0 ? piped.wait_seconds / piped.seconds : 0.0,
                               static_cast<double>(model.activation_slots()),
                               static_cast<double>(model.activation_bytes_held()) / (1 << 20),
                               static_cast<double>(model.slot_activation_bytes()) / (1 << 20)};
      add_stage_metrics(metrics_line, pp_group, stage);
    }
    add_rank_metrics(metrics_line, comm, *device);
    if (metrics) metrics->write(metrics_line.str());
    if (step == start_step) summary.first_loss = loss;
    summary.last_loss = loss;
    summary.steps = step;

    const bool eval_now = tc.eval_interval > 0 && (step % tc.eval_interval == 0 || step == tc.steps);
    std::optional<double> eval_loss;
    if (eval_now) {
      dp.wait_params();
      eval_loss = evaluate();
      device->take_host_syncs();  // evaluation's are not the next step's
      dispatch_bytes_before = dispatch_total();
      summary.last_eval_loss = *eval_loss;
      if (metrics) metrics->write(JsonLine().add("step", step).add("eval_loss", *eval_loss, 9).str());
    }

    progress.step(tc, m, seconds_since(start), eval_loss);

    // A finished asynchronous save is committed at a step boundary every rank agrees on.
    saver.poll();
    const bool exit_now = tc.exit_interval > 0 && step % tc.exit_interval == 0 && step < tc.steps;
    if (tc.save_interval > 0 && (step % tc.save_interval == 0 || step == tc.steps || exit_now)) {
      CheckpointInfo info;
      info.step = step;
      info.samples_consumed = static_cast<int64_t>(first_sample_of(step + 1));
      info.tokens_consumed = info.samples_consumed * T;
      info.seed = tc.seed;
      info.lr_schedule = tc.lr_schedule;
      info.lr = lr;
      info.config_toml = config_to_toml(config);
      info.layout = {comm.size(), mesh.tp(), mesh.cp(), mesh.dp(), mesh.pp(), mesh.ep(), mesh.etp(),
                     config.optimizer.distributed};
      dp.wait_params();  // the replicas written are complete (ddp.overlap_param_gather)
      saver.save(info, state);
    }
    if (exit_now) {
      if (pending_fingerprint) write_fingerprint(*pending_fingerprint, {});
      progress.stopping(step, tc.exit_interval);
      break;
    }
  }
  saver.finish();

  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.empty() ? 0 : sorted[sorted.size() / 2];
  summary.tokens_per_s = median > 0 ? static_cast<double>(tokens_per_step) / median : 0;
  summary.mfu = peak_gflops > 0 ? summary.tokens_per_s * flops_per_token / (peak_gflops * 1e9) : 0;
  progress.done(summary, seconds_since(start));
  return summary;
}

}  // namespace lockstep
