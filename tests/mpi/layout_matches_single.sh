#!/usr/bin/env bash
# determinism = "layout": the same job as one process (one rank, every micro-batch) and as N mpirun
# processes (data parallel N): identical global fingerprint fields at every step (lockstep diff
# compares loss, lm_loss, aux_loss, mtp_loss, grad_norm and lr across layouts) and identical
# parameter hashes on rank 0 (when it holds the whole model: not under expert, expert tensor,
# pipeline or tensor parallelism).
# (context parallelism: rank 0 still holds every parameter, so the hashes are compared too.)
#   layout_matches_single.sh LOCKSTEP MPIRUN CONFIG NPROC [KEY=VALUE ...]
set -euo pipefail
lockstep=$1 mpirun=$2 config=$3 n=$4
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(-c "$config" determinism=layout train.steps=2 train.eval_interval=0 train.threads=1 data.synthetic_bytes=65536)
# The single process holds every expert, layer and slice: the same keys without the parallel sizes.
single=()
for kv in "$@"; do
  case $kv in parallel.expert=* | parallel.expert_tensor=* | parallel.pipeline=* | parallel.virtual_pipeline=* | \
    parallel.tensor=* | parallel.sequence_parallel=* | parallel.context=*) ;;
    *) single+=("$kv") ;;
  esac
done
"$lockstep" train "${args[@]}" "${single[@]}" train.out_dir="$dir/single" >"$dir/single.log"
args+=("$@")
"$mpirun" --allow-run-as-root --oversubscribe -n "$n" "$lockstep" train "${args[@]}" train.out_dir="$dir/mpi" >"$dir/mpi.log"
"$lockstep" diff "$dir/single" "$dir/mpi"
params() { grep -o '"params":"[0-9a-f]*"' "$1/fingerprints/rank-00000.jsonl"; }
[ "$(params "$dir/single" | wc -l)" = 2 ] || { echo "single run: not 2 fingerprint lines"; exit 1; }
# Rank 0's parameter hash covers the whole model only when no parallel size splits the parameters.
compared="global fingerprints"
case " $* " in
  *" parallel.expert="[2-9]*|*" parallel.expert_tensor="[2-9]*|*" parallel.pipeline="[2-9]*|*" parallel.tensor="[2-9]*) ;;
  *) [ "$(params "$dir/single")" = "$(params "$dir/mpi")" ] || { echo "parameter hashes differ"; exit 1; }
     compared="global fingerprints and parameter hashes" ;;
esac
echo "1 process and $n mpi processes: identical $compared ($*)"
