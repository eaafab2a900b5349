#!/usr/bin/env bash
# The next session's H200 calls (issues 30, 31), on what round 40 changed after its last call
# (nothing of it ran on a GPU yet: the scheduler's room for prompts, the request warm-up at
# startup), and what round 40's calls left unfinished. Each stage under its own timeout, logs and
# JSON under $OUT:
#   bash scripts/gpu_round41.sh 1   # tests/gpu in parallel groups; 16k among 32 at budget 512 (the
#                                   # drafts cut for the prompt); HTTP bursts (the request warm-up)
#   bash scripts/gpu_round41.sh 2   # adaptive vs fixed vs plain 1…256 (closed loop), the host split
#   bash scripts/gpu_round41.sh 3   # the cold multi-turn given its time, the hybrid cycle, images on the graphs
# Mode 1's parts alone or listed: tests, burst, http, e.g. `burst,http` (round 41 ran those beside
# staging the GGUF).
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
has() { [ "$M" = 1 ] || [[ ",$M," == *",$1,"* ]]; }
if has tests; then
  S=${TESTS_S:-220}
  timeout $S $T tests/gpu/test_graph_dispatch.py tests/gpu/test_adaptive_graphs.py tests/gpu/test_warm_gpu.py > "$OUT/t_a.log" 2>&1 &
  timeout $S $T tests/gpu/test_ragged_graphs.py tests/gpu/test_gpu.py tests/gpu/test_overlap_gpu.py > "$OUT/t_b.log" 2>&1 &
  timeout $S $T tests/gpu/test_vision_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/t_c.log" 2>&1 &
  timeout $S $T tests/gpu/test_fp8.py > "$OUT/t_d.log" 2>&1 &
  wait
  summary
fi
if has burst; then
  stage "16k prompt during 32 decoders, budget 512" timeout ${BURST_S:-100} $B --shape qwen3-8b --accept-len 6.5 \
    --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens 512 \
    --out "$OUT/burst16k_512.json"
fi
if has http; then
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-80} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 2 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256 (closed loop)" timeout ${ADAPT_S:-240} \
    $A --shape qwen3-8b --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  echo "=== host split ($(date +%T))" | tee -a "$LOG"
  timeout ${SPLIT_S:-110} python3 scripts/host_split.py --shape qwen3-8b --concurrency 1 8 32 --profile \
    > "$OUT/host_split.txt" 2>&1; grep '^{' "$OUT/host_split.txt" | tee -a "$LOG"
elif [ "$M" = 3 ]; then
  stage "multi-turn Qwen3.5-4B 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-260} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn.json"
  stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-150} $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
  echo "=== host split, hybrid at 1 ($(date +%T))" | tee -a "$LOG"    # where the cycle's 4 ms outside the forwards go
  timeout ${HSPLIT_S:-90} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 \
    > "$OUT/host_split_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_hybrid.txt" | tee -a "$LOG"
  stage "images: Qwen3.5-4B shape with its tower (decode on the graphs)" timeout ${VIS_S:-80} python3 scripts/vision_bench.py
fi
