"""Where an engine's plain decode step goes, kernel by kernel, for any target (dense, hybrid, MoE):
one request decoding through a real engine (its graphs, its state pool), a run of steps under
torch.profiler, the device's kernels by name and by class a step, the step's wall time and the
gap between the two (issue 33: Qwen3.5-35B-A3B's plain step is 4.94 ms in bf16 and in FP8 alike
on the H100, 3.3 × its FP8 floor: something other than the weights' reads bounds it).
scripts/step_profile.py does the same for a dense forward alone; this one needs no pool of its own.

    python scripts/engine_step_profile.py --shape qwen3.5-35b-a3b --formats fp8 [--steps 20] [--out F.json]

--formats bf16,fp8: the bf16 target, then the same weights quantized in place (layers/fp8.py).
--shared-slot 0,1: the FP8 MoE's step with its shared expert on its own, then riding in the fused
experts' last slot (BLOCKSPEC_FP8_SHARED_SLOT), each on an engine of its own (its graphs).
--arrivals 0,1: the MoE's routing, alignment and slot sum in separate launches, then with the
arrival counts (kernels/moe.py ARRIVALS, BLOCKSPEC_MOE_ARRIVALS), each format, each on its own engine.
--tail 0,1: FP8 mixed-format projections (GDN in_proj) in two launches, then with the bf16 rows riding
in the FP8 launch (kernels/fp8.py FP8_BF16_TAIL, BLOCKSPEC_FP8_BF16_TAIL); crossed with --arrivals.
--split-k 1,4: the MoE gate/up GEMM's K unsplit, then in 4 parts at decode widths (kernels/moe.py
SPLIT_K, BLOCKSPEC_MOE_SPLIT_K); crossed with the others. The JSON is written after each variant.
On CPU: a smoke test (the profiler's CPU ops, no kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from blockspec.bench.common import SHAPES, bench_engine, build_models, release, synchronize
from blockspec.engine.request import Request
from blockspec.sampling import SamplingParams
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import kernel_table  # noqa: E402  (the same per-kernel table as a dense forward's)


def profile_steps(target, device: torch.device, steps: int, prompt_len: int) -> dict:
    """One request of prompt_len random tokens, prefilled, then `steps` plain decode steps timed
    and `steps` more under the profiler."""
    engine = bench_engine(target, None, 1, 1, prompt_len, 3 * steps + 8)
    request = Request("profile", torch.randint(1000, 50000, (prompt_len,)).tolist(),
                      SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True), frozenset(), engine.config.max_model_len)
    engine.submit(request, lambda event: None)
    while not request.output_ids:
        engine.step()
    for _ in range(steps // 2):                                     # warm
        engine.step()
    synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    step_ms = (time.perf_counter() - started) * 1e3 / steps
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize()
    request.abort()
    while engine.has_work:
        engine.step()
    del engine
    release()
    table = kernel_table(prof, steps, step_ms, cuda=cuda)
    return {"step_ms": step_ms, "kernels_ms": table["kernels_ms"], "kernels_per_step": table["kernels_per_call"],
            "gap_ms": table["gap_ms"], "by_class_ms": table["by_class_ms"], "kernels": table["kernels"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="the shape's first N layers only")
    ap.add_argument("--shared-slot", default="", help="FP8: values of BLOCKSPEC_FP8_SHARED_SLOT to compare, e.g. 0,1")
    ap.add_argument("--arrivals", default="", help="values of kernels/moe.py ARRIVALS to compare, e.g. 0,1")
    ap.add_argument("--tail", default="", help="FP8: values of kernels/fp8.py FP8_BF16_TAIL to compare, e.g. 0,1")
    ap.add_argument("--split-k", default="", help="values of kernels/moe.py SPLIT_K to compare, e.g. 1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from blockspec.kernels import fp8 as fp8_kernels
    from blockspec.kernels import moe as moe_kernels
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    _, _, target, _ = build_models(shape, device, dtype, 16)
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for fmt in args.formats.split(","):
        if fmt == "fp8":
            from blockspec.layers import fp8
            fp8.quantize_model(target)
        variants = [(slot, arrivals, tail, split)
                    for slot in (args.shared_slot.split(",") if fmt == "fp8" and args.shared_slot else [None])
                    for arrivals in (args.arrivals.split(",") if args.arrivals else [None])
                    for tail in (args.tail.split(",") if fmt == "fp8" and args.tail else [None])
                    for split in (args.split_k.split(",") if args.split_k else [None])]
        for slot, arrivals, tail, split in variants:
            if slot is not None:
                os.environ["BLOCKSPEC_FP8_SHARED_SLOT"] = slot
            if arrivals is not None:
                moe_kernels.ARRIVALS = arrivals == "1"
            if tail is not None:
                fp8_kernels.FP8_BF16_TAIL = tail == "1"
            if split is not None:
                moe_kernels.SPLIT_K = int(split)
            key = fmt + (f"_shared_slot{slot}" if slot is not None else "") + (
                f"_arrivals{arrivals}" if arrivals is not None else "") + (f"_tail{tail}" if tail is not None else "") + (
                f"_split{split}" if split is not None else "")
            r = result[key] = profile_steps(target, device, args.steps, args.prompt_len)
            print(f"== {key}: step {r['step_ms']:.3f} ms, kernels {r['kernels_ms']:.3f} ms ({r['kernels_per_step']:.0f} "
                  f"a step), gaps {r['gap_ms']:.3f} ms; {r['by_class_ms']}", flush=True)
            for k in r["kernels"][:24]:
                print(f"   {k['us']:9.1f} us {k['calls']:6.1f}x  {k['name']}")
            if args.out:                                  # after each variant: a call's time limit keeps the rest
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
