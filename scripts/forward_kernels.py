"""One target forward of a bench shape on the GPU: graphed milliseconds at widths 1 (a plain
step) and 16 (a verify block) over a 512-token context, and the CUDA kernels of one eager
forward, per layer (torch.profiler).

    python scripts/forward_kernels.py --shape qwen3-8b [--unfused] [--out FILE]

--unfused runs the torch forms of the fused ops (blockspec.kernels.fused.set_enabled(False)),
weights stay fused. Also runs on trees without blockspec.kernels (the code before fusion).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec.bench import SHAPES, build_models, forward_metadata, graphed, timed  # noqa: E402
from blockspec.cache import KVPool  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--unfused", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    try:
        from blockspec.kernels import fused
        fused.set_enabled(not args.unfused)
        label = "unfused ops" if args.unfused else "fused"
    except ImportError:
        label = "before fusion"
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    _, _, target, _ = build_models(SHAPES[args.shape], device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = target.config
    page_size = 16
    kv = KVPool(target.num_attention_layers, (args.context // page_size + 4) * page_size, config.num_key_value_heads,
                config.head_dim, target.lm_head.weight.dtype, device)
    result = {"shape": args.shape, "code": label, "context": args.context}
    with torch.inference_mode():
        for width in (1, 16):
            meta = forward_metadata(width, args.context, page_size, kv, device)

            def forward(meta=meta, width=width):
                out = target(meta.input_ids, meta.positions, meta)
                return target.compute_logits(out.hidden[-1:] if width == 1 else out.hidden)

            result[f"forward_ms_w{width}"] = timed(graphed(forward, device), repeat=30)
            forward()
            sync()
            activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
            with torch.profiler.profile(activities=[activity]) as prof:
                forward()
                sync()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not e.name.startswith(("Memcpy", "Memset"))]
            if device.type != "cuda":      # a smoke test: count top-level CPU ops instead
                kernels = [e for e in prof.events() if e.cpu_parent is None]
            names = collections.Counter(e.name[:80] for e in kernels)
            result[f"kernels_w{width}"] = len(kernels)
            result[f"kernels_per_layer_w{width}"] = len(kernels) / target.num_layers
            result[f"kernel_names_w{width}"] = {n: c for n, c in names.most_common(30)}
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("kernel_names")}, indent=1))
    for width in (1, 16):
        print(f"-- kernels at width {width} ({label}):")
        for name, count in result[f"kernel_names_w{width}"].items():
            print(f"  {count:5d}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
