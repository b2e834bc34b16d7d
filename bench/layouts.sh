#!/usr/bin/env bash
# Training throughput of several parallel layouts side by side in one run (the runner of
# bench/data_parallel.sh and bench/tensor_parallel.sh). Each variant is "label|launcher|ranks|keys":
# launcher threads (lockstep train --nproc ranks) or mpi (mpirun -n ranks); keys are extra
# KEY=VALUE overrides. The cores are shared: each rank gets cores / ranks threads (at least 1).
#
#   bench/layouts.sh ROUNDS "COMMON KEY=VALUE ..." VARIANT...   (needs build/lockstep; mpirun for mpi)
#   LOCKSTEP=path/to/lockstep bench/layouts.sh ...
#
# Rounds alternate the variants, so machine noise hits all of them; the report gives each one's
# median tokens/s and step time over rounds (each run's own median over its steps after the first),
# and its ratio to the first variant.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=$1
read -r -a common <<<"$2"
shift 2
variants=("$@")
lockstep=${LOCKSTEP:-build/lockstep}
[ -x "$lockstep" ] || { echo "$lockstep missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cores=$(nproc)
mpirun_=(mpirun --allow-run-as-root --oversubscribe -x OMPI_MCA_btl_vader_single_copy_mechanism=none)

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
      command -v mpirun >/dev/null || { echo "mpirun missing: run scripts/setup.sh" >&2; exit 2; }
      OMPI_MCA_btl_vader_single_copy_mechanism=none "${mpirun_[@]}" -n "$ranks" "$lockstep" train "${args[@]}" >"$out/log$i"
    fi
    sed -n 's/.*median \([0-9.]*\) tok\/s.*/\1/p' "$out/log$i" >>"$out/toks$i"
    sed -n 's/^{"step":\([0-9]*\),.*"step_ms":\([0-9.e+-]*\).*/\1 \2/p' "$out/run$i/metrics.jsonl" |
      awk '$1 > 1 {print $2}' | median >>"$out/ms$i"
  done
done

IFS='|' read -r first _ _ _ <<<"${variants[0]}"
echo "load before: $load  after: $(cut -d' ' -f1-3 /proc/loadavg)  cores: $cores  rounds: $rounds"
printf '%-62s %10s %10s %8s\n' variant "tok/s" "step ms" "vs first"
base=$(median <"$out/toks0")
for i in "${!variants[@]}"; do
  IFS='|' read -r label _ _ _ <<<"${variants[$i]}"
  t=$(median <"$out/toks$i")
  printf '%-62s %10.0f %10.1f %7.2fx   (tok/s per round: %s)\n' "$label" "$t" "$(median <"$out/ms$i")" \
    "$(awk -v t="$t" -v b="$base" 'BEGIN {print t / b}')" "$(tr '\n' ' ' <"$out/toks$i")"
done
echo "(first: $first)"
