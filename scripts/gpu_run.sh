#!/usr/bin/env bash
# One device run: GPU checks, then the concurrency benchmarks (BENCHMARKS.md records the output).
# Wheels the device lacks travel in .whl (see the device tool's README); results go to $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
timeout 150 python3 -m blockspec.cli bench --shape qwen3-8b --concurrency 1,4,16,32 --accept-len 6.5 \
  --block-size 16 --prompt-len 512 --max-tokens 128 --vs transformers --out "$OUT/bench_qwen3_8b.json" 2>&1 \
  | tail -40 | tee "$OUT/bench_qwen3_8b.log"
timeout 110 python3 -m blockspec.cli bench --shape qwen3-30b-a3b --concurrency 1,8 --accept-len 6.5 \
  --block-size 16,8 --prompt-len 256 --max-tokens 64 --vs grouped-moe --out "$OUT/bench_qwen3_30b_a3b.json" 2>&1 \
  | tail -30 | tee "$OUT/bench_moe.log"
timeout 90 python3 -m blockspec.cli bench --shape qwen3.5-35b-a3b --concurrency 1 --accept-len 6.5 --block-size 16,8 \
  --prompt-len 128 --max-tokens 48 --no-dflash2 --vs grouped-moe --out "$OUT/bench_qwen3_5_35b_a3b.json" 2>&1 \
  | tail -30 | tee "$OUT/bench_moe35.log"
timeout 60 python3 -m blockspec.cli bench --shape qwen3.5-4b --concurrency 1 --accept-len 6.5 --block-size 16,8 \
  --prompt-len 128 --max-tokens 48 --no-dflash2 --out "$OUT/bench_qwen3_5_4b.json" 2>&1 | tail -30 | tee "$OUT/bench_4b.log"
