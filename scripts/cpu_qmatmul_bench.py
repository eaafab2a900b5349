"""Which CPU matmul serves a GGUF weight fastest at one thread: SmolLM2-135M's shapes, M = 1 and 8.

    OMP_NUM_THREADS=1 python scripts/cpu_qmatmul_bench.py

Candidates per weight [N, K]: fp32 F.linear (today's dequantized path), bf16 F.linear, torch's
weight-only int8 (`_weight_int8pack_mm`, one scale per row), int8 with Q8_0's per-32 scales
(one int8pack call per group of 32 columns), and torch's int4 (`_weight_int4pack_mm_for_cpu`,
group 32: Q4_1's layout). Prints the median ms of each (the box is shared: best of 3 medians).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate+up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def timed(fn, repeat: int = 30) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        best = min(best, statistics.median(times))
    return best * 1e3


def candidates(n: int, k: int, m: int):
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n) + 0.5
    out = {"fp32": lambda: F.linear(x, w)}
    wb, xb = w.bfloat16(), x.bfloat16()
    out["bf16"] = lambda: F.linear(xb, wb)
    out["int8 per-row"] = lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scales)
    group_scales = torch.rand(n, k // 32) + 0.5
    pieces = [(q8[:, g * 32:(g + 1) * 32].contiguous(), group_scales[:, g].contiguous()) for g in range(k // 32)]

    def grouped():
        acc = torch.ops.aten._weight_int8pack_mm(x[:, :32], *pieces[0])
        for g in range(1, len(pieces)):
            acc += torch.ops.aten._weight_int8pack_mm(x[:, g * 32:(g + 1) * 32], *pieces[g])
        return acc
    out["int8 per-32 (grouped calls)"] = grouped
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.rand(k // 32, n, 2)
    for dtype in (torch.float32, torch.bfloat16):
        xs, szs = x.to(dtype), sz.to(dtype)
        out[f"int4 g32 ({str(dtype)[6:]})"] = lambda xs=xs, szs=szs: torch.ops.aten._weight_int4pack_mm_for_cpu(
            xs, packed, 32, szs)
    return out


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 1 thread; ms per call")
    for name, (n, k) in SHAPES.items():
        for m in (1, 8):
            row = {}
            for label, fn in candidates(n, k, m).items():
                try:
                    row[label] = f"{timed(fn):.3f}"
                except RuntimeError as exc:
                    row[label] = f"n/a ({str(exc).splitlines()[0][:40]})"
            print(f"{name:18s} M={m}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
