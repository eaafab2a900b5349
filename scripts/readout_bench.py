"""The draft readout's cost on the GPU (issue 31): torch's argmax + float copy + logsumexp
against the one-pass kernel (blockspec/kernels/readout.py), µs a call, at the Qwen3-8B draft's
15 slots × 151,936 vocabulary, bf16, per sequence count; the bytes' floor at the copy rate beside.

    python scripts/readout_bench.py [--seqs 1,8,32,64,256]
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.kernels import readout


def timed_us(fn, repeat: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1,8,32,64,256")
    ap.add_argument("--slots", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151_936)
    args = ap.parse_args()
    copy = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_us = timed_us(lambda: copy.clone(), 10)
    rate = 2 * copy.numel() / (copy_us * 1e-6)                     # bytes a second, read + write
    for seqs in map(int, args.seqs.split(",")):
        logits = torch.randn(seqs, args.slots, args.vocab, device="cuda", dtype=torch.bfloat16)
        row = {"seqs": seqs,
               "torch_argmax_us": round(timed_us(lambda: readout.argmax_confidence_torch(logits, False)), 1),
               "torch_both_us": round(timed_us(lambda: readout.argmax_confidence_torch(logits, True)), 1),
               "kernel_both_us": round(timed_us(lambda: readout.argmax_confidence_triton(logits, True)), 1),
               "floor_us": round(logits.numel() * logits.element_size() / rate * 1e6, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
