"""`bench --multi-turn CxT`: the prefix cache on multi-turn chats over a shared system prompt."""
from __future__ import annotations

import gc
import time
from typing import Any
from unittest import mock

import torch

from blockspec.bench.common import SHAPES, EngineFailed, build_models, forced_accept, synchronize, timed
from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.loader import resolve_device
from blockspec.sampling import SamplingParams


def parse_multi_turn(text: str) -> tuple[int, int]:
    """'32x6' → (32 conversations, 6 turns each)."""
    try:
        conversations, turns = (int(part) for part in text.lower().split("x"))
    except ValueError:
        conversations = turns = 0
    if conversations < 1 or turns < 1:
        raise ValueError(f"--multi-turn takes CONVERSATIONSxTURNS, e.g. 32x6, not {text!r}")
    return conversations, turns


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def multi_turn_run(target, draft, block_size: int, conversations: int, turns: int, system_tokens: int,
                   user_tokens: int, answer_tokens: int, accept_len: float | None, prefix_cache: bool,
                   state_slots: int, page_size: int = 16) -> dict[str, Any]:
    """`conversations` chats over one shared system prompt, all at once; each submits its next
    turn (history + answer + a new user message) as soon as its last one ends. Per turn: mean time
    to first token, prompt tokens, tokens served from the cache, and the reusable ones (the
    longest prefix, in whole pages short of the last position, that an answer finished before
    this turn was submitted had in common with it)."""
    max_len = system_tokens + turns * (user_tokens + answer_tokens) + 16
    # A pool of every conversation at full length (sized, not measured: several engines in a row).
    num_pages = conversations * -(-(max_len + block_size) // page_size) + 1
    config = EngineConfig(max_model_len=max_len, block_size=block_size if draft is not None else 1,
                          max_num_seqs=conversations, max_queue=conversations, page_size=page_size,
                          prefix_cache=prefix_cache, prefix_state_slots=state_slots, num_gpu_blocks=num_pages,
                          max_prefill_tokens=min(max_len, 8192), max_num_batched_tokens=min(max_len, 8192),
                          speculation="fixed")                # as bench_engine (rounds before 55 ran the default, fixed)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()                 # the last run's engine and its pools are gone
    engine = Engine(target, draft, config)
    gen = torch.Generator().manual_seed(1)
    words = lambda n: torch.randint(1000, 100000, (n,), generator=gen).tolist()     # noqa: E731
    system = words(system_tokens)
    histories: list[list[int]] = []                      # prompt + answer of every finished turn
    turn_of = [0] * conversations
    prompts = [system + words(user_tokens) for _ in range(conversations)]
    submitted: dict[str, tuple[int, int, float, int]] = {}     # request id → (conversation, turn, time, reusable)
    rows: dict[int, list[dict[str, float]]] = {t: [] for t in range(turns)}
    finished: list[tuple[int, Request]] = []
    errors: list[str] = []

    def submit(c: int) -> None:
        prompt = prompts[c]
        reusable = max((common_prefix(prompt, h) for h in histories), default=0)
        reusable = min(reusable, len(prompt) - 1) // page_size * page_size
        request = Request(f"mt-{c}-{turn_of[c]}", prompt, SamplingParams(max_tokens=answer_tokens, ignore_eos=True),
                          frozenset(), max_len)
        submitted[request.request_id] = (c, turn_of[c], time.perf_counter(), reusable)

        def on_event(event, request=request) -> None:
            if event.error is not None:
                errors.append(event.error)
            if event.finish_reason is not None:
                finished.append((c, request))
        engine.submit(request, on_event)

    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "judge", forced_accept(accept_len) if forcing else model_runner.judge):
        for c in range(conversations):
            submit(c)
        first_token: dict[str, float] = {}
        started = time.perf_counter()
        while submitted.keys() - {r.request_id for _, r in finished} or finished:
            engine.step()
            synchronize()
            now = time.perf_counter()
            if errors:
                raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")
            for seq in engine.scheduler.running:
                if seq.request.output_ids and seq.request_id not in first_token:
                    first_token[seq.request_id] = now
            while finished:
                c, request = finished.pop()
                _, turn, at, reusable = submitted.pop(request.request_id)
                rows[turn].append({"ttft_s": first_token.get(request.request_id, now) - at,
                                   "prompt_tokens": len(request.prompt_ids), "cached": request.stats.cached_tokens,
                                   "reusable": reusable, "output": len(request.output_ids)})
                histories.append(request.prompt_ids + request.output_ids)
                turn_of[c] += 1
                if turn_of[c] < turns:
                    prompts[c] = request.prompt_ids + request.output_ids + words(user_tokens)
                    submit(c)
        seconds = time.perf_counter() - started
    per_turn = [{"turn": t + 1, "ttft_ms": 1e3 * sum(r["ttft_s"] for r in rs) / len(rs),
                 "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                 "cached_tokens": sum(r["cached"] for r in rs) / len(rs),
                 "reusable_tokens": sum(r["reusable"] for r in rs) / len(rs)} for t, rs in rows.items()]
    cached = sum(r["cached"] for rs in rows.values() for r in rs)
    reusable = sum(r["reusable"] for rs in rows.values() for r in rs)
    prompt = sum(r["prompt_tokens"] for rs in rows.values() for r in rs)
    return {"per_turn": per_turn, "hit_rate_of_reusable": cached / reusable if reusable else None,
            "cached_of_prompt": cached / prompt, "seconds": seconds,
            "output_tok_s": sum(r["output"] for rs in rows.values() for r in rs) / seconds}


def multi_turn_main(args) -> dict[str, Any]:
    """The multi-turn figures with the prefix cache and with --no-prefix-cache side by side, and a
    workload with no reuse at all (distinct prompts) through both."""
    device = resolve_device(args.device)
    conversations, turns = parse_multi_turn(args.multi_turn)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_size = int(str(args.block_size).split(",")[0])
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    _, _, target, draft = build_models(shape, device, dtype, block_size)
    spec = draft if block_size > 1 else None
    slots = max(args.prefix_state_slots, 3 * conversations)
    common = dict(block_size=block_size, conversations=conversations, turns=turns,
                  system_tokens=args.system_prompt_tokens, user_tokens=args.user_tokens,
                  answer_tokens=args.max_tokens, accept_len=args.accept_len, state_slots=slots)
    r: dict[str, Any] = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "multi_turn": f"{conversations}x{turns}",
                         "system_prompt_tokens": args.system_prompt_tokens, "user_tokens": args.user_tokens,
                         "answer_tokens": args.max_tokens, "block_size": block_size, "prefix_state_slots": slots,
                         "forced_acceptance_length": args.accept_len}
    multi_turn_run(target, spec, **{**common, "conversations": 1, "turns": 1, "system_tokens": 64}, prefix_cache=True)
    on = multi_turn_run(target, spec, **common, prefix_cache=True)
    off = multi_turn_run(target, spec, **common, prefix_cache=False)
    r["prefix_cache"], r["no_prefix_cache"] = on, off
    r["ttft_ratio_per_turn"] = [a["ttft_ms"] / b["ttft_ms"] for a, b in zip(on["per_turn"], off["per_turn"])]
    distinct = dict(common, turns=1, system_tokens=0, user_tokens=args.system_prompt_tokens)
    no_reuse_on = multi_turn_run(target, spec, **distinct, prefix_cache=True)
    no_reuse_off = multi_turn_run(target, spec, **distinct, prefix_cache=False)
    r["no_reuse_tok_s"] = {"prefix_cache": no_reuse_on["output_tok_s"], "no_prefix_cache": no_reuse_off["output_tok_s"],
                           "ratio": no_reuse_on["output_tok_s"] / no_reuse_off["output_tok_s"]}
    r["snapshot_copy_ms"] = snapshot_copy_ms(target, device, dtype)
    return r


def snapshot_copy_ms(target, device: torch.device, dtype: torch.dtype) -> dict[str, float] | None:
    """Milliseconds to copy one recurrent-state slot (every GDN layer's conv window and SSM
    state): what a hybrid snapshot costs to take or restore."""
    from blockspec.cache import StatePool
    if not target.recurrent_shapes:
        return None
    pool = StatePool(3, target.recurrent_shapes, dtype, device)
    return {"ms": timed(lambda: pool.copy(1, 2)), "bytes": pool.slot_bytes}
