#!/usr/bin/env bash
# MoE training throughput of lockstep against the PyTorch peer (../shared/peers/torch_gpt.py
# --model moe), side by side in one run on the same cores, on configs/moe-peer.toml: GPT-2
# flavour, 4 layers, hidden 256, 4 heads, sequence 256, micro-batch 4, vocabulary 8192, every layer
# MoE with 8 experts, top-2, expert hidden 512, GELU, switch aux loss 0.01.
#
#   bench/moe_vs_torch.sh [rounds]      (default 3; needs build/lockstep and python3-torch)
#
# Rounds alternate lockstep and every PyTorch thread setting, so that machine noise hits both;
# the report takes each one's median tokens/s over rounds and the ratio against PyTorch's best
# setting. OpenBLAS variables that pin a core type are unset for the PyTorch runs.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
lockstep=${LOCKSTEP:-build/lockstep}
peer=../shared/peers/torch_gpt.py
[ -x "$lockstep" ] || { echo "$lockstep missing: run scripts/setup.sh" >&2; exit 2; }
[ -f "$peer" ] || { echo "$peer missing" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

settings=("torch threads=1 openblas=2|OPENBLAS_NUM_THREADS=2|--threads 1"
          "torch threads=2 openblas=1|OPENBLAS_NUM_THREADS=1|--threads 2"
          "torch threads=2 openblas=2|OPENBLAS_NUM_THREADS=2|--threads 2")

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

for r in $(seq 1 "$rounds"); do
  "$lockstep" train -c configs/moe-peer.toml train.steps=12 train.threads=2 train.out_dir="$out/run" \
    > "$out/lockstep.log"
  grep -o 'median [0-9.]* tok/s, MFU [0-9.]*%' "$out/lockstep.log" | tee -a "$out/lockstep.txt" |
    sed "s/^/round $r lockstep threads=2: /"
  for i in "${!settings[@]}"; do
    IFS='|' read -r label envs args <<< "${settings[$i]}"
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $envs /usr/bin/python3 "$peer" --model moe $args --steps 10 --warmup 2 \
      > "$out/torch.log" 2>&1
    tps=$(grep -o 'tok_per_s=[0-9.]*' "$out/torch.log" | cut -d= -f2)
    echo "$tps" >> "$out/torch-$i.txt"
    echo "round $r $label: $tps tok/s"
  done
done

ls_tps=$(awk '{print $2}' "$out/lockstep.txt" | median)
best=0 best_label=""
for i in "${!settings[@]}"; do
  m=$(median < "$out/torch-$i.txt")
  label=${settings[$i]%%|*}
  echo "median $label: $m tok/s"
  if awk -v a="$m" -v b="$best" 'BEGIN {exit !(a > b)}'; then best=$m best_label=$label; fi
done
echo "median lockstep threads=2: $ls_tps tok/s"
awk -v a="$ls_tps" -v b="$best" -v l="$best_label" 'BEGIN {printf "lockstep / best PyTorch (%s): %.2fx\n", l, a / b}'
