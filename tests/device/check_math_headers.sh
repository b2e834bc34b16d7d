#!/usr/bin/env bash
# Compiles tests/device/math_headers.cu with nvcc for the GPU (compile only: no GPU is needed), with
# the flags under which the host/device math headers give the host's bits (core/hd.h). Exits 77
# (ctest: skipped) when there is no nvcc.
#   check_math_headers.sh SOURCE_DIR BUILD_DIR
# NVCC names the compiler (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc); CUDA_ARCH the
# target (default sm_90a).
set -euo pipefail
src=$1 build=$2
nvcc=${NVCC:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || nvcc=/usr/local/cuda/bin/nvcc
if [ ! -x "$nvcc" ]; then
  echo "SKIPPED: nvcc not found (set NVCC or install the CUDA toolkit); the device compile of the math headers was not checked"
  exit 77
fi
arch=${CUDA_ARCH:-sm_90a}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The kernels layer's include tree: core/ and kernels/, nothing above (the layer rule holds here too).
include=$build/layers/kernels
[ -d "$include/lockstep" ] || include=$src/src
flags=(-std=c++20 -fmad=false -ftz=false -prec-div=true -prec-sqrt=true -arch="$arch" -Werror all-warnings)
echo "$("$nvcc" --version | tail -1)"
echo "nvcc ${flags[*]} -c tests/device/math_headers.cu"
"$nvcc" "${flags[@]}" -I "$include" -c "$src/tests/device/math_headers.cu" -o "$tmp/math_headers.o"
echo "OK: core/{hd,libm,philox,float_formats}.h and kernels/{math,hadamard}.h compile for $arch"
