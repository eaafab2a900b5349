"""The engine thread and the in-process LLM: one owner of model state, every request ends once."""
from __future__ import annotations

import threading

import pytest
import torch

from blockspec.engine.engine import Engine
from blockspec.engine.request import Request, TokenEvent
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir, qwen3_draft_dir):
    return LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=4, max_model_len=512, show_progress=False)


def test_a_second_stream_cannot_start_while_one_is_live(llm):
    first = llm.stream(llm.make_request("a", [9707, 11], SamplingParams(max_tokens=20)))
    next(first)
    second = llm.stream(llm.make_request("b", [9707, 11], SamplingParams(max_tokens=20)))
    with pytest.raises(RuntimeError, match="already generating"):
        next(second)
    first.close()
    result = llm.generate_ids([9707, 11], SamplingParams(max_tokens=5))
    assert len(result.token_ids) == 5


def test_generate_json_stats_are_consistent_for_plain_and_dflash(qwen3_dir, llm):
    plain = LLM(str(qwen3_dir), max_model_len=512, show_progress=False)
    for model in (plain, llm):
        result = model.generate_ids([9707, 11, 1879], SamplingParams(max_tokens=9))
        stats = result.as_json()["stats"]
        assert stats["cycles"] == len(stats["acceptance_lengths"])
        assert sum(stats["acceptance_lengths"]) == len(result.token_ids) - 1
        assert "<|im_end|>" not in result.text


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate_ids([9707, 11], SamplingParams(max_tokens=8)).token_ids
    tiny = llm.generate_ids([9707, 11], SamplingParams(max_tokens=8, temperature=1e-40, seed=1)).token_ids
    assert tiny == greedy


def test_context_limit_below_two_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match="at least 2"):
        LLM(str(qwen3_dir), max_model_len=1, show_progress=False)


class ScriptedLLM:
    """Streams whatever script it is given; counts how many streams run at once."""
    draft = None

    def __init__(self, script):
        self.script = script
        self.running = 0
        self.max_running = 0

    def stream(self, request):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            yield from self.script(request)
        finally:
            self.running -= 1


def run_engine(llm, requests):
    finished, events, done = [], {}, threading.Event()

    def on_event(event: TokenEvent) -> None:
        events.setdefault(event.request_id, []).append(event)
        if len([e for es in events.values() for e in es if e.finish_reason]) == len(requests):
            done.set()
    engine = Engine(llm, max_queue=8, on_finish=finished.append)
    for request in requests:
        engine.submit(request, on_event)
    engine.start()
    assert done.wait(30)
    engine.shutdown()
    return events, finished


def make(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), frozenset(), 64)


def test_every_request_ends_exactly_once_one_at_a_time():
    def script(request):
        yield TokenEvent(request.request_id, [7])
        if request.request_id == "silent":
            return                                   # a loop that forgot its finish event
        if request.request_id == "boom":
            raise RuntimeError("kernel fault")
        request.finish_reason = "length"
        yield TokenEvent(request.request_id, [8], "length", request.stats)
    llm = ScriptedLLM(script)
    aborted = make("gone")
    aborted.abort()
    requests = [make("ok"), make("silent"), make("boom"), aborted, make("ok2")]
    events, finished = run_engine(llm, requests)
    reasons = {rid: [e.finish_reason for e in evs if e.finish_reason] for rid, evs in events.items()}
    assert reasons == {"ok": ["length"], "silent": ["error"], "boom": ["error"], "gone": ["abort"], "ok2": ["length"]}
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    assert llm.max_running == 1
