#!/usr/bin/env bash
# What round 64 ran on the device (BENCHMARKS.md, "Round 64"); every call carries .whl (with pytest-xdist:
# scripts/device_wheels.sh).
#   bash scripts/gpu_round64.sh 1   # any card (issue 30's "all of tests/gpu passes in one device call"): every file
#        # of tests/gpu in XDIST (default 8) pytest-xdist workers, then the one test that measures the device's free
#        # memory alone (other processes move it), each under TESTS_S (default 420) / POOL_S (default 90)
#   bash scripts/gpu_round64.sh 2   # mode 1 with TESTS_S 330, then on an H200 only (issue 31 asks for its figures)
#        # Qwen3-8B adaptive vs fixed vs plain at 1 … 256 in what is left of TOTAL_S (default 570)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
START=$SECONDS
[ "$M" = 2 ] && TESTS_S=${TESTS_S:-330}
if [ "$M" = 1 ] || [ "$M" = 2 ]; then
  POOL=tests/gpu/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given
  timeout ${TESTS_S:-420} $T -n ${XDIST:-8} --dist load tests/gpu --deselect $POOL > "$OUT/t_all.log" 2>&1
  timeout ${POOL_S:-90} $T $POOL > "$OUT/t_pool.log" 2>&1
  summary
fi
if [ "$M" = 2 ]; then
  left=$((${TOTAL_S:-570} - (SECONDS - START)))
  if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    echo "not an H200: issue 31's run left for one" | tee -a "$LOG"
  elif [ "$left" -lt 120 ]; then
    echo "${left} s left: issue 31's run not started" | tee -a "$LOG"
  else
    stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256" timeout $((left < 220 ? left : 220)) \
      $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
  fi
fi
