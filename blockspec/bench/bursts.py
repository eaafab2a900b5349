"""`bench --burst N [--burst-decoding M]`: arrivals at once while others decode."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any
from unittest import mock

import torch

from blockspec.bench.common import (ENGINE_OPTIONS, SHAPES, EngineFailed, build_models, forced_accept, percentile,
                                    release, run_batch, synchronize)
from blockspec.bench.speculation import LatentProfile, parse_accept_profile
from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.sampling import SamplingParams


def burst(target, draft, block_size: int, arrivals: int, decoding: int, prompt_len: int, max_tokens: int,
          accept_len: float | None, max_num_batched_tokens: int = 2048,
          profile: LatentProfile | None = None) -> dict[str, float]:
    """`arrivals` requests of prompt_len tokens submitted at once, while `decoding` others are
    already decoding: the arrivals' time to first token (p50, p99) and the gaps between the
    decoding requests' streamed events during the burst (p50, p99), in milliseconds. With the
    ragged step their prefill chunks ride along with the decode rows instead of stalling them.
    Speculation is fixed (whole blocks, the acceptance forced by accept_len) unless a latent
    profile is given: then adaptive, the default, whose verify widths leave the budget's rest
    to the prompt's chunks (--accept-profile; a forced count says nothing of confidences)."""
    width = block_size if draft is not None else 1
    # The decoding ones (64-token prompts) keep going past the burst: room for prompt_len + max_tokens more.
    config = EngineConfig(**{"max_model_len": 64 + prompt_len + max_tokens + width, **ENGINE_OPTIONS,
                             "max_num_batched_tokens": max_num_batched_tokens},
                          block_size=width, max_num_seqs=arrivals + decoding, max_queue=arrivals + decoding,
                          speculation="adaptive" if profile is not None else "fixed")
    engine = Engine(target, draft, config)
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {}
    errors: list[str] = []

    def on_event(event) -> None:
        times.setdefault(event.request_id, []).append(time.perf_counter())
        if event.error is not None:
            errors.append(event.error)

    def request(name: str, length: int, tokens: int) -> Request:
        ids = torch.randint(1000, 100000, (length,), generator=gen).tolist()
        return Request(name, ids, SamplingParams(max_tokens=tokens, ignore_eos=True), frozenset(), config.max_model_len)

    def step() -> None:
        engine.step()
        if errors:
            raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")

    if draft is None:
        patches = []
    elif profile is not None:
        patches = [mock.patch.object(model_runner, "propose", profile.propose(model_runner.propose)),
                   mock.patch.object(model_runner, "judge", profile.judge(model_runner.judge))]
    elif accept_len is not None:
        patches = [mock.patch.object(model_runner, "judge", forced_accept(accept_len))]
    else:
        patches = []
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        run_batch(engine, min(4, arrivals), min(prompt_len, 64), 4)                    # warm-up
        background = [request(f"decoding-{i}", 64, prompt_len + max_tokens) for i in range(decoding)]
        for r in background:
            engine.submit(r, on_event)
        while not all(r.output_ids for r in background):
            step()
        synchronize()
        burst_requests = [request(f"arrival-{i}", prompt_len, max_tokens) for i in range(arrivals)]
        started = time.perf_counter()
        for r in burst_requests:
            engine.submit(r, on_event)
        while not all(r.output_ids or r.is_finished for r in burst_requests):
            step()
        ended = time.perf_counter()
        for r in [*background, *burst_requests]:
            r.abort()
        while engine.has_work:
            step()
    ttft = sorted((times[r.request_id][0] - started) * 1e3 for r in burst_requests)
    gaps = sorted((b - a) * 1e3 for r in background for a, b in zip(times[r.request_id], times[r.request_id][1:])
                  if started <= b <= ended)
    result = {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99)}
    if gaps:
        result.update(gap_p50_ms=percentile(gaps, 50), gap_p99_ms=percentile(gaps, 99))
    return result


def burst_main(args, device: torch.device, block_size: int) -> int:
    """`bench --burst N [--burst-decoding M]`: the burst figures, plain and DFlash, as one JSON object."""
    if args.burst < 1 or args.burst_decoding < 0:
        raise ValueError("--burst must be at least 1 and --burst-decoding at least 0")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if getattr(args, "layers", None) else {}))
    _, _, target, draft = build_models(shape, device, dtype, block_size)
    budget = getattr(args, "max_num_batched_tokens", None) or 2048
    results: dict[str, Any] = {"shape": args.shape, "arrivals": args.burst, "decoding": args.burst_decoding,
                               "prompt_len": args.prompt_len, "max_num_batched_tokens": budget}
    profile = parse_accept_profile(getattr(args, "accept_profile", None), block_size)
    runs = [("plain", None, None)]
    if args.accept_len is not None or profile is None:      # fixed whole blocks
        runs.append(("dflash", draft, None))
    if profile is not None:                                  # adaptive (the default) on the profile's confidences
        runs.append(("dflash_adaptive", draft, profile))
    try:
        for name, drafter, prof in runs:
            results[name] = burst(target, drafter, block_size, args.burst, args.burst_decoding, args.prompt_len,
                                  args.max_tokens, args.accept_len, budget, prof)
            release()              # the next engine sizes its pool from the memory this one held
    except EngineFailed as exc:
        print(f"blockspec bench: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0
