"""Adaptive speculation step by step on a real pair (issue 31: adaptive measured 0.74–0.83 × fixed
and below plain on the SmolLM2 pair, whose steps are ~2 ms): fixed and adaptive engines side by
side in one process on the same prompts, each engine phase timed on the host (host_split.py's
wrappers), and for adaptive every decode step of the last round — the widths it verified, the
draft block, the tokens and milliseconds its allocation predicted against what the step took and
committed, and the host-work fit (scale, marginal) — so what it loses to (its choices, or its own
host work) is visible.

    BLOCKSPEC_BATCH_INVARIANT=1 python scripts/adaptive_steps.py --model /tmp/smollm2.gguf \
        --draft blockspec/demo/smollm2-draft --device cuda --dtype bfloat16 --concurrency 16 [--rounds 3]
        [--max-tokens 128] [--out steps.json]

(BLOCKSPEC_BATCH_INVARIANT=1: what `--model smollm2` runs; a path does not set it.)

Prompts: the SmolLM2 recipe's held-out chats (scripts/smollm2_prompts.py), chat-encoded.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from host_split import timed_phases          # noqa: E402  (scripts/ is not a package)
from smollm2_prompts import HELD_OUT         # noqa: E402
from smollm2_recipe import open_llm          # noqa: E402  (two engines on one device: pools sized, not "all memory")

from blockspec.engine.spec import policy     # noqa: E402


def traced(log: list[dict]) -> list:
    """Patches that log every allocation (its widths, draft block, predicted tokens and ms) and
    every recorded decode step (widths, tokens, ms, the fit's prediction before it learns)."""
    from unittest import mock
    real_allocate, real_record = policy.allocate, policy.Speculation.record_cycle

    def allocate(*args, **kwargs):
        alloc = real_allocate(*args, **kwargs)
        log.append({"kind": "plan", "widths": alloc.widths, "draft_width": alloc.draft_width,
                    "tokens": round(alloc.expected_tokens, 2), "ms": round(alloc.ms, 3)})
        return alloc

    def record(self, seconds, widths, num_tokens, draft_width=0, arm="policy", waited=0.0, drafting=None,
               learns=False):
        log.append({"kind": "step", "widths": list(widths), "draft_width": draft_width, "tokens": num_tokens, "arm": arm,
                    "learns": learns,
                    "ms": round(seconds * 1e3, 3),
                    "predicted_ms": round(self.predicted_step_ms(widths, num_tokens, draft_width), 3),
                    "scale": round(self.forward_scale, 3), "marginal": round(self.marginal_scale, 3),
                    "per_seq_ms": round(self.overhead_ms_per_seq, 4), "per_token_ms": round(self.overhead_ms_per_token, 4),
                    "stride": self.pace.stride, "wait_ms": round(self.pace.wait_ms, 3),
                    "work_ms": {k: round(v, 3) for k, v in self.pace.work_ms.items()}})
        return real_record(self, seconds, widths, num_tokens, draft_width, arm, waited, drafting, learns)
    return [mock.patch.object(policy, "allocate", allocate), mock.patch.object(policy.Speculation, "record_cycle", record)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="blockspec/demo/smollm2-draft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    from blockspec.sampling import SamplingParams
    dtype = {"dtype": args.dtype} if args.dtype else {}
    engines = {mode: open_llm(args.model, 1024, args.concurrency, draft=args.draft, device=args.device,
                              speculation=mode, **dtype) for mode in ("fixed", "adaptive")}
    tokenizer = engines["fixed"].tokenizer
    chats = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in HELD_OUT]
    prompts = [chats[i % len(chats)] for i in range(args.concurrency)]          # more requests than chats: again
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)   # every request its max_tokens
    costs = engines["adaptive"].engine.runner.speculation.costs
    report: dict = {"concurrency": args.concurrency, "table": costs.describe() if costs is not None else None}
    for llm in engines.values():
        llm.generate(prompts[:2], params)                                       # warm-up
    log: list[dict] = []
    best: dict[str, float] = defaultdict(float)
    phases: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for mode, llm in engines.items():
            totals: dict[str, float] = defaultdict(float)
            patches = timed_phases(totals) + (traced(log) if mode == "adaptive" else [])
            for p in patches:
                p.start()
            if mode == "adaptive":
                log.clear()                                            # the last round's steps
            steps = llm.engine.scheduler._num_steps
            started = time.perf_counter()
            done = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
            for p in reversed(patches):
                p.stop()
            steps = llm.engine.scheduler._num_steps - steps
            best[mode] = max(best[mode], sum(len(o.token_ids) for o in done) / seconds)
            phases[mode] = {k: round(v * 1e3 / steps, 3) for k, v in totals.items()} | {"steps": steps}
    report["tok_s"] = {k: round(v, 1) for k, v in best.items()}
    report["phases_ms_a_step"] = phases
    steps = [e for e in log if e["kind"] == "step"]
    if steps:
        report["adaptive_steps"] = {
            "count": len(steps), "mean_ms": round(float(np.mean([s["ms"] for s in steps])), 3),
            "mean_tokens": round(float(np.mean([s["tokens"] for s in steps])), 2),
            "mean_width": round(float(np.mean([np.mean(s["widths"]) for s in steps])), 2),
            "plain_steps": sum(not any(s["widths"]) for s in steps),
            "whole_arm_steps": sum(s.get("arm") == "whole" for s in steps),
            "mean_stride": round(float(np.mean([s["stride"] for s in steps])), 2)}
    print(json.dumps(report, indent=1))
    for entry in log:
        print(json.dumps(entry))
    if args.out:
        Path(args.out).write_text(json.dumps({**report, "log": log}, indent=1))


if __name__ == "__main__":
    main()
