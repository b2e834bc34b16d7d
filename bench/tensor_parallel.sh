#!/usr/bin/env bash
# Tensor-parallel training throughput on this machine's cores, side by side in one run
# (bench/layouts.sh): the benchmark model (configs/gpt2-peer.toml: 4 layers, hidden 256, 4 heads,
# vocabulary 8192) with a global batch of 4 sequences of 256 tokens (one micro-batch), as
#   tp 1 (one rank), tp 2 and tp 4 with sequence parallelism off and on, on the threads backend,
#   tp 2 + sp under mpirun.
# The cores are shared: tp 1 runs every core's thread, tp P ranks cores / P each (at least 1).
#
#   bench/tensor_parallel.sh [rounds]          (default 3; needs build/lockstep and mpirun)
exec "$(dirname "$0")/layouts.sh" "${1:-3}" \
  "-c configs/gpt2-peer.toml train.steps=8 train.global_batch=4 train.micro_batch=4" \
  "tp 1, threads|threads|1|" \
  "tp 2, threads|threads|2|parallel.tensor=2" \
  "tp 2 + sp, threads|threads|2|parallel.tensor=2 parallel.sequence_parallel=true" \
  "tp 4, threads|threads|4|parallel.tensor=4" \
  "tp 4 + sp, threads|threads|4|parallel.tensor=4 parallel.sequence_parallel=true" \
  "tp 2 + sp, mpi|mpi|2|parallel.tensor=2 parallel.sequence_parallel=true"
