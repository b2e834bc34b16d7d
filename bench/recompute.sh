#!/usr/bin/env bash
# Activation recompute's memory and time (train.recompute_granularity = "full", docs/performance.md):
# `lockstep train` on gpt2-peer, moe-peer and a long-sequence case (gpt2-peer at 2048 tokens, one
# sequence per micro-batch) with recompute off, uniform (1 and 2 layers per group), block (2 of
# the 4 layers) and selective (the MLP or MoE sublayers), 2 threads, 6 steps each. Per row: alloc_peak_mb as the metrics report it, the
# median step_ms of steps 2..6, and both against "off" (the fingerprints are the same bits: the
# script checks that too). The options of one model run one after the other, round by round, so
# that the machine's load moves them alike.
#
#   scripts/setup.sh && bench/recompute.sh [rounds]      (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
bin=${LOCKSTEP:-build/lockstep}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
echo "load: $(uptime | sed 's/.*load average: //')"
options=("off|" "uniform 1|train.recompute_granularity=full train.recompute_method=uniform train.recompute_num_layers=1"
  "uniform 2|train.recompute_granularity=full train.recompute_method=uniform train.recompute_num_layers=2"
  "block 2|train.recompute_granularity=full train.recompute_method=block train.recompute_num_layers=2"
  "mlp,moe|train.recompute_granularity=selective train.recompute_modules=mlp,moe")
printf '%-28s %-10s %14s %10s %12s %10s\n' model recompute alloc_peak_mb vs_off step_ms vs_off
for model in "gpt2-peer|configs/gpt2-peer.toml|" "moe-peer|configs/moe-peer.toml|" \
  "gpt2-peer 2048 tokens|configs/gpt2-peer.toml|model.seq_length=2048 train.micro_batch=1 train.global_batch=1"; do
  IFS='|' read -r name config keys <<<"$model"
  declare -A peak=() steps=()
  for ((r = 0; r < rounds; ++r)); do
    for opt in "${options[@]}"; do
      IFS='|' read -r label extra <<<"$opt"
      dir="$out/${label// /_}-$r"
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=2 "$bin" train -c "$config" $keys $extra train.steps=6 train.eval_interval=0 train.threads=2 \
        train.out_dir="$dir" >/dev/null
      peak[$label]=$(python3 -c "import json; print(json.loads(open('$dir/metrics.jsonl').readline())['alloc_peak_mb'])")
      steps[$label]+=" $(python3 -c "
import json
print(' '.join(str(json.loads(l)['step_ms']) for l in list(open('$dir/metrics.jsonl'))[1:]))")"
      if [ "$label" != off ] && ! cmp -s "$dir/fingerprints/rank-00000.jsonl" "$out/off-$r/fingerprints/rank-00000.jsonl"; then
        echo "recompute.sh: $name, $label: fingerprints differ from recompute off" >&2
        exit 1
      fi
    done
  done
  base_peak=${peak[off]}
  base_step=$(tr ' ' '\n' <<<"${steps[off]}" | grep . | median)
  for opt in "${options[@]}"; do
    IFS='|' read -r label _ <<<"$opt"
    step=$(tr ' ' '\n' <<<"${steps[$label]}" | grep . | median)
    awk -v n="$name" -v l="$label" -v p="${peak[$label]}" -v bp="$base_peak" -v s="$step" -v bs="$base_step" \
      'BEGIN { printf "%-28s %-10s %14.1f %9.2fx %12.1f %9.2fx\n", n, l, p, p / bp, s, s / bs }'
  done
  unset peak steps
done
