"""The draft readout's cost on the GPU (issue 31): torch's argmax + float copy + logsumexp
against the one-pass kernel (blockspec/kernels/readout.py), µs a call, at the Qwen3-8B draft's
15 slots × 151,936 vocabulary, bf16, per sequence count; the bytes' floor at the copy rate beside.

    python scripts/readout_bench.py [--seqs 1,8,32,64,256]
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.bench.common import copy_bandwidth, device_time_us
from blockspec.kernels import readout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1,8,32,64,256")
    ap.add_argument("--slots", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151_936)
    args = ap.parse_args()
    rate = copy_bandwidth(torch.device("cuda"))                    # bytes a second, read + write
    for seqs in map(int, args.seqs.split(",")):
        logits = torch.randn(seqs, args.slots, args.vocab, device="cuda", dtype=torch.bfloat16)
        row = {"seqs": seqs,
               "torch_argmax_us": round(device_time_us(lambda: readout.argmax_confidence_torch(logits, False)), 1),
               "torch_both_us": round(device_time_us(lambda: readout.argmax_confidence_torch(logits, True)), 1),
               "kernel_both_us": round(device_time_us(lambda: readout.argmax_confidence_triton(logits, True)), 1),
               "floor_us": round(logits.numel() * logits.element_size() / rate * 1e6, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
