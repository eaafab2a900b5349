#!/usr/bin/env bash
# Round 40's H200 calls (issues 30, 31, 33), after round 39's first call (scripts/gpu_round39.sh 1):
#   bash scripts/gpu_round40.sh 1   # the two GPU tests that call found broken, the host's share of a
#                                   # cycle fixed vs adaptive, HTTP bursts, the hybrid cycle, 16k among 32
#   bash scripts/gpu_round40.sh 3   # what call 1 left unfinished: the kernel and FP8-hybrid tests, the host
#                                   # split written whole, the hybrid cycle given its model build's minute
#   bash scripts/gpu_round40.sh 4   # after the fixes: the hybrid warm-up test, the host split with widths
#                                   # planned ahead, a cold multi-turn, 16k among 32 at budget 512
#   bash scripts/gpu_round40.sh 5   # after the scheduler's and the startup's fixes: 16k among 32 at
#                                   # budget 512, HTTP bursts
. "$(dirname "$0")/gpu_prelude.sh"
if [ "${1:-1}" = 1 ]; then
  S=${TESTS_S:-130}
  timeout $S $T tests/gpu/test_warm_gpu.py > "$OUT/t_warm.log" 2>&1 &
  timeout $S $T tests/gpu/test_fp8.py -k "decode_on_the_gpu" > "$OUT/t_fp8.log" 2>&1 &
  wait
  summary
  stage "host share of a cycle, fixed vs adaptive, Qwen3-8B at 1, 8, 32" timeout ${SPLIT_S:-110} \
    python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 1 32 --profile
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-80} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
  stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-80} $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-70} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
elif [ "$1" = 3 ]; then
  S=${TESTS_S:-200}
  timeout $S $T tests/gpu/test_warm_gpu.py -k hybrid > "$OUT/t_warm.log" 2>&1 &
  timeout $S $T tests/gpu/test_fp8.py -k "decode_on_the_gpu and qwen3_5_moe" > "$OUT/t_fp8.log" 2>&1 &
  timeout $S $T tests/gpu/test_gdn_kernel.py tests/gpu/test_fused_kernels.py > "$OUT/t_f.log" 2>&1 &
  timeout $S $T tests/gpu/test_moe_kernel.py tests/gpu/test_attention_kernels.py > "$OUT/t_g.log" 2>&1 &
  wait
  summary
  echo "=== host split ($(date +%T))" | tee -a "$LOG"
  timeout ${SPLIT_S:-110} python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 1 32 --profile \
    > "$OUT/host_split.txt" 2>&1; grep '^{' "$OUT/host_split.txt" | tee -a "$LOG"
  stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-200} $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
elif [ "$1" = 4 ]; then
  timeout ${TESTS_S:-90} $T tests/gpu/test_warm_gpu.py -k hybrid > "$OUT/t_warm.log" 2>&1
  summary
  echo "=== host split, widths planned ahead ($(date +%T))" | tee -a "$LOG"
  timeout ${SPLIT_S:-100} python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 1 32 \
    > "$OUT/host_split.txt" 2>&1; grep '^{' "$OUT/host_split.txt" | tee -a "$LOG"
  stage "multi-turn Qwen3.5-4B 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-130} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn.json"
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-150} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
elif [ "$1" = 5 ]; then
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-50} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-40} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
