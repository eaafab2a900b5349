"""Is a row's result independent of how many rows it runs with? (round 44: on the H200 in bf16,
DFlash's greedy output equalled plain decoding's on 6 of 32 SmolLM2 chat prompts at block 8, 10
at block 16, the same counts for every draft, and 32 of 32 in fp32: a verify's 8 or 16 rows per
sequence are rounded otherwise than a decode step's one, and near-ties of the argmax flip.)

For SmolLM2-135M's projections (and Qwen3-8B's), F.linear over M rows against the same rows one
at a time: how many rows differ in any bit, and by how much. One JSON line per (shape, dtype).

    python scripts/batch_invariance.py [--rows 1,2,4,8,16,32,64,128,256]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {   # name: (out features N, in features K)
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536), "smollm2 lm_head": (49152, 576),
    "qwen3-8b qkv": (6144, 4096), "qwen3-8b down": (4096, 12288),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
            x = torch.randn(max(rows), k, generator=gen).to(device, dtype)
            alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(min(16, max(rows)))])   # each row by itself
            report = {}
            for m in rows:
                y = F.linear(x[:m], w)[: alone.shape[0]]
                differ = (y != alone[: y.shape[0]]).any(-1)
                report[m] = {"rows_differ": int(differ.sum()), "of": int(y.shape[0]),
                             "max_abs": float((y.float() - alone[: y.shape[0]].float()).abs().max())}
            print(json.dumps({"shape": name, "dtype": str(dtype).split(".")[-1], "device": str(device),
                              "by_rows": report}), flush=True)


if __name__ == "__main__":
    main()
