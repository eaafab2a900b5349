#!/usr/bin/env bash
# The last H200 call of this round: the image bench (issue 35) alone, then the FP8 / vision / MoE GPU
# tests by name (-v: a test cut by the timeout still shows which ran and how).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
mkdir -p "$OUT"
echo "=== images ($(date +%T))"
timeout ${VIS_S:-150} python3 scripts/vision_bench.py 2>&1 | grep -v "it/s\]" | tee "$OUT/vision.log" | tail -20
echo "=== tests ($(date +%T))"
timeout ${TESTS_S:-170} python3 -m pytest -v -p no:cacheprovider -rf --tb=short tests/gpu/test_vision_gpu.py \
  tests/gpu/test_fp8.py tests/gpu/test_moe_gpu.py > "$OUT/t_d.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/t_d.log" | tail -15
