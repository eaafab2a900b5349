"""Per-layer time of the sparse MoE block on the GPU, graphed: the Triton path (router in one
launch, experts in two gather-GEMMs, shared expert as a slot) against the torch._grouped_mm
path, and a small sweep of decode tile sizes. 10 layers of distinct weights per graph, so no
layer's experts are still in L2 from the one before (as in a real step).

Usage: python scripts/moe_kernel_bench.py [--sweep] [--fp8] [--shapes qwen3.5-35b-a3b] [--out FILE]

--fp8: the experts (and the shared expert, riding in their last slot) in FP8, quantized as
`--quantization fp8` would (layers/fp8.py); the sweep then keeps BLOCK_K within the 128-column
scale blocks. Each row also times the arrivals' other setting (kernels/moe.py ARRIVALS: routing +
alignment in one launch, the slot sum in the down GEMM's; on by default since round 68).
--split-k 2,4,8: the gate/up GEMM's K in that many parts at decode widths (kernels/moe.py SPLIT_K).
"""
from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from blockspec.bench import copy_bandwidth, graphed, timed
from blockspec.config import MoeConfig
from blockspec.kernels import moe as K
from blockspec.layers.moe import SparseMoE, grouped_experts

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 0), "qwen3.5-35b-a3b": (256, 2048, 512, 512)}
LAYERS = 10


def make_layers(shape: str) -> list[SparseMoE]:
    num_experts, hidden, inter, shared = SHAPES[shape]
    config = MoeConfig(num_experts=num_experts, num_experts_per_tok=8, moe_intermediate_size=inter, normalize=True,
                       shared_expert_intermediate_size=shared)
    layers = []
    for _ in range(LAYERS):
        layer = SparseMoE(hidden, config).to("cuda", torch.bfloat16)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
        layers.append(layer)
    return layers


def quantized(layers: list[SparseMoE]) -> list[SparseMoE]:
    """The layers' experts and shared experts in FP8 (routers stay bf16), as --quantization fp8
    makes a model's: quantize_model over a holder named as a model is."""
    from types import SimpleNamespace

    from blockspec.layers import fp8
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList()
    for layer in layers:
        block = torch.nn.Module()
        block.mlp = layer
        holder.model.layers.append(block)
    first = next(layers[0].parameters())
    holder.lm_head = torch.nn.Linear(1, 1, bias=False).to(first.device, first.dtype)
    holder.config = SimpleNamespace(tie_word_embeddings=False)
    fp8.quantize_model(holder)
    return [block.mlp for block in holder.model.layers]


def bytes_read(layers: list[SparseMoE], x: torch.Tensor) -> int:
    """Weight bytes a perfect kernel reads: router, shared expert, each chosen expert once."""
    total = 0
    for layer in layers:
        ids = torch.topk(layer.gate(x), layer.top_k, dim=-1).indices.unique().numel()
        per_expert = sum(t[0].numel() * t.element_size() for t in (layer.experts.gate_up_proj, layer.experts.down_proj))
        other = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if not n.startswith("experts."))
        total += ids * per_expert + other
    return total


def layer_us(layers: list[SparseMoE], x: torch.Tensor, kernel) -> float:
    for layer in layers:
        layer.kernel = kernel

    def run():
        h = x
        for layer in layers:
            h = layer(h)
        return h
    with torch.inference_mode():
        return timed(graphed(run, x.device), repeat=20) * 1e3 / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--split-k", default="", help="gate/up K parts to time at decode widths (kernels/moe.py "
                        "SPLIT_K, BLOCKSPEC_MOE_SPLIT_K), e.g. 2,4,8")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results: dict = {"copy_bandwidth_TBps": bandwidth / 1e12, "fp8": args.fp8}
    sweep = ([((16, 32, 128, 4, 4), (16, 64, 128, 4, 4)), ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3)),
              ((16, 16, 128, 2, 4), (16, 32, 128, 2, 4)), ((16, 64, 64, 4, 4), (16, 64, 64, 4, 4)),
              ((16, 32, 128, 8, 4), (16, 128, 64, 4, 4)), ((16, 128, 128, 4, 3), (16, 128, 128, 4, 3)),
              ((16, 64, 128, 8, 4), (16, 64, 128, 8, 4)), ((16, 32, 64, 2, 5), (16, 32, 64, 2, 5))]
             if args.fp8 else
             [((16, 32, 128, 4, 4), (16, 64, 128, 4, 4)), ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3)),
              ((16, 32, 256, 4, 3), (16, 64, 256, 4, 3)), ((16, 16, 256, 2, 4), (16, 32, 256, 2, 4)),
              ((16, 64, 64, 4, 4), (16, 64, 64, 4, 4)), ((16, 32, 128, 8, 4), (16, 128, 64, 4, 4))])
    for shape in args.shapes.split(","):
        layers = make_layers(shape)
        if args.fp8:
            layers = quantized(layers)
        for num_tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(num_tokens, layers[0].gate.in_features, device="cuda", dtype=torch.bfloat16)
            floor_us = bytes_read(layers, x) / LAYERS / bandwidth * 1e6
            row = {"floor_us": floor_us, "triton_us": layer_us(layers, x, K.fused_experts)}
            with mock.patch.object(K, "ARRIVALS", not K.ARRIVALS):        # the default first, then the other
                row["triton_arrivals_us" if K.ARRIVALS else "triton_separate_us"] = layer_us(layers, x, K.fused_experts)
            for parts in [int(p) for p in args.split_k.split(",") if p]:
                with mock.patch.object(K, "SPLIT_K", parts):
                    row[f"triton_split{parts}_us"] = layer_us(layers, x, K.fused_experts)
            if not args.fp8:
                row["grouped_us"] = layer_us(layers, x, grouped_experts)
            row["triton_over_floor"] = row["triton_us"] / floor_us
            if args.sweep and num_tokens in (1, 16):
                for up, down in sweep:
                    with mock.patch.object(K, "gate_up_tiles", lambda *a, t=up: K.Tiles(*t)), \
                         mock.patch.object(K, "down_tiles", lambda *a, t=down: K.Tiles(*t)):
                        row[f"tiles {up} {down}"] = layer_us(layers, x, K.fused_experts)
            results[f"{shape} N={num_tokens}"] = row
            print(shape, num_tokens, json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
