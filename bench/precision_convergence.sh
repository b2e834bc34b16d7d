#!/usr/bin/env bash
# Convergence and speed of every precision mode on the MoE debug preset (configs/moe-debug.toml):
# the same job, the same number of steps, in FP32, BF16, each FP8 recipe and NVFP4, for each of
# several seeds. Prints a markdown table: final training loss (mean of the last 10 steps) and final
# held-out loss, each the mean over seeds, with the gap to BF16 paired by seed (mean ± sample sd of
# the differences: a gap within its sd is trajectory noise, not precision), and the median training
# tokens/s (only comparable within one run of this script: the load is printed).
#
#   bench/precision_convergence.sh [steps] [threads] [seeds]   (defaults: 200, 2, "1234 1 2")
#   LOCKSTEP=path/to/lockstep bench/precision_convergence.sh ...
#
# docs/precision.md's convergence table and docs/performance.md's tokens/s per precision come from
# this script.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
threads=${2:-2}
seeds=${3:-1234 1 2}
lockstep=${LOCKSTEP:-build/lockstep}
[ -x "$lockstep" ] || { echo "$lockstep missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

modes=("fp32|precision.params=fp32"
       "bf16|precision.params=bf16"
       "fp8 delayed|precision.params=bf16 precision.fp8=delayed"
       "fp8 tensorwise|precision.params=bf16 precision.fp8=tensorwise"
       "fp8 blockwise|precision.params=bf16 precision.fp8=blockwise"
       "mxfp8|precision.params=bf16 precision.fp8=mxfp8"
       "nvfp4|precision.params=bf16 precision.fp4=nvfp4")

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
i=0
for seed in $seeds; do
for mode in "${modes[@]}"; do
  label=${mode%%|*}
  keys=${mode#*|}
  # shellcheck disable=SC2086  # keys are separate words
  "$lockstep" train -c configs/moe-debug.toml $keys train.steps="$steps" train.eval_interval="$steps" \
    train.eval_batches=8 train.threads="$threads" train.seed="$seed" train.out_dir="$out/run$i" >/dev/null
  python3 - "$label" "$out/run$i/metrics.jsonl" >>"$out/rows" <<'EOF'
import json, statistics, sys
label, path = sys.argv[1], sys.argv[2]
steps, evals = [], []
for line in open(path):
    m = json.loads(line)
    (evals if "eval_loss" in m else steps).append(m)
last = statistics.mean(m["loss"] for m in steps[-10:])
toks = statistics.median(m["tokens_per_s"] for m in steps[1:])
print(f"{label}\t{last:.4f}\t{evals[-1]['eval_loss']:.4f}\t{toks:.0f}")
EOF
  i=$((i + 1))
done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

python3 - "$out/rows" "$steps" "$threads" "$seeds" <<'EOF'
import statistics, sys
runs = {}  # label -> [(train, eval, tokens/s)] in seed order
for line in open(sys.argv[1]):
    label, train, ev, tok = line.rstrip("\n").split("\t")
    runs.setdefault(label, []).append((float(train), float(ev), float(tok)))
steps, threads, seeds = sys.argv[2], sys.argv[3], sys.argv[4].split()
def gap(label, i):  # paired over seeds: mean and sample sd of (mode - bf16)
    d = [r[i] - b[i] for r, b in zip(runs[label], runs["bf16"])]
    return statistics.mean(d), statistics.stdev(d) if len(d) > 1 else 0.0
def tok(label): return statistics.median(r[2] for r in runs[label])
print(f"configs/moe-debug.toml, {steps} steps, {threads} threads, seeds {' '.join(seeds)}\n")
print("| precision | final loss | gap to BF16 | held-out loss | gap to BF16 | tokens/s | vs BF16 |")
print("|---|---|---|---|---|---|---|")
for label in runs:
    t = statistics.mean(r[0] for r in runs[label])
    e = statistics.mean(r[1] for r in runs[label])
    (gt, st), (ge, se) = gap(label, 0), gap(label, 1)
    print(f"| {label} | {t:.4f} | {gt:+.4f} ± {st:.4f} | {e:.4f} | {ge:+.4f} ± {se:.4f} | {tok(label):.0f} | "
          f"{tok(label) / tok('bf16'):.2f}x |")
EOF
