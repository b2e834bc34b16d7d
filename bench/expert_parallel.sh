#!/usr/bin/env bash
# Expert-parallel layouts side by side on the threads backend: median tokens/s of each, and the
# bytes rank 0's token dispatchers sent per step (metrics.jsonl ep_bytes_sent, mean over the
# steps) against the analytic volume (docs/parallelism.md):
#   alltoall:  L m [16 C N K (S-1)/S + 8 (S-1) E/S]   (balanced routing, dropless)
#   allgather: L m (S-1) N (16 C + 13 K)               (exact)
# L MoE layers, m micro-batches per rank, N tokens per micro-batch, S = parallel.expert.
#   bench/expert_parallel.sh [LOCKSTEP] [CONFIG] [STEPS]
set -euo pipefail
lockstep=${1:-build/lockstep} config=${2:-configs/moe-debug.toml} steps=${3:-20}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "load: $(uptime | sed 's/.*load average: //')"
printf '%-28s %10s %14s %14s %8s\n' layout tok/s bytes/step analytic ratio
for layout in "2 1 allgather" "2 2 alltoall" "2 2 allgather" "4 1 allgather" "4 2 alltoall" "4 4 alltoall" "4 2 allgather" "4 4 allgather"; do
  read -r n ep disp <<<"$layout"
  out="$dir/w${n}_ep${ep}_$disp"
  "$lockstep" train -c "$config" --nproc "$n" train.steps="$steps" train.eval_interval=0 train.threads=1 \
    train.micro_batch=2 parallel.expert="$ep" moe.token_dispatcher="$disp" train.out_dir="$out" >"$out.log"
  python3 - "$out" "$n" "$ep" "$disp" <<'PY'
import json, sys, tomllib
out, n, S, disp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = tomllib.load(open(out + "/config.toml", "rb"))
m, t, moe = cfg["model"], cfg["train"], cfg["moe"]
C, E, K = m["hidden_size"], moe["num_experts"], moe["router_topk"]
freq = str(moe["layer_freq"])
L = m["num_layers"] if freq == "1" else sum(1 for c in freq if c == "1")
N = t["micro_batch"] * m["seq_length"]
micro = t["global_batch"] // (t["micro_batch"] * n)
rows = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"loss"' in l]
toks = sorted(r["tokens_per_s"] for r in rows[1:])[len(rows[1:]) // 2]
if S == 1:
    got, want = 0, 0
elif disp == "alltoall":
    got = sum(r["ep_bytes_sent"] for r in rows) / len(rows)
    want = L * micro * (16 * C * N * K * (S - 1) / S + 8 * (S - 1) * E // S)
else:
    got = sum(r["ep_bytes_sent"] for r in rows) / len(rows)
    want = L * micro * (S - 1) * N * (16 * C + 13 * K)
name = f"world {n}, ep {S}, {disp if S > 1 else '(dp only)'}"
print(f"{name:<28} {toks:10.0f} {got:14.0f} {want:14.0f} {got / want if want else 0:8.4f}")
PY
done
