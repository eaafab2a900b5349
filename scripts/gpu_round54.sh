#!/usr/bin/env bash
# What round 54 ran on the device (BENCHMARKS.md, "Round 54"):
#   bash scripts/gpu_round54.sh 1   # carry .whl (+ .gguf/p0 for call 3 on the same machine); an H200 (the MoE's bf16 weights): the hybrid (Qwen3.5-4B) and the
#        # MoE (Qwen3.5-35B-A3B) at one sequence, adaptive vs fixed vs plain, 256 new, after the cost table's verify
#        # probes route their rows apart (ModelRunner.idle_forward); the JSON keeps the table and the fit
. "$(dirname "$0")/gpu_prelude.sh"
M=${1:-1}
if compgen -G ".gguf/p*" > /dev/null; then bash scripts/gguf_pieces.sh keep > /dev/null || exit 1; fi   # a carried piece
if [ "$M" = 1 ]; then
  stage "the hybrid at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${HYB_S:-170} \
    $C --shape qwen3.5-4b --concurrency 1 --out "$OUT/hybrid_qwen3_5_4b.json"
  if [ -n "${FORCE_MOE:-}" ] || [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-300} \
      $C --shape qwen3.5-35b-a3b --concurrency 1 ${MOE_ARGS:-} --out "$OUT/moe_qwen3_5_35b.json"
  else echo "the MoE's bf16 weights need more than this card's memory: not run" | tee -a "$LOG"; fi
fi
#   bash scripts/gpu_round54.sh 2   # carry .whl; any card: where a prefill chunk's step goes (issue 30: a 2,048-token
#        # chunk at 1.52 × its FLOP floor, budget 512's p99 at 27 ms): one chunk after a cached prefix under
#        # torch.profiler at budgets 2,048 and 512, then the 16k prompt among 32 decoders at both budgets
if [ "$M" = 2 ]; then
  TAIL=110
  stage "a 2,048-token chunk after 14,336 cached, Qwen3-8B, profiled" timeout ${PP_S:-120} python3 scripts/prefill_profile.py \
    --shape qwen3-8b --prefix 14336 --tokens 2048 --budget 2048 --repeats 2
  stage "a 512-token chunk after 15,360 cached, Qwen3-8B, profiled" timeout ${PP_S:-120} python3 scripts/prefill_profile.py \
    --shape qwen3-8b --prefix 15360 --tokens 512 --budget 512 --repeats 2
  for budget in 2048 512; do
    stage "16k prompt during 32 decoders, budget $budget" timeout ${BURST_S:-100} $B --shape qwen3-8b --accept-len 6.5 \
      --burst 1 --burst-decoding 32 --prompt-len 16384 --max-tokens 64 --max-num-batched-tokens $budget \
      --out "$OUT/burst16k_$budget.json"
  done
fi
#   bash scripts/gpu_round54.sh 3   # carry .gguf/p1 (the demo pair's weights left behind, as in rounds 51–53): the real
#        # SmolLM2 pair, plain / fixed / adaptive at 1, 16, 64 (7 interleaved rounds, medians), after an arrival
#        # between the pace's turns takes the kept plan's median width; then adaptive step by step at 64
if [ "$M" = 3 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  SMOL_ROUNDS=${SMOL_ROUNDS:-7} SMOL_S=${SMOL_S:-330} smollm2_measure /tmp/w54
  stage "SmolLM2 adaptive step by step at 64" env BLOCKSPEC_BATCH_INVARIANT=1 timeout ${STEPS_S:-150} \
    python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft --device cuda \
    --dtype bfloat16 --concurrency 64 --rounds 3 --max-tokens 128 --out "$OUT/smollm2_steps_c64.json"
fi
#   FORCE_MOE=1 MOE_ARGS="--gpu-memory-utilization 0.96" bash scripts/gpu_round54.sh 4   # the MoE alone (an 80 GB
#        # card, after the weights are allocated in bf16 from the start)
if [ "$M" = 4 ]; then
  stage "the MoE at 1 sequence, adaptive vs fixed vs plain, 256 new" timeout ${MOE_S:-330} \
    $C --shape qwen3.5-35b-a3b --concurrency 1 ${MOE_ARGS:-} --out "$OUT/moe_qwen3_5_35b.json"
fi
#   bash scripts/gpu_round54.sh 5   # carry .whl: HTTP bursts (the demo pair, 3 bursts of 64 × 256 streams, fresh prompts),
#        # the server's startup heap frozen (the default) and not (BLOCKSPEC_GC_FREEZE=0), twice each, alternated
if [ "$M" = 5 ]; then
  for run in ${RUNS:-1 2}; do
    for freeze in 1 0; do
      stage "HTTP: demo pair, 3 bursts of 64 x 256, startup heap frozen: $freeze (run $run)" env BLOCKSPEC_GC_FREEZE=$freeze \
        timeout ${HTTP_S:-80} python3 scripts/bench_streams.py --serve-args "--device cuda --max-num-seqs 64" \
        --requests 64 --max-tokens 256 --bursts 3
    done
  done
fi
#   bash scripts/gpu_round54.sh 6   # carry .whl: the GPU tests the session's changes touch (the weights allocated in
#        # their dtype, the warm-up's logits, the MoE probe rows, arrivals between the pace's turns), four processes
if [ "$M" = 6 ]; then
  (timeout ${TESTS_S:-270} $T tests/gpu/test_warm_gpu.py tests/gpu/test_moe_gpu.py > "$OUT/t_warm_moe.log" 2>&1) &
  (timeout ${TESTS_S:-270} $T tests/gpu/test_adaptive_graphs.py tests/gpu/test_overlap_gpu.py > "$OUT/t_adaptive.log" 2>&1) &
  (timeout ${TESTS_S:-270} $T tests/gpu/test_fp8.py -k "decode_on_the_gpu or experts or replays" > "$OUT/t_fp8.log" 2>&1) &
  (timeout ${TESTS_S:-270} $T tests/gpu/test_gpu.py tests/gpu/test_graph_dispatch.py > "$OUT/t_gpu.log" 2>&1) &
  wait
  summary
fi
#   bash scripts/gpu_round54.sh 7   # carry .gguf/p1 after `0` (.whl) and `gguf_pieces.sh keep` (.gguf/p0): SmolLM2
#        # adaptive step by step at 1 request (round 54's 7 rounds: 0.87–0.98 × fixed in every one)
if [ "$M" = 7 ]; then
  bash scripts/gguf_pieces.sh join /tmp/smollm2.gguf || exit 1
  stage "SmolLM2 adaptive step by step at 1" env BLOCKSPEC_BATCH_INVARIANT=1 timeout ${STEPS_S:-150} \
    python3 scripts/adaptive_steps.py --model /tmp/smollm2.gguf --draft blockspec/demo/smollm2-draft --device cuda \
    --dtype bfloat16 --concurrency 1 --rounds 3 --max-tokens 128 --out "$OUT/smollm2_steps_c1.json"
fi
#   bash scripts/gpu_round54.sh 8   # carry .whl (next session): HTTP bursts with the client a thread per stream and
#        # with 8 client processes (each warmed on /health, as a load balancer's probe), the heap frozen
if [ "$M" = 8 ]; then
  for client in threads processes; do
    stage "HTTP: demo pair, 3 bursts of 64 x 256, client: $client" timeout ${HTTP_S:-90} python3 scripts/bench_streams.py \
      --serve-args "--device cuda --max-num-seqs 64" --requests 64 --max-tokens 256 --bursts 3 --burst-client $client
  done
fi
#   bash scripts/gpu_round54.sh 9   # carry .whl (next session, an H200): adaptive vs fixed vs plain, Qwen3-8B, 1 … 256,
#        # on the tree with the pace's rule, the learning cycles' fit and the per-term ridge (issue 31's default)
if [ "$M" = 9 ]; then
  stage "adaptive vs fixed vs plain, Qwen3-8B, 1…256, budget 2048" timeout ${ADAPT_S:-420} \
    $C --shape qwen3-8b --concurrency 1,8,32,64,128,256 --out "$OUT/adaptive_qwen3_8b.json"
fi
