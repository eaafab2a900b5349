"""Adaptive speculation with this tree's policy against another version of spec/policy.py, in one
process on one set of random weights (round 56: the GPU figures move run to run, so a change to
the policy is judged side by side). The other version is a file, e.g.

    git show 69d3b8b:blockspec/engine/spec/policy.py > old_policy.py   # untracked: it travels with the tree
    python scripts/policy_ab.py --old old_policy.py --shape qwen3-8b --concurrency 8,32,64

Runs fixed, then this tree's and the other policy twice each, alternated (--other-first: the other
first); prints tok/s ÷ fixed."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from unittest import mock

import torch

from blockspec.bench import common
from blockspec.bench.common import SHAPES, build_models
from blockspec.bench.speculation import LatentProfile, speculation_sweep
from blockspec.engine import model_runner


def load_policy(path: str):
    spec = importlib.util.spec_from_file_location("other_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_policy"] = module                  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the other spec/policy.py")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--other-first", action="store_true",
                        help="the other policy's engines before this tree's (a process's first adaptive engine "
                             "can settle into another regime: round 56 at 32 sequences)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    old = load_policy(args.old)
    if args.gpu_memory_utilization is not None:
        common.ENGINE_OPTIONS["gpu_memory_utilization"] = args.gpu_memory_utilization
    concurrency = [int(c) for c in args.concurrency.split(",")]
    torch.manual_seed(0)
    _, _, target, draft = build_models(SHAPES[args.shape], torch.device("cuda"), torch.bfloat16, 16)
    profile = LatentProfile(6.5, 16)
    out: dict[str, dict[int, dict[str, float]]] = {}
    order = ("other", "this", "other2", "this2") if args.other_first else ("this", "other", "this2", "other2")
    for name in ("fixed", *order):
        policy = old.Speculation if name.startswith("other") else model_runner.Speculation
        with mock.patch.object(model_runner, "Speculation", policy):
            result = speculation_sweep(target, draft, 16, concurrency, 128, 256,
                                       "fixed" if name == "fixed" else "adaptive", None, profile)
        out[name] = {c: {k: result[c][k] for k in ("tok_s", "ms_per_cycle", "mean_width")} for c in concurrency}
        print(name, json.dumps(out[name]), flush=True)
    for c in concurrency:
        fixed = out["fixed"][c]["tok_s"]
        print(c, " ".join(f"{name} {out[name][c]['tok_s'] / fixed:.3f}" for name in ("this", "other", "this2", "other2")))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
