#!/usr/bin/env bash
# `lockstep launch --max-restarts 1 -- mpirun -n 2 lockstep train ...` with rank 1 killed (SIGKILL)
# once, mid-step and then mid-save: mpirun ends the job, the supervisor runs it again from the newest
# checkpoint, and both ranks' fingerprints and the final checkpoint's data files equal the
# uninterrupted job's (4 steps, a checkpoint every 2).
#   restart_under_launch.sh LOCKSTEP MPIRUN CONFIG [KEY=VALUE ...]
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" train.steps=4 train.eval_interval=0 train.threads=1 train.save_interval=2
      data.synthetic_bytes=65536 train.micro_batch=2 "$@")
mpi=("$mpirun" --allow-run-as-root --oversubscribe -n 2 "$lockstep" train)
"${mpi[@]}" "${args[@]}" train.out_dir="$dir/whole" >>"$dir/log"
check() {  # check RUN FAULT...
  local run=$1
  shift
  "$lockstep" launch --max-restarts 1 -- "${mpi[@]}" "${args[@]}" debug.fail_rank=1 "$@" train.out_dir="$dir/$run" \
    >"$dir/$run.log" 2>&1 || { cat "$dir/$run.log"; echo "$run: the supervised job failed"; exit 1; }
  grep -q "^lockstep: restart 1 of 1: the job exited with status 137 .*; resuming from $dir/$run/checkpoints/step-00000002 (step 2)$" \
    "$dir/$run.log" || { cat "$dir/$run.log"; echo "$run: no restart line"; exit 1; }
  for ((r = 0; r < 2; r++)); do
    f=$(printf 'fingerprints/rank-%05d.jsonl' "$r")
    [ "$(wc -l <"$dir/$run/$f")" = 4 ] || { echo "$run: $f does not have 4 lines"; exit 1; }
    cmp "$dir/whole/$f" "$dir/$run/$f" || { echo "$run, rank $r: fingerprints differ"; exit 1; }
  done
  for f in "$dir"/whole/checkpoints/step-00000004/*.bin; do
    cmp "$f" "$dir/$run/checkpoints/step-00000004/${f##*/}" || { echo "$run: ${f##*/} differs"; exit 1; }
  done
  if ls -d "$dir/$run"/checkpoints/*.tmp 2>/dev/null; then echo "$run: a partial checkpoint is left"; exit 1; fi
}
check mid-step debug.fail_at_step=3
check mid-save debug.fail_at_step=4 debug.fail_in=save
echo "a job under mpirun, its rank 1 killed mid-step and mid-save, restarts and equals the uninterrupted job"
