"""The FP8 weight-only kernel against bf16 (cuBLAS through F.linear) at the Qwen3-8B linear
shapes, graphed, at M = 1, 16, 256 rows; the FP8 × FP8 kernel at 256; per-channel scales
against 128 × 128 blocks (speed here; accuracy: the relative error of each against the bf16
product); a sweep of the weight-only kernels' tiles at M = 1 and 16 (the tl.dot kernel's column tile, K
split and stages; the one-row GEMV's column tile, scale blocks an iteration, K split, warps); the
auto-chosen tiles with the K split turned off.

COPIES distinct weights per graph, so no weight is still in L2 from the replay before (a real
step reads every layer's weights once).

Usage: python scripts/fp8_kernel_bench.py [--out FILE] [--no-sweep]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from blockspec.bench import copy_bandwidth, graphed, timed
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
ROWS = (1, 16, 256)
COPIES = 8


def per_linear_us(fn, copies: int) -> float:
    return timed(graphed(fn, torch.device("cuda")), repeat=30, warmup=3) * 1e3 / copies


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def shape_rows(name: str, out_features: int, in_features: int, bandwidth: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
               for _ in range(COPIES)]
    per_channel = fp8.ScaleBlock(rows=1, cols=in_features)
    blocks = [fp8.quantize(w) for w in weights]
    channels = [fp8.quantize(w, per_channel) for w in weights]
    rows = []
    for m in ROWS:
        x = (torch.randn(m, in_features, device="cuda", generator=gen)).to(torch.bfloat16)
        bf16_us = per_linear_us(lambda: [F.linear(x, w) for w in weights], COPIES)
        block_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None) for q, s in blocks],
                                 COPIES)
        channel_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, per_channel, None) for q, s in channels],
                                   COPIES)
        chosen = K.weight_only_tiles(m, out_features, in_features, K.num_sms(torch.device("cuda", 0)))
        unsplit = K.WeightOnlyTiles(chosen.block_m, chosen.block_n, chosen.num_warps, chosen.num_stages, 1)
        unsplit_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None, unsplit)
                                            for q, s in blocks], COPIES)
        ref = F.linear(x.float(), weights[0].float())
        row = {"linear": name, "N": out_features, "K": in_features, "M": m, "bf16_us": round(bf16_us, 2),
               "fp8_block_us": round(block_us, 2), "fp8_channel_us": round(channel_us, 2),
               "split_k": chosen.split_k, "fp8_block_unsplit_us": round(unsplit_us, 2),
               "bf16_over_fp8_block": round(bf16_us / block_us, 3),
               "fp8_block_GBps": round(out_features * in_features / block_us / 1e3, 1),
               "bf16_GBps": round(2 * out_features * in_features / bf16_us / 1e3, 1),
               "copy_GBps": round(bandwidth / 1e9, 1),
               "rel_err_block": relative_error(K.weight_only_linear(x, *blocks[0], fp8.ScaleBlock(), None), ref),
               "rel_err_channel": relative_error(K.weight_only_linear(x, *channels[0], per_channel, None), ref)}
        if m == 256:
            row["fp8_fp8_us"] = round(per_linear_us(
                lambda: [K.fp8_fp8_linear(x, q, s, fp8.ScaleBlock(), None) for q, s in blocks], COPIES), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep(name: str, out_features: int, in_features: int) -> list[dict]:
    """Weight-only tiles at M = 1 and 16: the tl.dot kernel's column tile, K split and stages
    (BLOCK_M 16), and at M = 1 the GEMV kernel's column tile, scale blocks an iteration, K split
    and warps. Prints the three fastest of each (M, kernel) and the chosen tiles' time."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    blocks = [fp8.quantize((torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02))
              for _ in range(COPIES)]
    out = []
    for m in (1, 16):
        x = torch.randn(m, in_features, device="cuda", generator=gen).to(torch.bfloat16)
        chosen = K.weight_only_tiles(m, out_features, in_features, K.num_sms(torch.device("cuda", 0)))
        candidates = [K.WeightOnlyTiles(16, block_n, 4, stages, split) for block_n in (32, 64, 128)
                      for split in (1, 2, 4, 8) for stages in (3, 4)]
        if m == 1:
            candidates += [K.WeightOnlyTiles(1, block_n, warps, 2, split, gemv=True, k_blocks=kb)
                           for block_n in (16, 32, 64) for kb in (1, 2, 4) for split in (1, 2, 4, 8)
                           for warps in (4, 8)]
        if chosen not in candidates:
            candidates.append(chosen)
        rows = []
        for tiles in candidates:
            try:
                us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None, tiles)
                                            for q, s in blocks], COPIES)
            except Exception as error:          # a tile that does not fit (shared memory, registers)
                print(json.dumps({"linear": name, "M": m, "tiles": str(tiles), "error": str(error)[:120]}))
                continue
            rows.append({"linear": name, "M": m, "block_n": tiles.block_n, "split_k": tiles.split_k,
                         "stages": tiles.num_stages, "warps": tiles.num_warps, "gemv": tiles.gemv,
                         "k_blocks": tiles.k_blocks, "us": round(us, 2),
                         "GBps": round(out_features * in_features / us / 1e3, 1), "chosen": tiles == chosen})
        for gemv in (False, True):
            ranked = sorted((r for r in rows if r["gemv"] == gemv), key=lambda r: r["us"])[:3]
            if ranked:
                print(json.dumps({"sweep_best": ranked, "gemv": gemv}), flush=True)
        print(json.dumps({"sweep_chosen": [r for r in rows if r["chosen"]], "tiles": str(chosen)}), flush=True)
        out += rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copies": COPIES,
              "rows": [r for name, (n, k) in SHAPES.items() for r in shape_rows(name, n, k, bandwidth)]}
    if not args.no_sweep:
        result["sweep"] = [r for name in SHAPES for r in sweep(name, *SHAPES[name])]
    total = {m: {key: sum(r[key] for r in result["rows"] if r["M"] == m) for key in ("bf16_us", "fp8_block_us",
                                                                                   "fp8_channel_us")}
             for m in ROWS}
    result["per_layer_us"] = total          # one Qwen3-8B layer's four linears
    print(json.dumps({"per_layer_us": total}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
