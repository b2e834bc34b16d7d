#!/usr/bin/env python3
"""Writes a synthetic corpus and a matching GPT-2-format BPE vocabulary for the data-pipeline
benchmark (bench/preprocess_bench.sh):

  OUT/corpus.jsonl  JSONL documents of about MB megabytes: words from a Zipf-distributed list of
                    20,000 pseudo-words, punctuation, numbers, some accented and CJK text
  OUT/vocab.json, OUT/merges.txt
                    byte-level BPE in GPT-2's file format whose merges build each of the 5,000
                    most frequent words (with and without the leading "Ġ") left to right, so
                    tokenizing runs real merge chains, like a trained vocabulary would

usage: gen_corpus.py OUT MB [SEED]"""
import json
import os
import random
import sys

out, mb = sys.argv[1], float(sys.argv[2])
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
os.makedirs(out, exist_ok=True)

syllables = ["ka", "to", "ri", "en", "sa", "mo", "lu", "ne", "th", "qu", "ing", "er", "an", "st", "or", "é", "ü"]
words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40000)})[:20000]
rng.shuffle(words)
weights = [1.0 / (r + 1) for r in range(len(words))]
extras = ["日本語の文章", "данные", "🙂", "—", "12345", "3.14", "(see", "above)", "it's"]

with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as f:
    written = 0
    target = int(mb * 1e6)
    while written < target:
        n = rng.randint(20, 600)
        toks = rng.choices(words, weights, k=n)
        for i in range(0, n, 17):
            toks[i] = toks[i].capitalize() + rng.choice([".", ",", "", "", "!"])
        if rng.random() < 0.3:
            toks.insert(rng.randrange(len(toks)), rng.choice(extras))
        line = json.dumps({"text": " ".join(toks)}, ensure_ascii=False) + "\n"
        f.write(line)
        written += len(line.encode("utf-8"))


def byte_chars():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


b2c = byte_chars()
vocab = {b2c[b]: b for b in range(256)}
merges = []
for w in words[:5000]:
    for form in (w, " " + w):
        sym = "".join(b2c[b] for b in form.encode("utf-8"))
        chars = list(sym)
        cur = chars[0]
        for c in chars[1:]:
            if cur + c not in vocab:
                merges.append((cur, c))
                vocab[cur + c] = len(vocab)
            cur = cur + c
vocab["<|endoftext|>"] = len(vocab)
with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)
with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
    f.write("#version: 0.2\n")
    for a, b in merges:
        f.write(f"{a} {b}\n")
print(f"{out}: corpus {written / 1e6:.1f} MB, vocabulary {len(vocab)}, {len(merges)} merges", file=sys.stderr)
