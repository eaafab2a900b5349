"""Host time of one hybrid rollback (StatePool.select) as a graphed verify hands it over: 24
stacked GDN layers (tiny shapes, so the copies cost nothing and the figure is the host's), one
sequence, the stash in the preallocated space, the graph's stash list copied in before each call.

    python scripts/select_bench.py [--calls 3000]
"""
from __future__ import annotations

import argparse
import time

import torch

from blockspec.cache.state_pool import RecurrentShape, StatePool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = RecurrentShape(conv_dim=8, conv_kernel=4, num_v_heads=2, k_dim=4, v_dim=4)
    pool = StatePool(5, [shape] * 24, torch.float32, device)
    pool.reserve_space(2, 16)
    for layer in range(24):
        pool.stash(layer, *pool.space_for(layer, 1, 16))
    graphs_stash = list(pool.stashed)
    for rep in range(2):                                     # the first round warms the allocator
        started = time.perf_counter()
        for _ in range(args.calls):
            pool.stashed = list(graphs_stash)
            pool.select([3], [5])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        us = (time.perf_counter() - started) / args.calls * 1e6
    print(f"select: {us:.1f} us a call ({device}, {args.calls} calls)")


if __name__ == "__main__":
    main()
