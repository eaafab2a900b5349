"""GPU checks of the ragged engine (issue 20), run on the lent H200: graphs captured at startup
replay exactly what the eager ragged step computes, nothing is captured while serving, and the
KV pool fills the memory it is given. Their CPU analogues: tests/test_memory.py and
tests/test_ragged.py (the padded path run eagerly)."""
from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.loader import load_draft, load_model
from helpers import make_request, run_batch

PROMPT = [int(t) for t in torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(4))]


@pytest.fixture(scope="module")
def pair(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir), device="cuda", dtype="float32").model
    return target, load_draft(str(qwen3_draft_dir), target)


def requests():
    lengths = [(0, 40), (40, 47), (7, 120), (100, 103), (3, 300)]
    return [make_request(f"r{i}", PROMPT[a:b], max_tokens=24 + 3 * i) for i, (a, b) in enumerate(lengths)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_graphs_captured_at_startup_equal_the_eager_ragged_step(pair, block_size):
    """Two requests decode, three arrive (mixed steps: PIECEWISE graphs), then decode-only steps
    replay the FULL graphs captured at startup: every output and acceptance length equals the
    eager engine's."""
    target, draft = pair
    drafter = draft if block_size > 1 else None

    def config(graphs: bool) -> EngineConfig:
        return EngineConfig(max_model_len=512, block_size=block_size, max_num_seqs=8, cuda_graphs=graphs)

    _, eager = run_batch(lambda: Engine(target, drafter, config(False)), requests()[:2], arrivals={2: requests()[2:]})
    shapes, graphed_steps = set(), [0]

    def build() -> Engine:
        engine = Engine(target, drafter, config(True))
        graphs = engine.runner.graphs
        assert graphs.capture and graphs.full and graphs.piecewise          # captured at startup
        shapes.update(graphs.full)
        real = graphs.run_full

        def counted(kind, *args):
            graphed_steps[0] += kind == "verify"
            return real(kind, *args)
        graphs.run_full = counted
        return engine
    engine, graphed = run_batch(build, requests()[:2], arrivals={2: requests()[2:]})
    graphs = engine.runner.graphs
    assert {desc.num_tokens for kind, desc, _ in shapes if kind == "verify"} == set(graphs.full_tokens)
    assert set(graphs.full) == shapes                                  # nothing captured while serving
    assert all(static.graph is not None for static in graphs.full.values())
    assert graphed_steps[0] > 5
    by_id = {run.request.request_id: run for run in eager}
    for run in graphed:
        assert run.output_ids == by_id[run.request.request_id].output_ids, run.request.request_id
        assert run.stats.acceptance_lengths == by_id[run.request.request_id].stats.acceptance_lengths


@pytest.mark.measures_memory
def test_the_pool_fills_the_memory_it_is_given(pair):
    """gpu_memory_utilization set to leave 6 GiB above what this process and others use now: the
    pages take what one full-budget forward's activations (~2 GiB here) leave of it, never more."""
    target, draft = pair
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    utilization = (total - free + (6 << 30)) / total
    config = EngineConfig(max_model_len=4096, block_size=4, max_num_seqs=100_000, cuda_graphs=False,
                          gpu_memory_utilization=utilization)
    engine = Engine(target, draft, config)
    size = engine.runner.pool_size
    assert size.source == "measured"
    pool_bytes = size.num_pages * size.page_bytes
    assert (1 << 30) < pool_bytes < (6 << 30) + (256 << 20), pool_bytes
    assert engine.kv_cache_tokens == (size.num_pages - 1) * config.page_size
    # Within the 6 GiB (+ slack), counted as this process's own growth: the device's free memory
    # also moves with other processes (tests/gpu runs in several at once: round 64's one-call run).
    assert torch.cuda.memory_reserved() - reserved < (6 << 30) + (256 << 20)
