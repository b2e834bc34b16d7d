#!/usr/bin/env bash
# determinism = "layout": a job that runs steps 1-2 as N_A mpirun processes under one layout, saves,
# and resumes steps 3-4 as N_B threads (`lockstep train --nproc N_B`) under another has the bits of
# the uninterrupted single-process job: `lockstep diff` finds its global fingerprint fields
# identical over 4 steps, and the final checkpoints hold the same tensors (`lockstep ckpt export`
# of both, byte for byte).
#   layout_resumes_across_backends.sh LOCKSTEP MPIRUN CONFIG "N_A KEY=VALUE..." "N_B KEY=VALUE..." [KEY=VALUE ...]
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3
read -r -a before <<<"$4"
read -r -a after <<<"$5"
shift 5
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" determinism=layout train.steps=4 train.eval_interval=0 train.threads=1 train.save_interval=4
      data.synthetic_bytes=65536 "$@")
"$lockstep" train "${args[@]}" train.out_dir="$dir/single" >"$dir/log"
"$mpirun" --allow-run-as-root --oversubscribe -n "${before[0]}" "$lockstep" train "${args[@]}" "${before[@]:1}" \
  train.save_interval=2 train.exit_interval=2 train.out_dir="$dir/moved" >>"$dir/log"
"$lockstep" train --nproc "${after[0]}" "${args[@]}" "${after[@]:1}" train.resume=auto train.out_dir="$dir/moved" >>"$dir/log"
"$lockstep" diff "$dir/single" "$dir/moved" | tee "$dir/diff"
grep -q "identical over 4 steps" "$dir/diff" || { echo "not identical over 4 steps"; exit 1; }
"$lockstep" ckpt export "$dir/single" "$dir/single.safetensors" >>"$dir/log"
"$lockstep" ckpt export "$dir/moved" "$dir/moved.safetensors" >>"$dir/log"
cmp "$dir/single.safetensors" "$dir/moved.safetensors" || { echo "final weights differ"; exit 1; }
echo "${before[*]} (mpi) then ${after[*]} (threads): the single-process bits over 4 steps ($*)"
