"""The dense step's GEMMs alone (Qwen3-8B shapes, bf16, M = 1 and 16 rows), graphed over one
weight per layer so nothing stays in L2: cuBLAS as torch calls it (and which kernels it runs:
a split-K reduce shows as a second kernel), cuBLAS under other torch settings, and a Triton
skinny GEMM (one program per block of output columns, the whole K loop, no split) for
comparison. Each against its floor (weight bytes at the measured copy bandwidth).

Usage: python scripts/gemm_bench.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from blockspec.bench import copy_bandwidth, graphed, timed

# (name, in, out) per layer of Qwen3-8B with the fused q/k/v and gate/up weights.
GEMMS = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
LAYERS = 36


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + offs_m[:, None] * K + k + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + k + offs_k[:, None])
        acc = tl.dot(a, w, acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=offs_m[:, None] < M)


def skinny(x, w, block_n, block_k, warps, stages):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _skinny_kernel[(w.shape[0] // block_n,)](x, w, out, x.shape[0], w.shape[0], w.shape[1], BLOCK_M=16,
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def kernels_of(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results: dict = {"copy_bandwidth_TBps": round(bandwidth / 1e12, 3)}
    for name, k_in, n_out in GEMMS:
        weights = [torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        floor_us = n_out * k_in * 2 / bandwidth * 1e6
        for m in (1, 16):
            x = torch.randn(m, k_in, device="cuda", dtype=torch.bfloat16)
            row = {"floor_us": round(floor_us, 2)}

            def run(f):
                def all_layers():
                    for w in weights:
                        f(x, w)
                return round(timed(graphed(all_layers, x.device), repeat=20) * 1e3 / LAYERS, 2)
            row["cublas_us"] = run(F.linear)
            row["cublas_kernels"] = kernels_of(lambda: F.linear(x, weights[0]))
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            row["cublas_no_reduced_reduction_us"] = run(F.linear)
            row["cublas_no_reduced_reduction_kernels"] = kernels_of(lambda: F.linear(x, weights[0]))
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
            for library in ("cublaslt", "cublas"):
                try:
                    torch.backends.cuda.preferred_blas_library(library)
                    row[f"{library}_us"] = run(F.linear)
                    row[f"{library}_kernels"] = kernels_of(lambda: F.linear(x, weights[0]))
                except Exception as error:                       # noqa: BLE001 - a setting this torch lacks
                    row[f"{library}_error"] = str(error)[:120]
            try:
                torch.backends.cuda.preferred_blas_library("default")
            except Exception:                                    # noqa: BLE001
                pass
            ref = F.linear(x, weights[0]).float()
            for block_n, block_k, warps, stages in ((32, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4)):
                key = f"triton_{block_n}_{block_k}_{warps}_{stages}_us"
                got = skinny(x, weights[0], block_n, block_k, warps, stages).float()
                if ((got - ref).norm() / ref.norm()).item() > 1e-2:
                    row[key] = "wrong"
                    continue
                row[key] = run(lambda a, w: skinny(a, w, block_n, block_k, warps, stages))
            results[f"{name} M={m}"] = row
            print(name, m, json.dumps({k: v for k, v in row.items() if not k.endswith("kernels")}), flush=True)
            print("   kernels:", row["cublas_kernels"], flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
