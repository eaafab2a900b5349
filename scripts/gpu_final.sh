#!/usr/bin/env bash
# The merged tree's one device run (issues 30, 31, 33, 35): the GPU tests of this round's paths in
# parallel groups (tiny models: the host is the limit), then the benchmarks one after another, each
# stage under its own timeout. Logs and JSON under $OUT (at most 8 files come back).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TRITON_CACHE_DIR=/tmp/triton-empty
mkdir -p "$OUT"
LOG="$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG"
T="python3 -m pytest -q -p no:cacheprovider -rf --tb=short"
S=${TESTS_S:-210}
timeout $S $T tests/gpu/test_graph_dispatch.py tests/gpu/test_adaptive_graphs.py > "$OUT/tests_a.log" 2>&1 &
timeout $S $T tests/gpu/test_ragged_graphs.py tests/gpu/test_overlap_gpu.py tests/gpu/test_gpu.py > "$OUT/tests_b.log" 2>&1 &
timeout $S $T tests/gpu/test_fp8.py tests/gpu/test_vision_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/tests_c.log" 2>&1 &
timeout $S $T tests/gpu/test_gdn_kernel.py tests/gpu/test_fused_kernels.py tests/gpu/test_moe_kernel.py \
  tests/gpu/test_attention_kernels.py > "$OUT/tests_d.log" 2>&1 &
wait
for f in "$OUT"/tests_*.log; do echo "== $f"; grep -E "passed|failed|error|FAILED" "$f" | tail -8; done | tee -a "$LOG"
stage() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -24 | tee -a "$LOG"; }
A="python3 -m blockspec.cli bench --compare-speculation --accept-profile latent:6.5 --block-size 16 --no-dflash2 --prompt-len 128 --max-tokens 128"
stage "adaptive vs fixed vs plain, Qwen3-8B" timeout ${ADAPT_S:-150} $A --shape qwen3-8b --concurrency 1,32,64,128,256 \
  --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
stage "FP8 kernels" timeout ${FP8K_S:-30} python3 scripts/fp8_kernel_bench.py --no-sweep
stage "FP8 vs bf16, Qwen3-8B" timeout ${FP8_S:-60} python3 -m blockspec.cli bench --shape qwen3-8b --block-size 16 \
  --accept-len 6.5 --quantization fp8 --concurrency 1 --prompt-len 128 --max-tokens 64 --no-dflash2 --out "$OUT/fp8_qwen3_8b.json"
stage "hybrid Qwen3.5-4B at 1" timeout ${HYB_S:-40} $A --shape qwen3.5-4b --concurrency 1
stage "images: Qwen3.5-4B shape with its tower" timeout ${VIS_S:-60} python3 scripts/vision_bench.py
