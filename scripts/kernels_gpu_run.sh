#!/usr/bin/env bash
# Issue 24 (kernels) device run: GPU checks of the GDN step and MoE decode kernels, then the
# before/after benches, all under $OUT (BENCHMARKS.md records them). Wheels (fla etc.) in $WHL.
set -o pipefail
WHL=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a $LOG
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a $LOG
echo "== tests: gdn + moe kernels" | tee -a $LOG
timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gdn_kernel.py tests/gpu/test_moe_kernel.py 2>&1 | tail -15 | tee -a $LOG
echo "== gdn bench qwen3.5-4b" | tee -a $LOG
timeout 45 python3 scripts/gdn_bench.py --shape qwen3.5-4b --cases 1x1,1x8,32x8 --out $OUT/gdn_qwen3_5_4b.json 2>&1 | tail -6 | tee -a $LOG
echo "== gdn bench qwen3.5-35b-a3b" | tee -a $LOG
timeout 45 python3 scripts/gdn_bench.py --shape qwen3.5-35b-a3b --cases 1x1,1x8,8x8 --out $OUT/gdn_qwen3_5_35b_a3b.json 2>&1 | tail -6 | tee -a $LOG
echo "== moe kernel bench" | tee -a $LOG
timeout 35 python3 scripts/moe_kernel_bench.py --sweep --tokens 1,2,8,16 --out $OUT/moe_kernel.json 2>&1 | tail -10 | tee -a $LOG
echo "== gemm bench" | tee -a $LOG
timeout 25 python3 scripts/gemm_bench.py --out $OUT/gemm.json 2>&1 | tail -12 | tee -a $LOG
echo "== tests: hybrid + moe graphs == eager" | tee -a $LOG
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_moe_gpu.py -k "hybrid_graphs or moe_graphs or cuda_kernels_agree" 2>&1 | tail -8 | tee -a $LOG
echo "== done" | tee -a $LOG
