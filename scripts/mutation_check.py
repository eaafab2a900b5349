"""Mutation check (issue 16): plant each named mutant, one at a time, in a scratch copy of the
repository and run the CPU tests that should catch it; every mutant must be killed.

    OMP_NUM_THREADS=1 python scripts/mutation_check.py                 # all mutants
    OMP_NUM_THREADS=1 python scripts/mutation_check.py bonus-p-n-1      # some, by name
    OMP_NUM_THREADS=1 python scripts/mutation_check.py --group issue36  # one issue's mutants

A mutant's tests are pytest arguments: files or node ids (file::test), so each runs only the
tests meant to catch it.

Not part of the default test run (it runs the targeted tests once per mutant). A mutant whose
`old` text is missing from its file is an error, not a kill: the list must track the code.
Exit status 0 only when every mutant is killed and the unmutated copy passes the same tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = "blockspec/sampling.py"
TIMEOUT_S = 900                                  # per pytest run


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    group: str = ""                              # the issue whose invariants it plants a bug in


PREFIX = "blockspec/cache/prefix.py"
SCHEDULER = "blockspec/engine/scheduler.py"
POLICY = "blockspec/engine/spec/policy.py"
FP8 = "blockspec/kernels/fp8.py"
WAKEUPS = "blockspec/server/wakeups.py"
ENGINE = "blockspec/engine/engine.py"
RUNNER = "blockspec/engine/model_runner.py"
ATTENTION = "blockspec/kernels/attention.py"
LAYERS_FP8 = "blockspec/layers/fp8.py"
APP = "blockspec/server/app.py"
MEASURE = "blockspec/demo/measure.py"
BENCH_STREAMS = "scripts/bench_streams.py"
FP8_TESTS = "tests/test_fp8_targets.py"
REQUEST = "blockspec/engine/request.py"
SEQUENCE = "blockspec/engine/sequence.py"
DFLASH = "blockspec/engine/spec/dflash.py"
DFLASH_TESTS = "tests/test_dflash.py"
STOP_TEST = DFLASH_TESTS + "::test_stop_id_inside_an_accepted_block_ends_right_after_it"


MUTANTS = [
    Mutant("bonus-p-n-1", SAMPLING,
           "return n, int(sample_from_probs(p[n], generator))",
           "return n, int(sample_from_probs(p[n - 1], generator))",
           ("tests/test_acceptance.py",)),
    Mutant("accept-no-cumprod", "blockspec/engine/spec/dflash.py",
           "accepted = agree.cumprod(1).sum(1, keepdim=True)",
           "accepted = agree.sum(1, keepdim=True)",
           ("tests/test_acceptance.py", "tests/test_dflash.py")),
    Mutant("top-p-off", SAMPLING,
           "if params.top_p < 1.0:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("min-p-off", SAMPLING,
           "if params.min_p > 0.0:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("top-k-off", SAMPLING,
           "if params.top_k > 0 and params.top_k < scores.shape[-1]:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("abort-check-removed", "blockspec/engine/engine.py",
           "            if seq.request.is_aborted:\n                self._end(seq, \"abort\")",
           "            if False:\n                self._end(seq, \"abort\")",
           ("tests/test_acceptance.py", "tests/test_dflash.py", "tests/test_engine.py")),
    Mutant("rollback-off-by-one", "blockspec/engine/scheduler.py",
           "seq.num_cached += num_accepted + 1",
           "seq.num_cached += num_accepted + 2",
           ("tests/test_acceptance.py", "tests/test_dflash.py")),
    Mutant("state-select-num-kept", "blockspec/cache/state_pool.py",
           "step_states[rows, num_kept - 1]",
           "step_states[rows, (num_kept).clamp_max(step_states.shape[1] - 1)]",
           ("tests/test_hybrid.py",)),
    Mutant("stop-cut-removed", "blockspec/engine/request.py",
           "                allowed = allowed[: i + 1]\n",
           "",
           ("tests/test_dflash.py",)),
    Mutant("draft-context-off-by-one", "blockspec/engine/model_runner.py",
           "context_lens=meta.context_lens - width",
           "context_lens=meta.context_lens - width + 1",
           ("tests/test_dflash.py",)),
    Mutant("shutdown-forgets-waiting", "blockspec/engine/engine.py",
           "for seq in [*self.scheduler.running, *self.scheduler.waiting]:",
           "for seq in [*self.scheduler.running]:",
           ("tests/test_acceptance.py::test_engine_shutdown_aborts_running_and_waiting_requests",)),
    # invariant 7: stop strings are cut once, after; a partial match is held back
    Mutant("stop-string-holdback-off", "blockspec/server/output.py",
           "keep = partial_suffix_len(self._held, self._stop)",
           "keep = 0",
           ("tests/test_output.py",)),
    # invariant 8: the id that completes a stop string is counted, nothing after it
    Mutant("usage-count-after-stop", "blockspec/server/output.py",
           "            if self._add_text(self._detokenizer.add([token_id]), delta):\n"
           "                return self._finish(delta, \"stop\", stop_hit=True)\n"
           "        if finished is None:\n",
           "            if self._add_text(self._detokenizer.add([token_id]), delta):\n"
           "                self.completion_tokens -= 1\n"
           "                return self._finish(delta, \"stop\", stop_hit=True)\n"
           "        if finished is None:\n",
           ("tests/test_output.py",)),
    # invariant 3: a finished or preempted sequence's pages (and state slot) go back
    Mutant("pages-kept-on-finish", "blockspec/engine/scheduler.py",
           "    def finish(self, seq: Sequence) -> None:\n        self.cache.release(seq)\n",
           "    def finish(self, seq: Sequence) -> None:\n        pass\n",
           ("tests/test_acceptance.py::test_abort_stops_the_plain_loop_within_one_step",
            "tests/test_reliability.py::test_a_request_whose_decoding_raises_ends_alone")),
    Mutant("pages-kept-on-preempt", "blockspec/engine/scheduler.py",
           "        self.cache.release(seq)\n        seq.reset_for_recompute()\n",
           "        seq.reset_for_recompute()\n",
           ("tests/test_reliability.py::test_out_of_memory_in_a_batch_preempts_and_the_output_stays_exact",
            "tests/test_batching.py")),
    Mutant("allocator-loses-a-page", "blockspec/cache/manager.py",
           "            if self._refs[page] == 0:\n                self._free.append(page)",
           "            if self._refs[page] == 0 and page != pages[0]:\n                self._free.append(page)",
           ("tests/test_acceptance.py::test_abort_stops_the_plain_loop_within_one_step", "tests/test_scheduler.py")),
    # issue 20: each page freed exactly once; decoding never waits behind prefill
    Mutant("release-keeps-the-block-table", "blockspec/cache/manager.py",
           "        self.pages.free(seq.block_table)\n        seq.block_table = []\n",
           "        self.pages.free(seq.block_table)\n",
           ("tests/test_scheduler.py",)),
    Mutant("prefill-always-wins", "blockspec/engine/scheduler.py",
           "        decoding = [s for s in self.running if not s.is_prefilling]\n",
           "        decoding = [s for s in self.running if not any(r.is_prefilling for r in self.running)]\n",
           ("tests/test_scheduler.py",)),
    # the CUDA-graph path: padding rows write only page 0 and read only state slot 0
    Mutant("graph-padding-writes-page-1", "blockspec/engine/model_runner.py",
           "        tables += [0] * (num_padding * cols)\n",
           "        tables += [1] * (num_padding * cols)\n",
           ("tests/test_batching.py::test_padding_rows_stay_inside_page_0_when_the_block_outgrows_a_page",)),
    Mutant("graph-padding-uses-state-slot-1", "blockspec/engine/model_runner.py",
           "        state_slots += [0] * num_padding\n",
           "        state_slots += [1] * num_padding\n",
           ("tests/test_batching.py::test_padded_graph_path_batch_equals_alone",)),
    # invariant 6: the draft's context features are the outputs of layers l (hidden_states[l + 1])
    Mutant("features-miss-the-residual", "blockspec/models/base.py",
           "            if i in capture_layers:\n                captured[i] = x + residual\n",
           "            if i in capture_layers:\n                captured[i] = x\n",
           ("tests/test_dflash.py::test_context_features_are_transformers_hidden_states_of_the_layer_ids",)),
    # invariant 4: the chat template's turn-end tokens are stop ids
    Mutant("turn-end-not-a-stop-id", "blockspec/tokenizer.py",
           'TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>",',
           'TURN_END_TOKENS = ("<|endoftext|>",',
           ("tests/test_tokenizer.py::test_stop_token_ids",
            "tests/test_tokenizer.py::test_turn_end_tokens_are_stop_ids_whatever_eos_says")),
    # reliability (issue 14): a sequence's own failure is its own; out of memory preempts;
    # the drain ends what is left; merged events keep every token
    Mutant("fault-fails-the-batch", "blockspec/engine/engine.py",
           "        except torch.OutOfMemoryError:\n            raise\n        except Exception as exc:\n"
           "            logger.exception(",
           "        except torch.OutOfMemoryError:\n            raise\n        except ZeroDivisionError as exc:\n"
           "            logger.exception(",
           ("tests/test_reliability.py::test_a_request_whose_decoding_raises_ends_alone",)),
    Mutant("oom-not-preempted", "blockspec/engine/engine.py",
           "        if out_of_memory:\n            self._preempt_after_oom(",
           "        if False:\n            self._preempt_after_oom(",
           ("tests/test_reliability.py::test_out_of_memory_in_a_batch_preempts_and_the_output_stays_exact",)),
    Mutant("drain-never-interrupts", "blockspec/server/state.py",
           "        for generation in list(self.generations):\n            generation.interrupt()\n",
           "        for generation in []:\n            generation.interrupt()\n",
           ("tests/test_reliability.py::test_sigterm_drains_then_ends_every_open_request_with_done",)),
    # issue 25's audit: the two invariants no test held
    Mutant("logit-bias-after-penalties", "blockspec/engine/logits.py",
           "        if self.bias is not None:\n            scores += self.bias\n        if self.params.min_tokens:\n"
           "            self._mask_stops(scores, offset, completed)\n        if self.has_counts:\n"
           "            self._penalise(scores, prefix, offset)\n",
           "        if self.params.min_tokens:\n            self._mask_stops(scores, offset, completed)\n"
           "        if self.has_counts:\n            self._penalise(scores, prefix, offset)\n"
           "        if self.bias is not None:\n            scores += self.bias\n",
           ("tests/test_logits.py::test_logit_bias_comes_before_the_penalties",)),
    Mutant("accepted-counts-drafts", "blockspec/engine/engine.py",
           "            self.counters.spec_accepted_tokens += request.stats.accepted_tokens\n",
           "            self.counters.spec_accepted_tokens += request.stats.accepted_tokens + request.stats.draft_tokens\n",
           ("tests/test_server.py::test_spec_accepted_tokens_counts_accepted_drafts_only",)),
    # adaptive speculation (issue 21): a width k is never exceeded, k = 0 runs no draft, the
    # calibration counts only judged drafts, the allocation pays for the draft
    Mutant("greedy-accepts-past-k", "blockspec/engine/spec/dflash.py",
           "            agree = agree * verified\n",
           "",
           ("tests/test_adaptive.py::test_greedy_random_widths_equals_plain_alone_batched_and_padded",)),
    Mutant("sampled-judges-past-k", "blockspec/engine/spec/dflash.py",
           "processed.get(b, logits[b, : k + 1]), k)",
           "processed.get(b, logits[b]), width - 1)",
           ("tests/test_adaptive.py::test_sampled_accept_never_reads_past_k",)),
    Mutant("draft-runs-at-k-0", "blockspec/engine/model_runner.py",
           "drafting = [b for b, k in enumerate(num_drafts) if k > 0]",
           "drafting = list(range(len(num_drafts)))",
           ("tests/test_adaptive.py::test_greedy_fixed_width_equals_plain_and_accepts_at_most_k",)),
    Mutant("calibration-counts-unjudged", "blockspec/engine/spec/policy.py",
           "judged = np.broadcast_to(slot < np.minimum(k, a + 1), bins.shape)",
           "judged = np.broadcast_to(slot < k, bins.shape)",
           ("tests/test_adaptive.py::test_calibration_learns_an_overconfident_draft_and_each_sequence_its_own",)),
    Mutant("allocation-forgets-the-draft", "blockspec/engine/spec/policy.py",
           "forwards = costs.target(rows) + costs.draft(drafting, width)",
           "forwards = costs.target(rows)",
           ("tests/test_adaptive.py::test_the_allocation_is_the_best_of_every_greedy_prefix",)),
    Mutant("draft-priced-for-everyone", "blockspec/engine/spec/policy.py",
           "forwards = costs.target(rows) + costs.draft(drafting, width)",
           "forwards = costs.target(rows) + costs.draft((drafting > 0) * num_seqs, width)",
           ("tests/test_adaptive.py::test_a_sequence_whose_draft_does_not_pay_gets_no_draft_forward",)),
    Mutant("merge-drops-tokens", "blockspec/server/generation.py",
           "return TokenEvent(then.request_id, first.token_ids + then.token_ids,",
           "return TokenEvent(then.request_id, then.token_ids,",
           ("tests/test_reliability.py::test_a_reader_that_stops_reading_stalls_nobody",)),
    # issue 36: the invariants of the token-level engine, the prefix cache and the policy that
    # an audit found no test holding, each with its own test
    Mutant("hit-covers-the-last-position", PREFIX,
           "hit = self.prefix.match(seq.tokens, seq.prefill_len - 1)",
           "hit = self.prefix.match(seq.tokens, seq.prefill_len)",
           ("tests/test_prefix_engine.py::test_a_fully_cached_prompt_of_whole_pages_still_recomputes_its_last_position",),
           "issue36"),
    Mutant("preempted-lookup-counted-again", PREFIX,
           "        if seq.num_preemptions == 0:\n            seq.request.stats.cached_tokens = seq.num_cached\n",
           "        if True:\n            seq.request.stats.cached_tokens = seq.num_cached\n",
           ("tests/test_prefix_cache.py::test_a_preempted_sequence_is_looked_up_once",), "issue36"),
    Mutant("grow-evicts-past-the-free-list", PREFIX,
           "self.prefix.evict(self.pages_needed(seq, num_positions) - self.pages.num_free)",
           "self.prefix.evict(self.pages_needed(seq, num_positions))",
           ("tests/test_prefix_cache.py::test_growing_evicts_only_the_pages_the_free_list_cannot_cover",), "issue36"),
    Mutant("snapshot-evicts-the-newest", PREFIX,
           "self._release_snapshot(min(held, key=lambda n: n.last_used))",
           "self._release_snapshot(max(held, key=lambda n: n.last_used))",
           ("tests/test_prefix_cache.py::test_the_least_recently_used_of_several_snapshots_is_evicted",), "issue36"),
    Mutant("usage-counts-the-padding-page", "blockspec/cache/manager.py",
           "return 1.0 - self.num_free / (self.num_pages - 1)",
           "return 1.0 - self.num_free / self.num_pages",
           ("tests/test_prefix_cache.py::test_kv_cache_usage_is_exactly_0_empty_and_1_full",), "issue36"),
    Mutant("prefix-usage-counts-the-padding-page", PREFIX,
           "return 1.0 - self.num_free_pages / self.num_usable_pages",
           "return 1.0 - self.num_free_pages / self.pages.num_pages",
           ("tests/test_prefix_cache.py::test_kv_cache_usage_is_exactly_0_empty_and_1_full",), "issue36"),
    Mutant("cached-tokens-per-choice", "blockspec/server/generation.py",
           "cached_tokens = sum(c.generation.stats.cached_tokens for c in choices if c.counts_prompt)",
           "cached_tokens = sum(c.generation.stats.cached_tokens for c in choices)",
           ("tests/test_prefix_server.py::test_n_choices_after_a_hit_count_the_cached_tokens_once",), "issue36"),
    Mutant("budget-verify-off-by-one", SCHEDULER,
           "            if num_drafts + 1 > budget:",
           "            if num_drafts > budget:",
           ("tests/test_scheduler.py::test_no_step_exceeds_the_token_budget_and_no_chunk_is_empty",), "issue36"),
    Mutant("chunks-ignore-the-budget", SCHEDULER,
           "                chunks.append((seq, length))\n                budget -= length\n",
           "                chunks.append((seq, length))\n",
           ("tests/test_scheduler.py::test_no_step_exceeds_the_token_budget_and_no_chunk_is_empty",), "issue36"),
    Mutant("preempted-to-the-back", SCHEDULER,
           "        self.waiting.appendleft(seq)",
           "        self.waiting.append(seq)",
           ("tests/test_scheduler.py::test_a_preempted_sequence_goes_back_to_the_head_of_the_waiting_queue",),
           "issue36"),
    Mutant("seeded-floor-on-the-unseeded", POLICY,
           "seq.request.params.seed is not None) else 0",
           "seq.request.params.seed is None) else 0",
           ("tests/test_adaptive.py::test_seeded_sampling_keeps_the_whole_block_under_adaptive_and_the_others_keep_theirs",),
           "issue36"),
    Mutant("widths-drop-the-floors", POLICY,
           "self.buckets, self.floors(seqs),",
           "self.buckets, None,",
           ("tests/test_adaptive.py::test_seeded_sampling_keeps_the_whole_block_under_adaptive_and_the_others_keep_theirs",),
           "issue36"),
    Mutant("calibration-row-inherited", POLICY,
           "                self.calibration.grow(row + 1)\n                self.calibration.reset(row)\n",
           "                self.calibration.grow(row + 1)\n",
           ("tests/test_adaptive.py::test_a_reused_calibration_row_starts_fresh",), "issue36"),
    Mutant("smollm-split-without-gpt2-regex", "blockspec/gguf.py",
           "pre_tokenizers.ByteLevel(add_prefix_space=False)])",
           "byte_level])",
           ("tests/test_gguf.py::test_smollm2_whitespace_runs_encode_as_transformers",), "issue36"),
    Mutant("gguf-eot-not-a-stop-id", "blockspec/gguf.py",
           'keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")',
           'keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eom_token_id")',
           ("tests/test_gguf.py::test_a_gguf_whose_end_of_turn_is_not_its_end_of_sequence_stops_on_both",), "issue36"),
    Mutant("graph-sizes-miss-max-num-seqs", "blockspec/engine/graphs.py",
           "list(range(16, max_num_seqs + 16, 16))",
           "list(range(16, max_num_seqs, 16))",
           ("tests/test_batching.py::test_graph_sizes_include_max_num_seqs_and_cover_every_batch_up_to_it",), "issue36"),
    Mutant("bench-graph-at-the-concurrency", "blockspec/bench/forward.py",
           "seqs = min(concurrency, graphs.max_draft_seqs)",
           "seqs = concurrency",
           ("tests/test_batching.py::test_the_runners_graphs_serve_every_decode_batch_and_the_bench_reads_them_at_any_concurrency",),
           "issue36"),
    # round 58's audit: the FP8 GEMM choice (kernels/fp8.py), the loop's wake-ups per step
    # (server/wakeups.py, Engine.event_batch), draw_first's shared argmax and the decode tiles
    Mutant("fp8-gemm-default-triton", FP8,
           'os.environ.get("BLOCKSPEC_FP8_GEMM", "cublas")',
           'os.environ.get("BLOCKSPEC_FP8_GEMM", "triton")',
           ("tests/test_fp8_targets.py::test_the_fp8_gemm_defaults_to_cublas_without_a_warning",), "round58"),
    Mutant("fp8-gemm-env-case-folded", FP8,
           'value = os.environ.get("BLOCKSPEC_FP8_GEMM", "cublas")',
           'value = os.environ.get("BLOCKSPEC_FP8_GEMM", "cublas").lower()',
           ("tests/test_fp8_targets.py::test_column_scales_refuse_blocks_of_part_of_128_columns_and_the_gemm_variable_is_checked",),
           "round58"),
    Mutant("scaled-mm-rows-not-padded", FP8,
           "    if padded != rows:            # zero rows",
           "    if False:            # zero rows",
           ("tests/test_fp8_targets.py::test_the_cublas_gemm_is_the_fp8_fp8_product_bit_for_bit",), "round58"),
    Mutant("column-scales-not-transposed", FP8,
           "    return per_row.t().contiguous()\n",
           "    return per_row.contiguous()\n",
           ("tests/test_fp8_targets.py::test_column_scales_dequantize_the_weight_as_its_blocks_do",), "round58"),
    Mutant("column-scales-floor-k-blocks", FP8,
           "k_blocks = -(-in_features // BLOCK)",
           "k_blocks = in_features // BLOCK",
           ("tests/test_fp8_targets.py::test_column_scales_cover_a_ragged_last_block",), "round58"),
    Mutant("column-scales-outlive-the-weight", FP8,
           "weakref.finalize(scale, _column_scales.pop, id(scale), None)",
           "weakref.finalize(made, _column_scales.pop, id(scale), None)",
           ("tests/test_fp8_targets.py::test_column_scales_dequantize_the_weight_as_its_blocks_do",), "round58"),
    Mutant("column-scales-kept-from-a-capture", FP8,
           "    if not (scale.is_cuda and torch.cuda.is_current_stream_capturing()):\n",
           "    if True:\n",
           ("tests/test_fp8_targets.py::test_column_scales_made_inside_a_graph_capture_are_not_kept",), "round58"),
    Mutant("cublas-gemm-ignores-the-variable", FP8,
           'elif FP8_GEMM == "cublas" and blockwise_scaled_mm_serves(flat, weight):',
           "elif blockwise_scaled_mm_serves(flat, weight):",
           ("tests/test_fp8_targets.py::test_the_cublas_gemm_is_taken_only_when_asked_for_and_for_shapes_it_serves",),
           "round58"),
    Mutant("cublas-gemm-checks-k-not-n", FP8,
           "and weight.shape[0] % 16 == 0",
           "and weight.shape[1] % 16 == 0",
           ("tests/test_fp8_targets.py::test_the_cublas_gemm_is_taken_only_when_asked_for_and_for_shapes_it_serves",),
           "round58"),
    Mutant("cublas-gemm-bias-after-rounding", FP8,
           "out_dtype=x.dtype if bias is None else torch.float32)",
           "out_dtype=x.dtype)",
           ("tests/test_fp8_targets.py::test_the_cublas_gemm_is_the_fp8_fp8_product_bit_for_bit",), "round58"),
    Mutant("quantize-rows-column-major-ignored", FP8,
           "scales.stride(0), scales.stride(1), FP8_MAX=FP8_MAX,",
           "scales.stride(0), 1, FP8_MAX=FP8_MAX,",
           ("tests/test_fp8_targets.py::test_fp8_kernels_equal_the_reference_in_the_interpreter",), "round58"),
    Mutant("wakeup-never-rearmed", WAKEUPS,
           "            waiting, self._waiting = self._waiting, []\n            self._scheduled = False\n",
           "            waiting, self._waiting = self._waiting, []\n",
           ("tests/test_wakeups.py::test_a_batch_whose_earlier_wake_up_ran_mid_way_is_woken_again_at_its_end",),
           "round58"),
    Mutant("wakeup-in-flight-drops-the-event", WAKEUPS,
           "            self._waiting.append(generation)\n            if self._scheduled:\n                return\n",
           "            if self._scheduled:\n                return\n            self._waiting.append(generation)\n",
           ("tests/test_wakeups.py::test_a_wake_up_in_flight_when_a_batch_begins_takes_the_batch_too",), "round58"),
    Mutant("wakeups-held-across-threads", WAKEUPS,
           "_held = threading.local()",
           "_held = type(\"Held\", (), {})()",
           ("tests/test_wakeups.py::test_a_batch_held_on_one_thread_does_not_hold_another_threads_events",),
           "round58"),
    Mutant("closed-loop-aborts-nobody", WAKEUPS,
           "            for waiting in self._take():\n                waiting.request.abort()\n",
           "            return\n",
           ("tests/test_wakeups.py::test_a_closed_loop_aborts_whoever_waits_for_it",), "round58"),
    Mutant("events-handed-over-in-reverse", ENGINE,
           "            for callback, event in outbox:\n",
           "            for callback, event in reversed(outbox):\n",
           ("tests/test_engine.py::test_events_reach_their_consumers_in_the_order_made_even_past_one_that_raises",),
           "round58"),
    Mutant("a-raising-callback-drops-the-rest", ENGINE,
           "            for callback, event in outbox:\n                try:\n                    callback(event)\n"
           "                except Exception:",
           "            try:\n                for callback, event in outbox:\n                    callback(event)\n"
           "            except Exception:",
           ("tests/test_engine.py::test_events_reach_their_consumers_in_the_order_made_even_past_one_that_raises",),
           "round58"),
    Mutant("processed-greedy-takes-the-shared-argmax", RUNNER,
           "if self.processor_of(seq) is not None or not seq.request.params.is_greedy:",
           "if not seq.request.params.is_greedy:",
           ("tests/test_engine.py::test_first_draws_take_each_rows_own_logits_processor_and_generator",), "round58"),
    Mutant("own-draw-reads-the-chunks-row", RUNNER,
           "tokens[j] = self.draw_own(seq, logits[j: j + 1])",
           "tokens[j] = self.draw_own(seq, logits[ending[j]: ending[j] + 1])",
           ("tests/test_engine.py::test_first_draws_take_each_rows_own_logits_processor_and_generator",), "round58"),
    Mutant("first-draw-skips-the-generator", RUNNER,
           "return sample(scores[0], seq.request.params, seq.generator)",
           "return sample(scores[0], seq.request.params, None)",
           ("tests/test_engine.py::test_first_draws_take_each_rows_own_logits_processor_and_generator",), "round58"),
    Mutant("first-logprobs-of-the-whole-step", RUNNER,
           "raw = self.raw_logprobs(seqs, logits.unsqueeze(1))",
           "raw = self.raw_logprobs(seqs, logits.unsqueeze(0))",
           ("tests/test_engine.py::test_first_draws_take_each_rows_own_logits_processor_and_generator",), "round58"),
    Mutant("bf16-128-heads-keep-three-stages", ATTENTION,
           "(chunk_bytes == sixteen_kb and block_d <= 128)",
           "(chunk_bytes == sixteen_kb and block_d < 128)",
           ("tests/test_attention_interpreter.py::test_pipeline_stages_follow_the_key_chunk_bytes_and_the_head_width",),
           "round58"),
    Mutant("wide-heads-16kb-two-stages", ATTENTION,
           "num_stages = 2 if chunk_bytes > sixteen_kb or",
           "num_stages = 2 if chunk_bytes >= sixteen_kb or",
           ("tests/test_attention_interpreter.py::test_pipeline_stages_follow_the_key_chunk_bytes_and_the_head_width",),
           "round58"),
    Mutant("stages-ignore-the-element-size", ATTENTION,
           "chunk_bytes, sixteen_kb = block_n * block_d * element_size, 16 * 1024",
           "chunk_bytes, sixteen_kb = block_n * block_d * 2, 16 * 1024",
           ("tests/test_attention_interpreter.py::test_pipeline_stages_follow_the_key_chunk_bytes_and_the_head_width",),
           "round58"),
    # round 59's audit: cuBLASLt's row padding and probe (kernels/fp8.py), its weight scales kept
    # before the pool is sized (layers/fp8.py, ModelRunner.size_pool), 64-wide fp32 heads' stages,
    # BLOCKSPEC_UVICORN, the demo comparison's rounds and bench_streams.py's --client-gc
    Mutant("scaled-mm-pads-whole-multiples", FP8,
           "padded = -(-rows // SCALED_MM_ROWS) * SCALED_MM_ROWS",
           "padded = (rows // SCALED_MM_ROWS + 1) * SCALED_MM_ROWS",
           (FP8_TESTS + "::test_the_cublas_gemm_pads_only_rows_short_of_a_multiple_of_16_and_with_zeros",), "round59"),
    Mutant("scaled-mm-keeps-the-padding-rows", FP8,
           "out_dtype=x.dtype if bias is None else torch.float32)[:rows]",
           "out_dtype=x.dtype if bias is None else torch.float32)",
           (FP8_TESTS + "::test_the_cublas_gemm_is_the_fp8_fp8_product_bit_for_bit",), "round59"),
    Mutant("scaled-mm-pads-columns", FP8,
           "x = F.pad(x, (0, 0, 0, padded - rows))",
           "x = F.pad(x, (0, padded - rows))",
           (FP8_TESTS + "::test_the_cublas_gemm_is_the_fp8_fp8_product_bit_for_bit",), "round59"),
    Mutant("probe-runs-inside-a-capture", FP8,
           "    if torch.cuda.is_current_stream_capturing():      # the probe would be captured, not run\n",
           "    if False:      # the probe would be captured, not run\n",
           (FP8_TESTS + "::test_the_cublas_probe_runs_two_k_blocks_once_per_device_and_never_in_a_capture",),
           "round59"),
    Mutant("probe-one-k-block", FP8,
           "q = torch.zeros(16, 2 * BLOCK, dtype=FP8, device=device)\n        ones = torch.ones(16, 2, device=device)",
           "q = torch.zeros(16, BLOCK, dtype=FP8, device=device)\n        ones = torch.ones(16, 1, device=device)",
           (FP8_TESTS + "::test_the_cublas_probe_runs_two_k_blocks_once_per_device_and_never_in_a_capture",),
           "round59"),
    Mutant("probe-refusal-says-yes", FP8,
           "whatever this torch raises for a layout it lacks\n        return False",
           "whatever this torch raises for a layout it lacks\n        return True",
           (FP8_TESTS + "::test_the_cublas_probe_runs_two_k_blocks_once_per_device_and_never_in_a_capture",),
           "round59"),
    Mutant("probe-on-any-device", FP8,
           'if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):',
           'if not hasattr(torch, "_scaled_mm"):',
           (FP8_TESTS + "::test_the_cublas_probe_runs_two_k_blocks_once_per_device_and_never_in_a_capture",),
           "round59"),
    Mutant("keep-scales-counts-the-last-only", LAYERS_FP8,
           "made += kernels.cached_column_scales(",
           "made = kernels.cached_column_scales(",
           (FP8_TESTS + "::test_keep_column_scales_counts_every_served_linear",), "round59"),
    Mutant("keep-scales-probe-in-fp32", LAYERS_FP8,
           "probe = torch.empty(0, module.in_features, dtype=dtype, device=module.weight.device)",
           "probe = torch.empty(0, module.in_features, device=module.weight.device)",
           (FP8_TESTS + "::test_the_cublas_gemms_weight_scales_are_made_before_the_pool_is_sized",), "round59"),
    Mutant("runner-keeps-no-column-scales", RUNNER,
           "        keep_column_scales(self.target, self.dtype)          # with the weights, not as activations\n",
           "",
           (FP8_TESTS + "::test_the_runner_keeps_the_cublas_scales_before_it_sizes_the_pool",), "round59"),
    Mutant("runner-keeps-scales-for-any-dtype", RUNNER,
           "keep_column_scales(self.target, self.dtype)",
           "keep_column_scales(self.target, torch.bfloat16)",
           (FP8_TESTS + "::test_the_runner_keeps_the_cublas_scales_before_it_sizes_the_pool",), "round59"),
    Mutant("fp32-64-heads-keep-three-stages", ATTENTION,
           "block_d <= 128) else 3",
           "block_d == 128) else 3",
           ("tests/test_attention_interpreter.py::"
            "test_64_wide_fp32_heads_16kb_chunks_take_two_stages_as_128_wide_bf16_heads_do",), "round59"),
    Mutant("uvicorn-empty-value-warns", APP,
           'if value not in (None, "", "auto"):',
           'if value not in (None, "auto"):',
           ("tests/test_server.py::test_serve_runs_on_uvloop_and_httptools",), "round59"),
    Mutant("uvicorn-auto-value-warns", APP,
           'if value not in (None, "", "auto"):',
           'if value not in (None, ""):',
           ("tests/test_server.py::test_serve_runs_on_uvloop_and_httptools",), "round59"),
    Mutant("serve-ignores-blockspec-uvicorn", APP,
           '**uvicorn_implementations(os.environ.get("BLOCKSPEC_UVICORN"))',
           "**uvicorn_implementations(None)",
           ("tests/test_server.py::test_serve_reads_blockspec_uvicorn_into_uvicorns_config",), "round59"),
    Mutant("rounds-at-floor-division", MEASURE,
           "return max(rounds, -(-MIN_REQUESTS // concurrency))",
           "return max(rounds, MIN_REQUESTS // concurrency)",
           ("tests/test_demo.py::test_rounds_at_gives_every_mode_at_least_eight_requests_at_low_concurrency",),
           "round59"),
    Mutant("compare-runs-the-base-rounds", MEASURE,
           'for _ in range(row["rounds"]):',
           "for _ in range(rounds):",
           ("tests/test_demo.py::test_compare_speculation_runs_each_mode_rounds_at_times_per_concurrency",), "round59"),
    Mutant("client-gc-left-off-after-an-error", BENCH_STREAMS,
           "    gc.disable()\n    try:\n        yield\n    finally:\n        gc.enable()\n",
           "    gc.disable()\n    yield\n    gc.enable()\n",
           ("tests/test_api.py::test_bench_streams_holds_the_clients_collector_off_for_a_burst_unless_asked",),
           "round59"),
    Mutant("bursts-ignore-client-gc", BENCH_STREAMS,
           "with collector_quiet(quiet_gc):",
           "with collector_quiet():",
           ("tests/test_api.py::test_bench_streams_holds_the_clients_collector_off_for_a_burst_unless_asked",),
           "round59"),
    Mutant("client-processes-keep-gc-on", BENCH_STREAMS,
           "with new_client() as client, collector_quiet():",
           "with new_client() as client:",
           ("tests/test_api.py::test_bench_streams_holds_the_clients_collector_off_for_a_burst_unless_asked",),
           "round59"),
    Mutant("client-gc-default-on", BENCH_STREAMS,
           'choices=("quiet", "on"), default="quiet"',
           'choices=("quiet", "on"), default="on"',
           ("tests/test_api.py::test_bench_streams_client_gc_defaults_to_quiet",), "round59"),
    # -- core60: commit (stop ids, limits, finish reasons), abort, rollback, prefix cache ----
    Mutant("stop-checked-at-block-end", REQUEST,
           "if not self.stop_ids.isdisjoint(allowed):",
           "if allowed and allowed[-1] in self.stop_ids:",
           (STOP_TEST,), "core60"),
    Mutant("stop-token-not-kept", REQUEST,
           "allowed = allowed[: i + 1]",
           "allowed = allowed[: i]",
           (STOP_TEST,), "core60"),
    Mutant("stop-cut-at-the-last-stop", REQUEST,
           "for i, token in enumerate(allowed):",
           "for i, token in reversed(list(enumerate(allowed))):",
           (DFLASH_TESTS + "::test_the_first_of_two_stop_ids_in_one_accepted_block_ends_it",), "core60"),
    Mutant("max-tokens-one-over", REQUEST,
           "allowed = tokens[: self.num_allowed]",
           "allowed = tokens[: self.num_allowed + 1]",
           (DFLASH_TESTS + "::test_max_tokens_is_exact",), "core60"),
    Mutant("context-limit-ignored", REQUEST,
           "self._output_limit = min(params.max_tokens, max_model_len - len(self.prompt_ids))",
           "self._output_limit = params.max_tokens",
           (DFLASH_TESTS + "::test_context_limit_ends_the_request",), "core60"),
    Mutant("stop-at-the-limit-says-length", REQUEST,
           "if self.finish_reason is None and self.num_allowed == 0:",
           "if self.num_allowed == 0:",
           (DFLASH_TESTS + "::test_a_stop_id_that_is_the_last_allowed_token_finishes_with_stop",), "core60"),
    Mutant("logprobs-not-cut-at-stop", REQUEST,
           "self.output_logprobs.extend(logprobs[: len(allowed)])",
           "self.output_logprobs.extend(logprobs)",
           (DFLASH_TESTS + "::test_logprobs_are_cut_with_the_tokens_at_a_stop_id_inside_a_block",), "core60"),
    Mutant("accepted-stats-past-the-cut", SCHEDULER,
           "accepted = max(0, min(num_accepted, len(committed) - 1))",
           "accepted = num_accepted",
           (STOP_TEST,), "core60"),
    Mutant("draft-stats-past-the-limit", SCHEDULER,
           "allowed = min(num_drafts + 1, seq.request.num_allowed)",
           "allowed = num_drafts + 1",
           (DFLASH_TESTS + "::test_oracle_draft_accepts_whole_blocks",), "core60"),
    Mutant("finish-leaves-it-waiting", SCHEDULER,
           "for queue in (self.running, self.waiting, self.unservable):",
           "for queue in (self.running, self.unservable):",
           ("tests/test_acceptance.py::test_engine_shutdown_aborts_running_and_waiting_requests",), "core60"),
    Mutant("abort-skips-the-waiting", ENGINE,
           "for seq in [*self.scheduler.waiting, *self.scheduler.running]:",
           "for seq in [*self.scheduler.running]:",
           ("tests/test_acceptance.py::test_an_aborted_waiting_request_ends_at_the_next_step_before_any_compute",), "core60"),
    Mutant("inbox-abort-still-queued", ENGINE,
           "                self._end(seq, \"abort\")\n                continue\n",
           "                self._end(seq, \"abort\")\n",
           ("tests/test_engine.py::test_every_request_ends_exactly_once_even_when_a_step_fails",), "core60"),
    Mutant("verified-mask-off-by-one", DFLASH,
           "torch.arange(width - 1, device=logits.device)[None] < device_longs(",
           "torch.arange(width - 1, device=logits.device)[None] <= device_longs(",
           ("tests/test_ragged.py::test_acceptance_never_passes_k",), "core60"),
    Mutant("k0-sampler-draws-twice", DFLASH,
           "if not seq.request.params.is_greedy and proposal is not None and num_drafts[b] > 0:",
           "if not seq.request.params.is_greedy and proposal is not None:",
           ("tests/test_ragged.py::test_a_seeded_sampling_row_verifying_no_draft_draws_once_as_plain_decoding",),
           "core60"),
    Mutant("select-keeps-one-less", RUNNER,
           "[a + 1 for a in num_accepted]",
           "[max(1, a) for a in num_accepted]",
           ("tests/test_acceptance.py::test_partial_acceptance_at_known_lengths",), "core60"),
    Mutant("prefill-before-the-rollback", RUNNER,
           "        if batch.prefill:                   # a slot the rollback writes may be a new sequence's now\n"
           "            self.flush_states()\n",
           "",
           ("tests/test_hybrid.py::test_the_rollback_waits_for_the_next_draft_and_a_reused_slot_stays_exact",),
           "core60"),
    Mutant("snapshot-restored-backwards", RUNNER,
           "self.states.copy(seq.restore_from, seq.state_slot)",
           "self.states.copy(seq.state_slot, seq.restore_from)",
           ("tests/test_prefix_engine.py::test_a_hybrid_hit_stops_at_the_deepest_snapshot_then_snapshots_the_branch",),
           "core60"),
    Mutant("boundary-snapshot-misses-the-last-row", RUNNER,
           "boundary = (seq.num_cached + accepted + 1) // self.page_size * self.page_size",
           "boundary = (seq.num_cached + accepted) // self.page_size * self.page_size",
           ("tests/test_hybrid.py::test_a_decode_cycle_keeps_the_state_at_each_page_boundary_its_kept_rows_reach",
            "tests/test_prefix_engine.py::test_greedy_turns_with_hits_equal_the_cache_off"), "core60"),
    Mutant("hybrid-hit-past-its-snapshot", PREFIX,
           "while path and path[-1].snapshot is None:",
           "while False and path[-1].snapshot is None:",
           ("tests/test_prefix_cache.py::test_hybrid_hit_ends_at_the_deepest_snapshot",), "core60"),
    Mutant("drop-hit-keeps-its-pins", PREFIX,
           "        self.pages.free(seq.block_table)\n        self.prefix.unpin(seq.prefix_path)\n",
           "        self.pages.free(seq.block_table)\n",
           ("tests/test_prefix_cache.py::test_scheduler_with_the_prefix_cache_accounts_every_page_exactly",), "core60"),
    Mutant("unpinned-leaf-never-filed", PREFIX,
           "                if not node.children:\n                    self._candidate(node)\n",
           "",
           ("tests/test_prefix_cache.py::test_every_page_freed_exactly_once",), "core60"),
    Mutant("evict-a-pinned-leaf", PREFIX,
           "if node.refs or node.children or node.parent.children.get(node.key) is not node:",
           "if node.children or node.parent.children.get(node.key) is not node:",
           ("tests/test_prefix_cache.py::test_a_leaf_filed_for_eviction_then_pinned_again_is_never_evicted",), "core60"),
    Mutant("hit-pages-not-referenced", PREFIX,
           "        self.pages.incref(seq.block_table)\n        seq.num_cached = hit.num_tokens(self.page_size)\n",
           "        seq.num_cached = hit.num_tokens(self.page_size)\n",
           ("tests/test_prefix_cache.py::test_scheduler_with_the_prefix_cache_accounts_every_page_exactly",), "core60"),
    Mutant("publish-counts-fed-drafts", PREFIX,
           "num_valid = min(seq.num_cached, seq.num_tokens)",
           "num_valid = seq.num_cached",
           ("tests/test_prefix_engine.py::test_a_stop_id_inside_a_block_caches_no_page_past_the_committed_tokens",), "core60"),
    Mutant("recompute-feeds-the-anchor", SEQUENCE,
           "return self.num_tokens - (1 if self.request.output_ids else 0)",
           "return self.num_tokens",
           ("tests/test_batching.py::test_preempted_requests_complete_exactly",), "core60"),
    # server60: the HTTP/output edges (stop strings, finish reasons, tool calls, SSE framing, usage,
    # validation's 400s, disconnects) that an audit planted bugs in
    Mutant("stop-holdback-one-short", "blockspec/server/parsers.py",
           "for size in range(min(len(text), longest - 1), 0, -1):",
           "for size in range(min(len(text), longest - 2), 0, -1):",
           ("tests/test_output.py::test_partial_stop_string_is_held_then_released",
            "tests/test_output.py::test_stop_filter_matches_reference_for_any_split"), "server60"),
    Mutant("held-partial-stop-dropped-at-end", "blockspec/server/output.py",
           "        self._parse(self._stop.flush(), delta)\n        return self._finish(delta, finished)\n",
           "        self._stop.flush()\n        return self._finish(delta, finished)\n",
           ("tests/test_output.py::test_partial_stop_string_is_held_then_released",), "server60"),
    Mutant("stop-listed-first-wins", "blockspec/server/output.py",
           "if start >= 0 and (best is None or (start + len(stop), start) < best):",
           "if start >= 0 and best is None:",
           ("tests/test_output.py::test_one_token_completing_two_stop_strings_cuts_at_the_one_ending_first",), "server60"),
    Mutant("stop-at-length-says-length", "blockspec/server/output.py",
           "                    return self._finish(delta, \"stop\", stop_hit=True)\n",
           "                    return self._finish(delta, finished or \"stop\", stop_hit=True)\n",
           ("tests/test_output.py",), "server60"),
    Mutant("length-with-a-call-says-tool-calls", "blockspec/server/output.py",
           'if reason == "stop" and self.num_tool_calls:',
           'if reason in ("stop", "length") and self.num_tool_calls:',
           ("tests/test_output.py::test_tool_call_then_length_keeps_the_call_and_says_length",), "server60"),
    Mutant("tool-arguments-python-repr", "blockspec/server/parsers.py",
           "arguments_json = json.dumps(arguments, ensure_ascii=False, allow_nan=False)",
           "arguments_json = str(arguments)",
           ("tests/test_parsers.py",), "server60"),
    Mutant("tool-call-delta-without-type", "blockspec/server/parsers.py",
           'delta.update(id=self.id, type="function")',
           "delta.update(id=self.id)",
           ("tests/test_parsers.py::test_tool_call_delta_openai_shape",), "server60"),
    Mutant("tool-call-content-empty-string", "blockspec/server/chat.py",
           "content=output.content if output.content or not calls else None,",
           "content=output.content,",
           ("tests/test_server.py::test_tool_calls_have_openais_shape_whole_and_streamed",), "server60"),
    Mutant("parallel-tool-calls-off-by-default", "blockspec/server/chat.py",
           "max_tool_calls=1 if body.parallel_tool_calls is False else None",
           "max_tool_calls=1 if not body.parallel_tool_calls else None",
           ("tests/test_server.py::test_tool_calls_have_openais_shape_whole_and_streamed",), "server60"),
    Mutant("stop-hit-keeps-the-engine-running", "blockspec/server/generation.py",
           "                if delta.stop_hit:\n                    self.request.abort()",
           "                if False:\n                    self.request.abort()",
           ("tests/test_server.py::test_early_stop_string_then_next_request",), "server60"),
    Mutant("disconnect-leaves-generation-running", "blockspec/server/generation.py",
           "        if not self.processor.is_finished:\n            self.request.abort()\n        self._end(\"abort\")",
           "        self._end(\"abort\")",
           ("tests/test_server.py::test_disconnect_mid_stream_aborts",), "server60"),
    Mutant("shutdown-failure-is-500", "blockspec/server/generation.py",
           "raise GenerationFailed(503, \"the server shut down",
           "raise GenerationFailed(500, \"the server shut down",
           ("tests/test_reliability.py::test_sigterm_drains_then_ends_every_open_request_with_done",), "server60"),
    Mutant("usage-prompt-per-choice", "blockspec/server/generation.py",
           "prompt_tokens = sum(len(c.prompt.token_ids) for c in choices if c.counts_prompt)",
           "prompt_tokens = sum(len(c.prompt.token_ids) for c in choices)",
           ("tests/test_api.py::test_chat_n_choices_use_seed_plus_index_and_run_as_one_batch",), "server60"),
    Mutant("chat-stream-error-without-done", "blockspec/server/chat.py",
           "        yield sse(error_body(exc.status, exc.message))\n    else:",
           "        yield sse(error_body(exc.status, exc.message))\n        return\n    else:",
           ("tests/test_server.py::test_engine_error_is_500_and_the_server_keeps_serving",), "server60"),
    Mutant("completion-stream-error-without-done", "blockspec/server/completions.py",
           "        yield sse(error_body(exc.status, exc.message))\n    else:",
           "        yield sse(error_body(exc.status, exc.message))\n        return\n    else:",
           ("tests/test_server.py::test_a_failed_stream_ends_with_its_error_object_then_a_terminated_done",), "server60"),
    Mutant("done-event-unterminated", "blockspec/server/streaming.py",
           'DONE = b"data: [DONE]\\n\\n"',
           'DONE = b"data: [DONE]\\n"',
           ("tests/test_server.py::test_a_failed_stream_ends_with_its_error_object_then_a_terminated_done",), "server60"),
    Mutant("ended-by-repeats-finished-choices", "blockspec/server/streaming.py",
           "rest = [c.index for c in choices if c.index not in finished and c.index != exc.index]",
           "rest = [c.index for c in choices if c.index != exc.index]",
           ("tests/test_output.py::test_a_failed_stream_ends_only_its_unfinished_choices_the_failed_one_first",), "server60"),
    Mutant("validation-error-is-422", "blockspec/server/request_building.py",
           "        raise ApiError(400, message, param) from None",
           "        raise ApiError(422, message, param) from None",
           ("tests/test_api.py::test_choice_counts_and_prompt_lists_are_validated",), "server60"),
    Mutant("stop-list-limit-off-by-one", "blockspec/server/protocol.py",
           "if len(value) > MAX_STOP_STRINGS:",
           "if len(value) >= MAX_STOP_STRINGS:",
           ("tests/test_parsers.py::test_each_limit_is_inclusive",), "server60"),
    Mutant("top-logprobs-limit-exclusive", "blockspec/server/protocol.py",
           "if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:",
           "if value is not None and not 0 <= value < MAX_TOP_LOGPROBS:",
           ("tests/test_parsers.py::test_each_limit_is_inclusive",), "server60"),
    Mutant("param-index-as-field", "blockspec/server/errors.py",
           'name += f"[{part}]"',
           'name += f".{part}"',
           ("tests/test_parsers.py::test_chat_request_rejections",), "server60"),
    # round 60: a failure that carries tokens streams them before its error
    Mutant("failure-drops-its-tokens", "blockspec/server/generation.py",
           "    if event.finish_reason not in FAILURES or not event.token_ids:",
           "    if True:",
           ("tests/test_server.py::test_tokens_merged_into_a_failure_reach_the_stream_before_its_error",), "server60"),
    Mutant("carried-stop-then-fails", "blockspec/server/generation.py",
           "                if failure is not None and not self.processor.is_finished:",
           "                if failure is not None:",
           ("tests/test_server.py::test_a_stop_string_in_tokens_merged_into_a_failure_finishes_the_request",), "server60"),
    # round 60: the opt-in plain arm (policy.Arms over any number of arms)
    Mutant("plain-arm-verifies-its-caps", POLICY,
           "return [int(cap) if keeps_whole_block(seq) else 0 for seq, cap in zip(seqs, self.caps(seqs))]",
           "return [int(cap) for seq, cap in zip(seqs, self.caps(seqs))]",
           ("tests/test_adaptive.py::test_adaptive_with_the_plain_arm_is_lossless_and_its_steps_verify_no_drafts",), "round60"),
    Mutant("arms-explore-only-the-first-overdue", POLICY,
           "lateness, arm = max(overdue, default=(-1.0, best))",
           "lateness, arm = overdue[0] if overdue else (-1.0, best)",
           ("tests/test_adaptive.py::test_three_arms_are_measured_in_turn_then_the_fastest_runs_and_the_others_when_due",), "round60"),
    # round 61: the arms re-measure a slower arm by its gap squared; short plain windows; plain plans ahead
    Mutant("arms-explore-unscaled", POLICY,
           "return window_of(other) * min(MAX_EXPLORE, ARM_EXPLORE * ratio * ratio)",
           "return window_of(other) * ARM_EXPLORE",
           ("tests/test_adaptive.py::test_an_arm_far_behind_is_remeasured_rarely_and_one_level_every_explore_windows",), "round61"),
    Mutant("arms-explore-uncapped", POLICY,
           "return window_of(other) * min(MAX_EXPLORE, ARM_EXPLORE * ratio * ratio)",
           "return window_of(other) * ARM_EXPLORE * ratio * ratio",
           ("tests/test_adaptive.py::test_an_arm_far_behind_is_remeasured_rarely_and_one_level_every_explore_windows",), "round61"),
    Mutant("arms-never-explore", POLICY,
           "return arm if lateness >= 0 else best",
           "return best",
           ("tests/test_adaptive.py::test_arms_measure_both_then_keep_the_faster_and_remeasure_the_other",), "round61"),
    Mutant("plain-window-full-length", POLICY,
           'return PLAIN_WINDOW if arm == "plain" else ARM_WINDOW',
           'return ARM_WINDOW',
           ("tests/test_adaptive.py::test_an_arm_far_behind_is_remeasured_rarely_and_one_level_every_explore_windows",), "round61"),
    Mutant("plain-arm-ignored", RUNNER,
           "plain_arm=policy.PLAIN_ARM)",
           "plain_arm=False)",
           ("tests/test_adaptive.py::test_the_plain_arm_is_opt_in",), "round61"),
    Mutant("plain-step-drafts-early", POLICY,
           '        if upcoming == "plain":            # no early draft',
           '        if False:            # no early draft',
           ("tests/test_adaptive.py::test_a_plain_step_is_planned_ahead_without_drafts_and_that_plan_serves_no_other_arm",), "round61"),
    Mutant("plain-plan-serves-the-policy", POLICY,
           "if ahead is not None and ahead is not self._plain_ahead else None",
           "if ahead is not None else None",
           ("tests/test_adaptive.py::test_a_plain_step_is_planned_ahead_without_drafts_and_that_plan_serves_no_other_arm",), "round61"),
]


def ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in {".git", "__pycache__", ".pytest_cache", ".venv", "out"}}


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[bool, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:            # a hang is a detected change, not a pass
        return False, time.perf_counter() - start
    return proc.returncode == 0, time.perf_counter() - start


def main(args: list[str]) -> int:
    group = None
    if "--group" in args:
        at = args.index("--group")
        if at + 1 == len(args):
            print("--group needs a name (e.g. issue36)", file=sys.stderr)
            return 2
        group, args = args[at + 1], args[:at] + args[at + 2:]
    names = args
    chosen = [m for m in MUTANTS if (not names or m.name in names) and (group is None or m.group == group)]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown or not chosen:
        print(f"unknown mutants: {sorted(unknown)}" if unknown else f"no mutant in group {group!r}", file=sys.stderr)
        return 2
    start, rows, ok = time.perf_counter(), [], True
    with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
        copy = Path(scratch) / "repo"
        shutil.copytree(ROOT, copy, ignore=ignore)
        baseline_tests = tuple(sorted({t for m in chosen for t in m.tests}))
        passed, seconds = run_tests(copy, baseline_tests)
        print(f"{'(unmutated)':26} {'pass' if passed else 'FAIL':9} {seconds:6.1f} s")
        if not passed:
            print("the unmutated copy fails its tests: no mutant can be judged", file=sys.stderr)
            return 1
        for mutant in chosen:
            target = copy / mutant.path
            original = target.read_text()
            if original.count(mutant.old) != 1:
                rows.append((mutant.name, "NOT FOUND", 0.0))
                ok = False
                continue
            target.write_text(original.replace(mutant.old, mutant.new))
            try:
                passed, seconds = run_tests(copy, mutant.tests)
            finally:
                target.write_text(original)
            rows.append((mutant.name, "SURVIVED" if passed else "killed", seconds))
            ok &= not passed
            print(f"{mutant.name:26} {rows[-1][1]:9} {seconds:6.1f} s  {' '.join(mutant.tests)}", flush=True)
    killed = sum(r[1] == "killed" for r in rows)
    print(f"\n{killed}/{len(rows)} mutants killed in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
