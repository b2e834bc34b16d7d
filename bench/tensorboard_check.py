#!/usr/bin/env python3
"""Reads a run's TensorBoard event files (train.tensorboard = true) with the tensorboard package's
EventAccumulator, the reader TensorBoard itself uses, prints every scalar tag (points, steps, first
and last value) and checks each value against the run's metrics.jsonl (as float32, which
TensorBoard's simple_value is). Exit status 1 when a value is missing, differs or a step repeats.

    bench/setup_peers.sh                       # puts tensorboard (and torch) into bench/.venv
    bench/.venv/bin/python bench/tensorboard_check.py runs/moe-debug
"""
import json
import math
import re
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator


def tag_of(key):
    """src/lockstep/train/tensorboard.h's tensorboard_tag."""
    m = re.fullmatch(r"(moe|pp)\.(\d+)\.(.+)", key)
    if not m:
        return key
    return f"{m[1]}/{dict(moe='layer', pp='stage')[m[1]]}{m[2]}/{m[3]}"


def expected(metrics_path):
    """{(tag, step): float32 value} from metrics.jsonl's numbers (arrays: one per element)."""
    want = {}
    for line in open(metrics_path):
        row = json.loads(line)
        step = row.pop("step")
        for key, value in row.items():
            items = [(tag_of(key), value)]
            if isinstance(value, list):
                stem = key[: -len("_ranks")] + "/rank" if key.endswith("_ranks") else key + "/"
                items = [(f"{stem}{i}", v) for i, v in enumerate(value)]
            for tag, v in items:
                if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
                    want[(tag, step)] = math.nan if v is None else struct.unpack("f", struct.pack("f", v))[0]
    return want


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    run = sys.argv[1]
    acc = event_accumulator.EventAccumulator(f"{run}/tensorboard", size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got, repeated = {}, []
    for tag in sorted(acc.Tags()["scalars"]):
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        if len(set(steps)) != len(steps):
            repeated.append(tag)  # a resumed run's file must not repeat the steps after the checkpoint
        print(f"{tag}: {len(events)} points, steps {min(steps)}..{max(steps)}, "
              f"first {events[0].value:.6g}, last {events[-1].value:.6g}")
        for e in events:
            got[(tag, e.step)] = e.value
    want = expected(f"{run}/metrics.jsonl")
    bad = [(k, v, got.get(k)) for k, v in want.items()
           if k not in got or not (got[k] == v or math.isnan(v) and math.isnan(got[k]))]
    extra = set(got) - set(want)
    for (tag, step), v, g in bad[:10]:
        print(f"MISMATCH {tag} at step {step}: metrics.jsonl {v}, events {g}")
    for tag in repeated:
        print(f"REPEATED steps in {tag}")
    print(f"tensorboard_check: {len(acc.Tags()['scalars'])} tags, {len(got)} values; "
          f"{len(want) - len(bad)} of {len(want)} metrics.jsonl values match, {len(extra)} events values not in it")
    sys.exit(1 if bad or extra or repeated else 0)


if __name__ == "__main__":
    main()
