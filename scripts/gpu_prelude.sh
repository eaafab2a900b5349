# Sourced by the H200 round scripts (scripts/gpu_round*.sh): the carried wheels on the path, $OUT
# and its log, Triton's cache, `stage NAME CMD…` (a timed stage's tail into the log) and the bench
# commands they share ($B: plain vs DFlash at block 16; $A and $C: adaptive vs fixed vs plain, latent
# 6.5, 128 and 256 new; $T: pytest; `smollm2_measure`: the real SmolLM2 pair; `summary`: the tests logs
# t_*.log, their results). The wheels: scripts/device_wheels.sh.
set -o pipefail
# A call that carries no wheels (its room went to a GGUF piece) uses what an earlier call on the same
# warm machine installed.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site ]; then
  echo "gpu_prelude: no .whl carried and no /tmp/site from an earlier call on this machine" >&2; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
mkdir -p "$OUT"
LOG="$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG"
stage() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -${TAIL:-40} | tee -a "$LOG"; }
B="python3 -m blockspec.cli bench --block-size 16 --no-dflash2"
A="$B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 128"
C="$B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256"   # issue 31's runs
# smollm2_measure WORK: the real SmolLM2 pair (the joined /tmp/smollm2.gguf, its shipped draft): held-out
# acceptance and plain / fixed / adaptive tok/s at 1, 16, 64 requests (5 interleaved rounds, medians) into
# $OUT/smollm2_measure.json. tok/s needs a "best" draft measured before the last (the baseline): the shipped
# draft twice. BLOCKSPEC_BATCH_INVARIANT=1: what `--model smollm2` runs (named.use_batch_invariance); a path
# does not set it.
smollm2_measure() {
  mkdir -p "$1"
  stage "SmolLM2: held-out acceptance and plain / fixed / adaptive tok/s at 1, 16, 64" env BLOCKSPEC_BATCH_INVARIANT=1 \
    timeout ${SMOL_S:-260} python3 scripts/smollm2_recipe.py measure --target /tmp/smollm2.gguf --work "$1" \
    --device cuda --dtype bfloat16 --drafts blockspec/demo/smollm2-draft,blockspec/demo/smollm2-draft --limit 32 \
    --max-tokens 128 --concurrency 1,16,64 --rounds ${SMOL_ROUNDS:-5} --sets chat --block-sizes 8
  cp "$1/measure.json" "$OUT/smollm2_measure.json" 2>/dev/null
}
T="python3 -m pytest -q -p no:cacheprovider -rf --tb=short"
summary() { for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "FAILED|ERROR|passed|failed" "$f" | tail -12; done | tee -a "$LOG"; }
