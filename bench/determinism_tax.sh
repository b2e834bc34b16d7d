#!/usr/bin/env bash
# The determinism tax: the training step of the normal build (every GEMM one fixed FMA chain per
# element, plus the per-step fingerprint) against the fastest variant we can build without the
# guarantee (build-blas: -DLOCKSTEP_GEMM_BLAS=ON, the fp32 GEMMs on OpenBLAS's sgemm, and no
# fingerprint), on the dense and the MoE peer models, alternating the two builds round by round.
#
#   scripts/setup.sh --bench && bench/determinism_tax.sh [rounds]      (default 3)
#
# Both run the step on 2 threads (OpenBLAS with OPENBLAS_NUM_THREADS=2). Per model: the median step
# of each build over the rounds (each round is bench_fingerprint's median of 5 steps), the
# fingerprint's hashing as the trainer does it (2 threads), and the tax = (step + fingerprint) /
# BLAS step - 1.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cmake -S . -B build-blas -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_GEMM_BLAS=ON -DLOCKSTEP_TESTS=OFF -DLOCKSTEP_BENCH=ON \
  >/dev/null 2>&1
cmake --build build-blas --target bench_fingerprint -j2 >/dev/null
cmake --build build --target bench_fingerprint -j2 >/dev/null
ms='$0 ~ pattern { for (i = 2; i <= NF; ++i) if ($i == "ms") { print $(i - 1); exit } }'  # a row's milliseconds
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
echo "load: $(uptime | sed 's/.*load average: //')"
for config in configs/gpt2-peer.toml configs/moe-peer.toml; do
  : >/tmp/tax_run.$$; : >/tmp/tax_fp.$$; : >/tmp/tax_blas.$$
  for ((r = 0; r < rounds; ++r)); do
    out=$(build/bench_fingerprint "$config" 5)
    echo "$out" | awk "$ms" pattern='^training step' >>/tmp/tax_run.$$
    echo "$out" | awk "$ms" pattern='the trainer' >>/tmp/tax_fp.$$
    OPENBLAS_NUM_THREADS=2 build-blas/bench_fingerprint "$config" 5 | awk "$ms" pattern='^training step' >>/tmp/tax_blas.$$
  done
  run=$(median </tmp/tax_run.$$); fp=$(median </tmp/tax_fp.$$); blas=$(median </tmp/tax_blas.$$)
  awk -v c="$config" -v run="$run" -v fp="$fp" -v blas="$blas" 'BEGIN {
    printf "%s: step %.1f ms + fingerprint %.2f ms (run) vs %.1f ms (OpenBLAS, no fingerprint): tax %+.1f%%\n",
           c, run, fp, blas, 100 * ((run + fp) / blas - 1) }'
done
echo "load: $(uptime | sed 's/.*load average: //')"
rm -f /tmp/tax_run.$$ /tmp/tax_fp.$$ /tmp/tax_blas.$$
