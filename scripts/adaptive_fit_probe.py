"""What adaptive speculation learnt, printed after each round (issue 31, round 60's CPU finding):
fresh adaptive engines of the demo pair at one concurrency, the held-out prompts, a few rounds
each; per round the output tok/s, the mean verified width and the policy's fitted state (the
step-time fit's `forward_scale`, `marginal_scale` and host terms, the pace's stride), and once
the cost table measured at startup.

    OMP_NUM_THREADS=1 python scripts/adaptive_fit_probe.py [--engines 3] [--rounds 3] [--concurrency 32]
        [--loads 1,8,32]   # the loads one engine walks in turn, as `bench --demo --compare-speculation`
                           # does (its rounds at each: measure.rounds_at); the widths' histogram per round
"""
from __future__ import annotations

import argparse
import time

from blockspec.demo import require_built
from blockspec.demo.measure import held_out_prompts, rounds_at
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--loads", default="", help="comma-separated concurrencies one engine walks in turn")
    args = ap.parse_args()
    target, draft = require_built()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    loads = [int(c) for c in args.loads.split(",")] if args.loads else [args.concurrency]
    seats = max(loads)
    for engine in range(args.engines):
        llm = LLM(str(target), draft=str(draft), block_size=8, device=args.device, max_num_seqs=seats,
                  speculation="adaptive", show_progress=False)
        policy = llm.engine.runner.speculation
        if engine == 0 and policy.costs is not None:
            print(policy.costs.describe())
        prompts = held_out_prompts(llm.tokenizer, seats + 2)
        llm.generate(prompts[:2], params)                                   # warm-up, as the bench does
        llm.engine.counters.spec_widths.clear()
        for load in loads:
            for round_ in range(rounds_at(args.rounds, load) if args.loads else args.rounds):
                started = time.perf_counter()
                done = llm.generate(prompts[2:load + 2], params)           # none of the warm-up's
                seconds = time.perf_counter() - started
                widths = llm.engine.counters.spec_widths
                mean_width = sum(k * n for k, n in widths.items()) / max(1, sum(widths.values()))
                histogram = " ".join(f"{k}:{n}" for k, n in sorted(widths.items()))
                widths.clear()
                print(f"engine {engine} load {load} round {round_}: {sum(len(o.token_ids) for o in done) / seconds:.1f} "
                      f"tok/s, width {mean_width:.2f} ({histogram}), forward_scale {policy.forward_scale:.3f}, "
                      f"marginal_scale {policy.marginal_scale:.3f}, ms per seq {policy.overhead_ms_per_seq:.3f}, "
                      f"ms per token {policy.overhead_ms_per_token:.3f}, stride {policy.pace.stride}", flush=True)

if __name__ == "__main__":
    main()
