#!/usr/bin/env bash
# What round 57 ran on the device (BENCHMARKS.md, "Round 57"); every call carried .whl.
#   bash scripts/gpu_round57.sh 1   # the GPU tests round 56's review mends touch, then round 56's open
#        # question: does round 55's policy (OLD: `git show 69d3b8b:blockspec/engine/spec/policy.py >
#        # old_policy.py`, untracked, it travels with the tree) fall into the wide regime at 32 when its
#        # engine is the process's first adaptive one?
#   bash scripts/gpu_round57.sh 2   # issue 33: the decode step kernel by kernel (bf16, FP8), then the FP8 bench
#   (calls 3-4 ran step_profile.py --widths 1 --formats bf16 --contexts 512,4096 --min-chunks 4,2,1, then with
#    attention.MAX_SPLITS = 64 and --min-chunks 2,1; mode 3 is the fuller form with engine benches, not run)
#   bash scripts/gpu_round57.sh 3   # the decode attention: splits of at least 4, 2 or 1 chunks of keys
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  TESTS_S=${TESTS_S:-230} bash "$(dirname "$0")/gpu_round55.sh" 2
  stage "policy A/B at 32, the other policy first" timeout ${AB_S:-300} python3 scripts/policy_ab.py \
    --old old_policy.py --concurrency 32 --other-first --out "$OUT/ab32_other_first.json"
fi
if [ "$M" = 2 ]; then           # issue 33: where the FP8 (and bf16) decode step's device time goes
  stage "step profile, Qwen3-8B, bf16 then FP8, widths 1 and 16" timeout ${PROF_S:-200} python3 scripts/step_profile.py \
    --shape qwen3-8b --widths 1,16 --formats bf16,fp8 --out "$OUT/step_profile_qwen3_8b.json"
  TAIL=60 stage "FP8 vs bf16, Qwen3-8B, 1 sequence" timeout ${FP8_S:-150} $B --shape qwen3-8b --accept-len 6.5 \
    --quantization fp8 --concurrency 1 --prompt-len 128 --max-tokens 64 --out "$OUT/fp8_qwen3_8b.json"
fi
if [ "$M" = 3 ]; then           # the decode attention's split size: each split ≥ 4, 2 or 1 chunks of 64 keys
  stage "step profile, Qwen3-8B bf16, attention splits of >= 4 / 2 / 1 chunks" timeout ${PROF_S:-200} python3 \
    scripts/step_profile.py --shape qwen3-8b --widths 1,16 --formats bf16 --contexts 512,4096 --min-chunks 4,2,1 \
    --out "$OUT/step_profile_chunks.json"
  for chunks in 4 1; do
    stage "bench, Qwen3-8B plain and DFlash at 1, MIN_CHUNKS_PER_SPLIT=$chunks" timeout ${BENCH_S:-100} python3 -c "
import sys; import blockspec.kernels.attention as a; a.MIN_CHUNKS_PER_SPLIT = $chunks
from blockspec.cli import main; sys.exit(main(sys.argv[1:]))" bench --block-size 16 --no-dflash2 --shape qwen3-8b \
      --accept-len 6.5 --concurrency 1 --prompt-len 1024 --max-tokens 64 --out "$OUT/bench_chunks$chunks.json"
  done
fi
