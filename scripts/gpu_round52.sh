#!/usr/bin/env bash
# What round 52 ran on the device (BENCHMARKS.md, "Round 52"), carry .whl:
#   bash scripts/gpu_round52.sh 1   # issue 31's 0.3 ms a step at 8 sequences: the host split of fixed and adaptive
#        # side by side (Qwen3-8B, latent 6.5), each under torch.profiler (the device's kernels outside the graphs,
#        # the host's ops), then adaptive vs fixed vs plain at 8 with the opt-in depth correction
#   bash scripts/gpu_round52.sh 2   # the draft's one-pass readout (kernels/readout.py): its GPU tests with the adaptive
#        # and early-draft ones, its cost against torch's, adaptive vs fixed vs plain at 1 … 256
# Calls 3 and 4 run on one warm machine with the demo pair's weights left behind (untracked and excluded while
# they run, as round 51's calls 1 and 2: a 14.5 MB tree), the SmolLM2 GGUF in two pieces (gguf_pieces.sh split2):
#   bash scripts/gpu_round52.sh 3   # carry .whl .gguf/p0: the hybrid (Qwen3.5-4B) and the MoE (Qwen3.5-35B-A3B) at one
#        # sequence, adaptive vs fixed vs plain, with the one-pass readout
#   bash scripts/gpu_round52.sh 4   # carry .gguf/p1: the real SmolLM2 pair (its shipped draft): plain / fixed / adaptive
#        # tok/s at 1, 16, 64 requests (5 interleaved rounds, medians), held-out acceptance
# Calls 5 and 6 likewise (a fresh machine: the pieces again):
#   bash scripts/gpu_round52.sh 5   # carry .whl .gguf/p0: the wheels installed and the piece kept, nothing else
#   bash scripts/gpu_round52.sh 6   # carry .gguf/p1: where adaptive loses on the SmolLM2 pair, step by step
#        # (scripts/adaptive_steps.py: fixed and adaptive side by side, host phases, each adaptive step's widths,
#        # predicted against realised tokens and ms) at 1, 16 and 64 requests
# Calls 7 and 8 likewise, with the measured choice between the policy and whole blocks (BLOCKSPEC_ADAPTIVE_ARMS=1):
#   bash scripts/gpu_round52.sh 7   # carry .whl .gguf/p0: the wheels installed and the piece kept
#   bash scripts/gpu_round52.sh 8   # carry .gguf/p1: SmolLM2 fixed vs adaptive step by step at 16 and 32 requests,
#        # then Qwen3-8B adaptive vs fixed vs plain at 1, 8, 64, 256 sequences, both with the arms measured
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
if [ "$M" = 1 ]; then
  stage "host split, Qwen3-8B, 8 sequences, fixed and adaptive, torch profiles" timeout ${HS_S:-240} \
    sh -c "python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 --modes fixed,adaptive --torch-profile \
      --torch-profile-modes fixed,adaptive > $OUT/host_split8.txt 2>&1; grep '^{' $OUT/host_split8.txt"
  stage "adaptive vs fixed vs plain, Qwen3-8B, 8 sequences, BLOCKSPEC_ADAPTIVE_DEPTH=1" env BLOCKSPEC_ADAPTIVE_DEPTH=1 \
    timeout ${ADAPT8_S:-100} $C --shape qwen3-8b --concurrency 8 --out "$OUT/adaptive8_depth.json"
fi
if [ "$M" = 2 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_readout_gpu.py tests/gpu/test_adaptive_graphs.py tests/gpu/test_overlap_gpu.py \
    > "$OUT/t_readout.log" 2>&1
  summary
  stage "the draft readout: torch vs the one-pass kernel" timeout 60 python3 scripts/readout_bench.py
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, the one-pass readout" timeout ${ADAPT_S:-300} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 3 ]; then
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-150} \
    $C --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-200} \
    $C --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
fi
if [ "$M" = 4 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  smollm2_measure /tmp/w52
fi
if [ "$M" = 6 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  for c in 16 64 1; do
    stage "SmolLM2 adaptive step by step at $c" env BLOCKSPEC_BATCH_INVARIANT=1 timeout ${STEPS_S:-120} \
      python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft --device cuda \
      --dtype bfloat16 --concurrency $c --rounds 3 --max-tokens 128 --out "$OUT/smollm2_steps_c$c.json"
  done
fi
if [ "$M" = 8 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  for c in 16 32; do
    stage "SmolLM2 adaptive (measured arms) step by step at $c" env BLOCKSPEC_BATCH_INVARIANT=1 BLOCKSPEC_ADAPTIVE_ARMS=1 \
      timeout ${STEPS_S:-100} python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft \
      --device cuda --dtype bfloat16 --concurrency $c --rounds 3 --max-tokens 128 --out "$OUT/smollm2_arms_c$c.json"
  done
  stage "adaptive (measured arms) vs fixed vs plain, Qwen3-8B, 1, 8, 64, 256" env BLOCKSPEC_ADAPTIVE_ARMS=1 \
    timeout ${ADAPT_S:-240} $C --shape qwen3-8b --concurrency 1,8,64,256 --out "$OUT/adaptive_arms_qwen3_8b.json"
fi
