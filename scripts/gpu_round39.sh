#!/usr/bin/env bash
# Round 39's H200 calls (issues 30, 31, 35's caveat), nothing of which has run on a GPU yet: each
# stage under its own timeout, logs and JSON under $OUT (at most 8 files come back). Two calls
# back to back on one warm machine, then a third if device time is left:
#   bash scripts/gpu_round39.sh 1   # tests/gpu in parallel groups (the new warm-up, image-graph and
#                                   # narrow-draft cases included), adaptive vs fixed vs plain 1…256
#   bash scripts/gpu_round39.sh 2   # HTTP bursts (the warm-up's target), images on the graphs, the
#                                   # hybrid cycle, a 16k prompt among 32 decoders at budget 512
#   bash scripts/gpu_round39.sh 3   # the kernel tests, the MoE cycle, a cold multi-turn (empty Triton cache)
. "$(dirname "$0")/gpu_prelude.sh"
if [ "${1:-1}" = 1 ]; then
  S=${TESTS_S:-200}
  timeout $S $T tests/gpu/test_graph_dispatch.py tests/gpu/test_adaptive_graphs.py tests/gpu/test_warm_gpu.py > "$OUT/t_a.log" 2>&1 &
  timeout $S $T tests/gpu/test_ragged_graphs.py tests/gpu/test_gpu.py > "$OUT/t_b.log" 2>&1 &
  timeout $S $T tests/gpu/test_overlap_gpu.py > "$OUT/t_c.log" 2>&1 &
  timeout $S $T tests/gpu/test_vision_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/t_d.log" 2>&1 &
  timeout $S $T tests/gpu/test_fp8.py > "$OUT/t_e.log" 2>&1 &
  wait
  summary
  stage "adaptive (narrow draft blocks) vs fixed vs plain, Qwen3-8B, 1…256 (closed loop)" timeout ${ADAPT_S:-230} \
    $A --shape qwen3-8b --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
elif [ "$1" = 2 ]; then
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-80} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
  stage "images: Qwen3.5-4B shape with its tower (decode on the graphs)" timeout ${VIS_S:-100} python3 scripts/vision_bench.py
  stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-80} $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-70} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
else
  S=${TESTS_S:-240}
  timeout $S $T tests/gpu/test_gdn_kernel.py tests/gpu/test_fused_kernels.py > "$OUT/t_f.log" 2>&1 &
  timeout $S $T tests/gpu/test_moe_kernel.py tests/gpu/test_attention_kernels.py > "$OUT/t_g.log" 2>&1 &
  wait
  summary
  stage "MoE Qwen3.5-35B-A3B at 1" timeout ${MOE_S:-100} $A --shape qwen3.5-35b-a3b --concurrency 1 --out "$OUT/moe.json"
  stage "multi-turn Qwen3.5-4B 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-120} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn.json"
fi
