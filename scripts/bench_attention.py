"""Time the Triton paged attention kernels against the torch reference on one attention layer
of a given shape (default: Qwen3-8B, 32 query heads, 8 KV heads, head_dim 128, bf16), for
decode (T = 1), verify blocks (T = 16, causal) and the draft's block (T = 16, non-causal over
context + its own K/V). Each figure is one call, measured as replays of a CUDA graph of 20
calls (as the engine runs them). The reference gathers the live length (its best case: the
engine's graphs gather the length's power-of-two bucket); the kernel gets the pool's capacity
as its key bound, as under the engine's graphs.

    python scripts/bench_attention.py --out attention.json
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.kernels.attention import paged_attention as kernel
from blockspec.layers.attention import AttentionMetadata, reference_paged_attention


def make(num_seqs: int, width: int, context: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
         capacity: int, draft: bool, device: torch.device, dtype: torch.dtype):
    pages = capacity // page_size
    gen = torch.Generator(device=device).manual_seed(0)
    tables = (torch.randperm(num_seqs * pages, device=device, generator=gen) + 1).view(num_seqs, pages)
    slots = (num_seqs * pages + 1) * page_size
    k_pool = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(num_seqs * width, heads, head_dim, device=device, dtype=dtype)
    lens = torch.full((num_seqs,), context, device=device)
    starts = lens if draft else lens - width
    positions = (starts[:, None] + torch.arange(width, device=device)[None]).reshape(-1)
    meta = AttentionMetadata(num_seqs=num_seqs, width=width, input_ids=None, positions=positions, slot_mapping=None,
                             block_tables=tables, context_lens=lens, max_context_len=context, page_size=page_size, kv=[])
    block_kv = (torch.randn(num_seqs * width, kv_heads, head_dim, device=device, dtype=dtype),
                torch.randn(num_seqs * width, kv_heads, head_dim, device=device, dtype=dtype)) if draft else None
    return q, k_pool, v_pool, meta, block_kv


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=8192, help="keys per sequence the pool can hold")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    scale = args.head_dim ** -0.5
    rows = []
    print(f"{'form':>7} {'B':>3} {'T':>3} {'ctx':>5} {'kernel µs':>10} {'ref µs':>9} {'ref/kernel':>10} {'KV TB/s':>8}")
    for form, width in (("decode", 1), ("verify", 16), ("draft", 16)):
        for num_seqs in (1, 16, 32):
            for context in (512, 4096):
                draft = form == "draft"
                q, k_pool, v_pool, meta, block_kv = make(num_seqs, width, context, args.heads, args.kv_heads,
                                                         args.head_dim, 16, args.capacity, draft, device, dtype)
                causal = not draft
                starts = meta.starts                   # query_start, made before the graph captures
                fast = graph_ms(lambda: kernel(q, k_pool, v_pool, meta.block_tables, meta.context_lens, meta.positions,
                                               starts, width, 16, args.capacity, scale, causal, block_kv))
                meta.shared.clear()
                slow = graph_ms(lambda: reference_paged_attention(q, k_pool, v_pool, meta, meta.context_lens, scale,
                                                                  causal, None, block_kv))
                kv_bytes = 2 * num_seqs * context * args.kv_heads * args.head_dim * k_pool.element_size()
                row = dict(form=form, num_seqs=num_seqs, width=width, context=context, kernel_us=fast * 1e3,
                           reference_us=slow * 1e3, speedup=slow / fast, kernel_kv_TBps=kv_bytes / (fast * 1e-3) / 1e12)
                rows.append(row)
                print(f"{form:>7} {num_seqs:>3} {width:>3} {context:>5} {row['kernel_us']:>10.1f} "
                      f"{row['reference_us']:>9.1f} {row['speedup']:>10.2f} {row['kernel_kv_TBps']:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
