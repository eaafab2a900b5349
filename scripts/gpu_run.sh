#!/usr/bin/env bash
# One device run: GPU checks, then the concurrency benchmark (BENCHMARKS.md records its output).
# Wheels the device lacks travel in .whl (see the device tool's README); results go to $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
timeout 240 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout 420 python3 -m blockspec.cli bench --shape "${SHAPE:-qwen3-8b}" --concurrency "${CONCURRENCY:-1,4,16,32}" \
  --accept-len 6.5 --block-size 16 --prompt-len 512 --max-tokens 128 ${VS:---vs transformers} \
  --out "$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench.log"
