#!/usr/bin/env bash
# One device run on the merged tree (issues 20-22, 24): GPU checks, then the burst, adaptive,
# prefix-cache and long-context benchmarks. Wheels the device lacks travel in .whl (see the device
# tool's README); results go to $OUT (at most 8 files come back: one log + JSON per stage).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
stage() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | tail -40 | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
B="python3 -m blockspec.cli bench --shape qwen3-8b --block-size 16"
stage "gpu checks" timeout 130 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_ragged_graphs.py \
  tests/gpu/test_gdn_kernel.py tests/gpu/test_gpu.py "tests/gpu/test_attention_kernels.py::test_a_flat_ragged_step"
stage "burst 64 x 512" timeout 60 $B --accept-len 6.5 --burst 64 --prompt-len 512 --max-tokens 32 --out "$OUT/burst64.json"
stage "16k prompt during 32 decoding" timeout 55 $B --accept-len 6.5 --burst 1 --burst-decoding 32 --prompt-len 16384 \
  --max-tokens 64 --out "$OUT/burst16k.json"
stage "adaptive vs fixed vs plain" timeout 130 $B --compare-speculation --accept-profile latent:6.5 --concurrency 1,8,32,64 \
  --prompt-len 512 --max-tokens 128 --max-num-batched-tokens 4096 --no-dflash2 --out "$OUT/adaptive.json"
stage "multi-turn 16k" timeout 60 $B --accept-len 6.5 --max-tokens 64 --multi-turn 1x3 --system-prompt-tokens 16000 \
  --user-tokens 64 --out "$OUT/multiturn16k.json"
