#!/usr/bin/env bash
# What round 68 leaves for the device (BENCHMARKS.md, "Round 68 → Next on the device"): calls on one warm
# machine, each carrying the whole tree (the first also .whl), naming nvidia-h200 (issues 31 and 33 want the
# H200's figures; an H100's check the same code).
#   bash scripts/gpu_round68.sh 1   # carry .whl (issue 33): the two FP8 Qwen3.5-MoE decode cases round 68's
#        # call did not reach (the bf16 tail now on by default, and off); the MoE kernel tests with the split
#        # K's; the FP8 experts at 1, 4 and 16 tokens unsplit and in 2, 4, 8 parts; the MoE's FP8 plain step
#        # with the split off and in 4 parts (engine_step_profile.py --split-k 1,4)
#   bash scripts/gpu_round67.sh 4   # issue 31: Qwen3-8B adaptive vs fixed vs plain at 1 … 256
#   bash scripts/gpu_round67.sh 3   # issues 30, 31, 33: the hybrid and the MoE at one sequence, FP8 for every
#        # mode at 1 and 32, the 16k prompt among 32 decoders, HTTP bursts
# The SmolLM2 half of gpu_round67.sh 2 (the GGUF in two pieces) and issue 32's training run
# (smollm2_device_run.sh, ~1,650 s) wait for a session whose device time allows them.
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-150} $T -vv -n 2 --dist loadfile tests/gpu/test_fp8.py -k "decode_on_the_gpu and qwen3_5_moe" \
    > "$OUT/t_fp8_hybrid_decode.log" 2>&1
  timeout ${TESTS_S2:-120} $T -vv tests/gpu/test_moe_kernel.py -k "split_k or arrivals" > "$OUT/t_moe_split.log" 2>&1
  for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$f" | tail -30; done | tee -a "$LOG"
  TAIL=40 stage "the FP8 experts at 1, 4, 16 tokens, K unsplit and in parts" timeout ${SWEEP_S:-90} \
    python3 scripts/moe_kernel_bench.py --fp8 --split-k 2,4,8 --shapes qwen3.5-35b-a3b --tokens 1,4,16 \
    --out "$OUT/moe_fp8_split.json"
  TAIL=60 stage "the MoE's FP8 plain step, K unsplit and in 4 parts" timeout ${PROF_S:-200} \
    python3 scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats fp8 --split-k 1,4 \
    --out "$OUT/moe_step_profile_split.json"
fi
