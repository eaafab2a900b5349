"""The cost table adaptive speculation allocates with (policy.py): target-forward milliseconds
by rows and draft-forward milliseconds by batch, measured on the device the engine runs on.

Measured once per (models, device, block, seats) in a process, at the first decode cycle that
needs it, through the runner's own path (the padded batch shapes and, on CUDA, the same graphs
the cycle replays; capturing them here is work the first cycles would do anyway). The rows are
padding rows (page 0, state slot 0: nobody's memory) with a short context, so the table prices
the weights and the per-row work; attention over long contexts is not in it (at a few thousand
tokens of context the per-row GEMMs still dominate a dense 8B forward).

Points: B sequences of the full block (B · T rows) and of 1 token (B rows), B over the graph
capture sizes up to max_num_seqs (every size the engine pads to), so the table is exact at the
shapes the rectangle engine runs and interpolated between them. A few seconds on an H200; on
CPU, where the test models take milliseconds per forward, a fraction of a second.
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from blockspec.engine.cuda_graphs import capture_sizes
from blockspec.engine.spec.policy import CostTable

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
    sizes = capture_sizes(runner.config.max_num_seqs)
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
        print(f"blockspec: speculation cost table ({runner.device}, {time.perf_counter() - started:.1f} s): "
              f"{table.describe()}", file=sys.stderr, flush=True)        # stdout may be `generate --json`
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
    """Median milliseconds of one target verify (kind "verify") or draft propose ("propose") of
    `batch` padding sequences of `width` tokens, through the runner's padded / graphed path."""
    fakes = [SimpleNamespace(block_table=[0], state_slot=0) for _ in range(batch)]
    blocks = [[0] * width for _ in range(batch)]
    graphs = runner.graphs_for(width)
    meta = runner.prepare(fakes, width, [0] * batch, blocks, padded=graphs is not None)
    if graphs is not None:
        meta = graphs.bind(meta)
    fn = runner.target_logits if kind == "verify" else runner.draft_proposal
    forwards = runner.num_forwards

    def once() -> None:
        runner.run_forward(kind, fn, meta)
    once()                                                               # warm-up (and capture)
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
