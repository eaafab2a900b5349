"""GPU checks of adaptive speculation (issue 31) on the lent H200: per-sequence widths chosen
before the step (k = 0 included: no draft row for that sequence) give the same outputs and
acceptance lengths through the CUDA graphs as through the eager ragged step, and the real policy,
its cost table measured at startup, is lossless. CPU analogues: tests/test_adaptive.py."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.graphs import EAGER, FULL
from blockspec.loader import load_draft, load_model
from helpers import make_request, run_batch
from test_adaptive import ForcedWidths

PROMPT = [int(t) for t in torch.randint(0, 151643, (200,), generator=torch.Generator().manual_seed(31))]
BLOCK = 8


@pytest.fixture(scope="module")
def pair(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir), device="cuda", dtype="float32").model
    return target, load_draft(str(qwen3_draft_dir), target)


def requests():
    spans = [(0, 40), (40, 47), (7, 120), (100, 103), (3, 200)]
    return [make_request(f"r{i}", PROMPT[a:b], max_tokens=24 + 3 * i) for i, (a, b) in enumerate(spans)]


def config(graphs: bool, speculation: str = "fixed") -> EngineConfig:
    return EngineConfig(max_model_len=512, block_size=BLOCK, max_num_seqs=8, cuda_graphs=graphs,
                        speculation=speculation)


def counting(engine: Engine, modes: Counter) -> Engine:
    """Counts the dispatcher's plans by (forward, mode, whether the step had prefill rows)."""
    dispatcher = engine.runner.graphs
    real = dispatcher.run

    def run(kind, plan, fn, meta, prepare):
        modes[(kind, plan.mode, plan.desc.has_prefill)] += 1
        return real(kind, plan, fn, meta, prepare)
    dispatcher.run = run
    return engine


def test_random_per_sequence_widths_replay_what_the_eager_step_computes(pair):
    """Narrowed widths stay on the graphed path: every decode-only verify and every draft
    propose replays a FULL graph."""
    target, draft = pair
    runs, modes = {}, Counter()
    for graphs in (False, True):
        def build() -> Engine:
            engine = Engine(target, draft, config(graphs))
            engine.runner.speculation = engine.scheduler.speculation = ForcedWidths(BLOCK - 1, seed=9)
            return counting(engine, modes) if graphs else engine
        _, runs[graphs] = run_batch(build, requests()[:2], arrivals={2: requests()[2:]})
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.output_ids == eager.output_ids, graphed.request.request_id
        assert graphed.stats.acceptance_lengths == eager.stats.acceptance_lengths
        assert graphed.stats.verify_widths == eager.stats.verify_widths
    assert 0 in {k for run in runs[True] for k in run.stats.verify_widths}
    assert modes[("verify", FULL, False)] > 5 and modes[("propose", FULL, False)] > 5
    assert modes[("verify", EAGER, False)] == modes[("propose", EAGER, False)] == 0


def test_the_adaptive_policy_on_graphs_is_lossless(pair):
    target, draft = pair
    _, plain = run_batch(lambda: Engine(target, None, EngineConfig(max_model_len=512, max_num_seqs=8)), requests())
    modes = Counter()
    engine, adaptive = run_batch(lambda: counting(Engine(target, draft, config(True, "adaptive")), modes), requests())
    table = engine.runner.speculation.costs
    assert table is not None and table.padded and list(table.target_ms) == sorted(table.target_ms)
    assert table.target_rows == tuple(engine.runner.graphs.full_tokens)
    assert modes[("verify", EAGER, False)] == 0
    assert [r.output_ids for r in adaptive] == [r.output_ids for r in plain]


def test_narrower_draft_blocks_replay_what_the_eager_step_computes(pair):
    """Adaptive mode's draft blocks of 2 / 4 / 8 (each step the narrowest holding its widest
    k + 1, random widths): graphs and eager agree token for token and every draft propose,
    whatever its width, replays a FULL graph that writes the shared logits buffer."""
    from test_adaptive import RandomAdaptive, draft_by_width
    from blockspec.engine.spec.policy import CostTable
    target, draft = pair
    costs = CostTable((1, 4096), (5.0, 46.0), (1, 64), draft_by_width(BLOCK),
                      narrow=tuple((w, draft_by_width(w)) for w in (2, 4)))
    runs, modes, widths = {}, Counter(), Counter()
    for graphs in (False, True):
        def build() -> Engine:
            engine = Engine(target, draft, config(graphs, "adaptive"))
            engine.runner.speculation = engine.scheduler.speculation = RandomAdaptive(BLOCK - 1, costs, seed=5)
            launch = engine.runner.launch
            engine.runner.launch = lambda batch: (widths.update([batch.draft_width or BLOCK] if graphs and any(
                batch.num_drafts) else []), launch(batch))[1]
            return counting(engine, modes) if graphs else engine
        _, runs[graphs] = run_batch(build, requests()[:2], arrivals={2: requests()[2:]})
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.output_ids == eager.output_ids, graphed.request.request_id
        assert graphed.stats.acceptance_lengths == eager.stats.acceptance_lengths
    assert widths[2] and widths[4] and widths[BLOCK]
    assert modes[("propose", EAGER, False)] == 0 and modes[("propose", FULL, False)] > 5
