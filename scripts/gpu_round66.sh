#!/usr/bin/env bash
# What round 66 runs on the device (BENCHMARKS.md, "Round 66"); every call carries .whl (the first) or runs on the
# warm machine that installed it, and each may carry one piece of the SmolLM2 GGUF (.gguf/pN, kept in /tmp).
#   bash scripts/gpu_round66.sh 1   # an H200 (issues 31, 33): Qwen3-8B adaptive vs fixed vs plain at 1 … 256; FP8 vs
#        # bf16 for every mode at 1 and 32 (--compare-speculation --quantization fp8); the MoE's plain step kernel by
#        # kernel, bf16 and FP8 (scripts/engine_step_profile.py); the MoE in FP8 beside bf16 at one sequence
#   bash scripts/gpu_round66.sh 2   # an H200 (issue 31): the hybrid and the MoE at one sequence (gpu_round54.sh 1); the
#        # 16k prompt among 32 decoders at budgets 2,048 and 512 with adaptive beside fixed; the demo pair's HTTP bursts
#   bash scripts/gpu_round66.sh 3   # any card (issue 30): every file of tests/gpu in 8 workers, then measures_memory alone
#   bash scripts/gpu_round66.sh 4   # the last GGUF piece: the real SmolLM2 pair (issue 31's item on the H200)
#   bash scripts/gpu_round66.sh 5   # an H100 (what it can say): FP8 vs bf16 for every mode at 1 and 32, the 16k bursts
#        # with adaptive, the MoE's FP8 step kernel by kernel
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
burst16k() {   # burst16k BUDGET: plain, fixed (forced 6.5) and adaptive (latent 6.5)
  stage "16k prompt during 32 decoders, budget $1, fixed and adaptive" timeout ${BURST_S:-120} $B --shape qwen3-8b \
    --accept-len 6.5 --accept-profile latent:6.5 --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 \
    --max-num-batched-tokens $1 --out "$OUT/burst16k_$1.json"
}
fp8modes() {
  TAIL=30 stage "FP8 vs bf16, Qwen3-8B, every mode at 1 and 32" timeout ${FP8_S:-200} $C --shape qwen3-8b \
    --concurrency 1,32 --quantization fp8 --out "$OUT/fp8_modes_qwen3_8b.json"
}
if [ "$M" = 1 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256" timeout ${ADAPT_S:-200} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
  fp8modes
  TAIL=70 stage "the MoE's plain step, kernel by kernel, bf16 and FP8" timeout ${PROF_S:-150} \
    python3 scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats bf16,fp8 --out "$OUT/moe_step_profile.json"
fi
if [ "$M" = 2 ]; then
  bash "$(dirname "$0")/gpu_round54.sh" 1
  burst16k 2048
  burst16k 512
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-80} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 3 ]; then
  timeout ${TESTS_S:-420} $T -n ${XDIST:-8} --dist load tests/gpu \
    -m "not measures_memory" > "$OUT/t_all.log" 2>&1
  timeout ${POOL_S:-90} $T tests/gpu -m measures_memory > "$OUT/t_pool.log" 2>&1
  summary
fi
if [ "$M" = 4 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  SMOL_ROUNDS=${SMOL_ROUNDS:-5} smollm2_measure /tmp/w66
fi
if [ "$M" = 5 ]; then
  fp8modes
  burst16k 512
  TAIL=40 stage "the MoE's plain step in FP8, kernel by kernel" timeout ${PROF_S:-200} \
    python3 scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats fp8 --out "$OUT/moe_step_profile.json"
fi
#   bash scripts/gpu_round66.sh 6   # any card (issue 33): the FP8 shared expert in the experts' last slot
#        # (BLOCKSPEC_FP8_SHARED_SLOT=1): its GPU test, then the MoE's FP8 plain step with it off and on
if [ "$M" = 6 ]; then
  BLOCKSPEC_FP8_SHARED_SLOT=1 timeout ${TESTS_S:-120} $T tests/gpu/test_fp8.py -k "fp8_experts_equal or decode_on_the_gpu" \
    > "$OUT/t_fp8_shared.log" 2>&1
  summary
  TAIL=60 stage "the MoE's FP8 plain step, shared expert on its own and in the last slot" timeout ${PROF_S:-240} \
    python3 scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats fp8 --shared-slot 0,1 \
    --out "$OUT/moe_step_profile_shared_slot.json"
fi
