#!/usr/bin/env bash
# What round 45 ran on the H200 (BENCHMARKS.md, "Round 45 on the H200"): round 44's open GPU checks, on one
# warm machine, calls back to back, each stage under its own timeout, logs and JSON under $OUT:
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round45.sh 1   # carry .whl .gguf/p0: the batch-invariant
#        # attention's bf16 test; the pool test alone; what the unsplit attention costs at 4k-token prompts
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round45.sh 2   # carry .gguf/p1: adaptive vs fixed vs plain
#        # (Qwen3-8B, 1 and 8); then the MoE, vision and FP8 engine GPU tests side by side
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round45.sh 3   # carry .gguf/p2: the hybrid (Qwen3.5-4B) at one
#        # sequence, adaptive vs fixed vs plain
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round45.sh 4   # carry .gguf/p3: the GGUF joined; SmolLM2's
#        # held-out DFlash-vs-plain equality in bf16 and fp32, then its tok/s at 1, 16 and 64 requests (plain, fixed,
#        # adaptive) with BLOCKSPEC_BATCH_INVARIANT=1 and 0 (round 45 ran these two as calls 5–8)
#   bash scripts/gpu_round45.sh 5   # carry .whl: after the calls, the invariant mode's fixed key ranges (the
#        # attention kernels' GPU tests, then plain vs DFlash over 4k-token prompts with and without the mode)
#   bash scripts/gpu_round45.sh 6   # carry .whl: all of tests/gpu in one call, four pytest processes side by
#        # side, then the pool test alone (it sizes its pool from the free memory the others move)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
GGUF=/tmp/smollm2.gguf
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-100} $T tests/gpu/test_attention_kernels.py -k batch_invariant > "$OUT/t_invariant.log" 2>&1
  timeout ${TESTS_S:-100} $T tests/gpu/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given > "$OUT/t_pool.log" 2>&1
  summary
  for inv in 0 1; do
    stage "plain vs DFlash, Qwen3-8B, 4k-token prompts, BLOCKSPEC_BATCH_INVARIANT=$inv" env BLOCKSPEC_BATCH_INVARIANT=$inv \
      timeout ${BENCH_S:-115} $B --shape qwen3-8b --concurrency 1,8 --prompt-len 4096 --max-tokens 64 \
      --accept-profile latent:6.5 --out "$OUT/invariant_$inv.json"
  done
fi
if [ "$M" = 2 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1 and 8" timeout ${ADAPT_S:-130} \
    $A --shape qwen3-8b --concurrency 1,8 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  timeout ${TESTS_S:-200} $T tests/gpu/test_moe_gpu.py tests/gpu/test_vision_gpu.py > "$OUT/t_moe_vision.log" 2>&1 &
  timeout ${TESTS_S:-200} $T tests/gpu/test_fp8.py -k "decode_on_the_gpu" > "$OUT/t_fp8_dflash.log" 2>&1 &
  wait
  summary
fi
if [ "$M" = 3 ]; then
  stage "adaptive vs fixed vs plain, Qwen3.5-4B, 1" timeout ${ADAPT_S:-150} \
    $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
fi
if [ "$M" = 4 ]; then
  bash scripts/gguf_pieces.sh join $GGUF || exit 1
  mkdir -p /tmp/w2
  for run in "0 bfloat16" "0 float32"; do
    set -- $run
    echo "=== held-out equality, BLOCKSPEC_BATCH_INVARIANT=$1, $2 ($(date +%T))" | tee -a "$LOG"
    BLOCKSPEC_BATCH_INVARIANT=$1 timeout 110 python3 scripts/smollm2_recipe.py measure --target $GGUF --work /tmp/w2 \
      --device cuda --dtype $2 --drafts blockspec/demo/smollm2-draft --limit 32 --max-tokens 128 --concurrency "" \
      --sets chat --block-sizes 8 2>&1 | grep "block 8" | tee -a "$LOG"
  done
  # tok/s needs a "best" draft measured before the last (the baseline): the shipped draft twice.
  for inv in 1 0; do
    mkdir -p /tmp/w5$inv
    echo "=== held-out equality and tok/s, BLOCKSPEC_BATCH_INVARIANT=$inv, bf16 ($(date +%T))" | tee -a "$LOG"
    BLOCKSPEC_BATCH_INVARIANT=$inv timeout 200 python3 scripts/smollm2_recipe.py measure --target $GGUF --work /tmp/w5$inv \
      --device cuda --dtype bfloat16 --drafts blockspec/demo/smollm2-draft,blockspec/demo/smollm2-draft --limit 32 \
      --max-tokens 128 --concurrency 1,16,64 --sets chat --block-sizes 8 2>&1 | grep "block 8\|c=\|Error" | tee -a "$LOG"
  done
fi
if [ "$M" = 5 ]; then
  timeout ${TESTS_S:-150} $T tests/gpu/test_attention_kernels.py > "$OUT/t_attention.log" 2>&1
  summary
  for inv in 1 0; do
    stage "plain vs DFlash, Qwen3-8B, 4k-token prompts, BLOCKSPEC_BATCH_INVARIANT=$inv (fixed key ranges)" \
      env BLOCKSPEC_BATCH_INVARIANT=$inv timeout ${BENCH_S:-115} $B --shape qwen3-8b --concurrency 1,8 --prompt-len 4096 \
      --max-tokens 64 --accept-profile latent:6.5 --out "$OUT/ranges_$inv.json"
  done
fi
if [ "$M" = 6 ]; then
  G=tests/gpu
  POOL=$G/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given
  timeout ${TESTS_S:-400} $T $G/test_fp8.py > "$OUT/t_1.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_moe_gpu.py $G/test_vision_gpu.py $G/test_moe_kernel.py > "$OUT/t_2.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_attention_kernels.py $G/test_gpu.py $G/test_fused_kernels.py > "$OUT/t_3.log" 2>&1 &
  timeout ${TESTS_S:-400} $T $G/test_ragged_graphs.py $G/test_graph_dispatch.py $G/test_adaptive_graphs.py \
    $G/test_overlap_gpu.py $G/test_gdn_kernel.py $G/test_warm_gpu.py --deselect $POOL > "$OUT/t_4.log" 2>&1 &
  wait
  timeout 100 $T $POOL > "$OUT/t_5_pool.log" 2>&1
  summary
fi
