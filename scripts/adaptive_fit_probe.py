"""What adaptive speculation learnt, printed after each round (issue 31, round 60's CPU finding):
fresh adaptive engines of the demo pair at one concurrency, the held-out prompts, a few rounds
each; per round the output tok/s, the mean verified width and the policy's fitted state (the
step-time fit's `forward_scale`, `marginal_scale` and host terms, the pace's stride), and once
the cost table measured at startup.

    OMP_NUM_THREADS=1 python scripts/adaptive_fit_probe.py [--engines 3] [--rounds 3] [--concurrency 32]
"""
from __future__ import annotations

import argparse
import time

from blockspec.demo import require_built
from blockspec.demo.measure import held_out_prompts
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    target, draft = require_built()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for engine in range(args.engines):
        llm = LLM(str(target), draft=str(draft), block_size=8, device=args.device, max_num_seqs=args.concurrency,
                  speculation="adaptive", show_progress=False)
        policy = llm.engine.runner.speculation
        if engine == 0 and policy.costs is not None:
            print(policy.costs.describe())
        prompts = held_out_prompts(llm.tokenizer, args.concurrency + 2)
        llm.generate(prompts[:2], params)                                   # warm-up, as the bench does
        llm.engine.counters.spec_widths.clear()
        for round_ in range(args.rounds):
            started = time.perf_counter()
            done = llm.generate(prompts[2:args.concurrency + 2], params)   # none of the warm-up's
            seconds = time.perf_counter() - started
            widths = llm.engine.counters.spec_widths
            mean_width = sum(k * n for k, n in widths.items()) / max(1, sum(widths.values()))
            widths.clear()
            print(f"engine {engine} round {round_}: {sum(len(o.token_ids) for o in done) / seconds:.1f} tok/s, "
                  f"width {mean_width:.2f}, forward_scale {policy.forward_scale:.3f}, marginal_scale "
                  f"{policy.marginal_scale:.3f}, ms per seq {policy.overhead_ms_per_seq:.3f}, ms per token "
                  f"{policy.overhead_ms_per_token:.3f}, stride {policy.pace.stride}", flush=True)


if __name__ == "__main__":
    main()
