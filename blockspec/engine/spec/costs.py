"""The cost table adaptive speculation allocates with (policy.py): milliseconds of the target
forward of a decode step by tokens, and of the draft forward by sequences, measured at startup
on the device the engine runs on, through the forwards the steps will actually run.

What measures them is a CostSource: the graph dispatcher, replaying the graph of each bucket
(issue 30), or, where there are no graphs, EagerCosts, the runner's eager ragged path at sample
sizes. Either way the rows are padding rows (page 0, state slot 0: nobody's memory) with
a short context, so the table prices the weights and the per-row work; attention over long
contexts is not in it (at a few thousand tokens of context the per-row GEMMs still dominate a
dense 8B forward), nor the host's work per step, which the policy learns online
(Speculation.record_cycle). Times are made monotone (more rows never cost less: noise must not
make the allocation chase it) and logged. A few seconds on an H200; on CPU, where the test
models take milliseconds per forward, a fraction of a second.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Protocol

import torch

from blockspec.engine.spec.policy import CostTable

logger = logging.getLogger("blockspec.engine")
_CACHE: dict[tuple, tuple[tuple, CostTable]] = {}
REPEAT = 3


class CostSource(Protocol):
    """The measurement hook (issue 30's GraphDispatcher.measure_costs, NOTES.md)."""

    def measure_costs(self, repeat: int = REPEAT) -> dict[str, dict[int, float]]:
        """{"verify": {tokens: ms}, "draft": {sequences: ms}}: median ms of one target forward of
        a decode step's rows (logits of every row) per token bucket and of one draft propose
        per sequence bucket, through the path a step of that size takes, on padding rows (page
        0, state slot 0), the engine's state and counters untouched."""


def measure_costs(source: CostSource, padded: bool, key: tuple | None = None, owners: tuple = (),
                  log: bool = True) -> CostTable:
    """The table through `source` (padded: the steps run padded up to its buckets, i.e. graphs);
    with a key, cached per process (owners — the models — are kept in the entry and compared by
    identity, so a table is never served to other models)."""
    full_key = None if key is None else (key, tuple(id(owner) for owner in owners))
    cached = _CACHE.get(full_key) if full_key is not None else None
    if cached is not None and all(a is b for a, b in zip(cached[0], owners)):
        return cached[1]
    started = time.perf_counter()
    table = cost_table(source.measure_costs(REPEAT), padded)
    if full_key is not None:
        _CACHE[full_key] = (owners, table)
    if log:
        logger.info(f"blockspec: speculation cost table ({time.perf_counter() - started:.1f} s): "
                    f"{table.describe()}")            # the startup lines' logger (never stdout: generate --json)
    return table


def cost_table(measured: dict[str, dict[int, float]], padded: bool) -> CostTable:
    tokens, seqs = sorted(measured["verify"]), sorted(measured["draft"])
    return CostTable(tuple(tokens), tuple(monotone([measured["verify"][n] for n in tokens])),
                     tuple(seqs), tuple(monotone([measured["draft"][n] for n in seqs])), padded=padded)


def monotone(values: list[float]) -> list[float]:
    out, best = [], 0.0
    for value in values:
        best = max(best, value)
        out.append(best)
    return out


def sample_sizes(largest: int) -> list[int]:
    """1, 2, 4 … and the largest: where nothing is padded, the points to interpolate between."""
    sizes = {largest}
    size = 1
    while size < largest:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


class EagerCosts:
    """The runner's eager ragged path at sample sizes (no graphs: a step runs at its own size, so
    the table interpolates between these points). A verify of n tokens is spread over
    min(n, max_num_seqs) sequences (at least n / T), as a decode step of n tokens is."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def measure_costs(self, repeat: int = REPEAT) -> dict[str, dict[int, float]]:
        runner = self.runner
        return {"verify": {n: self.time_forward("verify", n, repeat)
                           for n in sample_sizes(runner.max_decode_seqs * runner.width)},
                "draft": {n: self.time_forward("propose", n, repeat) for n in sample_sizes(runner.max_decode_seqs)}}

    @torch.inference_mode()
    def time_forward(self, kind: str, size: int, repeat: int) -> float:
        from blockspec.engine.model_runner import Entry
        runner = self.runner
        pages = -(-runner.width // runner.page_size)
        idle = SimpleNamespace(block_table=[0] * pages, state_slot=0)      # page 0 only: the padding page
        if kind == "verify":
            num_seqs = max(-(-size // runner.width), min(size, runner.config.max_num_seqs))
            lens = [size // num_seqs + (b < size % num_seqs) for b in range(num_seqs)]
            meta = runner.prepare([Entry(idle, 0, [0] * n) for n in lens])

            def once() -> None:
                runner.target_logits(meta)
        else:
            meta = runner.prepare([Entry(idle, 0, [0] * runner.width) for _ in range(size)])

            def once() -> None:
                runner.draft_proposal(meta)
        forwards = runner.num_forwards
        once()                                                           # warm-up
        times = []
        for _ in range(repeat):
            sync(runner.device)
            start = time.perf_counter()
            once()
            sync(runner.device)
            times.append((time.perf_counter() - start) * 1e3)
        runner.num_forwards = forwards                                  # not the engine's work
        return sorted(times)[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
