#!/usr/bin/env bash
# What round 47 ran on the H200 (BENCHMARKS.md, "Round 47 on the H200"), calls back to back on one
# warm machine, each stage under its own timeout, logs under $OUT:
#   bash scripts/gpu_round47.sh 1   # carry .whl: where the hybrid's 64-token prefill after a cached 16k
#        # prefix spends its time (scripts/prefill_profile.py) beside the dense Qwen3-8B's; the host's split
#        # of a fixed and an adaptive cycle at 1, 8 and 128 sequences (scripts/host_split.py)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  bash "$(dirname "$0")/gpu_round46.sh" 4            # round 46's mode 4, written then and first run here
  echo "=== host split, Qwen3-8B, 1, 8, 128 sequences ($(date +%T))" | tee -a "$LOG"
  timeout ${HS_S:-240} python3 scripts/host_split.py --shape qwen3-8b --concurrency 1 8 128 --modes fixed,adaptive \
    --profile > "$OUT/host_split_qwen3_8b.txt" 2>&1; tail -5 "$OUT/host_split_qwen3_8b.txt" | tee -a "$LOG"
fi
#   bash scripts/gpu_round47.sh 2   # the hybrid's short prefill on the GDN step kernel against the chunked form
#        # (one process); a 512-token chunk after a cached 15k prefix (Qwen3-8B, the chunk step alone); the GDN,
#        # warm-up and ragged-graph GPU tests; the hybrid's cold multi-turn (a fresh process, empty Triton cache)
if [ "$M" = 2 ]; then
  echo "=== hybrid short prefill: step kernel vs chunked ($(date +%T))" | tee -a "$LOG"
  timeout ${PP_S:-200} python3 scripts/prefill_profile.py --shape qwen3.5-4b --prefix 16000 --tokens 64,128,256 --repeats 2 --compare-chunked \
    > "$OUT/prefill_kernel_qwen3.5-4b.txt" 2>&1; grep "turn\|profiled\|ready" "$OUT/prefill_kernel_qwen3.5-4b.txt" | tee -a "$LOG"
  echo "=== a 512-token chunk after 15k cached, Qwen3-8B ($(date +%T))" | tee -a "$LOG"
  timeout ${PP_S:-120} python3 scripts/prefill_profile.py --shape qwen3-8b --prefix 15360 --tokens 512 --budget 512 \
    --repeats 2 > "$OUT/chunk512_qwen3-8b.txt" 2>&1; grep "turn\|profiled\|ready" "$OUT/chunk512_qwen3-8b.txt" | tee -a "$LOG"
  timeout ${TESTS_S:-200} $T tests/gpu/test_gdn_kernel.py tests/gpu/test_warm_gpu.py tests/gpu/test_ragged_graphs.py \
    > "$OUT/t_gdn.log" 2>&1
  summary
  rm -rf /tmp/triton-cold
  stage "multi-turn qwen3.5-4b 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-170} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn_qwen3.5-4b.json"
fi
#   bash scripts/gpu_round47.sh 3   # the attention kernel's tiles on long prefill chunks (scripts/attention_tile_sweep.py);
#        # the GDN and warm-up GPU tests with SHORT_PREFILL_ROWS = 256
if [ "$M" = 3 ]; then
  stage "attention tiles, long prefill chunks" timeout ${SW_S:-200} python3 scripts/attention_tile_sweep.py \
    --out "$OUT/attention_tile_sweep.json"
  timeout ${TESTS_S:-230} $T tests/gpu/test_gdn_kernel.py tests/gpu/test_warm_gpu.py > "$OUT/t_gdn.log" 2>&1
  summary
fi
