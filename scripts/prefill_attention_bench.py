"""A prefill chunk's attention: the Triton paged kernel against FlashAttention's varlen forward
(kernels/flash_prefill.py), side by side on the same pools (issue 30: a 512-token chunk of
Qwen3-8B over 16k cached keys spent 68 % of its step in the Triton kernel, ~215 TFLOP/s).

For each head shape, chunk of T query rows and context of C keys (one causal sequence, pages of
16 in random order, as the runner lays them out): the Triton kernel as a step calls it; the
routed path as a step runs it (plan + gather + FlashAttention); FlashAttention alone on keys
already contiguous (what the gather costs is the difference); the largest difference between
the two paths' outputs. Times by CUDA events over repeated calls, TFLOP/s = 4 · T · (C − T/2) ·
heads · head_dim ÷ time. Sets LONG_PREFILL_ROWS from where the routed path starts to win.

    python scripts/prefill_attention_bench.py --out prefill_attention.json
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.kernels import attention as K
from blockspec.kernels import flash_prefill

SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3.5-4b": (16, 4, 256), "smollm2": (9, 3, 64)}


def time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / reps


def measure(shape: str, tokens: int, context: int, page: int = 16) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    pages = -(-context // page)
    gen = torch.Generator(device=dev).manual_seed(0)
    table = (torch.randperm(pages, device=dev, generator=gen) + 1).view(1, pages)
    k_pool = torch.randn((pages + 1) * page, kv_heads, dim, device=dev, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(tokens, heads, dim, device=dev, dtype=dtype)
    lens = torch.tensor([context], device=dev)
    positions = torch.arange(context - tokens, context, device=dev)
    starts = torch.tensor([0, tokens], device=dev)
    scale = dim ** -0.5

    def triton():
        return K.paged_attention(q, k_pool, v_pool, table, lens, positions, starts, tokens, page, context, scale,
                                 True)

    def routed():
        plan = flash_prefill.plan(1, [tokens], [context], starts, lens, table, page)
        return flash_prefill.attend(plan, q, k_pool, v_pool, scale)

    plan = flash_prefill.plan(1, [tokens], [context], starts, lens, table, page)
    keys, values = k_pool.index_select(0, plan.slots), v_pool.index_select(0, plan.slots)

    def flash_only():
        return flash_prefill.varlen_causal(q, keys, values, plan.cu_q, plan.cu_k, tokens, context, scale)

    def cudnn():
        # cuDNN's fused attention on the same keys, heads expanded, no mask (an upper bound on what a
        # prefix-then-diagonal split would cost there): is it worth a form of our own?
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale)

    q4 = q.transpose(0, 1)[None]
    k4 = keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
    v4 = values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
    diff = float((triton().float() - routed().float()).abs().max())
    flops = 4 * tokens * (context - tokens / 2) * heads * dim
    row = {"shape": shape, "tokens": tokens, "context": context, "max_diff": diff}
    for name, fn in (("triton", triton), ("routed", routed), ("flash_only", flash_only)):
        us = time_us(fn)
        row[f"{name}_us"], row[f"{name}_tflops"] = round(us, 1), round(flops / us / 1e6, 1)
    try:
        us = time_us(cudnn)
        row["cudnn_full_us"], row["cudnn_full_tflops"] = round(us, 1), round(2 * flops * context / (2 * context - tokens) / us / 1e6, 1)
    except RuntimeError as exc:
        row["cudnn_error"] = str(exc).splitlines()[0][:200]
    row["speedup"] = round(row["triton_us"] / row["routed_us"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="qwen3-8b,qwen3.5-4b,smollm2")
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[32, 64, 128, 256, 512, 2048])
    args = ap.parse_args()
    print(f"FlashAttention available: {flash_prefill.flash_available(torch.device('cuda'))}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for tokens in args.tokens:
            for context in sorted({tokens, 2048, 16384}):
                if context < tokens:
                    continue
                row = measure(shape, tokens, context)
                rows.append(row)
                print(f"{shape:11s} T={tokens:5d} C={context:6d}  triton {row['triton_us']:8.1f} µs "
                      f"({row['triton_tflops']:5.1f} TF/s)  routed {row['routed_us']:8.1f} "
                      f"({row['routed_tflops']:5.1f})  flash alone {row['flash_only_us']:8.1f}  "
                      f"× {row['speedup']:.2f}  diff {row['max_diff']:.3g}  cudnn unmasked "
                      f"{row.get('cudnn_full_us', row.get('cudnn_error'))}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
