"""Where a short prefill after a cached prefix spends its time (issue 30: Qwen3.5-4B's second turn
of a 16k-token chat reached its first token in ~75 ms for 64 new tokens, where Qwen3-8B took 14).

One engine, plain decoding, the prefix cache on: a prompt of --prefix tokens is prefilled (turn 1),
then prompts of that prefix + --tokens new ones, each timed to its first token; the last of them
under torch.profiler (the host's ops by own CPU time, the device's kernels by own device time).

    python scripts/prefill_profile.py --shape qwen3.5-4b --prefix 16000 --tokens 64
    python scripts/prefill_profile.py --shape qwen3.5-4b --prefix 16000 --tokens 64,128,256 --compare-chunked
    python scripts/prefill_profile.py --shape tiny-moe --prefix 512 --tokens 64      # CPU, a check
"""
from __future__ import annotations

import argparse
import time

import torch

from blockspec.bench.common import SHAPES, build_models, synchronize
from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.models import gated_delta
from blockspec.sampling import SamplingParams


def first_token_ms(engine: Engine, name: str, prompt: list[int], max_len: int) -> tuple[float, Request]:
    """Submit one request of max_tokens 1 and step the engine until it ends: ms to its first token."""
    request = Request(name, prompt, SamplingParams(max_tokens=1), frozenset(), max_len)
    engine.submit(request, lambda event: None)
    started = time.perf_counter()
    while not request.is_finished:
        engine.step()
    synchronize()
    return (time.perf_counter() - started) * 1e3, request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.5-4b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a CPU check)")
    parser.add_argument("--prefix", type=int, default=16000)
    parser.add_argument("--tokens", default="64", help="new tokens a turn; a list (64,128,256) runs each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--compare-chunked", action="store_true",
                        help="also the turns with every Gated DeltaNet prefill on the chunked form")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    _, _, target, _ = build_models(shape, device, dtype)
    sizes = [int(n) for n in str(args.tokens).split(",")]
    max_len = args.prefix + 3 * args.repeats * sum(sizes) + sizes[0] + 16
    pages = -(-max_len // 16) * 2 + 8
    config = EngineConfig(max_model_len=max_len, block_size=1, max_num_seqs=1, max_queue=4, prefix_cache=True,
                          num_gpu_blocks=pages, max_num_batched_tokens=args.budget,
                          max_prefill_tokens=args.budget)
    started = time.perf_counter()
    engine = Engine(target, None, config)
    print(f"engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    words = lambda n: torch.randint(1000, 100000, (n,), generator=gen).tolist()      # noqa: E731
    prefix = words(args.prefix)
    cold, _ = first_token_ms(engine, "turn-1", prefix, max_len)
    print(f"turn 1: {args.prefix} tokens, first token in {cold:.1f} ms", flush=True)
    prompt = list(prefix)

    def turns(label: str, tokens: int) -> None:
        nonlocal prompt
        for i in range(args.repeats):
            prompt = prompt + words(tokens)
            ms, request = first_token_ms(engine, f"{label}-{i + 2}", prompt, max_len)
            print(f"{label}turn {i + 2}: {len(prompt)} tokens, {request.stats.cached_tokens} cached, first token in "
                  f"{ms:.1f} ms ({ms / cold:.3f} of turn 1)", flush=True)
    shipped = gated_delta.SHORT_PREFILL_ROWS
    for tokens in sizes:
        turns("", tokens)
        if args.compare_chunked:
            # The same turns with the step kernel forced (gated_delta.SHORT_PREFILL_ROWS ≥ the chunk)
            # and with every chunk on the chunked form (0): the short-prefill path against what it
            # replaced, and where they cross, in one process.
            for rows, label in ((max(shipped, tokens + 16), "step kernel, "), (0, "chunked form, ")):
                gated_delta.SHORT_PREFILL_ROWS = rows
                turns(label, tokens)
            gated_delta.SHORT_PREFILL_ROWS = shipped
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prompt = prompt + words(sizes[0])
    with profile(activities=activities) as prof:
        ms, request = first_token_ms(engine, "profiled", prompt, max_len)
    print(f"profiled: {len(prompt)} tokens, {request.stats.cached_tokens} cached, {ms:.1f} ms under the profiler")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=30))
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
