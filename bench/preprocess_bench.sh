#!/usr/bin/env bash
# `lockstep preprocess` throughput (MB of JSONL input per second) with the byte and gpt2
# tokenizers and 1 and 2 workers, on a generated corpus (bench/gen_corpus.py: 40 MB of Zipfian
# pseudo-words, a 27k-token GPT-2-format vocabulary whose merges build the frequent words).
#
#   bench/preprocess_bench.sh [MB] [rounds]     (defaults 40 and 3; needs build/lockstep)
#
# Prints, per setting, the median wall-clock MB/s over rounds and the median CPU seconds (user +
# system, all threads), and checks that 1 and 2 workers write identical files.
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-40}
rounds=${2:-3}
[ -x build/lockstep ] || { echo "build/lockstep missing: run scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 bench/gen_corpus.py "$out" "$mb"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
printf "%-8s %-8s %10s %10s\n" tokenizer workers "MB/s" "CPU s"
for tok in byte gpt2; do
  spec=$tok
  [ "$tok" = gpt2 ] && spec="gpt2:$out/vocab.json,$out/merges.txt"
  for w in 1 2; do
    : > "$out/rates"
    : > "$out/cpu"
    for r in $(seq 1 "$rounds"); do
      /usr/bin/time -f "%U %S" -o "$out/time" build/lockstep preprocess --input "$out/corpus.jsonl" \
        --output "$out/$tok-$w" --tokenizer "$spec" --workers "$w" --append-eod > "$out/log"
      sed -n 's/.*(\([0-9.]*\) MB\/s.*/\1/p' "$out/log" >> "$out/rates"
      awk '{print $1 + $2}' "$out/time" >> "$out/cpu"
    done
    printf "%-8s %-8s %10s %10s\n" "$tok" "$w" "$(median < "$out/rates")" "$(median < "$out/cpu")"
  done
  cmp -s "$out/$tok-1.bin" "$out/$tok-2.bin" && cmp -s "$out/$tok-1.idx" "$out/$tok-2.idx" ||
    { echo "$tok: 1 and 2 workers wrote different files" >&2; exit 1; }
done
