#!/usr/bin/env bash
# What round 56 ran on the device (BENCHMARKS.md, "Round 56 on the H100"); every call carried .whl:
#   bash scripts/gpu_round54.sh 9      # Qwen3-8B, adaptive vs fixed vs plain, 1 … 256
#   python3 scripts/policy_ab.py --old OLD --concurrency 8,32,64   # this tree's policy vs round 55's
#        # (OLD: `git show 69d3b8b:blockspec/engine/spec/policy.py`, carried in the tree for the call)
# Next (no device time was left): policy_ab.py --old OLD --concurrency 32 --other-first, whether round
# 55's policy also settles into the wide regime at 32 when it is a process's first adaptive engine.
#   TESTS_S=280 bash scripts/gpu_round55.sh 2    # the GPU tests the policy touches (a capture failed)
#   bash scripts/gpu_round56.sh 1      # after the collector's pause: those tests again, then the hybrid
#        # and the MoE at one sequence (FORCE_MOE=1 MOE_ARGS="--gpu-memory-utilization 0.96" on an H100)
#   python3 scripts/policy_ab.py --old OLD --shape qwen3.5-35b-a3b --concurrency 1 --gpu-memory-utilization 0.96
#   TESTS_S=370 bash scripts/gpu_round55.sh 1    # all of tests/gpu, four processes, then the pool test
#   bash scripts/gpu_round56.sh 2      # the pool test again, after the cost probes' cache is emptied
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
G=tests/gpu
if [ "$M" = 1 ]; then
  timeout 90 $T $G/test_overlap_gpu.py $G/test_readout_gpu.py $G/test_adaptive_graphs.py > "$OUT/t_2.log" 2>&1
  summary
  FORCE_MOE=${FORCE_MOE:-1} MOE_ARGS=${MOE_ARGS:---gpu-memory-utilization 0.96} HYB_S=${HYB_S:-150} MOE_S=${MOE_S:-290} \
    bash "$(dirname "$0")/gpu_round54.sh" 1
fi
if [ "$M" = 2 ]; then
  timeout 100 $T $G/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given > "$OUT/t_5_pool.log" 2>&1
  summary
fi
