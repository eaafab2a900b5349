#!/usr/bin/env bash
# What round 51 ran on the device (BENCHMARKS.md, "Round 51"): two calls on one warm machine. The
# demo pair's weights stay behind (untracked and excluded while the calls run: a 14.5 MB tree), so
# the SmolLM2 GGUF travels in two pieces (scripts/gguf_pieces.sh split2, here, first):
#   bash scripts/gpu_round51.sh 1   # carry .whl .gguf/p0: the early-draft and adaptive GPU tests (adaptive widths
#        # with arrivals among them), adaptive vs fixed vs plain at 1 … 256 (Qwen3-8B, budget 2,048): round 50's
#        # review mends, plans kept after an end or a lowered cap, early blocks serving narrower plans, plain
#        # steps without a margin
#   bash scripts/gpu_round51.sh 2   # carry .gguf/p1: the GGUF joined; the real SmolLM2 pair (its shipped draft):
#        # held-out acceptance, plain / fixed / adaptive tok/s at 1, 16, 64 requests (5 interleaved rounds,
#        # medians); then the hybrid (Qwen3.5-4B) at one sequence, adaptive vs fixed vs plain
#   bash scripts/gpu_round51.sh 3   # (not run in round 51) the MoE at one sequence; adaptive at 8 twice more; the
#        # host split at 8 (how each step's widths were planned, the early rows drafted and taken)
#   bash scripts/gpu_round51.sh 4   # (not run in round 51) the opt-in depth correction weighed: adaptive vs fixed vs
#        # plain at 1 … 256 with BLOCKSPEC_ADAPTIVE_DEPTH=1 (call 1 is the same without it)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-120} $T tests/gpu/test_overlap_gpu.py tests/gpu/test_adaptive_graphs.py > "$OUT/t_early.log" 2>&1
  summary
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048" timeout ${ADAPT_S:-290} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 2 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  smollm2_measure /tmp/w51
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-130} \
    $C --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
fi
if [ "$M" = 3 ]; then
  stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-200} \
    $C --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
  for run in 2 3; do
    stage "adaptive vs fixed vs plain, Qwen3-8B, 8 sequences, run $run" timeout ${ADAPT8_S:-90} \
      $C --shape qwen3-8b --concurrency 8 --out "$OUT/adaptive8_run$run.json"
  done
  stage "host split, Qwen3-8B, 8 sequences, fixed and adaptive" timeout ${HS_S:-150} python3 scripts/host_split.py \
    --shape qwen3-8b --concurrency 8 --modes fixed,adaptive
fi
if [ "$M" = 4 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, BLOCKSPEC_ADAPTIVE_DEPTH=1" \
    env BLOCKSPEC_ADAPTIVE_DEPTH=1 timeout ${ADAPT_S:-290} $B --compare-speculation --accept-profile latent:6.5 \
    --prompt-len 128 --max-tokens 256 --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_depth.json"
fi
