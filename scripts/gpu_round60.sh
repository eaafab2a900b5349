#!/usr/bin/env bash
# What rounds 60 and 61 prepared for the device (BENCHMARKS.md, "Round 60"; no call ran in either); every call
# carries .whl. Each stage is a function below; a mode runs them in its order, each under its own timeout
# (LAYOUT_S, TESTS_S, PROF_S, HTTP_S, FP8_S; the defaults per mode as given).
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}

layouts() {          # the block-scale layouts torch._scaled_mm serves (1 x 128 against the weight's 128 x 128)
  TAIL=30 stage "torch._scaled_mm block-scale layouts, Qwen3-8B linears" timeout ${LAYOUT_S:-$1} \
    python3 scripts/scaled_mm_layouts.py --out "$OUT/scaled_mm_layouts.json"
}
fp8_tests() {        # tests/gpu/test_fp8.py: all of it (all), or its cuBLASLt cases, the padded row counts among them
  if [ "$2" = all ]; then
    timeout ${TESTS_S:-$1} $T tests/gpu/test_fp8.py > "$OUT/t_fp8_all.log" 2>&1
  else
    timeout ${TESTS_S:-$1} $T tests/gpu/test_fp8.py -k "blockwise_scaled_mm or dispatch or replays" > "$OUT/t_fp8.log" 2>&1
  fi
  summary
}
profile_512() {      # one 512-row forward (32 sequences' verify) kernel by kernel, bf16 and FP8
  TAIL=60 stage "step profile, Qwen3-8B, 512 rows, bf16 and FP8" timeout ${PROF_S:-$1} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 512 --formats bf16,fp8 --out "$OUT/step_profile_512.json"
}
http_bursts() {      # the demo pair over HTTP, the client's collector held off during a burst and on (HTTP=0: none)
  for gc in $([ "${HTTP:-1}" = 1 ] && echo quiet on); do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, the client's collector $gc" timeout ${HTTP_S:-$1} \
      python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 \
      --bursts 3 --client-gc $gc
  done
}
fp8_bench() {        # FP8 vs bf16, Qwen3-8B, 1 and 32 sequences (issue 33's figures need an H200)
  TAIL=60 stage "FP8 vs bf16, Qwen3-8B, 1 and 32 sequences" timeout ${FP8_S:-$1} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1,32 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
}

case "$M" in
  1) layouts 90; fp8_tests 200 all; profile_512 100; http_bursts 50 ;;   # any card, ~460 s (issue 33, then 30)
  2) fp8_bench 200 ;;                                                      # an H200: issue 33's figures
  3) layouts 60; fp8_tests 90; profile_512 100 ;;                          # any card, ~200 s: mode 1 cut
  # any card, ~480 s (round 61: for a session that may get one call only): the default FP8 path's padded rows
  # (never run on a GPU) first, then FP8 vs bf16, the layouts, the profile
  4) fp8_tests 90; fp8_bench 170; layouts 60; profile_512 100 ;;
  *) echo "gpu_round60.sh: mode 1, 2, 3 or 4" >&2; exit 2 ;;
esac
