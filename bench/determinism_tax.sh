#!/usr/bin/env bash
# The determinism tax: the training step of the normal build (every GEMM one fixed FMA chain per
# element, plus the per-step fingerprint) against the fastest variant we can build without the
# guarantee (build-blas: -DLOCKSTEP_GEMM_BLAS=ON, the fp32 GEMMs on OpenBLAS's sgemm, and no
# fingerprint), on the dense and the MoE peer models, alternating the two builds round by round.
#
#   scripts/setup.sh --bench && bench/determinism_tax.sh [rounds] [run|layout|both|tp]   (default 3 both)
#
# Both run the step on 2 threads (OpenBLAS with OPENBLAS_NUM_THREADS=2). Per model: the median step
# of each build over the rounds (each round is bench_fingerprint's median of 5 steps), the
# fingerprint's hashing as the trainer does it with its default (replicated) optimizer (2
# threads), and the tax = (step + fingerprint) / BLAS step - 1.
#
# Part two, the layout tax: `lockstep train` (the whole trainer step, fingerprint included, 2
# threads) with determinism = "layout" against "run", alternating round by round, on the same two
# models as they are (one micro-batch per step) and with four micro-batches accumulated
# (train.global_batch=16: the canonical tree's pushes); median step_ms of steps 2..6 per round, then
# the median over rounds; tax = layout / run - 1 (and the same of the 25th percentile of all those
# steps, which a few slow steps from other processes move less). Also the CPU time (user + system) of each whole
# run (6 steps and the start-up, which is the same for both): on a loaded machine the wall time of a
# step swings by tens of percent with the other processes, the CPU time much less.
#
# Part three (`tp`, on its own): the same layout tax on moe-peer at TP 2 + SP on 2 thread ranks
# (one thread each; every rank holds all experts, docs/design/reductions.md#expert-tp-parts-and-slices) in bf16 and with the block
# recipes (blockwise FP8, NVFP4), the low-precision MoE rows of docs/performance.md, with one
# micro-batch per rank, and in bf16 with four. Parts two and three run their pairs through
# bench/interleave.sh, and time $LOCKSTEP instead of build/lockstep when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
parts=${2:-both}
case "$parts" in
  run | layout | both | tp) ;;
  *) echo "determinism_tax.sh: unknown part '$parts' (expected run, layout, both or tp)" >&2; exit 2 ;;
esac
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
echo "load: $(uptime | sed 's/.*load average: //')"
if [ "$parts" = run ] || [ "$parts" = both ]; then
  cmake -S . -B build-blas -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_GEMM_BLAS=ON -DLOCKSTEP_TESTS=OFF -DLOCKSTEP_BENCH=ON \
    >/dev/null 2>&1
  cmake --build build-blas --target bench_fingerprint -j2 >/dev/null
  cmake --build build --target bench_fingerprint -j2 >/dev/null
  ms='$0 ~ pattern { for (i = 2; i <= NF; ++i) if ($i == "ms") { print $(i - 1); exit } }'  # a row's milliseconds
  for config in configs/gpt2-peer.toml configs/moe-peer.toml; do
    : >/tmp/tax_run.$$; : >/tmp/tax_fp.$$; : >/tmp/tax_blas.$$
    for ((r = 0; r < rounds; ++r)); do
      out=$(build/bench_fingerprint "$config" 5)
      echo "$out" | awk "$ms" pattern='^training step' >>/tmp/tax_run.$$
      echo "$out" | awk "$ms" pattern='^trainer, replicated' >>/tmp/tax_fp.$$
      OPENBLAS_NUM_THREADS=2 build-blas/bench_fingerprint "$config" 5 | awk "$ms" pattern='^training step' >>/tmp/tax_blas.$$
    done
    run=$(median </tmp/tax_run.$$); fp=$(median </tmp/tax_fp.$$); blas=$(median </tmp/tax_blas.$$)
    awk -v c="$config" -v run="$run" -v fp="$fp" -v blas="$blas" 'BEGIN {
      printf "%s: step %.1f ms + fingerprint %.2f ms (run) vs %.1f ms (OpenBLAS, no fingerprint): tax %+.1f%%\n",
             c, run, fp, blas, 100 * ((run + fp) / blas - 1) }'
  done
  rm -f /tmp/tax_run.$$ /tmp/tax_fp.$$ /tmp/tax_blas.$$
fi
if [ "$parts" != run ]; then
  # LOCKSTEP=path: time that binary instead of building build/lockstep (e.g. an older commit's).
  if [ -z "${LOCKSTEP:-}" ]; then
    cmake --build build --target lockstep -j2 >/dev/null
  fi
  bin=${LOCKSTEP:-build/lockstep}
  # One row: the job under `run` against `layout`, interleaved round by round (bench/interleave.sh:
  # 6 steps, the median over rounds of each run's median step of steps 2..6, the 25th percentile of
  # all those steps, the median CPU time per run).
  tax_row() {  # $1: the row's label; the rest: the job's arguments
    local label=$1 out
    shift
    out=$(bench/interleave.sh "$rounds" 6 "run::$bin::$* determinism=run" "layout::$bin::$* determinism=layout")
    echo "$out" | awk -v c="$label" '
      $1 == "run:" { run = $3; runq = $6; runc = $11 }
      $1 == "layout:" { lay = $3; layq = $6; layc = $11 }
      END {
        printf "%s: step %.1f ms (layout) vs %.1f ms (run): %+.1f%% (25th percentile of all steps: %+.1f%%); CPU per run %.2f s vs %.2f s: %+.1f%%\n",
               c, lay, run, 100 * (lay / run - 1), 100 * (layq / runq - 1), layc, runc, 100 * (layc / runc - 1) }'
  }
fi
if [ "$parts" = layout ] || [ "$parts" = both ]; then
  for config in configs/gpt2-peer.toml configs/moe-peer.toml; do
    for batch in 4 16; do
      tax_row "$config, $((batch / 4)) micro-batch(es) per step" -c "$config" train.threads=2 train.global_batch=$batch
    done
  done
fi
if [ "$parts" = tp ]; then
  tp="--nproc 2 parallel.tensor=2 parallel.sequence_parallel=true train.threads=1 precision.params=bf16"
  # One micro-batch per rank (the global batch of 4), then four (16): each micro-batch's expert
  # gradients reduce-scattered over tp (docs/design/reductions.md#expert-tp-parts-and-slices, ExpertTpSum).
  for row in ":4" "precision.fp8=blockwise:4" "precision.fp4=nvfp4:4" ":16"; do
    recipe=${row%:*} batch=${row#*:}
    # shellcheck disable=SC2086  # $tp is a list of words
    tax_row "configs/moe-peer.toml, TP 2 + SP, bf16 ${recipe:-(no FP8 / FP4)}, $((batch / 4)) micro-batch(es) per rank" \
      -c configs/moe-peer.toml $tp $recipe train.global_batch=$batch
  done
fi
echo "load: $(uptime | sed 's/.*load average: //')"
