#!/usr/bin/env bash
# Side-by-side step times of several `lockstep train` variants (binaries and/or arguments), run
# interleaved round by round so that a shared machine's load falls on all of them alike.
#
#   bench/interleave.sh ROUNDS STEPS 'LABEL::BINARY::ARGS' ...
#
# e.g. an old and a new binary, each in `run` and `layout` mode:
#   tp='-c configs/moe-peer.toml --nproc 2 train.threads=1 parallel.tensor=2 parallel.sequence_parallel=true'
#   bench/interleave.sh 8 6 "old-run::/tmp/old/lockstep::$tp determinism=run" \
#       "old-layout::/tmp/old/lockstep::$tp determinism=layout" "new-layout::build/lockstep::$tp determinism=layout"
#
# Each run is `BINARY train ARGS train.steps=STEPS train.eval_interval=0` in a scratch directory.
# Per variant: the median over rounds of each run's median step_ms (steps 2..STEPS), the 25th
# percentile of all those steps (a few slow steps from other processes move it less), the median
# CPU time (user + system) per run, and each round's median.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bench/interleave.sh ROUNDS STEPS 'LABEL::BINARY::ARGS' ..." >&2
  exit 2
fi
rounds=$1 steps=$2
shift 2
for spec in "$@"; do
  case "$spec" in
    *::*::*) ;;
    *) echo "bench/interleave.sh: '$spec' is not LABEL::BINARY::ARGS" >&2; exit 2 ;;
  esac
done
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
p25() { sort -g | awk '{v[NR] = $1} END {print v[int((NR - 1) / 4) + 1]}'; }
echo "load: $(uptime | sed 's/.*load average: //')"
for ((r = 0; r < rounds; ++r)); do
  i=0
  for spec in "$@"; do
    rest=${spec#*::}
    bin=${rest%%::*} args=${rest#*::}
    # shellcheck disable=SC2086  # ARGS is a list of words
    if ! /usr/bin/time -o "$dir/time" -f "%U %S" "$bin" train $args train.steps="$steps" train.eval_interval=0 \
      train.out_dir="$dir/run" >"$dir/log" 2>&1; then
      echo "bench/interleave.sh: ${spec%%::*} failed: $(tail -n 1 "$dir/log")" >&2
      exit 1
    fi
    awk '{print $1 + $2}' "$dir/time" >>"$dir/$i.cpu"
    grep -o '"step_ms":[0-9.]*' "$dir/run/metrics.jsonl" | tail -n +2 | cut -d: -f2 | tee -a "$dir/$i.steps" |
      median >>"$dir/$i.med"
    rm -rf "$dir/run"
    i=$((i + 1))
  done
done
i=0
for spec in "$@"; do
  printf '%s: step %s ms, p25 %s ms, CPU per run %s s | rounds: %s\n' "${spec%%::*}" "$(median <"$dir/$i.med")" \
    "$(p25 <"$dir/$i.steps")" "$(median <"$dir/$i.cpu")" "$(tr '\n' ' ' <"$dir/$i.med")"
  i=$((i + 1))
done
echo "load: $(uptime | sed 's/.*load average: //')"
