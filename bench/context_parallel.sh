#!/usr/bin/env bash
# Context-parallel training throughput against data and tensor parallelism at the same world size
# (2 ranks, threads backend), side by side in one run (bench/layouts.sh): the benchmark model
# (configs/gpt2-peer.toml: 4 layers, hidden 256, 4 heads, vocabulary 8192) on long sequences
# (model.seq_length, default 2048, where attention is about as much work as the matmuls), a global
# batch of 2 sequences in micro-batches of 1:
#   cp 2 (each rank 2 x 1/4 of every sequence, 2 micro-batches), dp 2 (each rank one whole
#   sequence), tp 2 and tp 2 + sp (each rank half the heads / hidden units of both sequences).
# Every layout does the same FLOPs per step; each rank runs cores / 2 threads.
#
#   bench/context_parallel.sh [rounds] [seq_length]     (defaults 1 and 2048; needs build/lockstep)
exec "$(dirname "$0")/layouts.sh" "${1:-1}" \
  "-c configs/gpt2-peer.toml model.seq_length=${2:-2048} train.steps=4 train.global_batch=2 train.micro_batch=1" \
  "cp 2, threads|threads|2|parallel.context=2" \
  "dp 2, threads|threads|2|" \
  "tp 2, threads|threads|2|parallel.tensor=2" \
  "tp 2 + sp, threads|threads|2|parallel.tensor=2 parallel.sequence_parallel=true"
