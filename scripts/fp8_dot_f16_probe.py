"""Does the FP8 weight-only tl.dot kernel go faster with both operands widened to fp16 instead of
bf16 (e4m3 → fp16 is one conversion instruction, → bf16 two)? The chosen tiles at each row count,
as they are and with `dot_f16`, over the Qwen3-8B linears (COPIES weights a graph, so each replay
reads them from memory), with each one's largest difference from the bf16 dot's output.
Usage: python scripts/fp8_dot_f16_probe.py [--rows 4,8,16,32,64] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from blockspec.bench import copy_bandwidth, graphed, timed
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
COPIES = 8


def per_linear_us(fn) -> float:
    return timed(graphed(fn, torch.device("cuda")), repeat=30, warmup=3) * 1e3 / COPIES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows_out, layer = [], {}
    for name, (n, k) in SHAPES.items():
        blocks = [fp8.quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
                  for _ in range(COPIES)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            tiles = K.weight_only_tiles(m, n, k, K.num_sms(x.device))
            row = {"linear": name, "M": m, "tiles": str(tiles)}
            if tiles.gemv:
                row["skipped"] = "the GEMV serves these rows"
            else:
                q0, s0 = blocks[0]
                bf16 = K.weight_only_linear(x, q0, s0, fp8.ScaleBlock(), None, tiles)
                f16 = K.weight_only_linear(x, q0, s0, fp8.ScaleBlock(), None, replace(tiles, dot_f16=True))
                row["max_abs_diff"] = (bf16.float() - f16.float()).abs().max().item()
                row["bitwise_equal"] = torch.equal(bf16, f16)
                for label, t in (("bf16", tiles), ("f16", replace(tiles, dot_f16=True))):
                    us = per_linear_us(lambda t=t: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None, t)
                                                    for q, s in blocks])
                    row[f"{label}_us"] = round(us, 2)
                    row[f"{label}_share_of_copy"] = round(n * k / (us * 1e-6) / bandwidth, 3)
                    layer[(m, label)] = layer.get((m, label), 0.0) + us
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    for m in sorted({m for m, _ in layer}):
        print(f"M {m}: one layer's four linears {layer[(m, 'bf16')]:.1f} us bf16 dot, {layer[(m, 'f16')]:.1f} us fp16 dot")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out,
                       "layer_us": {f"{m}_{label}": round(v, 2) for (m, label), v in layer.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
