#!/usr/bin/env bash
# Installs lockstep's dependencies from Debian's archive (by package name; idempotent: apt runs
# only when something is missing) and builds build/lockstep and the test suite.
#
#   scripts/setup.sh            dependencies + Release build
#   scripts/setup.sh --bench    also the benchmark dependencies (OpenBLAS, Google Benchmark,
#                               python3-torch for the PyTorch peer) and the bench/ targets
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    *) echo "setup.sh: unknown option '$arg' (expected --bench)" >&2; exit 2 ;;
  esac
done

packages=(g++ make cmake pkg-config libtomlplusplus-dev libxxhash-dev libgtest-dev nlohmann-json3-dev)
packages+=(clang-format-14 git)  # the format check (ctest Format.TreeFollowsClangFormat)
packages+=(libopenmpi-dev openmpi-bin)  # the mpi backend (mpirun -n N lockstep train) and its tests
if [ "$bench" = 1 ]; then
  packages+=(libopenblas-dev libbenchmark-dev python3-torch bc)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_BENCH=$([ "$bench" = 1 ] && echo ON || echo OFF) >/dev/null
cmake --build build -j"$(nproc)"
echo "setup.sh: built build/lockstep"
