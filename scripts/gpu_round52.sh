#!/usr/bin/env bash
# What round 52 ran on the device (BENCHMARKS.md, "Round 52"), carry .whl:
#   bash scripts/gpu_round52.sh 1   # issue 31's 0.3 ms a step at 8 sequences: the host split of fixed and adaptive
#        # side by side (Qwen3-8B, latent 6.5), each under torch.profiler (the device's kernels outside the graphs,
#        # the host's ops), then adaptive vs fixed vs plain at 8 with the opt-in depth correction
#   bash scripts/gpu_round52.sh 2   # the draft's one-pass readout (kernels/readout.py): its GPU tests with the adaptive
#        # and early-draft ones, its cost against torch's, adaptive vs fixed vs plain at 1 … 256
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
if [ "$M" = 2 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_readout_gpu.py tests/gpu/test_adaptive_graphs.py tests/gpu/test_overlap_gpu.py \
    > "$OUT/t_readout.log" 2>&1
  summary
  stage "the draft readout: torch vs the one-pass kernel" timeout 60 python3 scripts/readout_bench.py
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, the one-pass readout" timeout ${ADAPT_S:-300} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
