#!/usr/bin/env bash
# What round 58 ran on the device (BENCHMARKS.md, "Round 58"); every call carried .whl.
#   bash scripts/gpu_round58.sh 1   # an H200 (issues 31, 33): Qwen3-8B adaptive vs fixed vs plain at 1 … 256, then
#        # FP8 vs bf16 at 1 and 32 sequences (refused three times: no H200 was lent; for the next session)
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
#   bash scripts/gpu_round58.sh 6   # any card (issue 33), run on commit 577608f (its swapped weight-only form, since
#        # dropped, and fp8_kernel_bench.py --swapped): the swapped tiles against the shipped ones at 16 and 4 rows,
#        # then the swapped variants' and the decode attention's GPU tests
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
#   (calls 3-6, on mode 6's warm machine, after the merge: HTTP bursts of the tree, then again with its one wake-up a
#    step turned off (`engine.event_batch = wakeups_held` edited out on the device), twice; `$B --quantization fp8
#    --concurrency 1,32` and step_profile.py at two attention stages; fp8_kernel_bench.py --no-sweep)
#   bash scripts/gpu_round58.sh 7   # any card (issue 33): the FP8 × FP8 kernel's tiles at 256 and 512 rows against
#        # cuBLAS's bf16 (round 58: 1.1-1.6 × bf16's time at 256 rows; DFlash at 32 sequences 0.79 × bf16)
if [ "$M" = 7 ]; then
  TAIL=20 stage "FP8 x FP8 tiles at 256 and 512 rows" timeout ${SWEEP_S:-150} python3 scripts/fp8_kernel_bench.py \
    --fp8-fp8-sweep --sweep-budget ${BUDGET:-90} --out "$OUT/fp8_fp8_sweep.json"
fi
#   (calls 8-10, on mode 7's warm machine: torch._scaled_mm with 1 × 128 block scales timed against F.linear in bf16
#    at 16, 256 and 512 rows of gate_up and down, ad hoc; BENCHMARKS.md has the figures)
#   Next session, on any card: TESTS_S=150 bash scripts/gpu_round58.sh 8, the opt-in cuBLASLt path's GPU tests, then
#   the FP8 bench at 1 and 32 sequences with it and without
if [ "$M" = 8 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_fp8.py -k "blockwise_scaled_mm or dispatch or replays" > "$OUT/t_fp8.log" 2>&1
  summary
  for gemm in triton cublas; do
    TAIL=12 stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences, BLOCKSPEC_FP8_GEMM=$gemm" env BLOCKSPEC_FP8_GEMM=$gemm \
      timeout ${FP8_S:-170} $B --shape qwen3-8b --accept-len 6.5 --quantization fp8 --concurrency 1,32 --prompt-len 128 \
      --max-tokens 64 --out "$OUT/fp8_qwen3_8b_$gemm.json"
  done
fi
