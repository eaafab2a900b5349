#!/usr/bin/env bash
# What round 49 ran on the H200 (BENCHMARKS.md, "Round 49 on the H200"), each stage under its own
# timeout, logs under $OUT:
#   bash scripts/gpu_round48.sh 5 / 6   # calls 1-2: adaptive 1…256 with the drafts fitted to the budget; the hybrid's
#        # cold multi-turn (gpu_round48.sh's modes, unchanged)
#   bash scripts/gpu_round49.sh 1   # call 3: where the DFlash cycle's time outside its forwards goes: torch.profiler
#        # timelines of fixed-width cycles (Qwen3-8B at 32 and 64 sequences, the hybrid at 1) and the device's idle
#        # stretches by host phase (scripts/trace_gaps.py), plain's phases beside them
#   bash scripts/gpu_round49.sh 2   # call 4: issue 33's FP8 weight-only sweep (GEMV of 1-16 rows, tl.dot over several
#        # scale blocks, K splits summed in the kernel; scripts/fp8_kernel_bench.py --sweep-only), FP8 vs bf16 in the
#        # engine with the one-row GEMV summing its split in the kernel, the new variants' GPU tests; HTTP bursts
#   bash scripts/gpu_round49.sh 3   # call 5: the sweep's tiles as the defaults: FP8 vs bf16 in the engine, the FP8
#        # kernels' GPU tests at the default tiles (every row count) and in a CUDA graph
#   bash scripts/gpu_round49.sh 4   # not run yet (the next session; carry .whl): all of tests/gpu in one call (four pytest
#        # processes, then the pool test alone) with this round's FP8 tiles and the GDN output norm's kernel
#   bash scripts/gpu_round49.sh 5   # not run yet: the hybrid at one sequence (the gated norm in one kernel: the verify's
#        # 288 torch launches a cycle gone), FP8 vs bf16 at 32 sequences, HTTP bursts again, each burst with prompts
#        # of its own (bench_streams' new default), then with the same prompts (rounds 40-49's form) for burst 2
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  for c in 32 64; do
    echo "=== host split + timeline, Qwen3-8B, $c sequences ($(date +%T))" | tee -a "$LOG"
    timeout ${HS_S:-150} python3 scripts/host_split.py --shape qwen3-8b --concurrency $c --modes fixed,plain \
      --torch-profile --trace "$OUT/trace_$c.json" > "$OUT/host_split_$c.txt" 2>&1
    grep '^{' "$OUT/host_split_$c.txt" | tee -a "$LOG"
    python3 scripts/trace_gaps.py "$OUT/trace_$c.json" 2>&1 | head -30 | tee -a "$LOG"
    gzip -f "$OUT/trace_$c.json"
  done
  echo "=== host split + timeline, Qwen3.5-4B, 1 sequence ($(date +%T))" | tee -a "$LOG"
  timeout ${HS_S:-150} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed,plain \
    --torch-profile --trace "$OUT/trace_hybrid_1.json" > "$OUT/host_split_hybrid_1.txt" 2>&1
  grep '^{' "$OUT/host_split_hybrid_1.txt" | tee -a "$LOG"
  python3 scripts/trace_gaps.py "$OUT/trace_hybrid_1.json" 2>&1 | head -30 | tee -a "$LOG"
  gzip -f "$OUT/trace_hybrid_1.json"
fi
if [ "$M" = 2 ]; then
  echo "=== FP8 weight-only sweep ($(date +%T))" | tee -a "$LOG"
  timeout ${SWEEP_S:-170} python3 scripts/fp8_kernel_bench.py --sweep-only --sweep-budget ${SWEEP_BUDGET:-120} \
    --out "$OUT/fp8_sweep.json" > "$OUT/fp8_sweep.txt" 2>&1
  grep -v '^{"linear"' "$OUT/fp8_sweep.txt" | tail -80 | tee -a "$LOG"
  stage "FP8 vs bf16, Qwen3-8B, 1 sequence" timeout ${FP8_S:-90} $B --shape qwen3-8b --accept-len 6.5 --quantization fp8 \
    --concurrency 1 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  timeout ${TESTS_S:-150} $T tests/gpu/test_fp8.py -k "variants or split_sums" > "$OUT/t_fp8_variants.log" 2>&1
  summary
  [ -n "$SKIP_HTTP" ] || stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 3 ]; then
  stage "FP8 vs bf16, Qwen3-8B, 1 sequence" timeout ${FP8_S:-90} $B --shape qwen3-8b --accept-len 6.5 --quantization fp8 \
    --concurrency 1 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  timeout ${TESTS_S:-130} $T tests/gpu/test_fp8.py -k "equals_the_reference or dispatch or replays or split" \
    > "$OUT/t_fp8_defaults.log" 2>&1
  summary
fi
if [ "$M" = 4 ]; then           # round 45's call 6, the same four processes and the pool test alone
  TESTS_S=${TESTS_S:-420} bash "$(dirname "$0")/gpu_round45.sh" 6
fi
if [ "$M" = 5 ]; then
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-150} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3.5-4b \
    --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences" timeout ${FP8_S:-150} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1,32 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  for prompts in fresh same; do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, $prompts prompts" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
      --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3 --burst-prompts $prompts
  done
fi
