#!/usr/bin/env bash
# Pipeline layouts side by side on the threads backend (docs/parallelism.md, docs/performance.md):
# median tokens/s of each, and per stage the measured fraction of the schedule spent waiting for
# messages (metrics.jsonl pp.<s>.wait_fraction, median over the steps after the first) against
# the analytic bubble (p - 1) / (v m + p - 1), the micro-batches whose activations the stage held
# at once (pp.<s>.in_flight) against the schedule's count (1F1B: min(p - s, m); all-forward-all-
# backward: m), and the activation memory it held (pp.<s>.activation_mb: slots + backward scratch;
# one slot = pp.<s>.slot_mb).
#   bench/pipeline.sh [LOCKSTEP] [STEPS]
set -euo pipefail
lockstep=${1:-build/lockstep} steps=${2:-6}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# 8 layers of width 128 over 128 tokens per micro-batch: compute well above a message's cost.
model=(-c configs/debug.toml model.num_layers=8 model.hidden_size=128 model.seq_length=128 train.micro_batch=1
       train.eval_interval=0 train.threads=1 train.steps="$steps" data.synthetic_bytes=65536)
echo "load: $(uptime | sed 's/.*load average: //')"
printf '%-26s %9s  %-30s %-24s %s\n' layout tok/s "wait fraction per stage" "bubble: analytic" "in flight (schedule) / activation MB per stage"
run() {
  local name=$1 n=$2
  shift 2
  local out="$dir/$name"
  "$lockstep" train "${model[@]}" --nproc "$n" train.out_dir="$out" "$@" >"$out.log"
  python3 - "$out" "$name" <<'PY'
import json, sys, tomllib
out, name = sys.argv[1], sys.argv[2]
cfg = tomllib.load(open(out + "/config.toml", "rb"))
par, t = cfg["parallel"], cfg["train"]
p, v, kind = par["pipeline"], par["virtual_pipeline"], par["pipeline_schedule"]
rows = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"loss"' in l]
later = rows[1:]
toks = sorted(r["tokens_per_s"] for r in later)[len(later) // 2]
if p == 1:
    print(f"{name:26s} {toks:9.0f}")
    sys.exit()
m = t["global_batch"] // t["micro_batch"] // (int(open(out + ".world").read()) // p)
med = lambda k: sorted(r[k] for r in later)[len(later) // 2]
wait = [med(f"pp.{s}.wait_fraction") for s in range(p)]
bubble = (p - 1) / (v * m + p - 1)
def predicted(s):
    if kind == "all_forward_all_backward": return m
    if v == 1: return min(p - s, m)
    return "-"
mem = [f"{rows[-1][f'pp.{s}.in_flight']}({predicted(s)})/{rows[-1][f'pp.{s}.activation_mb']:.1f}" for s in range(p)]
print(f"{name:26s} {toks:9.0f}  {' '.join(f'{w:.2f}' for w in wait):30s} {bubble:.3f} (m {m}, v {v})       "
      f"{' '.join(mem)}  slot {rows[-1]['pp.0.slot_mb']:.2f} MB")
PY
}
world() { echo "$2" >"$dir/$1.world"; }
world one 1; run one 1 train.global_batch=8 train.threads=2
world dp2 2; run dp2 2 train.global_batch=8
for m in 2 4 8 16; do world "pp2_1f1b_m$m" 2; run "pp2_1f1b_m$m" 2 parallel.pipeline=2 train.global_batch=$m; done
world pp2_afab_m8 2; run pp2_afab_m8 2 parallel.pipeline=2 parallel.pipeline_schedule=all_forward_all_backward train.global_batch=8
world pp2_interleaved_m8 2; run pp2_interleaved_m8 2 parallel.pipeline=2 parallel.virtual_pipeline=2 train.global_batch=8
world pp4_1f1b_m8 4; run pp4_1f1b_m8 4 parallel.pipeline=4 train.global_batch=8
world pp4_afab_m8 4; run pp4_afab_m8 4 parallel.pipeline=4 parallel.pipeline_schedule=all_forward_all_backward train.global_batch=8
world pp4_interleaved_m8 4; run pp4_interleaved_m8 4 parallel.pipeline=4 parallel.virtual_pipeline=2 train.global_batch=8
