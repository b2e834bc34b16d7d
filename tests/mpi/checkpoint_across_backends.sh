#!/usr/bin/env bash
# A checkpoint saved by N mpirun processes resumes under `lockstep train --nproc N` (threads), and one
# saved by N threads resumes under mpirun: both runs' fingerprint files equal the uninterrupted
# run's, rank by rank (4 steps; stopped and saved at step 2).
#   checkpoint_across_backends.sh LOCKSTEP MPIRUN CONFIG NPROC [KEY=VALUE ...]
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3 n=$4
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" train.steps=4 train.eval_interval=0 train.threads=1 data.synthetic_bytes=65536 "$@")
threads() { "$lockstep" train --nproc "$n" "${args[@]}" "$@" >>"$dir/log"; }
mpi() { "$mpirun" --allow-run-as-root --oversubscribe -n "$n" "$lockstep" train "${args[@]}" "$@" >>"$dir/log"; }
stop=(train.save_interval=2 train.exit_interval=2)
threads train.out_dir="$dir/whole"
mpi "${stop[@]}" train.out_dir="$dir/mpi-then-threads"
threads train.resume=auto train.out_dir="$dir/mpi-then-threads"
threads "${stop[@]}" train.out_dir="$dir/threads-then-mpi"
mpi train.resume=auto train.out_dir="$dir/threads-then-mpi"
for run in mpi-then-threads threads-then-mpi; do
  for ((r = 0; r < n; r++)); do
    f=$(printf 'fingerprints/rank-%05d.jsonl' "$r")
    [ "$(wc -l <"$dir/$run/$f")" = 4 ] || { echo "$run: $f does not have 4 lines"; exit 1; }
    cmp "$dir/whole/$f" "$dir/$run/$f" || { echo "$run, rank $r: fingerprints differ"; exit 1; }
  done
done
echo "checkpoints of $n ranks resume bitwise across the mpi and threads backends ($*)"
