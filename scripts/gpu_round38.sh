#!/usr/bin/env bash
# This round's H200 calls (issues 30, 31, 33, 35), each stage under its own timeout, logs and JSON
# under $OUT (at most 8 files come back). Two calls back to back on one warm machine:
#   bash scripts/gpu_round38.sh 1   # tests/gpu in parallel groups, adaptive vs fixed vs plain 1…256, images
#   bash scripts/gpu_round38.sh 2   # adaptive again (closed loop), images, the hybrid cycle, HTTP bursts of
#                                   # the demo pair, a 16k prompt among 32 decoders at a 512-token budget
#   bash scripts/gpu_round38.sh 3   # the FP8 / vision / MoE and kernel GPU tests, the MoE cycle, cold multi-turn
. "$(dirname "$0")/gpu_prelude.sh"
if [ "${1:-1}" = 1 ]; then
  T="python3 -m pytest -q -p no:cacheprovider -rf --tb=short"
  S=${TESTS_S:-180}
  timeout $S $T tests/gpu/test_graph_dispatch.py tests/gpu/test_adaptive_graphs.py > "$OUT/t_a.log" 2>&1 &
  timeout $S $T tests/gpu/test_ragged_graphs.py tests/gpu/test_gpu.py > "$OUT/t_b.log" 2>&1 &
  timeout $S python3 -m pytest -q -p no:cacheprovider -rf --tb=long tests/gpu/test_overlap_gpu.py > "$OUT/t_c.log" 2>&1 &
  timeout $S $T tests/gpu/test_fp8.py tests/gpu/test_vision_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/t_d.log" 2>&1 &
  timeout $S $T tests/gpu/test_gdn_kernel.py tests/gpu/test_fused_kernels.py tests/gpu/test_moe_kernel.py \
    tests/gpu/test_attention_kernels.py > "$OUT/t_e.log" 2>&1 &
  wait
  for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|error|FAILED" "$f" | tail -12; done | tee -a "$LOG"
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256" timeout ${ADAPT_S:-250} $A --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  stage "images: Qwen3.5-4B shape with its tower" timeout ${VIS_S:-110} python3 scripts/vision_bench.py
elif [ "$1" = 2 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256 (closed loop)" timeout ${ADAPT_S:-200} $A --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  stage "images: Qwen3.5-4B shape with its tower" timeout ${VIS_S:-90} python3 scripts/vision_bench.py
  stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-70} $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-60} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
else
  T="python3 -m pytest -v -p no:cacheprovider -rf --tb=short"
  timeout ${TESTS_S:-240} $T tests/gpu/test_fp8.py tests/gpu/test_vision_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/t_d.log" 2>&1 &
  timeout ${TESTS_S:-240} $T tests/gpu/test_gdn_kernel.py tests/gpu/test_fused_kernels.py tests/gpu/test_moe_kernel.py \
    tests/gpu/test_attention_kernels.py > "$OUT/t_e.log" 2>&1 &
  wait
  for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "FAILED|ERROR|passed|failed" "$f" | tail -12; done | tee -a "$LOG"
  stage "MoE Qwen3.5-35B-A3B at 1" timeout ${MOE_S:-100} $A --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe.json"
  stage "multi-turn Qwen3.5-4B 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-110} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn.json"
fi
