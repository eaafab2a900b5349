#!/usr/bin/env bash
# What round 67 runs on the device (BENCHMARKS.md, "Round 67"), three calls on one warm machine (an H200 where one
# comes: issue 31 and 33's figures are the H200's). Calls 1 and 2 leave the demo pair's weights and the shipped
# SmolLM2 draft behind (untracked and excluded while they run: a 7.5 MB tree), so the SmolLM2 GGUF travels in two
# pieces (scripts/gguf_pieces.sh split2); call 3 carries the whole tree.
#   bash scripts/gpu_round67.sh 1   # carry .whl .gguf/p0 (issue 33): the MoE kernels' GPU tests, the arrivals among
#        # them (BLOCKSPEC_MOE_ARRIVALS: routing + alignment in one launch, the slot sum in the down GEMM's), the MoE
#        # fixtures' decode with them on and the FP8 GDN in_proj's bf16 rows in its FP8 launch (BLOCKSPEC_FP8_BF16_TAIL);
#        # the MoE's FP8 plain step with each off and on (engine_step_profile.py --arrivals 0,1 --tail 0,1); the FP8
#        # experts' tile sweep at 1 and 16 tokens (moe_kernel_bench.py --fp8 --sweep)
#   bash scripts/gpu_round67.sh 2   # carry .gguf/p1 (issue 31): the GGUF joined; the real SmolLM2 pair, plain / fixed
#        # / adaptive at 1, 16, 64 (9 interleaved rounds, medians); Qwen3-8B adaptive vs fixed vs plain at 1 … 256
#   bash scripts/gpu_round67.sh 4   # the whole tree: call 2's Qwen3-8B half alone (round 68: calls 1, 3, 4 on the whole
#        # tree with .whl where starts are scarce; the SmolLM2 half waits for a session with device time to spare)
#   bash scripts/gpu_round67.sh 3   # the whole tree (issues 30, 31, 33): the hybrid and the MoE at one sequence
#        # (gpu_round54.sh 1); FP8 vs bf16 for every mode at 1 and 32; the 16k prompt among 32 decoders at budgets
#        # 2,048 and 512; the demo pair's HTTP bursts
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-100} $T tests/gpu/test_moe_kernel.py > "$OUT/t_moe_kernel.log" 2>&1
  BLOCKSPEC_MOE_ARRIVALS=1 BLOCKSPEC_FP8_BF16_TAIL=1 timeout ${TESTS_S2:-150} $T -n 4 --dist loadfile \
    tests/gpu/test_moe_gpu.py tests/gpu/test_fp8.py -k "moe or expert or tail or decode_on_the_gpu" \
    > "$OUT/t_moe_arrivals_tail.log" 2>&1
  summary
  TAIL=100 stage "the MoE's FP8 plain step, arrivals and the bf16 tail off and on" timeout ${PROF_S:-240} \
    python3 scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats fp8 --arrivals 0,1 --tail 0,1 \
    --out "$OUT/moe_step_profile_arrivals_tail.json"
  TAIL=40 stage "the FP8 experts' tiles at 1 and 16 tokens" timeout ${SWEEP_S:-90} \
    python3 scripts/moe_kernel_bench.py --fp8 --sweep --shapes qwen3.5-35b-a3b --tokens 1,16 --out "$OUT/moe_fp8_sweep.json"
fi
if [ "$M" = 2 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  SMOL_ROUNDS=${SMOL_ROUNDS:-9} SMOL_S=${SMOL_S:-300} smollm2_measure /tmp/w67
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256" timeout ${ADAPT_S:-220} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 4 ]; then   # call 2's Qwen3-8B half alone, on the whole tree (no GGUF pieces: a session whose starts cost)
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256" timeout ${ADAPT_S:-220} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 3 ]; then
  bash "$(dirname "$0")/gpu_round54.sh" 1
  TAIL=30 stage "FP8 vs bf16, Qwen3-8B, every mode at 1 and 32" timeout ${FP8_S:-150} $C --shape qwen3-8b \
    --concurrency 1,32 --quantization fp8 --out "$OUT/fp8_modes_qwen3_8b.json"
  for budget in 2048 512; do
    stage "16k prompt during 32 decoders, budget $budget, fixed and adaptive" timeout ${BURST_S:-90} $B \
      --shape qwen3-8b --accept-len 6.5 --accept-profile latent:6.5 --burst 1 --burst-decoding 32 --prompt-len 16384 \
      --max-tokens 64 --max-num-batched-tokens $budget --out "$OUT/burst16k_$budget.json"
  done
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-80} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
