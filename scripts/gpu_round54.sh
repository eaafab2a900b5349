#!/usr/bin/env bash
# What round 54 ran on the device (BENCHMARKS.md, "Round 54"):
#   bash scripts/gpu_round54.sh 1   # carry .whl; an H200 (the MoE's bf16 weights): the hybrid (Qwen3.5-4B) and the
#        # MoE (Qwen3.5-35B-A3B) at one sequence, adaptive vs fixed vs plain, 256 new, after the cost table's verify
#        # probes route their rows apart (ModelRunner.idle_forward); the JSON keeps the table and the fit
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-170} \
    $C --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-300} \
      $C --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
  else echo "the MoE's bf16 weights need more than this card's memory: not run" | tee -a "$LOG"; fi
fi
