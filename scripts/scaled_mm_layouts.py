"""Which block-scale layouts torch._scaled_mm (cuBLASLt) serves on this GPU, and at what speed, at
the Qwen3-8B linear shapes (issue 33). Three forms of the same FP8 × FP8 product:
  - bf16: F.linear on the dequantized weight (cuBLAS), the baseline;
  - 1x128: x per row × 128 columns, the weight's scales expanded to 1 × 128 (`column_scales`,
    what `kernels/fp8.scaled_mm_linear` runs: [K/128, N] fp32 per weight, ~217 MB for Qwen3-8B);
  - 128x128: the same x (padded to whole 16 rows alike) and scales, the weight's own
    [N/128, K/128] block scales passed as BlockWise128x128 (no expansion), if this torch and
    cuBLASLt take them;
  - rowwise: x per row (one scale a token), the weight per output channel (one scale a row of
    it, requantized from the dequantized blocks): cuBLAS's row-wise scaled GEMM, the fastest
    FP8 form Hopper has, at a coarser activation scale (its error says what that costs);
and quantize_rows alone (`quantize_us`, with its share of the copy bandwidth's bytes: read bf16,
write e4m3). Each at several row counts (multiples of 16 and not), graphed over COPIES weights, with the
relative error of each against the fp32 product of the dequantized operands, and what any call
raised. Usage: python scripts/scaled_mm_layouts.py [--rows 16,65,80,256,512,2048] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from blockspec.bench import copy_bandwidth, graphed, timed
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288),
          # K/128 = 9: cuBLASLt pads 128 × 128 scales' K axis to 4 blocks (pytorch #166752), so the form's
          # error here says whether this torch reads the unpadded layout wrongly (the engine never hands it)
          "k_of_9_blocks": (1536, 1152)}
COPIES = 8
DEVICE = "cuda"          # (a smoke run drives the script on the CPU with stand-ins)


def per_linear_us(fn) -> float:
    return timed(graphed(fn, torch.device(DEVICE)), repeat=30, warmup=3) * 1e3 / COPIES


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def product_1x128(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return K.scaled_mm_linear(x, q, s, fp8.ScaleBlock(), None)


def product_128x128(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # x padded with zero rows to a multiple of K.SCALED_MM_ROWS, as scaled_mm_linear pads it (the
    # two forms differ in the weight's scales only); s [N/128, K/128] row-major, its transpose
    # [K/128, N/128] with strides (1, K/128): the layout torch's tests pass for 128 × 128 scales
    rows = x.shape[0]
    x = F.pad(x, (0, 0, 0, -rows % K.SCALED_MM_ROWS))
    xq, x_scales = K.quantize_rows(x.contiguous(), column_major=True)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scales, scale_b=s.t(), out_dtype=x.dtype)[:rows]


def rowwise_weight(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-scaled weight requantized per output channel: (e4m3 [N, K], scales [1, N])."""
    q, scale = fp8.quantize(fp8.dequantize(q, s, fp8.ScaleBlock()), fp8.ScaleBlock(rows=1, cols=q.shape[1]))
    return q, scale.reshape(1, -1)


def product_rowwise(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x quantized per row (one scale each) times the per-channel weight of `rowwise_weight`."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    x_scale = torch.where(amax > 0, amax / fp8.FP8_MAX, torch.ones_like(amax))
    xq = (x.float() / x_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=s, out_dtype=x.dtype)


def try_form(name: str, fn, ref: torch.Tensor) -> dict:
    try:
        out = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
        return {f"{name}_rel_err": round(relative_error(out, ref), 5)}
    except Exception as exc:        # noqa: BLE001 - what this torch / cuBLASLt says is the finding
        first_line = (str(exc).splitlines() or [""])[0]
        return {f"{name}_error": f"{type(exc).__name__}: {first_line[:200]}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,65,80,256,512,2048")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = []
    copy_bytes_per_s = copy_bandwidth(torch.device(DEVICE))
    for name, (n, k) in SHAPES.items():
        weights = [(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
        blocks = [fp8.quantize(w) for w in weights]
        rowwise = [rowwise_weight(q, s) for q, s in blocks]
        dequantized = [fp8.dequantize(q, s, fp8.ScaleBlock()).to(torch.bfloat16) for q, s in blocks]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            q0, s0 = blocks[0]
            ref = K.reference_fp8_fp8(x, q0, s0, fp8.ScaleBlock(), None)
            row = {"linear": name, "N": n, "K": k, "M": m}
            row |= try_form("1x128", lambda: product_1x128(x, q0, s0), ref)
            row |= try_form("128x128", lambda: product_128x128(x, q0, s0), ref)
            row |= try_form("rowwise", lambda: product_rowwise(x, *rowwise[0]), ref)
            row["quantize_us"] = round(per_linear_us(lambda: [K.quantize_rows(x) for _ in range(COPIES)]), 2)
            row["quantize_share_of_copy"] = round(m * k * 3 / (row["quantize_us"] * 1e-6) / copy_bytes_per_s, 3)
            row["bf16_us"] = round(per_linear_us(lambda: [F.linear(x, w) for w in dequantized]), 2)
            for form, fn, operands in (("1x128", product_1x128, blocks), ("128x128", product_128x128, blocks),
                                       ("rowwise", product_rowwise, rowwise)):
                if f"{form}_rel_err" in row:
                    try:            # a form that runs eagerly may still fail in a graph's capture
                        row[f"{form}_us"] = round(per_linear_us(lambda: [fn(x, q, s) for q, s in operands]), 2)
                    except Exception as exc:        # noqa: BLE001 - recorded, the other rows go on
                        row[f"{form}_us_error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.out:        # after every row: a run cut by its timeout keeps what it measured
                with open(args.out, "w") as f:
                    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
                    json.dump({"device": device, "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
