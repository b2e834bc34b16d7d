#!/usr/bin/env bash
# Data-parallel training throughput on this machine's cores, side by side in one run: the benchmark
# model (configs/gpt2-peer.toml) with a global batch of 8 sequences (two micro-batches of 4 on one
# rank, one on each of two), as
#   dp 1 and dp 2 on the threads backend (lockstep train --nproc N) and under mpirun -n N,
#   dp 2 with the gradient reduction overlapped with backward or not (ddp.overlap_grad_reduce),
#   dp 2 with the distributed optimizer, its parameter gather overlapped with forward or not.
# The cores are shared: dp 1 runs 2 threads, each dp 2 rank 1 (train.threads = cores / ranks).
#
#   bench/data_parallel.sh [rounds]          (default 3; needs build/lockstep and mpirun)
#   LOCKSTEP=path/to/lockstep bench/data_parallel.sh ...
#
# Rounds alternate the variants, so machine noise hits all of them; the report gives each one's
# median tokens/s and step time over rounds (each run's own median over its steps after the first).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
lockstep=${LOCKSTEP:-build/lockstep}
[ -x "$lockstep" ] || { echo "$lockstep missing: run scripts/setup.sh" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "mpirun missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cores=$(nproc)
common=(-c configs/gpt2-peer.toml train.steps=8 train.global_batch=8 train.micro_batch=4 ddp.bucket_size=1000000)
mpirun_=(mpirun --allow-run-as-root --oversubscribe -x OMPI_MCA_btl_vader_single_copy_mechanism=none)

# "label|launcher|ranks|keys"
variants=("dp 1, threads|threads|1|"
          "dp 2, threads|threads|2|"
          "dp 1, mpi|mpi|1|"
          "dp 2, mpi|mpi|2|"
          "dp 2, threads, grad reduce after backward|threads|2|ddp.overlap_grad_reduce=false"
          "dp 2, threads, distributed optimizer|threads|2|optimizer.distributed=true"
          "dp 2, threads, distributed, param gather overlapped with forward|threads|2|optimizer.distributed=true ddp.overlap_param_gather=true")

load=$(cut -d' ' -f1-3 /proc/loadavg)
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

for r in $(seq 1 "$rounds"); do
  for i in "${!variants[@]}"; do
    IFS='|' read -r label launcher ranks keys <<<"${variants[$i]}"
    threads=$((cores / ranks > 0 ? cores / ranks : 1))
    # shellcheck disable=SC2206
    args=("${common[@]}" train.threads="$threads" train.out_dir="$out/run$i" $keys)
    if [ "$launcher" = threads ]; then
      "$lockstep" train --nproc "$ranks" "${args[@]}" >"$out/log$i"
    else
      OMPI_MCA_btl_vader_single_copy_mechanism=none "${mpirun_[@]}" -n "$ranks" "$lockstep" train "${args[@]}" >"$out/log$i"
    fi
    sed -n 's/.*median \([0-9.]*\) tok\/s.*/\1/p' "$out/log$i" >>"$out/toks$i"
    sed -n 's/^{"step":\([0-9]*\),.*"step_ms":\([0-9.e+-]*\).*/\1 \2/p' "$out/run$i/metrics.jsonl" |
      awk '$1 > 1 {print $2}' | median >>"$out/ms$i"
  done
done

echo "load before: $load  after: $(cut -d' ' -f1-3 /proc/loadavg)  cores: $cores  rounds: $rounds"
printf '%-62s %10s %10s %8s\n' variant "tok/s" "step ms" "vs dp 1"
base=$(median <"$out/toks0")
for i in "${!variants[@]}"; do
  IFS='|' read -r label _ _ _ <<<"${variants[$i]}"
  t=$(median <"$out/toks$i")
  printf '%-62s %10.0f %10.1f %7.2fx   (tok/s per round: %s)\n' "$label" "$t" "$(median <"$out/ms$i")" \
    "$(awk -v t="$t" -v b="$base" 'BEGIN {print t / b}')" "$(tr '\n' ' ' <"$out/toks$i")"
done
