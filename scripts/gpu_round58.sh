#!/usr/bin/env bash
# What round 58 ran on the device (BENCHMARKS.md, "Round 58"); every call carried .whl.
#   bash scripts/gpu_round58.sh 1   # an H200 (issues 31, 33): Qwen3-8B adaptive vs fixed vs plain at 1 … 256, then
#        # FP8 vs bf16 at 1 and 32 sequences
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  ADAPT_S=${ADAPT_S:-380} bash "$(dirname "$0")/gpu_round54.sh" 9
  TAIL=60 stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences" timeout ${FP8_S:-170} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1,32 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
fi
#   bash scripts/gpu_round58.sh 2   # any card (issue 33), run on commit 76c85ac (its prefetching key loop, since
#        # dropped): the decode attention swept (prefetching or chained loop, stages, BLOCK_N, splits), the step
#        # replayed with each loop, then the attention GPU tests
if [ "$M" = 2 ]; then
  TAIL=80 stage "decode attention sweep, Qwen3-8B heads" timeout ${SWEEP_S:-200} python3 scripts/decode_attention_sweep.py \
    --out "$OUT/decode_attention_sweep.json"
  for prefetch in 0 1; do
    stage "step profile, Qwen3-8B FP8, width 1 and 16, contexts 512 and 4096, prefetch $prefetch" \
      env BLOCKSPEC_ATTENTION_PREFETCH=$prefetch timeout ${PROF_S:-90} python3 scripts/step_profile.py \
      --shape qwen3-8b --widths 1,16 --formats fp8 --contexts 512,4096 --out "$OUT/step_profile_prefetch$prefetch.json"
  done
  timeout ${TESTS_S:-120} $T tests/gpu/test_attention_kernels.py > "$OUT/t_attention.log" 2>&1
  summary
fi
#   bash scripts/gpu_round58.sh 3   # any card (issue 33): the FP8 weight-only tl.dot kernel swapped (the weight tile
#        # the left operand) against the shipped tiles at 16 and 4 rows, then the FP8 GPU tests of the variants
if [ "$M" = 3 ]; then
  TAIL=40 stage "FP8 weight-only sweep at 16 and 4 rows, swapped tiles" timeout ${SWEEP_S:-200} python3 \
    scripts/fp8_kernel_bench.py --sweep-only --rows 16,4 --swapped --sweep-budget ${BUDGET:-150} \
    --out "$OUT/fp8_swap_sweep.json"
  timeout ${TESTS_S:-150} $T tests/gpu/test_fp8.py -k "variants_equal or split_sums" > "$OUT/t_fp8.log" 2>&1
  summary
fi
#   bash scripts/gpu_round58.sh 4   # any card: mode 3's sweep (shorter), then all of tests/gpu in four processes
#        # (round 55's split) and the pool test alone
if [ "$M" = 4 ]; then
  TAIL=40 stage "FP8 weight-only sweep at 16 and 4 rows, swapped tiles" timeout ${SWEEP_S:-160} python3 \
    scripts/fp8_kernel_bench.py --sweep-only --rows 16,4 --swapped --sweep-budget ${BUDGET:-110} \
    --out "$OUT/fp8_swap_sweep.json"
  TESTS_S=${TESTS_S:-330} bash "$(dirname "$0")/gpu_round55.sh" 1
fi
#   bash scripts/gpu_round58.sh 5   # any card: mode 3's sweep (shorter), HTTP bursts after the merged host-path
#        # changes (one wake-up a step, one argmax for the first tokens), then the GPU tests this round's changes touch
if [ "$M" = 5 ]; then
  TAIL=40 stage "FP8 weight-only sweep at 16 and 4 rows, swapped tiles" timeout ${SWEEP_S:-130} python3 \
    scripts/fp8_kernel_bench.py --sweep-only --rows 16,4 --swapped --sweep-budget ${BUDGET:-90} \
    --compile-workers 12 --out "$OUT/fp8_swap_sweep.json"
  stage "HTTP: demo pair, 3 bursts of 64 x 256, a thread per stream" timeout ${HTTP_S:-90} python3 \
    scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
  G=tests/gpu
  timeout ${TESTS_S:-220} $T $G/test_attention_kernels.py $G/test_fp8.py \
    -k "swapped or split_sums or target_batches or draft_blocks or invariant" > "$OUT/t_1.log" 2>&1 &
  timeout ${TESTS_S:-220} $T $G/test_gpu.py $G/test_overlap_gpu.py > "$OUT/t_2.log" 2>&1 &
  wait
  summary
fi
#   bash scripts/gpu_round58.sh 6   # mode 5 without the HTTP bursts, shorter (the device was scarce): the swap
#        # sweep, then the swapped variants' and the decode attention's GPU tests
if [ "$M" = 6 ]; then
  TAIL=40 stage "FP8 weight-only sweep at 16 and 4 rows, swapped tiles" timeout ${SWEEP_S:-120} python3 \
    scripts/fp8_kernel_bench.py --sweep-only --rows 16,4 --swapped --sweep-budget ${BUDGET:-80} \
    --compile-workers 12 --out "$OUT/fp8_swap_sweep.json"
  G=tests/gpu
  timeout ${TESTS_S:-150} $T $G/test_fp8.py -k "swapped or split_sums" > "$OUT/t_1.log" 2>&1 &
  timeout ${TESTS_S:-150} $T $G/test_attention_kernels.py -k "target_batches or invariant" > "$OUT/t_2.log" 2>&1 &
  wait
  summary
fi
#   (calls 4-6, on mode 6's warm machine: HTTP bursts of this tree, then again with its one wake-up a step turned off,
#    twice; `$B --quantization fp8 --concurrency 1,32` and step_profile.py at two attention stages;
#    fp8_kernel_bench.py --no-sweep)
#   bash scripts/gpu_round58.sh 7   # any card (issue 33): the FP8 × FP8 kernel's tiles at 256 and 512 rows against
#        # cuBLAS's bf16 (round 58: 1.1-1.6 × bf16's time at 256 rows; DFlash at 32 sequences 0.79 × bf16)
if [ "$M" = 7 ]; then
  TAIL=20 stage "FP8 x FP8 tiles at 256 and 512 rows" timeout ${SWEEP_S:-150} python3 scripts/fp8_kernel_bench.py \
    --fp8-fp8-sweep --sweep-budget ${BUDGET:-90} --out "$OUT/fp8_fp8_sweep.json"
fi
