"""The cost table adaptive speculation allocates with (policy.py): milliseconds of the target
forward of a decode step by tokens, and of the draft forward by sequences, measured at startup
on the device the engine runs on, through the forwards the steps will actually run.

What measures them is a CostSource: the graph dispatcher (GraphDispatcher.measure_costs), one
verify forward per token bucket and one draft propose per sequence bucket, each through the path
a step of that shape takes (its graph's replay on CUDA; where nothing is padded, as on CPU, the
eager forward of that size, and the table interpolates between the buckets). The rows are
padding rows (page 0, state slot 0: nobody's memory) with a short context, so the table prices
the weights and the per-row work; attention over long contexts is not in it (at a few thousand
tokens of context the per-row GEMMs still dominate a dense 8B forward), nor the host's work per
step, which the policy learns online (Speculation.record_cycle). Times are made monotone (more
rows never cost less: noise must not make the allocation chase it) and logged. A few seconds on an
H200; on CPU, where only the powers of two are measured and a bucket's repeats stop at a time
budget, a fraction of a second for the test models and a few seconds for 64 sequences.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from blockspec.engine.graphs import monotone
from blockspec.engine.spec.policy import CostTable

logger = logging.getLogger("blockspec.engine")
_CACHE: dict[tuple, tuple[tuple, CostTable]] = {}
REPEAT = 3
# Unpadded (eager, as on CPU) forwards are cheap to time and their host is often shared: more
# samples a bucket (the table still takes a few seconds there).
EAGER_REPEAT = 9


class CostSource(Protocol):
    """The measurement hook (issue 30's GraphDispatcher.measure_costs, NOTES.md)."""

    def measure_costs(self, repeat: int = REPEAT) -> dict:
        """{"verify": {tokens: ms}, "draft": {sequences: ms}, "narrow": {width: {sequences: ms}}}:
        median ms of one target forward of a decode step's rows (logits of every row) per token
        bucket and of one draft propose of full blocks (and of each narrower width) per sequence
        bucket, through the path a step of that size takes, on padding rows (page 0, state slot
        0), the engine's state and counters untouched."""


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
    table = cost_table(source.measure_costs(REPEAT if padded else EAGER_REPEAT), padded)
    if full_key is not None:
        _CACHE[full_key] = (owners, table)
    if log:
        logger.info(f"blockspec: speculation cost table ({time.perf_counter() - started:.1f} s): "
                    f"{table.describe()}")            # the startup lines' logger (never stdout: generate --json)
    return table


def cost_table(measured: dict, padded: bool) -> CostTable:
    tokens, seqs = sorted(measured["verify"]), sorted(measured["draft"])
    narrow = tuple((width, tuple(monotone([times[n] for n in seqs])))
                   for width, times in sorted(measured.get("narrow", {}).items()))
    return CostTable(tuple(tokens), tuple(monotone([measured["verify"][n] for n in tokens])),
                     tuple(seqs), tuple(monotone([measured["draft"][n] for n in seqs])), padded=padded, narrow=narrow)


