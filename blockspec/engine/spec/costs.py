"""The cost table adaptive speculation allocates with (policy.py): target-forward milliseconds
by rows and draft-forward milliseconds by batch, measured on the device the engine runs on.

Measured once per (models, device, block, seats) in a process, at the first decode step that
needs it, through the runner's own eager ragged path (the one narrowed steps run; a step at the
full block runs its graphs, a little faster at small batches). The rows are padding rows (page
0, state slot 0: nobody's memory) with a short context, so the table prices the weights and the
per-row work; attention over long contexts is not in it (at a few thousand tokens of context
the per-row GEMMs still dominate a dense 8B forward), nor the host's work per step, which the
policy learns online (Speculation.record_cycle).

Points: B sequences of the full block (B · T rows) and of 1 token (B rows), B over the graph
capture sizes up to the most sequences a step decodes, interpolated between them. A few seconds on an H200; on
CPU, where the test models take milliseconds per forward, a fraction of a second.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from blockspec.engine.cuda_graphs import capture_sizes
from blockspec.engine.spec.policy import CostTable

logger = logging.getLogger("blockspec.engine")
_CACHE: dict[tuple, tuple[object, object, CostTable]] = {}
REPEAT = 3


def measure_costs(runner, log: bool = True) -> CostTable:
    """The table for this runner's models and sizes (cached per process: the models are kept in
    the cache entry, so an id is never reused while it is there)."""
    key = (id(runner.target), id(runner.draft), runner.width, runner.config.max_num_seqs, str(runner.device),
           runner.graphs is not None)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is runner.target and cached[1] is runner.draft:
        return cached[2]
    started = time.perf_counter()
    sizes = capture_sizes(runner.max_decode_seqs)
    target: dict[int, float] = {}
    draft: dict[int, float] = {}
    for batch in sizes:
        for width in sorted({1, runner.width}):
            target[batch * width] = min(target.get(batch * width, float("inf")),
                                        forward_ms(runner, batch, width, "verify"))
        draft[batch] = forward_ms(runner, batch, runner.width, "propose")
    rows = sorted(target)
    table = CostTable(tuple(rows), tuple(monotone([target[r] for r in rows])),
                      tuple(sorted(draft)), tuple(monotone([draft[b] for b in sorted(draft)])))
    _CACHE[key] = (runner.target, runner.draft, table)
    if log:
        logger.info(f"blockspec: speculation cost table ({runner.device}, {time.perf_counter() - started:.1f} s): "
                    f"{table.describe()}")            # the startup lines' logger (never stdout: generate --json)
    return table


def monotone(values: list[float]) -> list[float]:
    """More rows never cost less: measurement noise must not make the allocation chase it."""
    out, best = [], 0.0
    for value in values:
        best = max(best, value)
        out.append(best)
    return out


@torch.inference_mode()
def forward_ms(runner, batch: int, width: int, kind: str) -> float:
    """Median milliseconds of one target forward (kind "verify": `batch` rows of `width` tokens,
    logits of every row, as a step's verify) or one draft propose ("propose": `batch` blocks),
    eager, on rows with no pages (every row at page 0, the padding page: nobody's memory)."""
    from blockspec.engine.model_runner import Entry
    pages = -(-runner.width // runner.page_size)
    idle = SimpleNamespace(block_table=[0] * pages, state_slot=0)      # page 0 only: the padding page
    forwards = runner.num_forwards
    if kind == "verify":
        meta = runner.prepare([Entry(idle, 0, [0] * width) for _ in range(batch)])

        def once() -> None:
            runner.target_logits(meta)
    else:
        meta = runner.prepare([Entry(idle, 0, [0] * runner.width) for _ in range(batch)])

        def once() -> None:
            runner.draft_proposal(meta)
    once()                                                               # warm-up
    times = []
    for _ in range(REPEAT):
        sync(runner.device)
        start = time.perf_counter()
        once()
        sync(runner.device)
        times.append((time.perf_counter() - start) * 1e3)
    runner.num_forwards = forwards                                      # not the engine's work
    return sorted(times)[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
