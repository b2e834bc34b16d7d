#!/usr/bin/env python3
"""Loads lockstep's Hugging Face exports in transformers and checks they are the fixtures' models.

HfCheckpoint.ExportWritesTheImportedCheckpointBack (tests/test_hf_checkpoint.cpp) loads each
fixture of tests/hf/fixtures/ into lockstep and writes it back with write_hf_checkpoint, the
function behind `lockstep ckpt export --format hf`; with LOCKSTEP_HF_EXPORT_DIR set it keeps the
directories. Here transformers' AutoModelForCausalLM loads each one (config.json as lockstep wrote
it, no missing or unexpected tensors but DeepSeek's multi-token prediction layer, which transformers
does not implement) and must give the fixture's float64 loss on its batch.

    bench/.venv/bin/python tests/hf/check_export.py [BUILD_DIR]      (default: build)
"""
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "build")
    failures = 0
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([os.path.join(build, "lockstep_tests"), "--gtest_filter=HfCheckpoint.ExportWrites*"],
                       env=dict(os.environ, LOCKSTEP_HF_EXPORT_DIR=out), check=True, stdout=subprocess.DEVNULL)
        for family in sorted(os.listdir(out)):
            model, info = AutoModelForCausalLM.from_pretrained(os.path.join(out, family), output_loading_info=True,
                                                               attn_implementation="eager",
                                                               experts_implementation="eager")
            # DeepSeek's multi-token prediction layers (model.layers.<L + k>) are not transformers'; it
            # skips them by the release's number (61), here they are unexpected and nothing else is.
            mtp = tuple(f"model.layers.{model.config.num_hidden_layers + k}."
                        for k in range(getattr(model.config, "num_nextn_predict_layers", 0) or 0))
            unexpected = {k for k in info["unexpected_keys"] if not (mtp and k.startswith(mtp))}
            missing = set(info["missing_keys"]) | unexpected
            if mtp and len(unexpected) == len(info["unexpected_keys"]):
                missing.add("(no multi-token prediction layer written)")
            ref = load_file(os.path.join(HERE, "fixtures", family, "reference.safetensors"))
            model = model.double()
            with torch.no_grad():
                logits = model(input_ids=ref["tokens"].long()).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ref["targets"].long().reshape(-1)).item()
            want = ref["loss"].item()
            ok = not missing and abs(loss - want) <= 1e-12 * abs(want)
            failures += not ok
            print(f"{family:10s} {type(model).__name__:22s} loss {loss:.15f} fixture {want:.15f} "
                  f"{'ok' if ok else 'FAIL'}{'; missing/unexpected: ' + str(sorted(missing)) if missing else ''}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
