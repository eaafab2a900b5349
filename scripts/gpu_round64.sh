#!/usr/bin/env bash
# What round 64 ran on the device (BENCHMARKS.md, "Round 64"); every call carries .whl (with pytest-xdist:
# scripts/device_wheels.sh).
#   bash scripts/gpu_round64.sh 1   # any card (issue 30's "all of tests/gpu passes in one device call"): every file
#        # of tests/gpu in XDIST (default 6) pytest-xdist workers, then the one test that measures the device's free
#        # memory alone (other processes move it), each under TESTS_S (default 420) / POOL_S (default 90)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  POOL=tests/gpu/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given
  timeout ${TESTS_S:-420} $T -n ${XDIST:-6} --dist load tests/gpu --deselect $POOL > "$OUT/t_all.log" 2>&1
  timeout ${POOL_S:-90} $T $POOL > "$OUT/t_pool.log" 2>&1
  summary
fi
