#!/usr/bin/env bash
# The SmolLM2 draft in one bounded run: prompts, responses, a three-draft training sweep, held-out
# acceptance and tok/s (scripts/smollm2_recipe.py has the stages). Every stage runs under its own
# `timeout`; the seconds each took go to WORK/stages.jsonl.
#
#   [UNTIL=responses|train] [SWEEP="d1b8 ..."] [RESPONSE_S=S] [TRAIN_S=S] [STEPS=N] [LABELS=target] [INIT_d1b8=DIR] \
#     scripts/smollm2_device_run.sh GGUF WORK OUT [full|toy]
#
# full: the H200 call (≤ 480 s). toy: the same commands at a few prompts on CPU (a check before
# the device call). OUT receives log.txt, results.json, the drafts and the data (gzipped, in
# 15 MB pieces). A stage whose output exists is skipped and a draft's training resumes from its
# checkpoint, so a run cut short continues where it stopped when called again on the same WORK;
# on one warm machine, calls of one stage each (UNTIL; SWEEP names the drafts to train, of d1b8
# d1b16 d2b16 d2b8, and d4b8 d6b8 for a size ladder; RESPONSE_S and TRAIN_S their seconds) spread a longer recipe over several calls.
set -o pipefail
GGUF=$1; WORK=$2; OUT=$3; SCALE=${4:-full}
UNTIL=${UNTIL:-measure}
SWEEP=${SWEEP:-d1b8 d1b16 d2b16}
LABELS=${LABELS:-tokens}   # train-draft --labels: target = the target's greedy choices on sampled rows too; distill = its top-32 distribution
# INIT_<draft>=DIR: train-draft --init-from for that draft of the sweep (e.g. INIT_d1b8=blockspec/demo/smollm2-draft)
mkdir -p "$WORK" "$OUT"
START=$(date +%s)
SEED=0
if [ "$SCALE" = toy ]; then
  DEV="--device cpu --threads 1"; TRAIN_DEV="--device cpu"
  PROMPTS="--magpie 8 --magpie-tokens 40 --seeds 20 --held-out-per-mille 300 --budget-s 60 --max-num-seqs 8 --workers 2"
  RESPONSES="--limit 24 --seq-len 160 --max-response 48 --temperatures 0.7 --budget-s 60 --max-num-seqs 24 --workers 2"
  TRAIN="--batch-size 4 --seq-len 160 --max-seconds 40 --save-every 3"
  STEPS1=6; STEPS2=4
  MEASURE="--limit 1 --max-tokens 12 --concurrency 1,2 --block-sizes 8"
  T_PROMPTS=150; T_RESPONSES=150; T_TRAIN=200; T_END=900
else
  DEV="--device cuda"; TRAIN_DEV="--device cuda"
  PROMPTS="--magpie 30000 --magpie-tokens 128 --seeds 6000 --budget-s 25 --max-num-seqs 256 --workers 8"
  RESPONSES="--seq-len 384 --max-response 320 --temperatures 0.7,0.7 --budget-s 115 --max-num-seqs 256 --workers 8"
  TRAIN="--batch-size 64 --seq-len 384 --max-seconds 100 --save-every 400"
  STEPS1=900; STEPS2=700
  MEASURE="--limit 32 --max-tokens 128 --concurrency 1,16,64 --sets chat"
  T_PROMPTS=120; T_RESPONSES=170; T_TRAIN=140; T_END=465
fi
if [ -n "$RESPONSE_S" ]; then RESPONSES="$RESPONSES --budget-s $RESPONSE_S"; T_RESPONSES=$((RESPONSE_S + 90)); fi
if [ -n "$TRAIN_S" ]; then TRAIN="$TRAIN --max-seconds $TRAIN_S"; T_TRAIN=$((TRAIN_S + 40)); fi
# The cosine schedule spans --steps: a run cut by its seconds before then is never annealed, so a
# longer training sets STEPS to what its calls (resumed) will reach.
if [ -n "$STEPS" ]; then STEPS1=$STEPS; STEPS2=$STEPS; fi

stage() {   # stage NAME SECONDS command...
  local name=$1 limit=$2 started rc
  shift 2
  started=$(date +%s)
  echo "=== $name (limit ${limit}s, at +$((started - START))s)"
  timeout "$limit" "$@"
  rc=$?
  echo "{\"stage\": \"$name\", \"seconds\": $(($(date +%s) - started)), \"rc\": $rc}" >> "$WORK/stages.jsonl"
  echo "=== $name: rc $rc, $(($(date +%s) - started)) s"
  return $rc
}

train() {   # train NAME STEPS flags...: one draft of the sweep, under the train stage's limit
  local name=$1 steps=$2 resume=""
  shift 2
  [ -d "$WORK/$name/checkpoints" ] && resume="--resume"
  local init="INIT_$name"
  [ -n "${!init:-}" ] && resume="$resume --init-from ${!init}"
  timeout "$T_TRAIN" python -m blockspec train-draft --target "$GGUF" --data "$WORK/responses.jsonl" \
    --out "$WORK/$name" --target-layer-ids 1,10,19,27 --mask-token-id 16 --eval-every 0 --steps "$steps" \
    --eval-prompts 0 --quiet --seed $SEED --labels $LABELS $resume $TRAIN_DEV $TRAIN "$@" >> "$WORK/$name.log" 2>&1
}

flags() {   # the sweep's drafts
  case $1 in
    d1b8) echo "$STEPS1 --num-layers 1 --block-size 8 --lr 2e-3" ;;
    d1b16) echo "$STEPS1 --num-layers 1 --block-size 16 --lr 2e-3" ;;
    d2b16) echo "$STEPS2 --num-layers 2 --block-size 16 --lr 1e-3" ;;
    d2b8) echo "$STEPS2 --num-layers 2 --block-size 8 --lr 1e-3" ;;
    d4b8) echo "$STEPS2 --num-layers 4 --block-size 8 --lr 7e-4" ;;     # the size ladder (round 58's next
    d6b8) echo "$STEPS2 --num-layers 6 --block-size 8 --lr 5e-4" ;;     # step): past the 20 MB in bf16
  esac
}

pack() {   # pack NAME: WORK/NAME's files gzipped into OUT, in pieces of 15 MB (16 MiB a file comes back)
  local name=$1
  shift
  tar -C "$WORK" -cf - "$@" | gzip -6 > "$OUT/$name.tar.gz"
  if [ "$(stat -c %s "$OUT/$name.tar.gz")" -gt 16000000 ]; then
    split -b 15000000 -d -a 1 "$OUT/$name.tar.gz" "$OUT/$name.tar.gz." && rm "$OUT/$name.tar.gz"
  fi
}

for d in $SWEEP; do
  [ -n "$(flags "$d")" ] || { echo "SWEEP: unknown draft $d (d1b8, d1b16, d2b16, d2b8, d4b8, d6b8)" >&2; exit 1; }
done
[ -f "$WORK/prompts.train.jsonl" ] || stage prompts $T_PROMPTS python scripts/smollm2_recipe.py prompts --target "$GGUF" --work "$WORK" --seed $SEED $DEV $PROMPTS || exit 1
[ -f "$WORK/responses.jsonl" ] || stage responses $T_RESPONSES python scripts/smollm2_recipe.py responses --target "$GGUF" --work "$WORK" --seed $SEED $DEV $RESPONSES || exit 1
if [ "$UNTIL" = responses ]; then
  pack data prompts.train.jsonl prompts.heldout.jsonl responses.jsonl responses.stats.json
  ls -l "$OUT"; exit 0
fi
# The sweep: the drafts train at once on the one device (none fills it alone).
if [ ! -f "$WORK/train.done" ]; then
  echo "=== train $SWEEP (limit ${T_TRAIN}s, at +$(($(date +%s) - START))s)"
  TRAINED=$(date +%s)
  for d in $SWEEP; do
    train "$d" $(flags "$d") &
  done
  wait
  echo "{\"stage\": \"train\", \"drafts\": \"$SWEEP\", \"seconds\": $(($(date +%s) - TRAINED))}" >> "$WORK/stages.jsonl"
  [ "$UNTIL" = train ] || touch "$WORK/train.done"
fi
for d in $SWEEP; do tail -n 2 "$WORK/$d.log"; done
DRAFTS=""      # the new drafts first, the shipped one last (the baseline; tok/s is measured before it)
for d in $SWEEP; do [ -f "$WORK/$d/model.safetensors" ] && DRAFTS="$DRAFTS$WORK/$d,"; done
DRAFTS="${DRAFTS}blockspec/demo/smollm2-draft"
LEFT=$((T_END - ($(date +%s) - START)))
[ "$UNTIL" = train ] || stage measure $LEFT python scripts/smollm2_recipe.py measure --target "$GGUF" --work "$WORK" \
  --seed $SEED $DEV --drafts "$DRAFTS" $MEASURE

python - "$WORK" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {}
for name in ("prompts.stats.json", "responses.stats.json", "measure.json"):
    if (work / name).exists():
        result[name.split(".")[0]] = json.loads((work / name).read_text())
result["stages"] = [json.loads(l) for l in (work / "stages.jsonl").read_text().splitlines()]
result["train"] = {d.name: [json.loads(l) for l in (d / "train_log.jsonl").read_text().splitlines()][-3:]
                   for d in sorted(work.iterdir()) if (d / "train_log.jsonl").exists()}
(out / "results.json").write_text(json.dumps(result, indent=1))
EOF
for d in $SWEEP; do
  [ -f "$WORK/$d/model.safetensors" ] && pack "$d" "$d/config.json" "$d/model.safetensors" "$d/train_log.jsonl"
done
[ "$UNTIL" = train ] || pack data prompts.train.jsonl prompts.heldout.jsonl responses.jsonl
ls -l "$OUT"
echo "=== done at +$(($(date +%s) - START))s"
