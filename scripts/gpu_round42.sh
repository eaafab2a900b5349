#!/usr/bin/env bash
# This session's H200 calls (issues 30, 31, 33), each stage under its own timeout, logs and JSON
# under $OUT:
#   bash scripts/gpu_round42.sh 1   # the hybrid cycle under torch's profiler (where its ~4 ms outside
#                                   # the forwards go), FP8 kernels + FP8 vs bf16 steps, adaptive vs
#                                   # fixed vs plain 1…256, HTTP bursts with fresh connections
#   bash scripts/gpu_round42.sh 2   # the FP8 weight-only tiles swept (the tl.dot kernel's and the one-row
#                                   # GEMV's), tests/gpu/test_fp8.py beside the hybrid cycle's torch profile
#   bash scripts/gpu_round42.sh 3   # the sweep's choice in the engine (FP8 vs bf16 steps), tests/gpu/test_fp8.py
#                                   # beside the hybrid's decode cycles profiled, fused vs unfused output norm
#   bash scripts/gpu_round42.sh 4   # the hybrid at 1 with the norm fused up to 8 rows, beside its warm-up and
#                                   # GDN kernel tests (round 42's swapped-operand sweep ran on a kernel since removed)
#   bash scripts/gpu_round42.sh 5   # tests/gpu/test_adaptive_graphs.py + the DFlash graph test (what branch
#                                   # readout-in-graph needs before it can land)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  echo "=== host split + torch profile, hybrid Qwen3.5-4B at 1 ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-200} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --torch-profile \
    > "$OUT/host_split_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_hybrid.txt" | tee -a "$LOG"
  stage "FP8 kernels" timeout ${FP8K_S:-40} python3 scripts/fp8_kernel_bench.py --no-sweep
  stage "FP8 vs bf16, Qwen3-8B" timeout ${FP8_S:-80} $B --shape qwen3-8b --accept-len 6.5 --quantization fp8 \
    --concurrency 1 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256 (closed loop)" timeout ${ADAPT_S:-230} \
    $A --shape qwen3-8b --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  stage "HTTP: demo pair, 3 bursts of 64 x 256 (fresh connections each)" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 2 ]; then
  echo "=== FP8 kernels: the weight-only tiles swept ($(date +%T))" | tee -a "$LOG"
  timeout ${FP8K_S:-150} python3 scripts/fp8_kernel_bench.py --out "$OUT/fp8_sweep.json" > "$OUT/fp8_bench.txt" 2>&1
  grep -v '^{"linear"' "$OUT/fp8_bench.txt" | tail -60 | tee -a "$LOG"
  timeout ${TESTS_S:-220} $T tests/gpu/test_fp8.py > "$OUT/t_fp8.log" 2>&1 &
  echo "=== host split + torch profile, hybrid Qwen3.5-4B at 1 ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-220} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed --torch-profile \
    > "$OUT/host_split_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_hybrid.txt" | tee -a "$LOG"
  wait
  summary
fi
if [ "$M" = 3 ]; then
  stage "FP8 kernels (the one-row GEMV chosen)" timeout ${FP8K_S:-40} python3 scripts/fp8_kernel_bench.py --no-sweep
  stage "FP8 vs bf16, Qwen3-8B" timeout ${FP8_S:-80} $B --shape qwen3-8b --accept-len 6.5 --quantization fp8 \
    --concurrency 1 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  timeout ${TESTS_S:-230} $T tests/gpu/test_fp8.py > "$OUT/t_fp8.log" 2>&1 &
  echo "=== hybrid Qwen3.5-4B at 1: fused vs unfused output norm, decode cycles profiled ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-230} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed,fixed-unfused \
    --torch-profile > "$OUT/host_split_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_hybrid.txt" | tee -a "$LOG"
  wait
  summary
fi
if [ "$M" = 4 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_warm_gpu.py::test_hybrid_compiles_nothing_after_startup \
    tests/gpu/test_gdn_kernel.py > "$OUT/t_hyb.log" 2>&1 &
  stage "hybrid Qwen3.5-4B at 1 (norm fused up to 8 rows)" timeout ${HYB_S:-150} $A --shape qwen3.5-4b --concurrency 1 \
    --out "$OUT/hybrid.json"
  wait
  summary
fi
if [ "$M" = 5 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_adaptive_graphs.py "tests/gpu/test_gpu.py::test_cuda_graphs_equal_eager_for_batches" \
    > "$OUT/t_readout.log" 2>&1 &
  wait
  summary
fi
