#!/usr/bin/env bash
# Installs what the benchmark peers need into bench/.venv (ignored by git): a Python virtual
# environment with PyTorch from PyPI, for bench/torch_peer.py and bench/train_vs_torch.sh, the
# tensorboard package for bench/tensorboard_check.py, and transformers and megatron-core for the
# oracle fixtures (tests/hf/, tests/megatron/).
# Idempotent: an existing environment that imports torch and tensorboard is left as it is.
#
#   bench/setup_peers.sh                          python3's venv, torch (CPU wheel where it can)
#   PYTHON=/usr/bin/python3 bench/setup_peers.sh  make the environment from another interpreter
#
# torch comes from PyTorch's CPU-only index when that is reachable (about 200 MB), else from plain
# PyPI, whose Linux wheel also pulls the CUDA libraries (a few GB; the peer runs on the CPU either
# way). On Debian, python3 -m venv needs the python3-venv package: installed with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=bench/.venv
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "setup_peers.sh: $python not found" >&2; exit 2; }

# Debian ships venv's ensurepip in python3-venv; install it only when it is what is missing.
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  if command -v dpkg-query >/dev/null &&
     ! dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "install ok installed"; then
    echo "setup_peers.sh: installing python3-venv"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv
  fi
fi

# A leftover environment whose interpreter no longer runs (moved, or its base python removed) is
# made anew.
if [ -e "$venv" ] && ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
  echo "setup_peers.sh: $venv is broken; recreating it"
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup_peers.sh: creating $venv from $("$python" -c 'import sys; print(sys.executable)')"
  "$python" -m venv "$venv"
fi

# tensorboard, for bench/tensorboard_check.py (reads train.tensorboard's event files as TensorBoard does).
"$venv/bin/python" -c 'import tensorboard' 2>/dev/null ||
  "$venv/bin/python" -m pip install --disable-pip-version-check tensorboard

# The oracles' fixture generators (tests/hf/make_fixtures.py, tests/megatron/make_fixtures.py) use
# Hugging Face transformers and Megatron Core, pinned to the versions the committed fixtures came from.
oracles() {
  "$venv/bin/python" -c 'import transformers, megatron.core' 2>/dev/null ||
    "$venv/bin/python" -m pip install --disable-pip-version-check transformers==5.25.0 megatron-core==0.16.1
}

# numpy too: torch warns on import without it.
if "$venv/bin/python" -c 'import numpy, torch' 2>/dev/null; then
  oracles
  echo "setup_peers.sh: $venv has torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  exit 0
fi

pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "setup_peers.sh: installing torch into $venv"
  if ! "${pip[@]}" --timeout 30 --retries 1 torch --index-url https://download.pytorch.org/whl/cpu; then
    echo "setup_peers.sh: PyTorch's CPU index is not reachable; installing torch from PyPI"
    "${pip[@]}" torch
  fi
fi
"$venv/bin/python" -c 'import numpy' 2>/dev/null || "${pip[@]}" numpy
"$venv/bin/python" -c 'import torch; print("setup_peers.sh: torch", torch.__version__, "in bench/.venv")'
oracles
