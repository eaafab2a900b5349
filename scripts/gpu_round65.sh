#!/usr/bin/env bash
# What round 65 ran on the device (BENCHMARKS.md, "Round 65"); every call carries .whl.
#   bash scripts/gpu_round65.sh 1   # whichever card comes: on an H200, issues 31 and 33's H200 figures
#        # (scripts/gpu_round63.sh 5: the MoE in FP8 beside bf16 at one sequence, Qwen3-8B adaptive vs fixed vs
#        # plain at 1 … 256, FP8 vs bf16 at 1 and 32); on any other card, issue 30's "all of tests/gpu in one
#        # call" (scripts/gpu_round64.sh 1). Machines are scarce: a call takes what the card it got is needed for.
#   bash scripts/gpu_round65.sh 2   # any card (issue 30): every file of tests/gpu in XDIST (default 8) workers, each
#        # engine's pool a 2 GiB share (tests/gpu/conftest.py), then the tests marked measures_memory alone
M=${1:-1}
if [ "$M" = 1 ]; then
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    bash "$(dirname "$0")/gpu_round63.sh" 5
  else
    bash "$(dirname "$0")/gpu_round64.sh" 1
  fi
fi
if [ "$M" = 2 ]; then
  . "$(dirname "$0")/gpu_prelude.sh"
  timeout ${TESTS_S:-420} $T -n ${XDIST:-8} --dist load tests/gpu -m "not measures_memory" > "$OUT/t_all.log" 2>&1
  timeout ${POOL_S:-90} $T tests/gpu -m measures_memory > "$OUT/t_pool.log" 2>&1
  summary
fi
