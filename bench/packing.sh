#!/usr/bin/env bash
# Packed variable-length samples (data.packing = "thd") against fixed-length samples with document
# masks (reset_position_ids, reset_attention_mask, eod_mask_loss) on a corpus with a wide length
# distribution (docs/data.md#packed-variable-length-samples-datapacking--thd): DOCS byte documents
# (default 3000) whose lengths are log-uniform in [16, 4096] bytes, preprocessed with
# `lockstep preprocess --tokenizer byte --append-eod`; configs/debug.toml as Llama at SEQ tokens
# (default 2048), 4 sequences per step, 8 steps, 2 threads. Per row: tokens/s (every position),
# tokens with a loss per step and per second (padding and each document's final EOD have none),
# the share of positions without a loss, and the share of documents a sample boundary cuts.
#
#   scripts/setup.sh && bench/packing.sh [SEQ] [DOCS]
set -euo pipefail
cd "$(dirname "$0")/.."
seq=${1:-2048}
docs=${2:-3000}
bin=${LOCKSTEP:-build/lockstep}
[ -x "$bin" ] || { echo "$bin missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 - "$out/corpus.jsonl" "$docs" "$out/lengths" <<'EOF'
import json, math, random, sys
rng = random.Random(7)
with open(sys.argv[1], "w") as f, open(sys.argv[3], "w") as lengths:
    for _ in range(int(sys.argv[2])):
        n = int(math.exp(rng.uniform(math.log(16), math.log(4096))))
        f.write(json.dumps({"text": "".join(rng.choice("abcdefghij klmnop") for _ in range(n))}) + "\n")
        lengths.write(f"{n + 1}\n")  # with the EOD
EOF
"$bin" preprocess --input "$out/corpus.jsonl" --output "$out/corpus" --tokenizer byte --append-eod >/dev/null
echo "load: $(uptime | sed 's/.*load average: //'); $docs documents, $seq-token samples"
common="-c configs/debug.toml model.preset=llama model.seq_length=$seq model.vocab_size=260 data.source=indexed:$out/corpus
  data.eod_token=256 train.micro_batch=1 train.global_batch=4 train.steps=8 train.eval_interval=0
  train.threads=2"
printf '%-34s %10s %14s %16s %12s %10s\n' samples tokens/s loss_tokens loss_tokens/s no_loss cut_docs
for row in "fixed, document masks|data.reset_position_ids=true data.reset_attention_mask=true data.eod_mask_loss=true" \
  "packed (thd)|data.packing=thd"; do
  IFS='|' read -r label keys <<<"$row"
  dir="$out/${label%%,*}"
  dir=${dir// /_}
  # shellcheck disable=SC2086
  "$bin" train $common $keys train.out_dir="$dir" >/dev/null
  python3 - "$dir/metrics.jsonl" "$label" "$seq" "$out/lengths" <<'EOF'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])][1:]  # step 1 warms up
seq, label = int(sys.argv[3]), sys.argv[2]
tps = statistics.median(l["tokens_per_s"] for l in lines)
lt = statistics.median(l["loss_tokens"] for l in lines)
# Fixed-length windows over the concatenated documents cut every document that spans a multiple of
# SEQ (in the corpus's order; a shuffle moves which, not how many); packing only those longer than SEQ.
lengths = [int(x) for x in open(sys.argv[4])]
if label.startswith("fixed"):
    start, cut = 0, 0
    for n in lengths:
        cut += start // seq != (start + n - 1) // seq
        start += n
else:
    cut = sum(n > seq for n in lengths)
print(f"{label:<34} {tps:10.0f} {lt:14.0f} {tps * lt / (4 * seq):16.0f} {1 - lt / (4 * seq):11.1%} "
      f"{cut / len(lengths):9.1%}")
EOF
done
