#!/usr/bin/env bash
# MoE parallel folding side by side (the runner: bench/layouts.sh): the MoE benchmark model
# (configs/moe-peer.toml, global batch 8 x 256 tokens in micro-batches of 2) on one rank, under data
# parallelism, tensor (+ sequence) parallelism, expert tensor parallelism, expert parallelism, and
# folded together, threads backend; tokens/s and the ratio to the single rank.
#   bench/moe_layouts.sh [ROUNDS]
exec "$(dirname "$0")/layouts.sh" "${1:-2}" \
  "-c configs/moe-peer.toml train.steps=6 train.global_batch=8 train.micro_batch=2" \
  "1 rank|threads|1|" \
  "dp 2|threads|2|" \
  "tp 2|threads|2|parallel.tensor=2" \
  "tp 2 + sp|threads|2|parallel.tensor=2 parallel.sequence_parallel=true" \
  "etp 2 (dp 2)|threads|2|parallel.expert_tensor=2" \
  "ep 2 alltoall (dp 2)|threads|2|parallel.expert=2 moe.token_dispatcher=alltoall" \
  "tp 2 + sp, etp 2|threads|2|parallel.tensor=2 parallel.sequence_parallel=true parallel.expert_tensor=2" \
  "tp 2 + sp, etp 2, ep 2 alltoall (4 ranks)|threads|4|parallel.tensor=2 parallel.sequence_parallel=true parallel.expert_tensor=2 parallel.expert=2 moe.token_dispatcher=alltoall" \
  "tp 4 + sp, ep 4 alltoall (4 ranks)|threads|4|parallel.tensor=4 parallel.sequence_parallel=true parallel.expert=4 moe.token_dispatcher=alltoall"
