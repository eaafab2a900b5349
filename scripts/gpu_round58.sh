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
