#!/usr/bin/env bash
# What round 59 ran on the device (BENCHMARKS.md, "Round 59"); every call carried .whl.
#   bash scripts/gpu_round59.sh 1   # any card (issue 33): the opt-in cuBLASLt FP8 path's GPU tests, then the FP8
#        # bench at 1 and 32 sequences with BLOCKSPEC_FP8_GEMM=triton and =cublas (round 58's mode 8)
#   bash scripts/gpu_round59.sh 3   # any card (issue 33), after cuBLASLt became the default (rows padded to 16):
#        # all of tests/gpu/test_fp8.py; HTTP bursts with the client's collector held off during a burst and on; one forward of 512 rows (32 sequences' verify) kernel by kernel, bf16 and FP8
#   bash scripts/gpu_round59.sh 2   # any card (issue 30): HTTP bursts with uvicorn on uvloop + httptools (the default
#        # now) and on asyncio + h11 (BLOCKSPEC_UVICORN=plain), alternated, twice; then one asyncio client
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  bash "$(dirname "$0")/gpu_round58.sh" 8
fi
if [ "$M" = 2 ]; then
  for run in 1 2; do
    for impl in auto plain; do
      stage "HTTP: demo pair, 3 bursts of 64 x 256, uvicorn $impl, run $run" env BLOCKSPEC_UVICORN=$impl \
        timeout ${HTTP_S:-70} python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" \
        --requests 64 --max-tokens 256 --bursts 3
    done
  done
  stage "HTTP: demo pair, 3 bursts of 64 x 256, uvicorn auto, one asyncio client" timeout ${HTTP_S:-70} \
    python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 \
    --bursts 3 --burst-client async
fi
if [ "$M" = 3 ]; then
  timeout ${TESTS_S:-300} $T tests/gpu/test_fp8.py > "$OUT/t_fp8_all.log" 2>&1
  summary
  for gc in quiet on; do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, the client's collector $gc" timeout ${HTTP_S:-60} \
      python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 \
      --bursts 3 --client-gc $gc
  done
  TAIL=60 stage "step profile, Qwen3-8B, 512 rows, bf16 and FP8" timeout ${PROF_S:-120} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 512 --formats bf16,fp8 --out "$OUT/step_profile_512.json"
fi
#   bash scripts/gpu_round59.sh 4   # any card, mode 3 cut to what the budget's end held: the cuBLASLt cases of
#        # tests/gpu/test_fp8.py (the padded row counts among them), then one HTTP run with the client's collector quiet
if [ "$M" = 4 ]; then
  timeout ${TESTS_S:-120} $T tests/gpu/test_fp8.py -k "blockwise_scaled_mm or dispatch or replays" > "$OUT/t_fp8.log" 2>&1
  summary
  stage "HTTP: demo pair, 3 bursts of 64 x 256, the client's collector quiet" timeout ${HTTP_S:-55} \
    python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 \
    --bursts 3 --client-gc quiet
fi
