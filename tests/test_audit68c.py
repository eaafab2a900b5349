"""Audit 68c: the figures the benches print (medians, percentiles, speed-ups, the best of plain and
the fixed block, the ratios between concurrencies and block sizes), the tensor-parallel ranks'
bookkeeping (a slice read in pieces, a failed or dead rank named by its number, the pool agreed
on, a worker's prefill chunk and its accepted rows) and the graph dispatcher's CPU-side choices
(key buckets, draft seats, a narrow draft's descriptor, the cost table's medians): the mutants of
group audit68c in scripts/mutation_check.py. Unit tests on hand-made inputs with known answers;
where a bench mode runs engines, its measurements are replaced by canned figures so that only
the arithmetic on them is under test. No model is built."""
from __future__ import annotations

import math
import signal
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from blockspec.bench import common, forward, multi_turn, speculation, sweep
from blockspec.config import MoeConfig
from blockspec.distributed import launch, runner
from blockspec.distributed.loading import read_slice
from blockspec.distributed.shard import Slice
from blockspec.engine import graphs as graphs_module
from blockspec.engine.graphs import EAGER, FULL, BatchDescriptor, GraphDispatcher
from blockspec.engine.memory import PoolSize
from blockspec.layers.moe import SparseMoE
from blockspec.models.dflash import default_target_layer_ids

CPU = torch.device("cpu")


class Clock:
    """A perf_counter that moves only when a timed function says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# ---- bench/common.py: timing, percentiles, weight bytes, forced acceptance, shapes ------------

def test_timed_is_the_median_of_the_timed_runs_after_the_warm_ups(monkeypatch):
    """Two warm-ups (100 s each, never counted), then runs of 1, 0.25, 2, 0.5 and 1.5 s: the
    median is 1000 ms, not the middle run in call order (2000 ms)."""
    clock = Clock()
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    durations = iter([100.0, 100.0, 1.0, 0.25, 2.0, 0.5, 1.5])

    def fn() -> None:
        clock.now += next(durations)
    assert common.timed(fn, repeat=5, warmup=2) == 1000.0
    assert next(durations, None) is None                      # every run and warm-up made, no more


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    assert common.percentile(values, 99) == 10.0               # rank ⌈9.9⌉ = 10
    assert common.percentile(values, 50) == 5.0
    assert common.percentile(values, 91) == 10.0               # rank ⌈9.1⌉ = 10, not 9
    assert common.percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert common.percentile([7.0], 99) == 7.0
    assert math.isnan(common.percentile([], 50))


def test_a_step_reads_the_chosen_experts_and_everything_else():
    """One sparse layer of 4 experts choosing 1: a step reads every weight but 3/4 of the experts'."""
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.moe = SparseMoE(8, MoeConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4, normalize=True))
    experts = common.weight_bytes(model.moe.experts)
    total = common.weight_bytes(model)
    assert experts == 4 * (2 * 4 * 8 + 8 * 4) * 4            # gate_up [4, 8, 8] + down [4, 8, 4], fp32
    assert common.step_weight_bytes(model) == total - experts * 3 // 4
    dense = nn.Linear(8, 8)
    assert common.step_weight_bytes(dense) == common.weight_bytes(dense) == (64 + 8) * 4


def test_forced_acceptance_carries_its_credit_and_stops_at_each_rows_drafts(monkeypatch):
    """accept_len 2.5 over rows that may keep 3, 1 and 0 drafts: kept 2 (credit 0.5), then 3.0
    credit but 1 draft at most (kept 2, credit 1.0), then 3.5 credit and no draft (kept 1,
    credit 2.5); the next verify (3 drafts each) keeps 4, 3, 3."""
    from blockspec.engine import model_runner
    monkeypatch.setattr(model_runner, "judge", lambda *args: SimpleNamespace(accepted=None))
    judge = common.forced_accept(2.5)
    logits = torch.zeros(3, 4, 5)
    first = judge([None] * 3, None, logits, None, [3, 1, 0])
    assert first.accepted.tolist() == [[1], [1], [0]]
    second = judge([None] * 3, None, logits)
    assert second.accepted.tolist() == [[3], [2], [2]]


def test_a_shapes_draft_keeps_its_own_sizes_over_the_targets():
    """qwen3.5-4b's draft has its own heads, head size, MLP and full rotary; the rest (hidden
    size, vocabulary) is the target's, and the target's config carries none of the draft's keys."""
    shape = common.SHAPES["qwen3.5-4b"]
    target, draft = common.shape_configs(shape, 8)
    assert {k: draft[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                  "partial_rotary_factor")} == dict(num_attention_heads=32, num_key_value_heads=8,
                                                                    head_dim=128, intermediate_size=9728,
                                                                    partial_rotary_factor=1.0)
    assert (draft["hidden_size"], draft["vocab_size"], draft["num_hidden_layers"], draft["block_size"]) == (
        2560, 248320, 5, 8)
    assert draft["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": default_target_layer_ids(32, 5)}
    assert target["num_attention_heads"] == 16 and not {"draft", "draft_layers", "mask_token_id"} & target.keys()
    assert common.shape_configs(common.SHAPES["host"])[1]["dflash_config"]["mask_token_id"] == 511


# ---- bench/forward.py and speculation.py: the ratios of one row -------------------------------

def test_forward_figures_divide_the_verify_by_the_plain_step():
    plain = {"verify_graph_ms": 2.0}
    spec = {"verify_graph_ms": 5.0, "propose_graph_ms": 1.5}
    assert forward.forward_figures(plain, spec, 8) == {"target_forward_w1_ms": 2.0, "target_forward_w8_ms": 5.0,
                                                       "verify8_over_step": 2.5, "draft_propose_b8_ms": 1.5}
    assert forward.forward_figures({}, {"propose_graph_ms": 1.5}, 4) == {"draft_propose_b4_ms": 1.5}


def test_the_bench_forwards_metadata_starts_at_page_one():
    """3 tokens after 17 cached, pages of 16: pages 1 and 2 (page 0 is the padding page), the
    tokens in page 2's slots 1 … 3."""
    meta = forward.forward_metadata(3, 17, 16, SimpleNamespace(layers=[]), CPU)
    assert meta.block_tables.tolist() == [[1, 2]]
    assert meta.positions.tolist() == [17, 18, 19]
    assert meta.slot_mapping.tolist() == [33, 34, 35]
    assert meta.context_lens.tolist() == [20] and meta.max_context_len == 32


def speculation_figures() -> dict:
    return {"plain": {"tok_s": 100.0, "ms_per_cycle": 10.0, "verify_graph_ms": 8.0, "mean_acceptance_length": 1.0},
            "fixed": {"tok_s": 150.0, "ms_per_cycle": 30.0, "verify_graph_ms": 12.0, "propose_graph_ms": 6.0,
                      "mean_acceptance_length": 4.0},
            "adaptive": {"tok_s": 180.0, "ms_per_cycle": 20.0, "mean_acceptance_length": 3.5, "mean_width": 5.25,
                         "width_counts": {4: 2, 8: 1}}}


def test_the_speculation_row_compares_adaptive_with_the_best_of_plain_and_fixed():
    row = speculation.speculation_row(speculation_figures())
    assert (row["adaptive_over_plain"], row["adaptive_over_fixed"], row["adaptive_over_best"]) == (1.8, 1.2, 1.2)
    assert (row["plain_tok_s"], row["fixed_tok_s"], row["adaptive_tok_s"]) == (100.0, 150.0, 180.0)
    assert (row["fixed_acceptance_length"], row["adaptive_acceptance_length"]) == (4.0, 3.5)
    assert row["adaptive_mean_width"] == 5.25 and row["adaptive_width_counts"] == {4: 2, 8: 1}
    slower_fixed = speculation_figures()
    slower_fixed["fixed"]["tok_s"] = 90.0                      # plain is the best fixed choice now
    assert speculation.speculation_row(slower_fixed)["adaptive_over_best"] == 1.8


def test_a_cycles_parts_are_each_modes_own_forwards():
    """The plain forward is plain's own graph replay (8 ms), the fixed cycle's 30 ms = verify 12 +
    draft 6 + 12 outside the forwards."""
    parts = speculation.cycle_parts(speculation_figures())
    assert parts == {"plain_ms_per_step": 10.0, "fixed_ms_per_step": 30.0, "adaptive_ms_per_step": 20.0,
                     "plain_forward_ms": 8.0, "fixed_verify_ms": 12.0, "fixed_draft_ms": 6.0,
                     "fixed_outside_forwards_ms": 12.0}


# ---- bench/sweep.py: the default mode's figures, its measurements canned ----------------------

def test_the_sweeps_figures_are_the_right_ratios_of_the_right_runs(monkeypatch):
    """Concurrencies 1 and 4, block sizes 4 then 2, DFlash 2 on: every ratio is the one its name
    says, of measurements told apart by value, and the other block size is measured at the first
    concurrency only."""
    target, draft, draft2 = nn.Module(), nn.Linear(4, 4), nn.Linear(4, 4)
    target.lm_head = nn.Linear(4, 4)
    monkeypatch.setattr(sweep, "build_models", lambda shape, device, dtype, block: ({}, {}, target, draft))
    monkeypatch.setattr(sweep, "build_dflash2", lambda cfg, device, dtype: draft2)
    monkeypatch.setattr(sweep, "readout_ms", lambda readers, head, c, block, device: {})
    figures = {None: {1: (100.0, 10.0, 2.0), 4: (300.0, 16.0, 2.5)},          # tok/s, ms a step, verify graph ms
               id(draft): {1: (250.0, 40.0, 5.0), 4: (500.0, 64.0, 7.5)},
               id(draft2): {1: (200.0, 50.0, 5.0), 4: (450.0, 80.0, 7.5)}}

    def fake_sweep(t, d, block_size, concurrency, prompt_len, max_tokens, accept_len):
        runs = figures[None if d is None else id(d)]
        return {c: {"tok_s": runs[c][0], "ms_per_cycle": runs[c][1], "verify_graph_ms": runs[c][2],
                    "mean_acceptance_length": 1.0 if d is None else 3.0} for c in concurrency}
    extra_at = []

    def fake_throughput(t, d, block_size, c, prompt_len, max_tokens, accept_len):
        extra_at.append((block_size, c))
        return {"tok_s": 220.0, "ms_per_cycle": 25.0, "verify_graph_ms": 4.0, "mean_acceptance_length": 2.0}
    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    monkeypatch.setattr(sweep, "throughput", fake_throughput)
    r = sweep.run("host", CPU, [], [1, 4], 2.0, 8, 6, [4, 2], dflash2=True)
    c1, c4 = r["c1"], r["c4"]
    assert (c1["dflash_over_plain"], c4["dflash_over_plain"]) == (2.5, 500.0 / 300.0)
    assert (c1["dflash_cycle_over_plain_step"], c4["dflash_cycle_over_plain_step"]) == (4.0, 4.0)
    assert (c1["dflash2_cycle_over_dflash1"], c4["dflash2_cycle_over_dflash1"]) == (1.25, 1.25)
    assert c1["dflash_acceptance_length"] == 3.0 and c1["verify4_over_step"] == 2.5
    assert extra_at == [(2, 1)]
    assert (c1["dflash_b2_tok_s"], c1["dflash_b2_cycle_over_plain_step"], c1["verify2_over_step"]) == (220.0, 2.5, 2.0)
    assert not any(key.startswith("dflash_b2") for key in c4)
    assert r["plain_throughput_ratio_last_over_first"] == 3.0
    assert r["dflash_throughput_ratio_last_over_first"] == 2.0


def test_multi_turn_ratios_are_the_prefix_cache_over_without_it(monkeypatch):
    """The time-to-first-token ratio per turn and the no-reuse throughput ratio are with the prefix
    cache ÷ without; the warm-up run (one conversation) is never one of the compared runs."""
    monkeypatch.setattr(multi_turn, "build_models", lambda shape, device, dtype, block: ({}, {}, None, "draft"))
    monkeypatch.setattr(multi_turn, "snapshot_copy_ms", lambda target, device, dtype: None)
    calls = []

    def fake_run(target, draft, block_size, conversations, turns, system_tokens, user_tokens, answer_tokens,
                 accept_len, prefix_cache, state_slots):
        calls.append((conversations, turns, system_tokens, prefix_cache, state_slots))
        if conversations == 1:
            return {"per_turn": [{"ttft_ms": 1000.0}]}                # the warm-up: slow, and never read
        if system_tokens == 0:
            return {"output_tok_s": 80.0 if prefix_cache else 100.0}
        return {"per_turn": [{"ttft_ms": 30.0}, {"ttft_ms": 10.0}] if prefix_cache
                else [{"ttft_ms": 40.0}, {"ttft_ms": 40.0}]}
    monkeypatch.setattr(multi_turn, "multi_turn_run", fake_run)
    args = SimpleNamespace(device="cpu", multi_turn="2x2", block_size="4,2", shape="tiny", layers=None,
                           prefix_state_slots=0, system_prompt_tokens=40, user_tokens=5, max_tokens=6, accept_len=2.0)
    r = multi_turn.multi_turn_main(args)
    assert r["ttft_ratio_per_turn"] == [0.75, 0.25]
    assert r["no_reuse_tok_s"] == {"prefix_cache": 80.0, "no_prefix_cache": 100.0, "ratio": 0.8}
    assert r["prefix_state_slots"] == 6 and r["block_size"] == 4
    assert calls == [(1, 1, 64, True, 6), (2, 2, 40, True, 6), (2, 2, 40, False, 6), (2, 1, 0, True, 6),
                     (2, 1, 0, False, 6)]


# ---- distributed: slices, ranks named, the agreed pool, a worker's view -----------------------

def test_a_slice_read_in_ranges_is_their_concatenation_along_its_dim():
    """A fused gate/up's rank reads two ranges of columns (its gate part, its up part)."""
    t = torch.arange(24.0).view(2, 12)
    assert torch.equal(read_slice(t, (2, 12), Slice(1, ((0, 2), (6, 8)))), t[:, [0, 1, 6, 7]])
    assert torch.equal(read_slice(t, (2, 12), Slice(0, ((1, 2),))), t[1:2])
    cube = torch.arange(2 * 8 * 3.0).view(2, 8, 3)
    assert torch.equal(read_slice(cube, (2, 8, 3), Slice(1, ((2, 4), (6, 8)))), cube[:, [2, 3, 6, 7]])


def test_a_failed_load_is_named_by_the_rank_that_failed(monkeypatch):
    def gather(out, obj, group=None):
        out[:] = [None, "LoadError: no such file", None]
    monkeypatch.setattr(launch.dist, "all_gather_object", gather)
    assert launch.exchange_status(SimpleNamespace(size=3, control=None), None) == [
        "tensor-parallel rank 1: LoadError: no such file"]


class Process:
    def __init__(self, pid: int, code: int | None) -> None:
        self.pid, self.returncode = pid, code

    def poll(self) -> int | None:
        return self.returncode


def test_a_dead_worker_is_named_by_its_rank():
    """Workers are ranks 1 …: the second process is rank 2."""
    workers = launch.Workers(tp=None, processes=[Process(100, None), Process(4242, -signal.SIGKILL)])
    assert workers.dead_worker(0.0) == "tensor-parallel worker rank 2 (pid 4242) died (killed by SIGKILL); stopping"
    workers = launch.Workers(tp=None, processes=[Process(7, 3), Process(8, None)])
    assert workers.dead_worker(0.0) == "tensor-parallel worker rank 1 (pid 7) died (exit code 3); stopping"
    assert launch.Workers(tp=None, processes=[Process(9, None)]).dead_worker(0.0) is None


def test_every_rank_takes_the_fewest_pages_any_rank_measured(monkeypatch):
    """Rank 0 schedules for all: a pool larger than another rank's would overrun that rank's."""
    def all_reduce(tensor, op=None, group=None):                  # this rank measured 12, the other 9
        peers = torch.stack([tensor, torch.tensor([9])])
        tensor.copy_(peers.min(0).values if op == torch.distributed.ReduceOp.MIN else peers.max(0).values)
    monkeypatch.setattr(runner.dist, "all_reduce", all_reduce)
    agreed = runner.agreed_pool(SimpleNamespace(control=None), PoolSize(12, 4096, "measured", 7, 3))
    assert agreed == PoolSize(9, 4096, "measured", 7, 3)


def test_a_workers_prefill_chunk_is_indexed_as_the_whole_sequence():
    view = runner.SeqView(10, [1, 2], None, 0, [7, 8, 9], 13, False)
    assert view.tokens[10:13] == [7, 8, 9] and view.tokens[11:13] == [8, 9]
    assert runner.TokensFrom(0, [4, 5])[0:1] == [4]


def test_a_worker_keeps_the_state_after_each_accepted_prefix_and_its_target_token():
    """Accepted 2 and 0 drafts: the states after rows 3 and 1 of the verify (the anchor's row
    counts), from each sequence's own slot."""
    calls = []
    verified = [SimpleNamespace(state_slot=5), SimpleNamespace(state_slot=9)]
    fake = SimpleNamespace(is_hybrid=True, draft=object(), _verified=verified,
                           snapshot_page_boundaries=lambda seqs, accepted, from_stash: calls.append(
                               ("snapshots", seqs, accepted, from_stash)),
                           states=SimpleNamespace(select=lambda slots, rows: calls.append(("select", slots, rows))))
    runner.WorkerRunner.select_accepted(fake, [2, 0])
    assert calls == [("snapshots", verified, [2, 0], True), ("select", [5, 9], [3, 1])]
    calls.clear()
    runner.WorkerRunner.select_accepted(SimpleNamespace(is_hybrid=False), [2, 0])
    assert calls == []


# ---- engine/graphs.py: the CPU-side choices ----------------------------------------------------

def test_a_key_bucket_is_the_live_length_rounded_up_to_a_power_of_two():
    graphs = GraphDispatcher(4, 8, 64, pages_per_seq=64, page_size=16, device=CPU, capture=False)
    assert [graphs.keys(n) for n in (0, 1, 256, 257, 512, 513, 1024, 5000)] == [256, 256, 256, 512, 512, 1024,
                                                                               1024, 1024]
    unbucketed = GraphDispatcher(4, 8, 64, pages_per_seq=64, page_size=16, device=CPU, capture=False,
                                 bucket_keys=False)
    assert unbucketed.keys(40) == 1024


def test_draft_seats_are_the_whole_blocks_the_token_budget_holds():
    """A budget of 100 tokens holds 6 blocks of 16, not 7: 7 sequences' drafts run eagerly."""
    graphs = GraphDispatcher(16, 64, 100, pages_per_seq=8, page_size=16, device=CPU, capture=False)
    assert graphs.max_draft_seqs == 6 and graphs.draft_sizes == [1, 2, 4, 6]
    assert graphs.plan_draft(6, 0, 1).desc == BatchDescriptor(96, 6, False)
    assert graphs.plan_draft(7, 0, 1).mode == EAGER


def test_a_narrow_drafts_descriptor_is_its_own_width():
    graphs = GraphDispatcher(16, 8, 256, pages_per_seq=8, page_size=16, device=CPU, capture=False,
                             draft_widths=(4, 8))
    assert graphs.draft_widths == (4, 8, 16)
    narrow = graphs.plan_draft(3, 0, 1, width=4)
    assert (narrow.mode, narrow.desc) == (FULL, BatchDescriptor(16, 4, False))
    assert graphs.plan_draft(3, 0, 1).desc == BatchDescriptor(64, 4, False)
    odd = graphs.plan_draft(3, 0, 1, width=2)                       # not a captured width: eager, exact
    assert (odd.mode, odd.desc) == (EAGER, BatchDescriptor(6, 3, False))


def test_the_cost_table_is_each_buckets_median_run(monkeypatch):
    """Verify buckets 1, 2, 4, 8 probed once warm then 3 times round: each bucket's figure is the
    median of its 3 timed runs (the warm run never counts)."""
    clock = Clock()
    monkeypatch.setattr(graphs_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    graphs = GraphDispatcher(4, 2, 8, pages_per_seq=4, page_size=16, device=CPU, capture=False)
    assert graphs.full_tokens == [1, 2, 4, 8]
    seconds = {1: [9.0, 0.375, 0.125, 0.25], 2: [9.0, 0.625, 0.5, 0.75], 4: [9.0, 1.0, 0.875, 2.5],
               8: [9.0, 4.0, 1.25, 1.125]}

    def probe(kind, size, width):
        assert kind == "verify" and width is None
        clock.now += seconds[size].pop(0)
    graphs.probe = probe
    costs = graphs.measure_costs(repeat=3)
    assert costs["verify"] == {1: 250.0, 2: 625.0, 4: 1000.0, 8: 1250.0}
    assert costs["draft"] == {} and costs["narrow"] == {}
    assert all(not left for left in seconds.values())


# ---- bench/common.py run_batch: the window's tokens and steps, on a scripted engine -----------

class ScriptedEngine:
    """Every step commits 2 tokens to each live request and takes 0.5 s of a fake clock: the
    engine run_batch drives, reduced to what it reads."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.live = clock, []
        self.runner = SimpleNamespace(target=SimpleNamespace(lm_head=SimpleNamespace(out_features=512)))
        self.config = SimpleNamespace(max_model_len=64)

    def submit(self, request, on_event) -> None:
        self.live.append(request)

    def step(self) -> None:
        self.clock.now += 0.5
        for request in self.live:
            if not request.is_finished:
                request.commit([1, 1])
                request.stats.acceptance_lengths.append(2)


def test_run_batch_counts_the_decode_windows_tokens_and_steps_only(monkeypatch):
    """Two requests of 7 tokens: the prefill step gives each 2 (outside the window), then 3 steps
    in 1.5 s give 2 + 2 + 1 each: 10 tokens, 500 ms a step."""
    clock = Clock()
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    result = common.run_batch(ScriptedEngine(clock), 2, 4, 7)
    assert result == {"tok_s": 10 / 1.5, "ms_per_cycle": 500.0, "mean_acceptance_length": 2.0}


class BurstEngine:
    """Each step decodes one token for every request that has its first, and gives one waiting
    request its first token; the steps take 1, 1, 2, 3 s of a fake clock; an aborted request ends
    with a last event, as the engine's do."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.live, self.durations = clock, [], iter([1.0, 1.0, 2.0, 3.0])

    def submit(self, request, on_event) -> None:
        self.live.append((request, on_event))

    @property
    def has_work(self) -> bool:
        return any(not request.is_finished for request, _ in self.live)

    def step(self) -> None:
        self.clock.now += next(self.durations)
        started_one = False
        for request, on_event in self.live:
            if request.is_finished:
                continue
            if request.is_aborted:
                request.finish_reason = "abort"
            elif request.output_ids or not started_one:
                started_one |= not request.output_ids
                request.commit([1])
            else:
                continue
            on_event(SimpleNamespace(request_id=request.request_id, error=None))


def test_a_bursts_gaps_are_those_that_end_inside_it(monkeypatch):
    """One request decoding, two arriving at t = 1: their first tokens at t = 2 and 4 (1000 and
    3000 ms); the decoding one's events at 1, 2, 4 and its abort at 7 s: the gaps ending inside
    the burst are 1000 and 2000 ms (the 3000 ms one ends after it)."""
    from blockspec.bench import bursts
    clock = Clock()
    engine = BurstEngine(clock)
    monkeypatch.setattr(bursts, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(bursts, "Engine", lambda target, draft, config: engine)
    monkeypatch.setattr(bursts, "run_batch", lambda *args: None)
    result = bursts.burst(None, None, 4, 2, 1, 4, 3, None)
    assert result == {"ttft_p50_ms": 1000.0, "ttft_p99_ms": 3000.0, "gap_p50_ms": 1000.0, "gap_p99_ms": 2000.0}
    assert next(engine.durations, None) is None                  # the burst, then one step to end the aborted
