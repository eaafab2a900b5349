"""Sweep the paged attention kernel's tiles on a long prefill chunk (issue 30: a 512-token chunk
of Qwen3-8B over a 16k cached context spent 648 µs a layer in attention, 68 % of its step, ~215
TFLOP/s, while its GEMMs ran near the bf16 peak). One causal sequence of T query tokens after
C − T cached keys, pages of 16 in random order; every (BLOCK_M, BLOCK_N, warps, stages) of the
grid, unsplit, timed by CUDA events over repeated launches and checked against the shipped
tiles' output; sorted by time, with TFLOP/s (4 · T · keys seen · heads · head_dim, causal).

    python scripts/attention_tile_sweep.py --out sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from blockspec.bench.common import device_time_us as time_us
from blockspec.kernels import attention as K


def case(tokens: int, context: int, heads: int, kv_heads: int, head_dim: int, page: int = 16):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    pages = -(-context // page)
    gen = torch.Generator(device=dev).manual_seed(0)
    table = (torch.randperm(pages, device=dev, generator=gen) + 1).view(1, pages)
    k_pool = torch.randn((pages + 1) * page, kv_heads, head_dim, device=dev, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dtype)
    lens = torch.tensor([context], device=dev)
    positions = torch.arange(context - tokens, context, device=dev)
    starts = torch.tensor([0, tokens], device=dev)
    return q, k_pool, v_pool, table, lens, positions, starts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    results = []
    for name, tokens, context, heads, kv_heads, dim in (("qwen3-8b", 512, 16384, 32, 8, 128),
                                                        ("qwen3-8b", 2048, 16384, 32, 8, 128),
                                                        ("qwen3.5-4b", 512, 16384, 16, 4, 256)):
        q, k_pool, v_pool, table, lens, positions, starts = case(tokens, context, heads, kv_heads, dim)
        heads_of = K.heads_of(q, k_pool)
        shipped = K.attention_variant(heads_of, tokens, 1, context, K.num_sms(q.device))

        def run(variant):
            return K.launch(variant, q, k_pool, v_pool, table, lens, positions, starts, tokens, 16,
                            dim ** -0.5, True, None)
        reference = run(shipped).float()
        flops = 4 * tokens * (context - tokens / 2) * heads * dim
        rows = []
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        for block_m, block_n, warps, stages in grid:
            variant = K.AttentionVariant(block_m, block_n, max(16, 1 << (dim - 1).bit_length()), warps, stages, 1)
            try:
                err = float((run(variant).float() - reference).abs().max())
                us = time_us(lambda: run(variant))
            except Exception as e:                                   # out of shared memory / registers
                rows.append({"variant": [block_m, block_n, warps, stages], "error": type(e).__name__})
                continue
            rows.append({"variant": [block_m, block_n, warps, stages], "us": round(us, 1),
                         "tflops": round(flops / us / 1e6, 1), "max_err": err})
        base = next(r for r in rows if r["variant"] == [shipped.block_m, shipped.block_n, shipped.num_warps,
                                                         shipped.num_stages])
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"== {name} T={tokens} C={context}: shipped {base['variant']} {base['us']} µs "
              f"({base['tflops']} TFLOP/s); splits {shipped.num_splits}", flush=True)
        for r in ok[:8]:
            print(f"   {r['variant']}: {r['us']} µs, {r['tflops']} TFLOP/s, max err {r['max_err']:.3g}", flush=True)
        results.append({"shape": name, "tokens": tokens, "context": context, "shipped": base, "rows": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
