#!/usr/bin/env bash
# Data-parallel training throughput on this machine's cores, side by side in one run
# (bench/layouts.sh): the benchmark model (configs/gpt2-peer.toml) with a global batch of 8
# sequences (two micro-batches of 4 on one rank, one on each of two), as
#   dp 1 and dp 2 on the threads backend (lockstep train --nproc N) and under mpirun -n N,
#   dp 2 with the gradient reduction overlapped with backward or not (ddp.overlap_grad_reduce),
#   dp 2 with the distributed optimizer, its parameter gather overlapped with forward or not.
# The cores are shared: dp 1 runs 2 threads, each dp 2 rank 1 (train.threads = cores / ranks).
#
#   bench/data_parallel.sh [rounds]          (default 3; needs build/lockstep and mpirun)
#   LOCKSTEP=path/to/lockstep bench/data_parallel.sh ...
exec "$(dirname "$0")/layouts.sh" "${1:-3}" \
  "-c configs/gpt2-peer.toml train.steps=8 train.global_batch=8 train.micro_batch=4 ddp.bucket_size=1000000" \
  "dp 1, threads|threads|1|" \
  "dp 2, threads|threads|2|" \
  "dp 1, mpi|mpi|1|" \
  "dp 2, mpi|mpi|2|" \
  "dp 2, threads, grad reduce after backward|threads|2|ddp.overlap_grad_reduce=false" \
  "dp 2, threads, distributed optimizer|threads|2|optimizer.distributed=true" \
  "dp 2, threads, distributed, param gather overlapped with forward|threads|2|optimizer.distributed=true ddp.overlap_param_gather=true"
