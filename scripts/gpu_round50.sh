#!/usr/bin/env bash
# What round 50 ran on the H200 (BENCHMARKS.md, "Round 50 on the H200"), each stage under its own
# timeout, logs and JSON under $OUT (carry .whl):
#   bash scripts/gpu_round50.sh 1   # early drafts (model_runner.draft_ahead): their GPU tests (no host wait, the same
#        # tokens and acceptance), adaptive vs fixed vs plain at 1 … 256 (budget 2,048) with them, and plain vs
#        # fixed-width DFlash at 1 and 64 sequences with them on and off (BLOCKSPEC_EARLY_DRAFT=0), side by side
#   bash scripts/gpu_round50.sh 2   # all of tests/gpu in one call (round 45's call 6: four pytest processes, then the
#        # pool test alone)
#   bash scripts/gpu_round50.sh 3   # the hybrid (Qwen3.5-4B) and the MoE (Qwen3.5-35B-A3B) at one sequence, adaptive
#        # vs fixed vs plain, with early drafts and the GDN norm kernel; HTTP bursts, fresh and repeated prompts
#   bash scripts/gpu_round50.sh 4   # adaptive vs fixed vs plain at 1 … 256 again, the bench's latent profile gathering
#        # each cycle's slots with one index (its per-sequence slicing was charged to the speculative cycles); where
#        # the adaptive cycle's host time goes at 128 sequences (scripts/host_split.py)
#   bash scripts/gpu_round50.sh 5   # arrivals drafted early too (their first decode step ran a second draft forward):
#        # the early-draft GPU tests, adaptive vs fixed vs plain at 1 … 256 (the next session: again after the review
#        # mends, with the new GPU test of adaptive widths and arrivals)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_overlap_gpu.py tests/gpu/test_adaptive_graphs.py > "$OUT/t_early.log" 2>&1
  summary
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, early drafts" timeout ${ADAPT_S:-280} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b_early.json"
  for early in 1 0; do
    stage "plain vs fixed DFlash, Qwen3-8B, 1 and 64 sequences, BLOCKSPEC_EARLY_DRAFT=$early" \
      env BLOCKSPEC_EARLY_DRAFT=$early timeout ${FIXED_S:-75} $B --shape qwen3-8b --accept-len 6.5 --concurrency 1,64 \
      --prompt-len 128 --max-tokens 256 --out "$OUT/fixed_qwen3_8b_early$early.json"
  done
fi
if [ "$M" = 2 ]; then
  TESTS_S=${TESTS_S:-420} bash "$(dirname "$0")/gpu_round45.sh" 6
fi
if [ "$M" = 3 ]; then
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-150} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3.5-4b \
    --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-170} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3.5-35b-a3b \
    --concurrency 1 --out "$OUT/moe_qwen3_5_35b.json"
  for prompts in fresh same; do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, $prompts prompts" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
      --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3 --burst-prompts $prompts
  done
fi
if [ "$M" = 4 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, early drafts, the profile's slots gathered" \
    timeout ${ADAPT_S:-280} $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 \
    --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b_early2.json"
  stage "host split, Qwen3-8B, 128 sequences, plain and adaptive" timeout ${HS_S:-120} python3 scripts/host_split.py \
    --shape qwen3-8b --concurrency 128 --modes plain,adaptive
fi
if [ "$M" = 5 ]; then
  timeout ${TESTS_S:-100} $T tests/gpu/test_overlap_gpu.py > "$OUT/t_early.log" 2>&1
  summary
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048, early drafts with arrivals" \
    timeout ${ADAPT_S:-280} $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 \
    --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b_early3.json"
fi
