"""Hybrid target forwards on the GPU, graphed, with the Gated DeltaNet step kernel
(kernels/gdn.py) and with the torch path it replaces, in one process: plain decode (1 row),
verify blocks (8, 16 rows, per-step states kept) at 1, 8 and 32 sequences; plus each path's
device time by kernel class for one eager decode forward (torch.profiler).

Usage: python scripts/gdn_bench.py [--shape qwen3.5-4b] [--layers N] [--cases 1x1,1x8,32x8] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.bench import (SHAPES, build_empty, copy_bandwidth, graphed, kernel_class, random_init,
                             step_weight_bytes, timed)
from blockspec.cache import KVPool, StatePool
from blockspec.layers import AttentionMetadata
from blockspec.models import gated_delta
from blockspec.models.registry import ARCHITECTURES

PAGE = 16


def batch_metadata(num_seqs: int, width: int, context: int, kv: KVPool, states: StatePool, keep_steps: bool,
                   device: torch.device) -> AttentionMetadata:
    """num_seqs sequences, each feeding `width` rows after `context` cached positions, own pages
    and state slot (1 …)."""
    pages = -(-(context + width) // PAGE)
    tables = 1 + torch.arange(num_seqs * pages, device=device).view(num_seqs, pages)
    positions = torch.arange(context, context + width, device=device).repeat(num_seqs)
    seq = torch.arange(num_seqs, device=device).repeat_interleave(width)
    slot_mapping = tables[seq, positions // PAGE] * PAGE + positions % PAGE
    return AttentionMetadata(
        num_seqs=num_seqs, width=width, input_ids=torch.randint(0, 1000, (num_seqs * width,), device=device),
        positions=positions, slot_mapping=slot_mapping, block_tables=tables,
        context_lens=torch.full((num_seqs,), context + width, device=device), max_context_len=pages * PAGE,
        page_size=PAGE, kv=kv.layers, states=states,
        state_slots=torch.arange(1, num_seqs + 1, device=device), keep_steps=keep_steps)


def profile_classes(fn) -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    by_class: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + e.device_time / 1e3
            count += 1
    return {**{k: round(v, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])}, "kernels": count}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3.5-4b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--cases", default="1x1,1x8,1x16,8x8,32x8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")          # cpu: a smoke run of this script
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    cfg = {k: v for k, v in shape.items() if k not in ("draft_layers", "draft")}
    arch = cfg["architectures"][0]
    target = random_init(build_empty(lambda: ARCHITECTURES[arch]().build(cfg, arch), device, dtype))
    bandwidth = copy_bandwidth(device)
    floor_ms = step_weight_bytes(target) / bandwidth * 1e3
    results: dict = {"shape": args.shape, "layers": shape["num_hidden_layers"], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "step_floor_ms": round(floor_ms, 3)}
    print(json.dumps(results), flush=True)
    cases = [tuple(int(n) for n in c.split("x")) for c in args.cases.split(",")]
    max_seqs = max(b for b, _ in cases)
    config = target.config
    kv = KVPool(target.num_attention_layers, (max_seqs * (-(-(args.context + 16) // PAGE)) + 1) * PAGE,
                config.num_key_value_heads, config.head_dim, dtype, device)
    states = StatePool(max_seqs + 1, target.recurrent_shapes, dtype, device)
    for num_seqs, width in cases:
        meta = batch_metadata(num_seqs, width, args.context, kv, states, width > 1, device)
        row = {}
        for kernel, fuse_norm in ((False, False), (True, False), (True, True)):
            gated_delta.STEP_KERNEL, gated_delta.FUSE_NORM = kernel, fuse_norm
            name = "kernel" if fuse_norm else "kernel_unfused_norm" if kernel else "torch"

            def forward(meta=meta):
                out = target(meta.input_ids, meta.positions, meta)
                return target.compute_logits(out.hidden)
            with torch.inference_mode():
                replay = graphed(forward, device)
                row[f"{name}_ms"] = round(timed(replay, repeat=30), 4)
            if num_seqs == 1 and width == 1:
                row[f"{name}_classes"] = profile_classes(forward)
            del replay
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["speedup"] = round(row["torch_ms"] / row["kernel_ms"], 3)
        if num_seqs == 1 and width == 1:
            row["kernel_over_floor"] = round(row["kernel_ms"] / floor_ms, 3)
        results[f"B{num_seqs}xT{width}"] = row
        print(f"B={num_seqs} T={width}", json.dumps(row), flush=True)
    one = results.get("B1xT1", {}).get("kernel_ms")
    for key, row in results.items():
        if one and isinstance(row, dict) and key != "B1xT1":
            row["kernel_over_step"] = round(row["kernel_ms"] / one, 3)
    gated_delta.STEP_KERNEL, gated_delta.FUSE_NORM = True, True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
