"""A prefill chunk's attention: the Triton paged kernel against FlashAttention's varlen forward
(kernels/flash_prefill.py), side by side on the same pools (issue 30: a 512-token chunk of
Qwen3-8B over 16k cached keys spent 68 % of its step in the Triton kernel, ~215 TFLOP/s).

For each head shape, chunk of T query rows and context of C keys (one causal sequence, pages of
16 in random order, as the runner lays them out): the Triton kernel as a step calls it; the
routed path as a step runs it (plan + gather + FlashAttention); FlashAttention alone on keys
already contiguous (what the gather costs is the difference); the largest difference between
the two paths' outputs. Times by CUDA events over repeated calls, TFLOP/s = 4 · T · (C − T/2) ·
heads · head_dim ÷ time. Sets LONG_PREFILL_ROWS from where the routed path starts to win.

--triton-fa adds the Triton FlashAttention forward (kernels/prefill_attention.py, its default
tile) on the same contiguous keys as "flash alone": its time, TFLOP/s and largest difference
from FlashAttention-2's output. --sweep then times a grid of its tiles (BLOCK_M × BLOCK_N ×
warps × stages, keys split or not) on a few representative shapes against FlashAttention-2,
each sorted fastest first; a tile that does not compile (shared memory) is recorded, not fatal,
and the sweep stops starting new tiles after --sweep-budget seconds.

    python scripts/prefill_attention_bench.py --out prefill_attention.json
    python scripts/prefill_attention_bench.py --triton-fa --sweep --out prefill_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from blockspec.bench.common import device_time_us as time_us
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_tile_sweep import case  # noqa: E402  (one causal sequence over shuffled pages, as there)
from blockspec.kernels import attention as K
from blockspec.kernels import flash_prefill

SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3.5-4b": (16, 4, 256), "smollm2": (9, 3, 64)}


def measure(shape: str, tokens: int, context: int, page: int = 16, triton_fa: bool = False) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    q, k_pool, v_pool, table, lens, positions, starts = case(tokens, context, heads, kv_heads, dim, page)
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
        unmasked = 4 * tokens * context * heads * dim
        row["cudnn_full_us"], row["cudnn_full_tflops"] = round(us, 1), round(unmasked / us / 1e6, 1)
    except RuntimeError as exc:
        row["cudnn_error"] = str(exc).splitlines()[0][:200]
    row["speedup"] = round(row["triton_us"] / row["routed_us"], 2)
    if triton_fa:
        from blockspec.kernels import prefill_attention as PA

        def triton_flash():
            return PA.varlen_causal_triton(q, keys, values, plan.cu_q, plan.cu_k, tokens, context, scale)

        us = time_us(triton_flash)
        row["triton_fa_us"], row["triton_fa_tflops"] = round(us, 1), round(flops / us / 1e6, 1)
        row["triton_fa_diff"] = float((triton_flash().float() - flash_only().float()).abs().max())
    return row


# --sweep: (head shape, T, C) where the choice matters (issue 30): a chunk over a long context
# (the grid about one wave at 128-row tiles), a long chunk over it, a whole 2k prompt, and the
# 256-wide heads' chunk (half the programs: where split-K may pay).
SWEEP_SHAPES = (("qwen3-8b", 512, 16384), ("qwen3-8b", 2048, 16384), ("qwen3-8b", 2048, 2048),
                ("qwen3.5-4b", 512, 16384))
MAX_SHARED = 232448          # H100 / H200: 227 KiB of shared memory per block


def sweep_configs(head_dim: int) -> list:
    """BLOCK_M ∈ {64, 128} × BLOCK_N ∈ {32, 64, 128} × warps ∈ {4, 8} × stages ∈ {2, 3, 4}, less
    64-row tiles on 8 warps (one warpgroup's wgmma is 64 rows: two would halve N) and tiles whose
    Q plus `stages` K and V buffers (what Triton allocates with TMA) cannot fit in shared memory."""
    from blockspec.kernels.prefill_attention import PrefillConfig
    configs = []
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        shared = 2 * head_dim * (block_m + 2 * stages * block_n)
        if (block_m == 64 and warps == 8) or shared > MAX_SHARED:
            continue
        configs.append(PrefillConfig(block_m, block_n, warps, stages))
    return configs


def sweep_inputs(shape: str, tokens: int, context: int) -> tuple:
    """One causal sequence: q [T, H, D], keys and values [C, Hkv, D] contiguous (bf16), cu_q, cu_k."""
    heads, kv_heads, dim = SHAPES[shape]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(tokens, heads, dim, device=dev, dtype=dtype)
    keys = torch.randn(context, kv_heads, dim, device=dev, dtype=dtype)
    values = torch.randn_like(keys)
    cu_q = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, context], device=dev, dtype=torch.int32)
    return q, keys, values, cu_q, cu_k


def compile_one(shape: str, config) -> str | None:
    """In a worker process: one tiny call of this tile on these heads (bf16, 16-row multiples, as
    the sweep's calls specialise), so its binary is in Triton's disk cache when the sweep times
    it. The error's first line if it fails."""
    from blockspec.kernels import prefill_attention as PA
    try:
        q, keys, values, cu_q, cu_k = sweep_inputs(shape, 64, 256)
        PA.varlen_causal_triton(q, keys, values, cu_q, cu_k, 64, 256, 0.1, config)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return str(exc).splitlines()[0][:160]


def precompile(jobs: list[tuple[str, object]]) -> None:
    """Compile the sweep's tiles in parallel processes (compiling one takes seconds, timing it
    milliseconds): what the sweep then loads from the cache. Best effort: whatever fails here is
    compiled, or reported, by the sweep itself."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    begin = time.monotonic()
    try:
        workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failed = sum(err is not None for err in pool.map(compile_one, *zip(*jobs)))
        print(f"--sweep: {len(jobs)} tiles compiled in {time.monotonic() - begin:.0f} s on {workers} processes "
              f"({failed} failed)", flush=True)
    except Exception as exc:
        print(f"--sweep: parallel compile unavailable ({exc}); compiling as the sweep goes", flush=True)


def sweep(budget_s: float) -> list[dict]:
    """Each shape's FlashAttention-2 time, then every tile of the grid unsplit and split (the
    kernel's own count, at least 2), TMA loads; then the three best tiles per shape with plain
    pointer loads. Rows per shape, fastest first."""
    from dataclasses import asdict, replace

    from blockspec.kernels import prefill_attention as PA
    jobs = {(shape, replace(config, num_splits=2, use_tma=True))      # split: the merge kernel too
            for shape, _, _ in SWEEP_SHAPES for config in sweep_configs(SHAPES[shape][2])}
    precompile(sorted(jobs, key=str))
    deadline = time.monotonic() + budget_s
    results = []
    for shape, tokens, context in SWEEP_SHAPES:
        heads, _, dim = SHAPES[shape]
        q, keys, values, cu_q, cu_k = sweep_inputs(shape, tokens, context)
        scale = dim ** -0.5
        flops = 4 * tokens * (context - tokens / 2) * heads * dim
        expected = flash_prefill.varlen_causal(q, keys, values, cu_q, cu_k, tokens, context, scale)
        fa2_us = time_us(lambda: flash_prefill.varlen_causal(q, keys, values, cu_q, cu_k, tokens, context, scale))
        rows = []

        def run(config):
            row = {"shape": shape, "tokens": tokens, "context": context, "fa2_us": round(fa2_us, 1),
                   **asdict(config)}
            if time.monotonic() > deadline:
                return {**row, "error": "skipped: past --sweep-budget"}
            try:
                call = lambda: PA.varlen_causal_triton(q, keys, values, cu_q, cu_k, tokens, context, scale, config)
                row["max_diff"] = float((call().float() - expected.float()).abs().max())
                us = time_us(call)
            except Exception as exc:                    # out of shared memory / resources, compile errors
                return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            return {**row, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1), "vs_fa2": round(fa2_us / us, 2)}

        for config in sweep_configs(dim):
            programs = -(-tokens // config.block_m) * heads
            auto = PA.choose_num_splits(programs, context, config.block_n, K.num_sms(q.device))
            for splits in (1, max(2, auto)):
                rows.append(run(replace(config, num_splits=splits, use_tma=True)))
        best = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:3]
        for r in best:
            rows.append(run(PA.PrefillConfig(r["block_m"], r["block_n"], r["num_warps"], r["num_stages"],
                                             r["num_splits"], use_tma=False)))
        rows.sort(key=lambda r: r.get("us", float("inf")))
        print_sweep(rows)
        results += rows
    return results


def print_sweep(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"\n--sweep {r0['shape']} T={r0['tokens']} C={r0['context']}: FlashAttention-2 {r0['fa2_us']} µs",
          flush=True)
    for r in rows:
        tile = (f"M{r['block_m']:<4d}N{r['block_n']:<4d}w{r['num_warps']} s{r['num_stages']} "
                f"split {r['num_splits']:<2d} {'tma' if r['use_tma'] else 'ptr'}")
        if "us" in r:
            print(f"  {tile}  {r['us']:8.1f} µs  {r['tflops']:6.1f} TF/s  × {r['vs_fa2']:.2f} vs FA2  "
                  f"diff {r['max_diff']:.3g}", flush=True)
        else:
            print(f"  {tile}  {r['error']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="qwen3-8b,qwen3.5-4b,smollm2")
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[32, 64, 128, 256, 512, 2048])
    ap.add_argument("--triton-fa", action="store_true",
                    help="also time kernels/prefill_attention.py on the contiguous keys")
    ap.add_argument("--sweep", action="store_true", help="time a grid of its tiles on SWEEP_SHAPES")
    ap.add_argument("--sweep-budget", type=float, default=100.0, help="seconds after which the sweep starts no tile")
    args = ap.parse_args()
    print(f"FlashAttention available: {flash_prefill.flash_available(torch.device('cuda'))}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for tokens in args.tokens:
            for context in sorted({tokens, 2048, 16384}):
                if context < tokens:
                    continue
                row = measure(shape, tokens, context, triton_fa=args.triton_fa)
                rows.append(row)
                print(f"{shape:11s} T={tokens:5d} C={context:6d}  triton {row['triton_us']:8.1f} µs "
                      f"({row['triton_tflops']:5.1f} TF/s)  routed {row['routed_us']:8.1f} "
                      f"({row['routed_tflops']:5.1f})  flash alone {row['flash_only_us']:8.1f}  "
                      f"× {row['speedup']:.2f}  diff {row['max_diff']:.3g}  cudnn unmasked "
                      f"{row.get('cudnn_full_us', row.get('cudnn_error'))}", flush=True)
                if args.triton_fa:
                    print(f"{'':11s} triton FA {row['triton_fa_us']:8.1f} µs ({row['triton_fa_tflops']:5.1f} TF/s)  "
                          f"× {row['flash_only_us'] / row['triton_fa_us']:.2f} vs flash alone  "
                          f"diff {row['triton_fa_diff']:.3g}", flush=True)
    result = {"rows": rows, "sweep": sweep(args.sweep_budget)} if args.sweep else rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
