"""`blockspec bench --demo`: the demo pair on held-out standard-library code, plain vs DFlash
greedy decoding in one process: mean acceptance length, decode tokens/s, speedup.

Prompts are 64-token windows of the held-out modules (never trained on), tokenized here; the
two paths alternate prompt by prompt so that machine noise hits both alike, and their outputs
must be identical (greedy DFlash is lossless).
"""
from __future__ import annotations

import json
import random
import time
from typing import Any

from blockspec.progress import track

PROMPT_LEN = 64


def held_out_prompts(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    from blockspec.demo import HELD_OUT_MODULES
    from blockspec.train.corpus import read_sources, stdlib_files
    windows = [ids[i: i + PROMPT_LEN] for source in read_sources(stdlib_files(only=HELD_OUT_MODULES))
               for ids in [tokenizer.encode(source)] for i in range(0, len(ids) - PROMPT_LEN, 997)]
    random.Random(seed).shuffle(windows)
    return windows[:num]


def measure(device: str = "cpu", block_size: int = 8, num_prompts: int = 8, max_tokens: int = 128) -> dict[str, Any]:
    from blockspec.demo import require_built
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    target, draft = require_built()
    plain = LLM(str(target), device=device, show_progress=False)
    dflash = LLM(str(target), draft=str(draft), block_size=block_size, device=device, show_progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = held_out_prompts(plain.tokenizer, num_prompts)
    for llm in (plain, dflash):                                     # warm-up (allocator, graphs)
        llm.generate_ids(prompts[0], params)
    totals = {"plain_s": 0.0, "dflash_s": 0.0, "tokens": 0}
    lengths: list[int] = []
    for prompt in track(prompts, "bench --demo: plain vs DFlash", len(prompts), "prompt"):
        a, b = plain.generate_ids(prompt, params), dflash.generate_ids(prompt, params)
        if a.token_ids != b.token_ids:
            raise AssertionError("DFlash output differs from plain greedy decoding")
        totals["plain_s"] += a.stats.decode_s
        totals["dflash_s"] += b.stats.decode_s
        totals["tokens"] += len(a.token_ids) - 1                    # the first token comes from prefill
        lengths += b.stats.acceptance_lengths
    return {"device": device, "block_size": block_size, "prompts": len(prompts), "max_tokens": max_tokens,
            "mean_acceptance_length": round(sum(lengths) / len(lengths), 3),
            "plain_tokens_per_s": round(totals["tokens"] / totals["plain_s"], 1),
            "dflash_tokens_per_s": round(totals["tokens"] / totals["dflash_s"], 1),
            "speedup": round(totals["plain_s"] / totals["dflash_s"], 2)}


def batch_throughput(device: str, concurrency: list[int], block_size: int = 8, max_tokens: int = 64
                     ) -> dict[str, Any]:
    """Output tok/s of c held-out prompts decoded as one batch, plain and DFlash, for each c
    (greedy; real acceptance). Each batch must equal its prompts decoded alone."""
    from blockspec.demo import require_built
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    target, draft = require_built()
    engines = {"plain": LLM(str(target), device=device, show_progress=False),
               "dflash": LLM(str(target), draft=str(draft), block_size=block_size, device=device, show_progress=False)}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = held_out_prompts(engines["plain"].tokenizer, max(concurrency) + 1)
    alone = [engines["plain"].generate_ids(p, params).token_ids for p in prompts[1:]]
    result: dict[str, Any] = {}
    for name, llm in engines.items():
        llm.generate([prompts[0]], params)                              # warm-up
        for c in track(concurrency, f"bench --demo: {name} batches", len(concurrency), "batch"):
            started = time.perf_counter()
            outputs = llm.generate(prompts[1: c + 1], params)
            seconds = time.perf_counter() - started
            if [o.token_ids for o in outputs] != alone[:c]:
                raise AssertionError(f"{name}: a batch of {c} differs from its prompts decoded alone")
            result[f"{name}_c{c}_tok_s"] = round(sum(len(o.token_ids) for o in outputs) / seconds, 1)
        first, last = concurrency[0], concurrency[-1]
        result[f"{name}_c{last}_over_c{first}"] = round(result[f"{name}_c{last}_tok_s"] / result[f"{name}_c{first}_tok_s"], 2)
    return result


def main(device: str, out: str | None, concurrency: list[int] | None = None) -> int:
    started = time.perf_counter()
    result = measure("cpu" if device == "auto" else device)
    if concurrency and len(concurrency) > 1:
        result["batches"] = batch_throughput("cpu" if device == "auto" else device, concurrency)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
