#include "lockstep/train/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "lockstep/core/tensor.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/train/trainer.h"

namespace lockstep {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_memory_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

}  // namespace

// Runs for a quarter of a second: a new pool's threads can start on one core and take tens of
// milliseconds to be spread by the scheduler. Measured once per process and pool size: tests and
// threads-backend ranks train many times in one process, and a quarter second per run was most
// of a short test's time (rank threads wait for the first one's measurement).
double measure_gemm_peak(const Ops& ops) {
  static std::mutex mutex;
  static std::map<int, double> measured;  // by thread count
  const std::lock_guard<std::mutex> lock(mutex);
  double& best = measured[current_threads()];
  if (best > 0) return best;
  constexpr int64_t n = 512;
  FloatBuffer a(n * n), b(n * n), c(n * n);
  for (int64_t i = 0; i < n * n; ++i) a[i] = b[i] = 1.0f / static_cast<float>(1 + i % 7);
  const auto start = Clock::now();
  for (int rep = 0; rep < 3 || seconds_since(start) < 0.25; ++rep) {
    const auto t0 = Clock::now();
    gemm_f32(ops, c.data(), a.data(), Trans::N, b.data(), Trans::T, n, n, n);
    best = std::max(best, 2.0 * n * n * n / seconds_since(t0) / 1e9);
  }
  return best;
}

JsonLine metrics_line(const StepMetrics& m) {
  JsonLine line;
  line.add("step", m.step)
      .add("loss", m.loss, 9)
      .add("lm_loss", m.lm_loss, 9)
      .add("aux_loss", m.aux_loss, 9)
      .add("mtp_loss", m.mtp_loss, 9)
      .add("grad_norm", m.grad_norm, 9)
      .add("lr", m.lr, 9)
      .add("step_ms", m.seconds * 1e3, 6)
      .add("tokens_per_s", m.tokens_per_s, 6)
      .add("mfu", m.mfu, 4)
      .add("peak_mem_mb", peak_memory_mb(), 6);
  if (m.tp_bytes >= 0) line.add("tp_bytes", m.tp_bytes);
  for (const MoeTokenStats& st : m.moe) {
    const std::string key = "moe." + std::to_string(st.layer) + ".";
    line.add((key + "tokens_min").c_str(), st.min)
        .add((key + "tokens_max").c_str(), st.max)
        .add((key + "imbalance").c_str(), st.imbalance, 6);
  }
  if (!m.nonfinite.empty()) line.add("nonfinite", m.nonfinite).add("skipped", true);
  if (m.skipped_steps > 0) line.add("skipped_steps", m.skipped_steps);
  if (m.ep_bytes >= 0) line.add("ep_bytes_sent", m.ep_bytes);
  if (m.etp_bytes >= 0) line.add("etp_bytes", m.etp_bytes);
  if (m.cp_bytes >= 0) line.add("cp_bytes", m.cp_bytes);
  if (m.loss_tokens >= 0) line.add("loss_tokens", m.loss_tokens);
  return line;
}

void add_stage_metrics(JsonLine& line, Communicator& pp, const StageMetrics& mine) {
  const double values[4] = {mine.wait_fraction, mine.in_flight, mine.activation_mb, mine.slot_mb};
  std::vector<double> stages(static_cast<size_t>(4 * pp.size()));
  pp.all_gather(stages.data(), values, 4);
  for (int st = 0; st < pp.size(); ++st) {
    const std::string key = "pp." + std::to_string(st) + ".";
    const double* v = stages.data() + 4 * st;
    line.add((key + "wait_fraction").c_str(), v[0], 4)
        .add((key + "in_flight").c_str(), static_cast<int64_t>(v[1]))
        .add((key + "activation_mb").c_str(), v[2], 6)
        .add((key + "slot_mb").c_str(), v[3], 6);
  }
}

RankTimes add_rank_metrics(JsonLine& line, Communicator& world, Device& device, const StepMetrics& m) {
  constexpr int kFields = 5;
  const double mine[kFields] = {static_cast<double>(device.memory().peak_bytes()) / (1 << 20),
                                static_cast<double>(device.take_host_syncs()), m.seconds * 1e3,
                                m.comm_wait_seconds * 1e3, m.params_nonfinite ? 1.0 : 0.0};
  std::vector<double> ranks(static_cast<size_t>(kFields * world.size()));
  world.all_gather(ranks.data(), mine, kFields);
  std::vector<double> peaks(static_cast<size_t>(world.size()));
  double syncs = 0;
  RankTimes times;
  for (int r = 0; r < world.size(); ++r) {
    const double* v = ranks.data() + kFields * r;
    peaks[static_cast<size_t>(r)] = v[0];
    syncs = std::max(syncs, v[1]);
    times.step_ms.push_back(v[2]);
    times.comm_wait_ms.push_back(v[3]);
    if (v[4] != 0 && times.first_nonfinite < 0) times.first_nonfinite = r;
  }
  line.add("alloc_peak_mb", *std::max_element(peaks.begin(), peaks.end()), 6)
      .add("alloc_peak_mb_ranks", peaks, 6)
      .add("host_syncs", static_cast<int64_t>(syncs))
      .add("step_ms_ranks", times.step_ms, 6)
      .add("comm_wait_ms_ranks", times.comm_wait_ms, 6);
  return times;
}

std::string duration_text(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60),
                  (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

Progress::Progress(std::FILE* out, bool leader)
    : sink_(leader ? nullptr : std::fopen("/dev/null", "w"), &std::fclose),
      out_(leader ? out : sink_.get()),
      live_(isatty(fileno(out_))) {}

void Progress::step(const TrainConfig& tc, const StepMetrics& m, double elapsed_s, std::optional<double> eval_loss) {
  const double eta = elapsed_s / static_cast<double>(m.step) * static_cast<double>(tc.steps - m.step);
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | MFU %.1f%% | ETA %s",
                (long long)m.step, (long long)tc.steps, m.loss, m.lr, m.tokens_per_s, 100 * m.mfu,
                duration_text(eta).c_str());
  if (live_) {
    std::fprintf(out_, "\r\033[K%s", line);
    if (eval_loss) std::fprintf(out_, "\n  eval loss %.4f\n", *eval_loss);
    std::fflush(out_);
  } else if (m.step == 1 || m.step % tc.log_interval == 0 || m.step == tc.steps || eval_loss) {
    std::fprintf(out_, "%s\n", line);
    if (eval_loss) std::fprintf(out_, "  eval loss %.4f\n", *eval_loss);
    std::fflush(out_);
  }
}

void Progress::stopping(int64_t step, int64_t exit_interval) {
  if (live_) std::fprintf(out_, "\n");
  std::fprintf(out_, "lockstep: stopping after step %lld (train.exit_interval = %lld)\n", (long long)step,
               (long long)exit_interval);
}

void Progress::warning(const std::string& line) {
  std::fprintf(out_, "%s%s\n", live_ ? "\r\033[K" : "", line.c_str());
  std::fflush(out_);
}

void Progress::done(const TrainSummary& summary, double elapsed_s) {
  if (live_) std::fprintf(out_, "\n");
  std::fprintf(out_, "lockstep: done: %lld steps in %s, loss %.4f -> %.4f", (long long)summary.steps,
               duration_text(elapsed_s).c_str(), summary.first_loss, summary.last_loss);
  if (summary.last_eval_loss >= 0) std::fprintf(out_, ", eval loss %.4f", summary.last_eval_loss);
  std::fprintf(out_, ", median %.0f tok/s, MFU %.1f%%\n", summary.tokens_per_s, 100 * summary.mfu);
}

}  // namespace lockstep
