"""Where a SmolLM2 decode step goes on CPU at one thread: plain and DFlash (the shipped draft),
measured in-process by timing the engine's own calls (no profiler overhead on the kernels).

    OMP_NUM_THREADS=1 python scripts/smollm2_cpu_profile.py [--dtype auto|float32] [--prompts 2] [--max-tokens 64]

Per decode step (plain) or cycle (DFlash), mean milliseconds of: the target's decoder layers (the
native stack, or the modules), its head (logits), the draft's layers, its head (draft logits), the
draft's context K/V (append_context), and the rest of the step (engine, scheduler, sampling,
acceptance, metadata). Prefill steps are left out. Prints one JSON line per mode.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from smollm2_prompts import HELD_OUT  # noqa: E402


class Timer:
    """Accumulates the time spent inside wrapped calls, per name, between resets."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] += time.perf_counter() - start

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            with timer.part(name):
                return inner(*args, **kwargs)
        setattr(owner, attr, timed)


def instrument(llm, timer: Timer) -> None:
    target, draft = llm.target, llm.draft
    stack = target.native_stack
    if stack is not None:
        timer.wrap(stack, "forward", "target layers")
    else:
        for layer in target.model.layers:
            timer.wrap(layer, "forward_residual", "target layers")
    timer.wrap(target, "compute_logits", "target head")
    if draft is not None:
        timer.wrap(draft, "append_context", "draft context K/V")
        timer.wrap(draft, "forward", "draft layers")
        timer.wrap(draft, "read_logits", "draft head")


def profile(llm, prompts, params) -> dict:
    timer = Timer()
    instrument(llm, timer)
    engine = llm.engine
    step = engine.step
    totals: dict[str, float] = defaultdict(float)
    counts = {"steps": 0, "tokens": 0}

    def timed_step(*args, **kwargs):
        decoding = any(seq.request.output_ids for seq in engine.scheduler.running)
        timer.spent.clear()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if decoding:
            counts["steps"] += 1
            for name, spent in timer.spent.items():
                totals[name] += spent
            totals["step"] += elapsed
        return out
    engine.step = timed_step
    lengths = []
    for prompt in prompts:
        result = llm.generate_ids(prompt, params)
        counts["tokens"] += len(result.token_ids) - 1
        lengths += result.stats.acceptance_lengths
    engine.step = step
    steps = counts["steps"]
    parts = {name: round(1e3 * spent / steps, 3) for name, spent in totals.items() if name != "step"}
    step_ms = 1e3 * totals["step"] / steps
    parts["rest of the step"] = round(step_ms - sum(parts.values()), 3)
    return {"ms_per_step": round(step_ms, 3), "tokens_per_step": round(counts["tokens"] / steps, 3),
            "tok_per_s": round(counts["tokens"] / totals["step"], 1), "parts_ms": parts,
            "shares": {name: round(ms / step_ms, 3) for name, ms in parts.items()},
            "mean_acceptance_length": round(sum(lengths) / len(lengths), 3) if lengths else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="plain,dflash")
    parser.add_argument("--threads", type=int, default=1, help="--threads (torch's intra-op threads; the quantized matmuls run on one)")
    args = parser.parse_args()
    from blockspec import named
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    options = dict(device="cpu", dtype=args.dtype, threads=args.threads, max_model_len=512, max_num_seqs=1, show_progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    modes = {"plain": {}, "dflash": {"draft": str(named.default_draft("smollm2")), "block_size": 8}}
    report = {}
    for mode in args.modes.split(","):
        extra = modes[mode]
        llm = LLM(args.target, **options, **extra)
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in HELD_OUT[: args.prompts]]
        llm.generate_ids(prompts[0], params)                                  # warm-up
        report[mode] = profile(llm, prompts, params)
        report[mode]["native_stack"] = llm.target.native_stack is not None
        print(json.dumps({mode: report[mode]}), flush=True)
        llm.close()
    if len(report) < 2:
        return 0
    cycle = report["dflash"]["ms_per_step"] / report["plain"]["ms_per_step"]
    print(json.dumps({"dtype": args.dtype, "dflash_cycle_over_plain_step": round(cycle, 2),
                      "dflash_over_plain_tok_s": round(report["dflash"]["tok_per_s"] / report["plain"]["tok_per_s"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
