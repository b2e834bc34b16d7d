#!/usr/bin/env bash
# Training throughput of lockstep against its PyTorch peer (bench/torch_peer.py), side by side in
# one run on the same cores, on one of the peer's models:
#   dense  configs/gpt2-peer.toml: GPT-2 flavour, 4 layers, hidden 256, 4 heads, sequence 256,
#          micro-batch 4, vocabulary 8192 (torch_peer.py --model dense)
#   moe    configs/moe-peer.toml: the same with every MLP an MoE layer of 8 experts, top-2, expert
#          hidden 512, GELU, switch aux loss 0.01 (torch_peer.py --model moe)
#
#   bench/train_vs_torch.sh [dense|moe] [rounds]      (defaults: dense, 3)
#   LOCKSTEP=path/to/lockstep bench/train_vs_torch.sh ...   (another build of lockstep)
#   PEER_PYTHON=path/to/python bench/train_vs_torch.sh ...  (another Python with torch)
#
# Needs build/lockstep (scripts/setup.sh --bench) and a Python with torch: bench/.venv from
# bench/setup_peers.sh (PyTorch from PyPI) when it exists, else /usr/bin/python3 (Debian's
# python3-torch, which scripts/setup.sh --bench installs).
#
# Rounds alternate lockstep and every PyTorch thread setting, so that machine noise hits both;
# the report takes each one's median tokens/s over rounds and the ratio against PyTorch's best
# setting. OpenBLAS variables that pin a core type are unset for the PyTorch runs.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-dense}
rounds=${2:-3}
case "$model" in
  dense) config=configs/gpt2-peer.toml ;;
  moe) config=configs/moe-peer.toml ;;
  *) echo "train_vs_torch.sh: model '$model' is not dense or moe" >&2; exit 2 ;;
esac
lockstep=${LOCKSTEP:-build/lockstep}
peer=bench/torch_peer.py
if [ -n "${PEER_PYTHON:-}" ]; then python=$PEER_PYTHON
elif [ -x bench/.venv/bin/python ]; then python=bench/.venv/bin/python
else python=/usr/bin/python3
fi
[ -x "$lockstep" ] || { echo "$lockstep missing: run scripts/setup.sh --bench" >&2; exit 2; }
"$python" -c 'import torch' 2>/dev/null ||
  { echo "$python has no torch: run bench/setup_peers.sh (or scripts/setup.sh --bench)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# PyTorch settings: "label|env|args". A torch whose BLAS is OpenBLAS (Debian's) runs sgemm in
# OpenBLAS, whose threads torch.set_num_threads does not set: three settings. PyPI's torch (MKL,
# oneDNN) follows --threads alone: two.
if "$python" -c 'import torch; print(torch.__config__.show())' 2>/dev/null | grep -q 'BLAS_INFO=open'; then
  settings=("torch threads=1 openblas=2|OPENBLAS_NUM_THREADS=2|--threads 1"
            "torch threads=2 openblas=1|OPENBLAS_NUM_THREADS=1|--threads 2"
            "torch threads=2 openblas=2|OPENBLAS_NUM_THREADS=2|--threads 2")
else
  settings=("torch threads=1||--threads 1"
            "torch threads=2||--threads 2")
fi
echo "peer: $python $peer, torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

for r in $(seq 1 "$rounds"); do
  "$lockstep" train -c "$config" train.steps=12 train.threads=2 train.out_dir="$out/run" \
    > "$out/lockstep.log"
  grep -o 'median [0-9.]* tok/s, MFU [0-9.]*%' "$out/lockstep.log" | tee -a "$out/lockstep.txt" |
    sed "s/^/round $r lockstep threads=2: /"
  for i in "${!settings[@]}"; do
    IFS='|' read -r label envs args <<< "${settings[$i]}"
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $envs "$python" "$peer" --model "$model" $args --steps 10 --warmup 2 \
      > "$out/torch.log" 2>&1
    tps=$(grep -o 'tok_per_s=[0-9.]*' "$out/torch.log" | cut -d= -f2)
    echo "$tps" >> "$out/torch-$i.txt"
    echo "round $r $label: $tps tok/s"
  done
done

ls_tps=$(awk '{print $2}' "$out/lockstep.txt" | median)
ls_mfu=$(awk '{print $5}' "$out/lockstep.txt" | tr -d % | median)
best=0 best_label=""
for i in "${!settings[@]}"; do
  m=$(median < "$out/torch-$i.txt")
  label=${settings[$i]%%|*}
  echo "median $label: $m tok/s"
  if awk -v a="$m" -v b="$best" 'BEGIN {exit !(a > b)}'; then best=$m best_label=$label; fi
done
echo "median lockstep threads=2: $ls_tps tok/s (MFU $ls_mfu% of the measured GEMM peak)"
awk -v a="$ls_tps" -v b="$best" -v l="$best_label" 'BEGIN {printf "lockstep / best PyTorch (%s): %.2fx\n", l, a / b}'
