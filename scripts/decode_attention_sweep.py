"""Sweep the paged attention kernel's decode and verify calls (issue 33: at 4,096 keys a Qwen3-8B
layer's attention read its 16.8 MB at 0.76 TB/s). For each call shape (sequences × query rows ×
context, the pool's capacity as the key bound, as under the engine's graphs): the shipped variant,
then every combination of pipeline stages, BLOCK_N and split count (the shipped one, 2× and 4×),
timed as replays of a CUDA graph of 20 calls (the merge kernel included) and checked against the
shipped output. Round 58 also swept a key loop loading K/V a chunk ahead of its math and pages two
ahead: the same bits, no faster (BENCHMARKS.md), so it was dropped.

    python scripts/decode_attention_sweep.py --out sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace

import torch

from bench_attention import graph_ms, make
from blockspec.kernels import attention as K

CASES = ((1, 1, 512), (1, 1, 4096), (1, 1, 16384), (1, 16, 512), (1, 16, 4096), (1, 16, 16384),
         (32, 1, 4096), (32, 16, 4096))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--capacity", type=int, default=40960, help="keys a sequence's pages can hold (the graphs' bound)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    scale = args.head_dim ** -0.5
    results = []
    for num_seqs, width, context in CASES:
        q, k_pool, v_pool, meta, _ = make(num_seqs, width, context, args.heads, args.kv_heads, args.head_dim, 16,
                                          max(args.capacity, context), False, device, dtype)
        starts = meta.starts
        shipped = K.attention_variant(K.heads_of(q, k_pool), width, num_seqs, args.capacity, K.num_sms(device))

        def run(variant):
            return K.launch(variant, q, k_pool, v_pool, meta.block_tables, meta.context_lens, meta.positions, starts,
                            width, 16, scale, True, None)
        expected = run(shipped)
        kv_bytes = 2 * num_seqs * context * args.kv_heads * args.head_dim * k_pool.element_size()
        rows = []
        for stages, block_n, split_x in itertools.product((1, 2, 3, 4), (32, 64), (1, 2, 4)):
            variant = replace(shipped, num_stages=stages, block_n=block_n,
                              num_splits=min(64, shipped.num_splits * split_x))
            try:
                out = run(variant)
                us = graph_ms(lambda: run(variant)) * 1e3
            except Exception as e:                                   # out of shared memory / registers
                rows.append(dict(variant=asdict(variant), error=str(e)[:120]))
                continue
            same_bits = bool(torch.equal(out, expected))
            rows.append(dict(variant=asdict(variant), us=us, kv_TBps=kv_bytes / (us * 1e-6) / 1e12, same_bits=same_bits,
                             max_err=float((out.float() - expected.float()).abs().max())))
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        base = next(r for r in rows if r["variant"] == asdict(shipped))
        print(f"== {num_seqs} seq × {width} rows, {context} keys: shipped {base['us']:.2f} µs "
              f"({base['kv_TBps']:.2f} TB/s, {shipped.num_splits} splits)")
        for r in timed[:6]:
            v = r["variant"]
            print(f"   {r['us']:8.2f} µs {r['kv_TBps']:5.2f} TB/s  stages={v['num_stages']} "
                  f"BLOCK_N={v['block_n']} splits={v['num_splits']}  err {r['max_err']:.1e}")
        results.append(dict(num_seqs=num_seqs, width=width, context=context, shipped=asdict(shipped), rows=rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": vars(args), "cases": results}, f, indent=2)


if __name__ == "__main__":
    main()
