"""Where a decode step's device time goes, kernel by kernel: one target forward (+ the LM head over
the rows read) of a random model of a real shape, captured as one CUDA graph and replayed under
torch.profiler, bf16 and then the same weights quantized to FP8 (issue 33). Per kernel name: calls
and microseconds a replay; the replay's wall time against the sum of its kernels (the gaps).

    python scripts/step_profile.py --shape qwen3-8b --widths 1,16 --formats bf16,fp8 [--out F.json]

--min-chunks 4,2,1: the decode attention's fewest BLOCK_N chunks of keys a split takes
(kernels/attention.MIN_CHUNKS_PER_SPLIT), each value its own graph, side by side;
--contexts 512,4096: the cached keys before the rows.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from blockspec.bench.common import SHAPES, build_models, graphed, synchronize, timed
from blockspec.bench.forward import kernel_class, sequence_forward


def profile_width(target: torch.nn.Module, device: torch.device, width: int, context: int, reps: int) -> dict:
    forward = sequence_forward(target, device, width, context)

    with torch.inference_mode():
        forward()
        synchronize()
        replay = graphed(forward, device)
        wall_ms = timed(replay, repeat=50, warmup=5)
        activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:     # (on CPU: a smoke test, no kernels)
            for _ in range(reps):
                replay()
            synchronize()
    table = kernel_table(prof, reps, wall_ms, cuda=device.type == "cuda")
    return {"width": width, "replay_ms": wall_ms, "kernels_ms": table["kernels_ms"],
            "kernels_per_replay": table["kernels_per_call"], "gap_ms": table["gap_ms"],
            "by_class_ms": table["by_class_ms"], "kernels": table["kernels"]}


def kernel_table(prof, calls: int, wall_ms: float, cuda: bool = True) -> dict:
    """A profile of `calls` equal calls (graph replays, engine steps) per call: the device's
    kernels by name and by class (on CPU the top-level ops), their sum and the gap to wall_ms."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA if cuda else e.cpu_parent is None
        if on_device and not e.name.startswith(("Memcpy", "Memset")):
            per_name[e.name][0] += 1
            per_name[e.name][1] += e.device_time if cuda else e.cpu_time_total
    rows = sorted(((name, n / calls, us / calls) for name, (n, us) in per_name.items()), key=lambda r: -r[2])
    kernel_us = sum(r[2] for r in rows)
    by_class: dict[str, float] = defaultdict(float)
    for name, _, us in rows:
        by_class[kernel_class(name)] += us
    return {"kernels_ms": kernel_us / 1e3, "kernels_per_call": sum(r[1] for r in rows), "gap_ms": wall_ms - kernel_us / 1e3,
            "by_class_ms": {k: round(v / 1e3, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "kernels": [{"name": name[:120], "calls": n, "us": round(us, 2)} for name, n, us in rows[:40]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--widths", default="1,16")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--min-chunks", default="", help="values of attention.MIN_CHUNKS_PER_SPLIT to compare")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="the shape's first N layers only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    _, _, target, _ = build_models(shape, device, dtype, 16)
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    from blockspec.kernels import attention
    chunk_values = [int(c) for c in args.min_chunks.split(",")] if args.min_chunks else [attention.MIN_CHUNKS_PER_SPLIT]
    for fmt in args.formats.split(","):
        if fmt == "fp8":
            from blockspec.layers import fp8
            fp8.quantize_model(target)
        for context in (int(c) for c in args.contexts.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                for chunks in chunk_values:
                    attention.MIN_CHUNKS_PER_SPLIT = chunks
                    r = profile_width(target, device, width, context, args.reps)
                    key = f"{fmt}_w{width}" + (f"_ctx{context}" if context != 512 else "") + (
                        f"_chunks{chunks}" if args.min_chunks else "")
                    result[key] = r
                    print(f"== {key}: replay {r['replay_ms']:.3f} ms, kernels {r['kernels_ms']:.3f} ms "
                          f"({r['kernels_per_replay']:.0f} a replay), gaps {r['gap_ms']:.3f} ms; {r['by_class_ms']}")
                    for k in r["kernels"][:(18 if not args.min_chunks else 4)]:
                        print(f"   {k['us']:9.1f} us {k['calls']:6.0f}x  {k['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
