#!/usr/bin/env bash
# What round 55 ran on the device (BENCHMARKS.md, "Round 55 on the H100"). Calls 1–4, on one warm
# machine, were round 54's stages on this round's tree (the demo pair's weights left behind for 1–3):
#   FORCE_MOE=1 MOE_ARGS="--gpu-memory-utilization 0.96" bash scripts/gpu_round54.sh 1   # carry .whl
#   bash scripts/gpu_round54.sh 9      # carry .gguf/p0: Qwen3-8B, adaptive vs fixed vs plain, 1 … 256
#   bash scripts/gpu_round54.sh 3      # carry .gguf/p1: SmolLM2, 7 rounds, then step by step at 64
#   bash scripts/gpu_round54.sh 8      # HTTP bursts, a thread per stream and 8 client processes
#   bash scripts/gpu_round55.sh 1      # carry .whl: all of tests/gpu with adaptive the default, four
#        # processes, then the pool test alone
#   bash scripts/gpu_round55.sh 2      # carry .whl: the GPU tests the default's change touches most
#        # (engines built with the default: graphs, dispatch, overlap, adaptive, warm-up), two processes
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  G=tests/gpu
  POOL=$G/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given
  timeout ${TESTS_S:-400} $T $G/test_fp8.py > "$OUT/t_1.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_moe_gpu.py $G/test_vision_gpu.py $G/test_moe_kernel.py > "$OUT/t_2.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_attention_kernels.py $G/test_gpu.py $G/test_fused_kernels.py \
    $G/test_readout_gpu.py > "$OUT/t_3.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_ragged_graphs.py $G/test_graph_dispatch.py $G/test_adaptive_graphs.py \
    $G/test_overlap_gpu.py $G/test_gdn_kernel.py $G/test_warm_gpu.py --deselect $POOL > "$OUT/t_4.log" 2>&1 &
  wait
  timeout 100 $T $POOL > "$OUT/t_5_pool.log" 2>&1
  summary
fi
if [ "$M" = 2 ]; then
  G=tests/gpu
  timeout ${TESTS_S:-300} $T $G/test_gpu.py $G/test_graph_dispatch.py $G/test_warm_gpu.py > "$OUT/t_1.log" 2>&1 &
  timeout ${TESTS_S:-300} $T $G/test_adaptive_graphs.py $G/test_overlap_gpu.py $G/test_readout_gpu.py > "$OUT/t_2.log" 2>&1 &
  wait
  summary
fi
