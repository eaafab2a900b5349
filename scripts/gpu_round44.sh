#!/usr/bin/env bash
# This session's H200 calls, on one warm machine, each within 30 s of the last (the SmolLM2 GGUF
# travels in three pieces, one a call, and the recipe's data and drafts stay in /tmp between calls):
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round44.sh 1   # carry .whl .gguf/p0: the GPU tests
#        # a DFlash step runs the draft readout in (round 43's last call was cut before them)
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round44.sh 2   # carry .gguf/p1: the hybrid at 1 (issue 31: 4.0
#        # of plain is the goal), adaptive vs fixed at 8 sequences, where the host's time goes (0.959 of fixed)
#   bash scripts/gguf_pieces.sh keep && bash scripts/gpu_round44.sh 3   # carry .gguf/p2: the GGUF joined; prompts
#        # and responses (issue 32's recipe, seed 0)
#   bash scripts/gpu_round44.sh 4   # two drafts trained side by side: the shipped d1b8 continued, and a 2-layer
#        # block-16 draft grown from it (train-draft --init-from a shallower draft), both on the target's labels
#   bash scripts/gpu_round44.sh 5   # held-out acceptance of all three, and plain vs fixed vs adaptive tok/s
#   bash scripts/gpu_round44.sh 6   # carry .whl (a fresh machine): which GEMMs round a row by the rows beside it
#        # (bf16 DFlash ≠ plain on 26 of 32 SmolLM2 prompts); adaptive vs fixed at 1 and 8 sequences again
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
GGUF=/tmp/smollm2.gguf; WORK=/tmp/w
export SWEEP="d1b8 d2b16" LABELS=target INIT_d1b8=blockspec/demo/smollm2-draft INIT_d2b16=blockspec/demo/smollm2-draft
export STEPS=${STEPS:-4000}
if [ "$M" = 1 ]; then
  TESTS_S=${TESTS_S:-150} bash "$(dirname "$0")/gpu_round43.sh" 6      # its three test groups, 150 s each
fi
if [ "$M" = 2 ]; then
  stage "hybrid Qwen3.5-4B at 1 (plain, fixed, adaptive; the rollback's one copy)" timeout ${HYB_S:-100} \
    $A --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid.json"
  echo "=== qwen3-8b at 8: fixed vs adaptive, each phase's host time, adaptive under cProfile ($(date +%T))" | tee -a "$LOG"
  timeout ${HSPLIT_S:-130} python3 scripts/host_split.py --shape qwen3-8b --concurrency 8 --modes fixed,adaptive \
    --profile > "$OUT/host_split_8.txt" 2>&1; grep '^{' "$OUT/host_split_8.txt" | tee -a "$LOG"
fi
if [ "$M" = 3 ]; then
  bash scripts/gguf_pieces.sh join $GGUF || exit 1
  UNTIL=responses RESPONSE_S=${RESPONSE_S:-270} scripts/smollm2_device_run.sh $GGUF $WORK "$OUT" full 2>&1 | tail -40 | tee -a "$LOG"
fi
if [ "$M" = 4 ]; then
  UNTIL=train TRAIN_S=${TRAIN_S:-480} scripts/smollm2_device_run.sh $GGUF $WORK "$OUT" full 2>&1 | tail -40 | tee -a "$LOG"
fi
if [ "$M" = 5 ]; then
  touch $WORK/train.done
  scripts/smollm2_device_run.sh $GGUF $WORK "$OUT" full 2>&1 | tail -60 | tee -a "$LOG"
fi
if [ "$M" = 6 ]; then
  stage "F.linear over M rows vs each row alone, bf16 and fp32" timeout 60 python3 scripts/batch_invariance.py
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1 and 8" timeout ${ADAPT_S:-130} \
    $A --shape qwen3-8b --concurrency 1,8 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
fi
