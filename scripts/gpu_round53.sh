#!/usr/bin/env bash
# What round 53 ran on the device (BENCHMARKS.md, "Round 53"). Calls 1 and 2 on one warm machine with the demo
# pair's weights left behind (untracked and excluded while they run, as in rounds 51–52), the SmolLM2 GGUF in two
# pieces (gguf_pieces.sh split2):
#   bash scripts/gpu_round53.sh 1   # carry .whl .gguf/p0: the paced policy (policy.Pace) — the adaptive GPU tests,
#        # then adaptive vs fixed vs plain, Qwen3-8B, 1 … 256 sequences
#   bash scripts/gpu_round53.sh 2   # carry .gguf/p1: the real SmolLM2 pair, plain / fixed / adaptive at 1, 16, 64
#        # (5 interleaved rounds, medians), then adaptive step by step at 16 (host phases, the pace's stride)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-170} $T tests/gpu/test_adaptive_graphs.py tests/gpu/test_overlap_gpu.py > "$OUT/t_adaptive.log" 2>&1
  summary
  stage "adaptive (paced) vs fixed vs plain, Qwen3-8B, 1…256, budget 2048" timeout ${ADAPT_S:-380} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 2 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  smollm2_measure /tmp/w53
  stage "SmolLM2 adaptive (paced) step by step at 16" env BLOCKSPEC_BATCH_INVARIANT=1 timeout ${STEPS_S:-110} \
    python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft --device cuda \
    --dtype bfloat16 --concurrency 16 --rounds 3 --max-tokens 128 --out "$OUT/smollm2_steps_c16.json"
fi
# Calls 3 and 4 on one warm machine (the H200's memory for the MoE's bf16 weights), the demo pair's weights left
# behind again, after the confidences became read only at the pace's turns (Speculation.step_observes):
#   bash scripts/gpu_round53.sh 3   # carry .whl .gguf/p0: the hybrid (Qwen3.5-4B) and the MoE (Qwen3.5-35B-A3B) at one sequence, adaptive
#        # (paced) vs fixed vs plain, 256 new
if [ "$M" = 3 ]; then
  stage "the hybrid at 1 sequence, adaptive (paced) vs fixed vs plain, 256 new" timeout ${HYB_S:-170} \
    $C --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    stage "the MoE at 1 sequence, adaptive (paced) vs fixed vs plain, 256 new" timeout ${MOE_S:-260} \
      $C --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
  else echo "the MoE's bf16 weights need more than this card's memory: not run" | tee -a "$LOG"; fi
fi
#   bash scripts/gpu_round53.sh 4   # carry .gguf/p1: the SmolLM2 pair again, then Qwen3-8B at 1, 8, 64, 256
if [ "$M" = 4 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  smollm2_measure /tmp/w53b
  stage "adaptive (paced, confidences at its turns) vs fixed vs plain, Qwen3-8B, 1, 8, 64, 256" timeout ${ADAPT_S:-300} \
    $C --shape qwen3-8b --concurrency 1,8,64,256 --out "$OUT/adaptive_qwen3_8b_b.json"
fi
# Calls 5 (carry .whl .gguf/p0: the MoE where the card holds it, else the wheels and the piece only) and 6 (carry
# .gguf/p1) on one warm machine, after the per-step trims (the kept plan read once, the learning interval kept):
#   bash scripts/gpu_round53.sh 5
#   bash scripts/gpu_round53.sh 6   # the SmolLM2 pair, 9 interleaved rounds; adaptive step by step at 16
if [ "$M" = 5 ] && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
  stage "the MoE at 1 sequence, adaptive (paced) vs fixed vs plain, 256 new" timeout ${MOE_S:-260} \
    $C --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
fi
if [ "$M" = 6 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  SMOL_ROUNDS=9 smollm2_measure /tmp/w53c
  stage "SmolLM2 adaptive (paced, trimmed) step by step at 16" env BLOCKSPEC_BATCH_INVARIANT=1 timeout ${STEPS_S:-110} \
    python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft --device cuda \
    --dtype bfloat16 --concurrency 16 --rounds 3 --max-tokens 128 --out "$OUT/smollm2_steps_c16_b.json"
fi
