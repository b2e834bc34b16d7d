#!/usr/bin/env bash
# The same 2-step job as 4 thread ranks and as 4 mpirun processes: identical fingerprint files,
# rank by rank (and a non-zero exit of either run fails the test).
#   train_matches_threads.sh LOCKSTEP MPIRUN CONFIG
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" train.steps=2 train.eval_interval=0 train.threads=1 data.synthetic_bytes=65536)
"$lockstep" train --nproc 4 "${args[@]}" train.out_dir="$dir/threads" >"$dir/threads.log"
"$mpirun" --allow-run-as-root --oversubscribe -n 4 "$lockstep" train "${args[@]}" train.out_dir="$dir/mpi" >"$dir/mpi.log"
for r in 0 1 2 3; do
  f=fingerprints/rank-0000$r.jsonl
  [ "$(wc -l <"$dir/threads/$f")" = 2 ] || { echo "threads run: $f does not have 2 lines"; exit 1; }
  cmp "$dir/threads/$f" "$dir/mpi/$f" || { echo "rank $r: fingerprints differ"; diff "$dir/threads/$f" "$dir/mpi/$f"; exit 1; }
  grep -q "\"rank\":$r,\"dp\":$r," "$dir/mpi/$f" || { echo "rank $r: wrong coordinates"; head -1 "$dir/mpi/$f"; exit 1; }
done
[ -f "$dir/mpi/metrics.jsonl" ] && [ -f "$dir/mpi/config.toml" ]
echo "fingerprints of 4 ranks identical on threads and mpi"
