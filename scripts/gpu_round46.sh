#!/usr/bin/env bash
# What round 46 ran on the H200 (BENCHMARKS.md, "Round 46 on the H200"), on one warm machine, calls
# back to back, each stage under its own timeout, logs and JSON under $OUT:
#   bash scripts/gpu_round46.sh 1   # carry .whl: adaptive vs fixed vs plain, Qwen3-8B, 1 … 256 sequences at
#        # the issue's 256 new tokens (the fit of the drafts' marginal cost, new), then HTTP bursts (demo pair)
#   bash scripts/gpu_round46.sh 2   # the 16k prompt among 32 decoders at the default budget and at 512; the
#        # multi-turn 16k runs (Qwen3.5-4B, then Qwen3-8B) each in a fresh process with an empty Triton cache
#   bash scripts/gpu_round46.sh 3   # the hybrid (Qwen3.5-4B) at one sequence; tests/gpu's adaptive and graph tests
#   bash scripts/gpu_round46.sh 4   # not run yet (the next session): where the hybrid's 64-token prefill after a
#        # cached 16k prefix spends its ~75 ms (scripts/prefill_profile.py), against the dense Qwen3-8B's 14 ms
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, 128 + 256 tokens" timeout ${ADAPT_S:-330} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b.json"
  stage "HTTP: demo pair, 3 bursts of 64 x 256" timeout ${HTTP_S:-100} python3 scripts/bench_streams.py \
    --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 2 ]; then
  for budget in 2048 512; do
    stage "16k prompt during 32 decoders, budget $budget" timeout ${BURST_S:-110} $B --shape qwen3-8b --accept-len 6.5 \
      --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens $budget \
      --out "$OUT/burst16k_$budget.json"
  done
  for shape in qwen3.5-4b qwen3-8b; do
    rm -rf /tmp/triton-cold-$shape
    stage "multi-turn $shape 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold-$shape timeout ${MT_S:-170} \
      $B --shape $shape --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
      --accept-len 6.5 --out "$OUT/multiturn_$shape.json"
  done
fi
if [ "$M" = 3 ]; then
  stage "adaptive vs fixed vs plain, Qwen3.5-4B, 1" timeout ${HYB_S:-150} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3.5-4b \
    --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  timeout ${TESTS_S:-200} $T tests/gpu/test_adaptive_graphs.py tests/gpu/test_graph_dispatch.py > "$OUT/t_adaptive.log" 2>&1
  summary
fi
if [ "$M" = 4 ]; then
  for shape in qwen3.5-4b qwen3-8b; do
    echo "=== short prefill after a cached 16k prefix, $shape ($(date +%T))" | tee -a "$LOG"
    timeout ${PP_S:-200} python3 scripts/prefill_profile.py --shape $shape --prefix 16000 --tokens 64 \
      > "$OUT/prefill_profile_$shape.txt" 2>&1; grep "turn\|profiled\|ready" "$OUT/prefill_profile_$shape.txt" | tee -a "$LOG"
  done
fi
