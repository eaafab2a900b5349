#!/usr/bin/env bash
# What round 48 ran on the H200 (BENCHMARKS.md, "Round 48 on the H200"), each stage under its own
# timeout, logs and JSON under $OUT:
#   bash scripts/gpu_round48.sh 1   # carry .whl: long prefill chunks on FlashAttention (kernels/flash_prefill.py)
#        # against the Triton kernel: the attention alone (scripts/prefill_attention_bench.py); the GPU tests that
#        # hold it (attention, warm-up, graphs) in two processes; the 16k prompt among 32 decoders at budgets
#        # 2048 and 512 and a 512 / 2048-token chunk after a cached 15k prefix, each with FlashAttention on and off
#   bash scripts/gpu_round48.sh 2   # prefill attention: the Triton paged kernel, FlashAttention-2, cuDNN and our
#        # Triton FA kernel (kernels/prefill_attention.py) with its tile sweep; the hybrid's cold multi-turn (fresh
#        # process, empty Triton cache); HTTP bursts (demo pair) from one event loop and from a thread per stream
#   bash scripts/gpu_round48.sh 3   # our Triton FlashAttention kernel wired in: the GPU tests (attention, warm-up,
#        # graphs); the three prefill attentions side by side; the 16k prompt among 32 decoders, ours vs the paged kernel
#   bash scripts/gpu_round48.sh 4   # adaptive vs fixed vs plain, Qwen3-8B, 1 … 256 (the host path's per-sequence
#        # work cut)
#   bash scripts/gpu_round48.sh 5   # not run yet (the next session): the drafts fitted to the budget (fit_budget,
#        # allocate max_rows) at 1 … 256 and at 128 / 256 under 4,096 tokens; the GPU tests of the scheduler's and
#        # the pool sizing's changes
#   bash scripts/gpu_round48.sh 6   # not run yet: the hybrid's cold multi-turn with room to finish (call 2's 180 s
#        # limit cut it during its engines' graph capture)
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if [ "$M" = 1 ]; then
  stage "prefill attention: Triton kernel vs FlashAttention varlen" timeout ${PA_S:-120} \
    python3 scripts/prefill_attention_bench.py --out "$OUT/prefill_attention.json"
  (timeout ${TESTS_S:-230} $T tests/gpu/test_attention_kernels.py tests/gpu/test_warm_gpu.py > "$OUT/t_attention.log" 2>&1) &
  (timeout ${TESTS_S:-230} $T tests/gpu/test_ragged_graphs.py tests/gpu/test_graph_dispatch.py tests/gpu/test_gpu.py \
    > "$OUT/t_graphs.log" 2>&1) &
  wait
  summary
  for attn in flash triton; do
    for budget in 2048 512; do
      stage "16k prompt during 32 decoders, budget $budget, prefill attention $attn" env BLOCKSPEC_PREFILL_ATTENTION=$attn \
        timeout ${BURST_S:-90} $B --shape qwen3-8b --accept-len 6.5 --burst 1 --burst-decoding 32 --prompt-len 16384 \
        --max-tokens 64 --max-num-batched-tokens $budget --out "$OUT/burst16k_${budget}_$attn.json"
    done
    stage "a 512 / 2048-token chunk after 15,360 cached, Qwen3-8B, prefill attention $attn" \
      env BLOCKSPEC_PREFILL_ATTENTION=$attn timeout ${PP_S:-100} python3 scripts/prefill_profile.py --shape qwen3-8b \
      --prefix 15360 --tokens 512,2048 --budget 2048 --repeats 2
  done
fi
if [ "$M" = 2 ]; then
  echo "=== prefill attention: Triton kernel, FlashAttention-2, cuDNN, our Triton FA kernel and its tiles ($(date +%T))" | tee -a "$LOG"
  timeout ${PA_S:-230} python3 scripts/prefill_attention_bench.py --shapes qwen3-8b,qwen3.5-4b --tokens 512,2048 \
    --triton-fa --sweep --sweep-budget ${SWEEP_S:-100} --out "$OUT/prefill_sweep.json" 2>&1 | tee "$OUT/prefill_sweep.txt" | tail -60 >> "$LOG"
  rm -rf /tmp/triton-cold
  stage "multi-turn qwen3.5-4b 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-180} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn_qwen3.5-4b.json"
  for client in async threads; do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, $client client" timeout ${HTTP_S:-70} python3 scripts/bench_streams.py \
      --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3 --burst-client $client
  done
fi
if [ "$M" = 3 ]; then
  (timeout ${TESTS_S:-240} $T tests/gpu/test_attention_kernels.py tests/gpu/test_warm_gpu.py > "$OUT/t_attention.log" 2>&1) &
  (timeout ${TESTS_S:-240} $T tests/gpu/test_ragged_graphs.py tests/gpu/test_graph_dispatch.py tests/gpu/test_gpu.py \
    > "$OUT/t_graphs.log" 2>&1) &
  wait
  summary
  stage "prefill attention: the paged kernel vs ours (routed) vs FlashAttention-2" timeout ${PA_S:-90} \
    python3 scripts/prefill_attention_bench.py --shapes qwen3-8b,qwen3.5-4b --tokens 128,256,512,2048 \
    --out "$OUT/prefill_attention_routed.json"
  for attn in triton-fa triton; do
    for budget in 2048 512; do
      stage "16k prompt during 32 decoders, budget $budget, prefill attention $attn" env BLOCKSPEC_PREFILL_ATTENTION=$attn \
        timeout ${BURST_S:-80} $B --shape qwen3-8b --accept-len 6.5 --burst 1 --burst-decoding 32 --prompt-len 16384 \
        --max-tokens 64 --max-num-batched-tokens $budget --out "$OUT/burst16k_${budget}_$attn.json"
    done
  done
  stage "HTTP: demo pair, 3 bursts of 64 x 256, the server's own first-token time beside the client's" \
    timeout ${HTTP_S:-70} python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" \
    --requests 64 --max-tokens 256 --bursts 3
fi
if [ "$M" = 4 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, 128 + 256 tokens" timeout ${ADAPT_S:-300} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
if [ "$M" = 5 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048 (drafts fitted to it)" timeout ${ADAPT_S:-280} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b_2048.json"
  stage "the same at 128 and 256, budget 4096 (round 46's)" timeout ${ADAPT_S:-200} \
    $B --compare-speculation --accept-profile latent:6.5 --prompt-len 128 --max-tokens 256 --shape qwen3-8b \
    --concurrency 128,256 --max-num-batched-tokens 4096 --out "$OUT/adaptive_qwen3_8b_4096.json"
  timeout ${TESTS_S:-200} $T "tests/gpu/test_ragged_graphs.py::test_the_pool_fills_the_memory_it_is_given" \
    tests/gpu/test_adaptive_graphs.py tests/gpu/test_overlap_gpu.py > "$OUT/t_budget.log" 2>&1
  summary
fi
if [ "$M" = 6 ]; then
  rm -rf /tmp/triton-cold
  stage "multi-turn qwen3.5-4b 16k, empty Triton cache" env TRITON_CACHE_DIR=/tmp/triton-cold timeout ${MT_S:-400} \
    $B --shape qwen3.5-4b --multi-turn 1x3 --system-prompt-tokens 16000 --user-tokens 64 --max-tokens 128 \
    --accept-len 6.5 --out "$OUT/multiturn_qwen3.5-4b.json"
fi
