#!/usr/bin/env bash
# The same 2-step data- (and tensor-) parallel job as N thread ranks and as N mpirun processes: identical
# fingerprint files (and module traces, with debug.trace = "modules"), rank by rank (and a non-zero
# exit of either run fails the test).
#   train_matches_threads.sh LOCKSTEP MPIRUN CONFIG NPROC [KEY=VALUE ...]
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3 n=$4
shift 4
# Ranks are ordered tp-cp-ep-dp-pp, tp fastest: rank r is tp r % tp, cp (r / tp) % cp, dp (r / (tp cp)) % dp,
# pp r / (tp cp dp).
tp=1 cp=1 pp=1
for kv in "$@"; do
  case $kv in parallel.tensor=*) tp=${kv#*=} ;; parallel.context=*) cp=${kv#*=} ;; parallel.pipeline=*) pp=${kv#*=} ;; esac
done
dp=$((n / (tp * cp * pp)))
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" train.steps=2 train.eval_interval=0 train.threads=1 data.synthetic_bytes=65536 "$@")
"$lockstep" train --nproc "$n" "${args[@]}" train.out_dir="$dir/threads" >"$dir/threads.log"
"$mpirun" --allow-run-as-root --oversubscribe -n "$n" "$lockstep" train "${args[@]}" train.out_dir="$dir/mpi" >"$dir/mpi.log"
for ((r = 0; r < n; r++)); do
  f=$(printf 'fingerprints/rank-%05d.jsonl' "$r")
  [ "$(wc -l <"$dir/threads/$f")" = 2 ] || { echo "threads run: $f does not have 2 lines"; exit 1; }
  cmp "$dir/threads/$f" "$dir/mpi/$f" || { echo "rank $r: fingerprints differ"; diff "$dir/threads/$f" "$dir/mpi/$f"; exit 1; }
  # Module traces (debug.trace = "modules"), when the job writes them: identical too.
  t=$(printf 'trace/rank-%05d.jsonl' "$r")
  if [ -f "$dir/threads/$t" ]; then
    [ -s "$dir/threads/$t" ] || { echo "threads run: $t is empty"; exit 1; }
    cmp "$dir/threads/$t" "$dir/mpi/$t" || { echo "rank $r: module traces differ"; exit 1; }
  fi
  grep -q "\"rank\":$r,\"dp\":$((r / (tp * cp) % dp)),\"tp\":$((r % tp)),\"pp\":$((r / (tp * cp * dp))),\"ep\":[0-9]*,\"cp\":$((r / tp % cp))," "$dir/mpi/$f" ||
    { echo "rank $r: wrong coordinates"; head -1 "$dir/mpi/$f"; exit 1; }
done
[ -f "$dir/mpi/metrics.jsonl" ] && [ -f "$dir/mpi/config.toml" ]
echo "fingerprints of $n ranks identical on threads and mpi ($*)"
