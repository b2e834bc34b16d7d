#!/usr/bin/env bash
# Checkpoint costs on the benchmark model (configs/gpt2-peer.toml): the same 30-step run without
# checkpoints, with a synchronous save every 5 steps, and with an asynchronous one, in interleaved
# rounds (the machine is shared: compare within a round). Reports the median extra time per step
# and per save against the run without saves (a sync save's extra time gives its MB/s), and the
# read + verify throughput of `lockstep ckpt verify` (what a load reads and checks).
#
#   bench/checkpoint.sh [ROUNDS] [THREADS]        (build/lockstep must exist)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
threads=${2:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
steps=30
interval=5
saves=$((steps / interval))
echo "load: $(uptime | sed 's/.*load average: //')"
declare -A times
line=
for round in $(seq "$rounds"); do
  for mode in none sync async; do
    keys=(train.steps=$steps train.threads=$threads train.out_dir="$out/$mode")
    case $mode in
      sync) keys+=(train.save_interval=$interval train.keep_last=2) ;;
      async) keys+=(train.save_interval=$interval train.keep_last=2 train.async_save=true) ;;
    esac
    rm -rf "$out/$mode"
    t0=$(date +%s.%N)
    build/lockstep train -c configs/gpt2-peer.toml "${keys[@]}" >/dev/null
    t1=$(date +%s.%N)
    t=$(echo "$t1 - $t0" | bc)
    times[$mode]+="$t "
    line+=" $mode ${t}s"
  done
  echo "round $round:$line"
  line=
done
mb=$(du -sm "$out/sync/checkpoints/$(ls "$out/sync/checkpoints" | tail -1)" | cut -f1)
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
none=$(echo "${times[none]}" | median)
for mode in sync async; do
  t=$(echo "${times[$mode]}" | median)
  printf "%-5s median %.2f s vs %.2f s without saves: +%.1f ms per step, +%.0f ms per save (%d saves of %s MB)\n" \
    "$mode" "$t" "$none" "$(echo "($t - $none) * 1000 / $steps" | bc -l)" "$(echo "($t - $none) * 1000 / $saves" | bc -l)" \
    "$saves" "$mb"
done
ckpt=$(ls -d "$out"/sync/checkpoints/step-* | tail -1)
sync 2>/dev/null || true
best=
for i in 1 2 3; do
  t0=$(date +%s.%N); build/lockstep ckpt verify "$ckpt" >/dev/null; t1=$(date +%s.%N)
  t=$(echo "$t1 - $t0" | bc); if [ -z "$best" ] || [ "$(echo "$t < $best" | bc)" = 1 ]; then best=$t; fi
done
t=$(echo "${times[sync]}" | median)
printf "sync save: %.0f MB/s (%s MB per save); ckpt verify (read + xxh3 of every piece and file, page cache warm): %.0f MB/s\n" \
  "$(echo "$mb / (($t - $none) / $saves)" | bc -l)" "$mb" "$(echo "$mb / $best" | bc -l)"
echo "load: $(uptime | sed 's/.*load average: //')"
