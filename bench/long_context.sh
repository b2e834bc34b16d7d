#!/usr/bin/env bash
# Long-context memory and time by context-parallel size and parallel.cp_comm_type (docs/performance.md
# #long-context): configs/debug.toml as Llama (2 layers, hidden 64, 4 heads of 16, RoPE, vocabulary 256)
# at SEQ tokens (default 32768), one sequence per step, 2 steps, ranks as threads (lockstep train
# --nproc, each rank cores / ranks threads). a2a needs the 4 heads divisible by cp (skipped above 4). Per row: the largest per-rank alloc_peak_mb as the metrics report it
# (every rank's in alloc_peak_mb_ranks), against CP 1, and step 2's step_ms.
#
#   scripts/setup.sh && bench/long_context.sh [SEQ] [CP sizes]      (defaults 32768 and "2 4 8")
set -euo pipefail
cd "$(dirname "$0")/.."
seq=${1:-32768}
sizes=${2:-"2 4 8"}
bin=${LOCKSTEP:-build/lockstep}
[ -x "$bin" ] || { echo "$bin missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cores=$(nproc)
echo "load: $(uptime | sed 's/.*load average: //'); $seq tokens, $cores cores"
printf '%-4s %-12s %14s %8s %10s  %s\n' cp cp_comm_type alloc_peak_mb vs_cp1 step_ms alloc_peak_mb_ranks
run() {  # cp type
  local cp=$1 type=$2 dir="$out/$1-$2" threads=$((cores / $1 > 0 ? cores / $1 : 1))
  "$bin" train --nproc "$cp" -c configs/debug.toml model.preset=llama model.seq_length="$seq" train.micro_batch=1 \
    train.global_batch=1 train.steps=2 train.eval_interval=0 train.threads="$threads" parallel.context="$cp" \
    parallel.cp_comm_type="$type" train.out_dir="$dir" >/dev/null
  python3 - "$dir/metrics.jsonl" "$cp" "$type" "${base:-0}" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
peak, base = lines[-1]["alloc_peak_mb"], float(sys.argv[4]) or lines[-1]["alloc_peak_mb"]
ranks = " ".join(f"{p:.1f}" for p in lines[-1].get("alloc_peak_mb_ranks", [peak]))
print(f"{sys.argv[2]:<4} {sys.argv[3]:<12} {peak:14.1f} {peak / base:7.2f}x {lines[-1]['step_ms']:10.0f}  {ranks}")
EOF
}
base=""
run 1 all_gather
base=$(python3 -c "import json; print(json.loads(open('$out/1-all_gather/metrics.jsonl').readlines()[-1])['alloc_peak_mb'])")
for cp in $sizes; do
  for type in all_gather p2p a2a; do
    [ "$type" = a2a ] && [ "$cp" -gt 4 ] && continue
    run "$cp" "$type"
  done
done
