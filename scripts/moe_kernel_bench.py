"""Per-layer time of the sparse MoE block on the GPU, graphed: the Triton path (router in one
launch, experts in two gather-GEMMs, shared expert as a slot) against the torch._grouped_mm
path, and a small sweep of decode tile sizes. 10 layers of distinct weights per graph, so no
layer's experts are still in L2 from the one before (as in a real step).

Usage: python scripts/moe_kernel_bench.py [--sweep] [--out FILE]
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


def bytes_read(layers: list[SparseMoE], x: torch.Tensor) -> int:
    """Weight bytes a perfect kernel reads: router, shared expert, each chosen expert once."""
    total = 0
    for layer in layers:
        ids = torch.topk(layer.gate(x), layer.top_k, dim=-1).indices.unique().numel()
        per_expert = layer.experts.gate_up_proj[0].numel() + layer.experts.down_proj[0].numel()
        other = sum(p.numel() for n, p in layer.named_parameters() if not n.startswith("experts."))
        total += 2 * (ids * per_expert + other)
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
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results: dict = {"copy_bandwidth_TBps": bandwidth / 1e12}
    for shape in SHAPES:
        layers = make_layers(shape)
        for num_tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(num_tokens, layers[0].gate.in_features, device="cuda", dtype=torch.bfloat16)
            floor_us = bytes_read(layers, x) / LAYERS / bandwidth * 1e6
            row = {"floor_us": floor_us, "triton_us": layer_us(layers, x, K.fused_experts),
                   "grouped_us": layer_us(layers, x, grouped_experts)}
            row["triton_over_floor"] = row["triton_us"] / floor_us
            if args.sweep and num_tokens in (1, 16):
                for up, down in [((16, 32, 128, 4, 4), (16, 64, 128, 4, 4)), ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3)),
                                 ((16, 32, 256, 4, 3), (16, 64, 256, 4, 3)), ((16, 16, 256, 2, 4), (16, 32, 256, 2, 4)),
                                 ((16, 64, 64, 4, 4), (16, 64, 64, 4, 4)), ((16, 32, 128, 8, 4), (16, 128, 64, 4, 4))]:
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
