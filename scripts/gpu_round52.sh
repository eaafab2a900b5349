#!/usr/bin/env bash
# What round 52 ran on the device (BENCHMARKS.md, "Round 52"), carry .whl:
#   bash scripts/gpu_round52.sh 1   # issue 31's 0.3 ms a step at 8 sequences: the host split of fixed and adaptive
#        # side by side (Qwen3-8B, latent 6.5), each under torch.profiler (the device's kernels outside the graphs,
#        # the host's ops), then adaptive vs fixed vs plain at 8 with the opt-in depth correction
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  stage "host split, Qwen3-8B, 8 sequences, fixed and adaptive, torch profiles" timeout ${HS_S:-240} \
    sh -c "python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 --modes fixed,adaptive --torch-profile \
      --torch-profile-modes fixed,adaptive > $OUT/host_split8.txt 2>&1; grep '^{' $OUT/host_split8.txt"
  stage "adaptive vs fixed vs plain, Qwen3-8B, 8 sequences, BLOCKSPEC_ADAPTIVE_DEPTH=1" env BLOCKSPEC_ADAPTIVE_DEPTH=1 \
    timeout ${ADAPT8_S:-100} $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 \
    --shape qwen3-8b --concurrency 8 --out "$OUT/adaptive8_depth.json"
fi
