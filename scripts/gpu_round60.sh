#!/usr/bin/env bash
# What round 60 ran on the device (BENCHMARKS.md, "Round 60"); every call carried .whl.
#   bash scripts/gpu_round60.sh 1   # any card (issue 33, then 30): the block-scale layouts torch._scaled_mm serves
#        # (1 x 128 against 128 x 128 for the weight, at row counts off 16 too); all of tests/gpu/test_fp8.py (the
#        # padded rows of cuBLASLt); one 512-row forward (32 sequences' verify) kernel by kernel, bf16 and FP8;
#        # HTTP bursts with the client's collector held off during a burst and on (round 59's mode 3 and more)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  TAIL=30 stage "torch._scaled_mm block-scale layouts, Qwen3-8B linears" timeout ${LAYOUT_S:-90} \
    python3 scripts/scaled_mm_layouts.py --out "$OUT/scaled_mm_layouts.json"
  timeout ${TESTS_S:-200} $T tests/gpu/test_fp8.py > "$OUT/t_fp8_all.log" 2>&1
  summary
  TAIL=60 stage "step profile, Qwen3-8B, 512 rows, bf16 and FP8" timeout ${PROF_S:-100} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 512 --formats bf16,fp8 --out "$OUT/step_profile_512.json"
  for gc in $([ "${HTTP:-1}" = 1 ] && echo quiet on); do   # HTTP=0: without them
    stage "HTTP: demo pair, 3 bursts of 64 x 256, the client's collector $gc" timeout ${HTTP_S:-50} \
      python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 \
      --bursts 3 --client-gc $gc
  done
fi
#   bash scripts/gpu_round60.sh 2   # an H200 (issue 33's figures): FP8 vs bf16, Qwen3-8B, 1 and 32 sequences
if [ "$M" = 2 ]; then
  TAIL=60 stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences" timeout ${FP8_S:-200} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1,32 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
fi
#   bash scripts/gpu_round60.sh 3   # any card, mode 1 cut to what the budget's end held: the layouts, the cuBLASLt
#        # cases of tests/gpu/test_fp8.py (the padded row counts among them), the 512-row profile
if [ "$M" = 3 ]; then
  TAIL=30 stage "torch._scaled_mm block-scale layouts, Qwen3-8B linears" timeout ${LAYOUT_S:-60} \
    python3 scripts/scaled_mm_layouts.py --out "$OUT/scaled_mm_layouts.json"
  timeout ${TESTS_S:-90} $T tests/gpu/test_fp8.py -k "blockwise_scaled_mm or dispatch or replays" > "$OUT/t_fp8.log" 2>&1
  summary
  TAIL=60 stage "step profile, Qwen3-8B, 512 rows, bf16 and FP8" timeout ${PROF_S:-100} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 512 --formats bf16,fp8 --out "$OUT/step_profile_512.json"
fi
#   bash scripts/gpu_round60.sh 4   # any card, ~480 s (round 61: for a session that may get one call only): the cuBLASLt
#        # cases of tests/gpu/test_fp8.py first (the default FP8 path's padded rows, never run on a GPU), FP8 vs bf16 at
#        # 1 and 32 sequences (issue 33; its acceptance figures need an H200), the layouts, the 512-row profile
if [ "$M" = 4 ]; then
  timeout ${TESTS_S:-90} $T tests/gpu/test_fp8.py -k "blockwise_scaled_mm or dispatch or replays" > "$OUT/t_fp8.log" 2>&1
  summary
  TAIL=60 stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences" timeout ${FP8_S:-170} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1,32 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
  TAIL=30 stage "torch._scaled_mm block-scale layouts, Qwen3-8B linears" timeout ${LAYOUT_S:-60} \
    python3 scripts/scaled_mm_layouts.py --out "$OUT/scaled_mm_layouts.json"
  TAIL=60 stage "step profile, Qwen3-8B, 512 rows, bf16 and FP8" timeout ${PROF_S:-100} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 512 --formats bf16,fp8 --out "$OUT/step_profile_512.json"
fi
