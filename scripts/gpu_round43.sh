#!/usr/bin/env bash
# This session's H200 calls (issues 30, 31, 33), each stage under its own timeout, logs and JSON
# under $OUT:
#   bash scripts/gpu_round43.sh 1   # the draft readout inside the draft graph (re-landed) and the GDN norm
#                                   # threshold under their GPU tests; the hybrid's cycle profiled at 1;
#                                   # adaptive vs fixed vs plain, Qwen3-8B, 1…64 (closed loop)
#   bash scripts/gpu_round43.sh 2   # the hybrid's launch (4.9 ms of host time against the dense's 0.8): each sync of a
#                                   # decode step with its frames, the launch under cProfile; the dense beside it
#   bash scripts/gpu_round43.sh 3   # the hybrid's and the dense's decode cycles as timelines: where the device waits, by host phase
#   bash scripts/gpu_round43.sh 4   # the hybrid's rollback issued after the next draft: its GPU tests (graphs = eager,
#                                   # dispatch, warm, overlap), the timeline again, hybrid and adaptive benches
#   bash scripts/gpu_round43.sh 5   # the hybrid's timeline with nothing beside it; the MoE hybrid (Qwen3.5-35B-A3B) at 1
#   bash scripts/gpu_round43.sh 6   # every other GPU test a DFlash step runs the readout in (graphs, ragged, MoE, vision, FP8)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  timeout ${TESTS_S:-300} $T tests/gpu/test_adaptive_graphs.py "tests/gpu/test_gpu.py::test_cuda_graphs_equal_eager_for_batches" \
    > "$OUT/t_readout.log" 2>&1 &
  timeout ${TESTS_S:-300} $T tests/gpu/test_warm_gpu.py::test_hybrid_compiles_nothing_after_startup \
    tests/gpu/test_gdn_kernel.py > "$OUT/t_hyb.log" 2>&1 &
  echo "=== host split + torch profile, hybrid Qwen3.5-4B at 1 ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-200} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed --torch-profile \
    > "$OUT/host_split_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_hybrid.txt" | tee -a "$LOG"
  wait
  summary
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…64 (closed loop)" timeout ${ADAPT_S:-200} \
    $A --shape qwen3-8b --concurrency 1,8,32,64 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 2 ]; then
  echo "=== hybrid Qwen3.5-4B at 1: each sync of a decode step, the launch under cProfile; dense beside it ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-240} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed \
    --profile --profile-modes fixed --sync-debug > "$OUT/host_split_hybrid_sync.txt" 2>&1
  grep -A60 '^syncs in' "$OUT/host_split_hybrid_sync.txt" | head -40 | tee -a "$LOG"
  timeout ${HSPLIT_S:-150} python3 scripts/host_split.py --shape qwen3-8b --concurrency 1 --modes fixed \
    --sync-debug > "$OUT/host_split_dense_sync.txt" 2>&1
  grep -A40 '^syncs in' "$OUT/host_split_dense_sync.txt" | head -30 | tee -a "$LOG"
fi
if [ "$M" = 3 ]; then
  for shape in qwen3.5-4b qwen3-8b; do
    echo "=== $shape at 1: the decode cycle's timeline, where the device waits ($(date +%T))" | tee -a "$LOG"
    timeout ${HSPLIT_S:-200} python3 scripts/host_split.py --shape $shape --concurrency 1 --modes fixed --torch-profile \
      --trace /tmp/trace_$shape.json > "$OUT/host_split_trace_$shape.txt" 2>&1; grep '^{' "$OUT/host_split_trace_$shape.txt" | tee -a "$LOG"
    python3 scripts/trace_gaps.py /tmp/trace_$shape.json | tee -a "$LOG"
    gzip -c /tmp/trace_$shape.json > "$OUT/trace_$shape.json.gz"
  done
fi
if [ "$M" = 4 ]; then
  timeout ${TESTS_S:-300} $T "tests/gpu/test_gpu.py::test_hybrid_graphs_equal_eager" tests/gpu/test_graph_dispatch.py \
    > "$OUT/t_dispatch.log" 2>&1 &
  timeout ${TESTS_S:-300} $T tests/gpu/test_warm_gpu.py::test_hybrid_compiles_nothing_after_startup tests/gpu/test_overlap_gpu.py \
    > "$OUT/t_warm_overlap.log" 2>&1 &
  echo "=== qwen3.5-4b at 1, the rollback after the next draft: the cycle's timeline ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-200} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed --torch-profile \
    --trace /tmp/trace_hybrid.json > "$OUT/host_split_trace_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_trace_hybrid.txt" | tee -a "$LOG"
  python3 scripts/trace_gaps.py /tmp/trace_hybrid.json | tee -a "$LOG"
  wait
  summary
  stage "hybrid Qwen3.5-4B at 1 (plain, fixed, adaptive)" timeout ${HYB_S:-150} $A --shape qwen3.5-4b --concurrency 1 \
    --out "$OUT/hybrid.json"
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1 and 8 (unjudged slots drift)" timeout ${ADAPT_S:-150} \
    $A --shape qwen3-8b --concurrency 1,8 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 5 ]; then
  echo "=== qwen3.5-4b at 1, the rollback after the next draft: the cycle's timeline, nothing beside it ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-150} python3 scripts/host_split.py --shape qwen3.5-4b --concurrency 1 --modes fixed --torch-profile \
    --trace /tmp/trace_hybrid.json > "$OUT/host_split_trace_hybrid.txt" 2>&1; grep '^{' "$OUT/host_split_trace_hybrid.txt" | tee -a "$LOG"
  python3 scripts/trace_gaps.py /tmp/trace_hybrid.json | tee -a "$LOG"
  stage "MoE Qwen3.5-35B-A3B at 1 (plain, fixed, adaptive)" timeout ${MOE_S:-200} $A --shape qwen3.5-35b-a3b --concurrency 1 \
    --out "$OUT/moe.json"
fi
if [ "$M" = 6 ]; then
  timeout ${TESTS_S:-165} $T tests/gpu/test_gpu.py tests/gpu/test_ragged_graphs.py > "$OUT/t_gpu_ragged.log" 2>&1 &
  timeout ${TESTS_S:-165} $T tests/gpu/test_moe_gpu.py tests/gpu/test_vision_gpu.py > "$OUT/t_moe_vision.log" 2>&1 &
  timeout ${TESTS_S:-165} $T tests/gpu/test_fp8.py -k "decode_on_the_gpu" > "$OUT/t_fp8_dflash.log" 2>&1 &
  wait
  summary
fi
