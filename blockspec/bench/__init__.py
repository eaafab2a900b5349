"""`blockspec bench`: speed on random weights of real shapes, side by side with peers in one run.

Everything is a ratio to something measured in the same process: the bandwidth floor (weight
bytes a plain step reads, for MoE targets only the chosen experts, / measured copy bandwidth),
plain decoding, transformers' forward, z-lab's reference loop.
Throughput is measured through the real engine (scheduler, batched cycle, pools) at each
concurrency. Random weights accept no drafts, so `--accept-len` forces the acceptance length
(the forwards are the same; only the bookkeeping of what is kept changes).

DFlash 1 and DFlash 2 drafts of the same shape run side by side: the DFlash 2 cycle (its convs
and the selector's walk inside the propose graph) against the DFlash 1 cycle, and the readout
alone (DFlash 1: logits; DFlash 2: logits, top-k, edge scores, greedy walk) replayed as a graph.

One module per mode: sweep (the default: plain vs DFlash at each concurrency), bursts (`--burst`),
speculation (`--compare-speculation`, the latent acceptance profile), multi_turn (`--multi-turn`);
forward (kernel breakdown, readout, graph replays), peers (transformers, z-lab) and common (shapes,
builders, timing, the engine batch) serve them.
"""
from __future__ import annotations

import logging
import sys

from blockspec.bench.bursts import burst, burst_main
from blockspec.bench.common import (ENGINE_OPTIONS, MEMORY_OPTIONS, SHAPES, EngineFailed, build_empty, build_models,
                                    copy_bandwidth, graphed, random_init, report, run_batch, step_weight_bytes, timed)
from blockspec.bench.forward import forward_metadata, kernel_class
from blockspec.bench.multi_turn import multi_turn_main
from blockspec.bench.speculation import (LatentProfile, main_compare_speculation, parse_accept_profile,
                                         solve_mean_probability)
from blockspec.bench.sweep import run, throughput
from blockspec.loader import resolve_device

# What scripts/ and tests/ import from `blockspec.bench`.
__all__ = ["SHAPES", "EngineFailed", "LatentProfile", "build_empty", "build_models", "burst", "copy_bandwidth",
           "forward_metadata", "graphed", "kernel_class", "main", "parse_accept_profile", "random_init", "run_batch",
           "solve_mean_probability", "step_weight_bytes", "throughput", "timed"]


def check_accept_len(accept_len: float | None, block_size: str) -> None:
    """--accept-len is what a cycle commits on average: at least its own target token, at most a
    whole block (forced_accept would clamp anything else into a figure nobody asked for)."""
    if accept_len is None:
        return
    try:
        largest = max(int(b) for b in str(block_size).split(",") if b.strip())
    except ValueError:
        return                                             # --block-size's own check names it
    if not 1.0 <= accept_len <= largest:
        raise ValueError(f"--accept-len must be in [1, {largest}] (a cycle commits its target's token and at "
                         f"most the block), not {accept_len:g}")


def main(args) -> int:
    check_accept_len(getattr(args, "accept_len", None), getattr(args, "block_size", "16"))
    if getattr(args, "multi_turn", None):
        log_startup(args.device != "cpu")
        return report(multi_turn_main, args)
    device = resolve_device(args.device)
    log_startup(device.type == "cuda")
    if args.shape not in SHAPES:
        raise ValueError(f"unknown --shape {args.shape!r} ({', '.join(SHAPES)})")
    concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if not concurrency or min(concurrency) < 1:
        raise ValueError("--concurrency must be a comma-separated list of positive integers")
    try:
        block_sizes = [int(b) for b in str(args.block_size).split(",") if b.strip()]
    except ValueError:
        block_sizes = []
    if not block_sizes or min(block_sizes) < 2:
        raise ValueError(f"--block-size must be a comma-separated list of integers ≥ 2, not {args.block_size!r}")
    if getattr(args, "layers", None) is not None and args.layers < 1:
        raise ValueError("--layers must be at least 1")
    ENGINE_OPTIONS.clear()
    ENGINE_OPTIONS.update({name: getattr(args, name) for name in MEMORY_OPTIONS if getattr(args, name, None) is not None})
    if getattr(args, "tensor_parallel_size", 1) > 1:   # plain / DFlash / DFlash 2 over N ranks (distributed/bench.py)
        from blockspec.distributed import bench as tp_bench
        return report(lambda args: tp_bench.run(args, args.tensor_parallel_size), args)
    if getattr(args, "burst", None):
        return burst_main(args, device, block_sizes[0])
    if getattr(args, "compare_speculation", False):
        try:
            return main_compare_speculation(args, device, concurrency, block_sizes[0])
        except EngineFailed as exc:
            print(f"blockspec bench: error: {exc}", file=sys.stderr)
            return 1
    return report(lambda args: run(args.shape, device, args.vs, concurrency, args.accept_len, args.prompt_len,
                                   args.max_tokens, block_sizes, dflash2=not getattr(args, "no_dflash2", False),
                                   layers=getattr(args, "layers", None), breakdown=getattr(args, "breakdown", False),
                                   quantization=getattr(args, "quantization", None)),
                  args)


def log_startup(on: bool) -> None:
    """The engines' startup lines (pool, graphs captured and their seconds) on stderr, as `serve`
    logs them: a bench's figures are read beside what each engine paid to start (on CUDA, where
    engines capture graphs; CPU runs stay quiet)."""
    named = logging.getLogger("blockspec")
    if on and not named.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        named.addHandler(handler)
        named.setLevel(logging.INFO)
