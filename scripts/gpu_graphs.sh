#!/usr/bin/env bash
# One device run of the graph dispatcher (issue 30): all of tests/gpu in three parallel groups
# (tiny models: the host is the limit), then the Qwen3-8B shape: a 16k prompt arriving while 32
# sequences decode, and plain vs DFlash at 1, 64 and 128 sequences. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T="python3 -m pytest -q -p no:cacheprovider --durations=8"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/bench.log"
timeout ${TESTS_S:-130} $T tests/gpu/test_graph_dispatch.py tests/gpu/test_ragged_graphs.py > "$OUT/tests_graphs.log" 2>&1 &
timeout ${TESTS_S:-130} $T tests/gpu/test_gpu.py tests/gpu/test_gdn_kernel.py tests/gpu/test_moe_gpu.py > "$OUT/tests_models.log" 2>&1 &
timeout ${TESTS_S:-130} $T tests/gpu/test_attention_kernels.py tests/gpu/test_moe_kernel.py tests/gpu/test_fused_kernels.py > "$OUT/tests_kernels.log" 2>&1 &
wait
tail -3 "$OUT"/tests_*.log
B="python3 -m blockspec.cli bench --shape qwen3-8b --block-size 16 --accept-len 6.5"
echo "=== 16k prompt during 32 decoding ($(date +%T))" | tee -a "$OUT/bench.log"
timeout ${BURST_S:-55} $B --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 \
  --out "$OUT/burst16k.json" 2>&1 | grep -v "it/s\]" | tail -30 | tee -a "$OUT/bench.log"
echo "=== concurrency 1,64,128 ($(date +%T))" | tee -a "$OUT/bench.log"
timeout ${CONC_S:-90} $B --concurrency 1,64,128 --prompt-len 128 --max-tokens 64 --no-dflash2 \
  --out "$OUT/concurrency.json" 2>&1 | grep -v "it/s\]" | tail -30 | tee -a "$OUT/bench.log"
