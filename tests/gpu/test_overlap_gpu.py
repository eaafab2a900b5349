"""Overlap on CUDA (invariant 12): the engine launches a step without waiting for the device and
sends the previous step's events while it runs. The launch of a graphed decode step synchronizes
nothing (so the host really is ahead), and the outputs equal those with overlap off. CPU
analogue: tests/test_overlap.py."""
from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.loader import load_draft, load_model
from helpers import make_request, run_batch

PROMPT = [int(t) for t in torch.randint(0, 151643, (200,), generator=torch.Generator().manual_seed(7))]


@pytest.fixture(scope="module")
def pair(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir), device="cuda", dtype="float32").model
    return target, load_draft(str(qwen3_draft_dir), target)


def requests():
    spans = [(0, 30), (30, 41), (5, 120), (90, 97)]
    return [make_request(f"r{i}", PROMPT[a:b], max_tokens=20 + 4 * i) for i, (a, b) in enumerate(spans)]


@pytest.mark.parametrize("block_size", [1, 4])
def test_overlap_on_cuda_launches_without_a_sync_and_changes_no_output(pair, block_size):
    target, draft = pair
    drafter = draft if block_size > 1 else None
    config = EngineConfig(max_model_len=512, block_size=block_size, max_num_seqs=8)
    quiet_launches = [0]

    def build(overlap: bool) -> Engine:
        engine = Engine(target, drafter, config)
        assert engine.overlap                                 # the CUDA default
        engine.overlap = overlap
        launch = engine.runner.launch

        def checked(batch):
            if batch.prefill or any(k != engine.runner.width - 1 for k in batch.num_drafts):
                return launch(batch)
            torch.cuda.set_sync_debug_mode("error")           # a host wait here would raise
            try:
                launched = launch(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            quiet_launches[0] += 1
            return launched
        engine.runner.launch = checked
        return engine

    _, off = run_batch(lambda: build(False), requests()[:2], arrivals={3: requests()[2:]})
    _, on = run_batch(lambda: build(True), requests()[:2], arrivals={3: requests()[2:]})
    assert quiet_launches[0] > 10
    for a, b in zip(on, off):
        assert [e.token_ids for e in a.events] == [e.token_ids for e in b.events], a.request.request_id
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths


def test_early_drafts_on_cuda_sync_nothing_and_change_no_output(pair):
    """Early drafts (model_runner.draft_ahead, on by default on CUDA): launching the next step's
    draft behind the verify waits for nothing on the host, the steps take those drafts, and
    every token and acceptance length equals the engine's without them (one batch that starts
    and ends together, so both engines draft the same batches)."""
    target, draft = pair
    config = EngineConfig(max_model_len=512, block_size=4, max_num_seqs=8)
    quiet = [0]

    def build(early: bool) -> Engine:
        engine = Engine(target, draft, config)
        assert engine.runner.drafts_early                     # the CUDA default
        engine.runner.drafts_early = early
        ahead = engine.runner.draft_ahead

        def checked(launched):
            torch.cuda.set_sync_debug_mode("error")           # a host wait here would raise
            try:
                ahead(launched)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            quiet[0] += 1
        engine.runner.draft_ahead = checked
        return engine

    def batch():
        return [make_request(f"r{i}", PROMPT[5 * i: 40 + 7 * i], max_tokens=40) for i in range(4)]
    _, off = run_batch(lambda: build(False), batch())
    engine, on = run_batch(lambda: build(True), batch())
    assert quiet[0] > 20 and engine.runner.early_rows[1] > 40
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids, a.request.request_id
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths


def test_early_drafts_under_adaptive_widths_with_arrivals_keep_greedy_output(pair):
    """Adaptive widths (narrow draft graphs), arrivals mid-run (steps whose drafts are partly
    early rows, partly a fresh draft forward reading the same shared readout) on CUDA graphs: the
    greedy output equals the engine's without early drafts (widths follow measured times, so
    only the output is compared), and the early rows are taken."""
    target, draft = pair
    config = EngineConfig(max_model_len=512, block_size=8, max_num_seqs=8, speculation="adaptive")

    def build(early: bool) -> Engine:
        engine = Engine(target, draft, config)
        engine.runner.drafts_early = early
        return engine

    def batch():
        return [make_request(f"r{i}", PROMPT[3 * i: 30 + 9 * i], max_tokens=24 + 6 * i) for i in range(5)]
    first = batch()
    _, off = run_batch(lambda: build(False), first[:3], arrivals={4: first[3:]})
    second = batch()
    engine, on = run_batch(lambda: build(True), second[:3], arrivals={4: second[3:]})
    assert engine.runner.early_rows[1] > 0          # the calibration's warm-up drafts every block
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids, a.request.request_id
