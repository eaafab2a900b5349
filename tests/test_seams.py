"""Where the features merged this session meet: the Responses API with the drain, the bounds and
the grammars; several choices with grammars, logprobs and faults; preemption of a sequence
whose logits are processed. Each test here failed on the merged tree before its fix."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import jsonschema
import pytest

from api_server import LiveServer, assert_error, load_llm, wait_until
from blockspec.server.request_building import MAX_TOOLS

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
DAYS = {"type": "function", "name": "get_days", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["days"]}}


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    with LiveServer(load_llm(qwen3_dir, max_model_len=1024), "qwen3") as server:
        yield server


# ---------------------------------------------------------------------------------------------
# /v1/responses is the chat path: the same admission checks and the same grammars
# ---------------------------------------------------------------------------------------------


def test_responses_are_refused_while_draining(plain):
    state = plain.app.state.server
    state.draining = True
    try:
        for path, body in (("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}),
                           ("/v1/responses", {"input": "Hi", "max_output_tokens": 2})):
            response = plain.post(path, body)
            assert_error(response, 503, "shutting down")
            assert response.headers["retry-after"]
    finally:
        state.draining = False
    assert plain.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2}).status_code == 200


def test_responses_tool_bounds_are_400s(plain):
    tools = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object", "properties": {}}}
             for i in range(MAX_TOOLS + 1)]
    error = assert_error(plain.post("/v1/responses", {"input": "Hi", "tools": tools, "max_output_tokens": 2}), 400,
                         f"the limit is {MAX_TOOLS}")
    assert error["param"] == "tools"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_days"}])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_choice_forces_a_valid_call(plain, tool_choice, stream):
    """A random model never writes a tool call by itself: only the grammar makes one."""
    body = {"input": "What time is it?", "tools": [TIME, DAYS], "tool_choice": tool_choice, "temperature": 0,
            "max_output_tokens": 200}
    if stream:
        events = plain.stream("/v1/responses", body)
        assert events[-1]["type"] == "response.completed", events[-1]
        response = events[-1]["response"]
    else:
        answer = plain.post("/v1/responses", body)
        assert answer.status_code == 200, answer.text
        response = answer.json()
    assert response["status"] == "completed", response
    [call] = response["output"]
    assert call["type"] == "function_call"
    if isinstance(tool_choice, dict):
        assert call["name"] == "get_days"
    tool = {"get_time": TIME, "get_days": DAYS}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])


# ---------------------------------------------------------------------------------------------
# n > 1: each choice its own matcher, its own stop, its own logprobs
# ---------------------------------------------------------------------------------------------

CHAT_TIME = {"type": "function", "function": {k: v for k, v in TIME.items() if k != "type"}}


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_follows_the_grammar(plain, stream):
    body = {"messages": HELLO, "n": 3, "temperature": 1.0, "seed": 5, "tools": [CHAT_TIME], "tool_choice": "required",
            "logprobs": True, "top_logprobs": 1, "max_tokens": 200}
    if stream:
        events = plain.stream("/v1/chat/completions", body)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        arguments, reasons, tokens = {}, {}, {}
        for event in events[:-1]:
            for choice in event["choices"]:
                index = choice["index"]
                for call in choice["delta"].get("tool_calls") or []:
                    arguments[index] = arguments.get(index, "") + call["function"].get("arguments", "")
                if choice.get("finish_reason"):
                    reasons[index] = choice["finish_reason"]
                tokens[index] = tokens.get(index, 0) + len((choice.get("logprobs") or {}).get("content") or [])
        assert reasons == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
        calls = [arguments[i] for i in range(3)]
    else:
        answer = plain.post("/v1/chat/completions", body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["tool_calls"] * 3
        calls = [c["message"]["tool_calls"][0]["function"]["arguments"] for c in choices]
        tokens = {c["index"]: len(c["logprobs"]["content"]) for c in choices}
        assert sum(tokens.values()) == answer.json()["usage"]["completion_tokens"]
    for arguments in calls:
        jsonschema.validate(json.loads(arguments), TIME["parameters"])
    assert all(tokens[i] > 0 for i in range(3))


def test_a_stop_string_ends_its_own_choice_only(plain):
    body = {"prompt": "Once upon a time", "n": 2, "temperature": 1.0, "seed": 9, "max_tokens": 12}
    free = plain.post("/v1/completions", body).json()["choices"]
    first, second = free[0]["text"], free[1]["text"]
    stop = next(second[i: i + 3] for i in range(3, len(second) - 3) if second[i: i + 3] not in first)
    for stream in (False, True):
        if stream:
            events = plain.stream("/v1/completions", {**body, "stop": [stop]})
            texts, reasons = ["", ""], [None, None]
            for event in events[:-1]:
                for choice in event["choices"]:
                    texts[choice["index"]] += choice["text"]
                    reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
        else:
            choices = plain.post("/v1/completions", {**body, "stop": [stop]}).json()["choices"]
            texts, reasons = [c["text"] for c in choices], [c["finish_reason"] for c in choices]
        assert texts == [first, second[: second.index(stop)]] and reasons == ["length", "stop"], (stream, stop)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": HELLO, "n": 2}),
                                       ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "logprobs": 1})])
def test_the_drain_ends_every_choice_of_a_stream(plain, path, body):
    """SIGTERM's drain running out (ServerState.drain, timeout 0) in the middle of a stream of
    several choices: each choice gets its abort, then one error event, then [DONE]."""
    state, engine = plain.app.state.server, plain.llm.engine
    initial = engine.runner.allocator.num_free
    lines: list[str] = []

    def read() -> None:
        request = {"model": plain.name, **body, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", plain.url + path, json=request, timeout=60) as response:
            lines.extend(line[len("data: "):] for line in response.iter_lines() if line)
    reader = threading.Thread(target=read)
    reader.start()
    assert wait_until(lambda: len(lines) > 8)
    try:
        asyncio.run_coroutine_threadsafe(state.drain(0.0), state.loop).result(30)
    finally:
        state.draining = state.interrupted = False
    reader.join(30)
    assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2])
    ends = [choice for line in lines[:-2] for choice in json.loads(line)["choices"] if choice["finish_reason"]]
    num_choices = 2 * (2 if "prompt" in body else 1)
    assert sorted(c["index"] for c in ends) == list(range(num_choices)), lines[-6:]
    assert {c["finish_reason"] for c in ends} == {"abort"}
    assert wait_until(lambda: engine.num_running == 0 and engine.runner.allocator.num_free == initial)


# ---------------------------------------------------------------------------------------------
# Preemption (out of memory, or a dry pool) of sequences with processors and logprobs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    from blockspec.loader import load_draft, load_model
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target)


def processed_requests() -> list:
    import torch
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 151643, (n,), generator=gen).tolist() for n in (9, 17, 12)]
    specs = [dict(frequency_penalty=1.0, repetition_penalty=1.3), dict(presence_penalty=0.7, logit_bias=((100, 3.0),)),
             dict(min_tokens=5, frequency_penalty=0.5)]
    requests = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=14, **spec), frozenset({151645}), 1024)
        request.num_logprobs = 2
        requests.append(request)
    return requests


@pytest.mark.parametrize("spec", [False, True])
def test_out_of_memory_preemption_keeps_processors_and_logprobs_exact(dense, spec):
    import torch
    from helpers import make_engine, run_alone, submit, run_until_done
    target, draft = dense
    factory = lambda: make_engine(target, draft if spec else None, block_size=4 if spec else 1)  # noqa: E731
    alone = [run_alone(factory, r) for r in processed_requests()]
    engine = factory()
    fired = []

    def out_of_memory_once(phase: str, seqs) -> None:
        if phase == "decode" and len(fired) < 2 and all(s.request.output_ids for s in seqs) \
                and len(seqs) == 3 and len(seqs[0].request.output_ids) > 3:
            fired.append(phase)
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
    engine.fault_hook = out_of_memory_once
    runs = [submit(engine, r) for r in processed_requests()]
    run_until_done(engine, runs)
    assert fired
    for run, reference in zip(runs, alone):
        run.check_events()
        request = run.request
        assert request.output_ids == reference.request.output_ids
        assert [lp.token_id for lp in request.output_logprobs] == request.output_ids      # none twice, none lost
        streamed = [lp for event in run.events for lp in event.logprobs or []]
        assert streamed == request.output_logprobs
        for got, want in zip(request.output_logprobs, reference.request.output_logprobs):
            assert abs(got.logprob - want.logprob) < 1e-4 and [t for t, _ in got.top] == [t for t, _ in want.top]


def test_out_of_memory_while_a_commit_advances_its_processor(dense, monkeypatch):
    """The processor's device work at commit (its token counts) runs out of memory: the batch is
    preempted as for any out-of-memory error, and the commit that failed half-way leaves
    nothing behind — neither output the client never got nor a processor that lags the output."""
    import torch
    from blockspec.engine.logits import LogitsProcessor
    from helpers import make_engine, run_alone, submit, run_until_done
    target, draft = dense
    factory = lambda: make_engine(target, draft, block_size=4)  # noqa: E731
    alone = [run_alone(factory, r) for r in processed_requests()]
    engine = factory()
    runs = [submit(engine, r) for r in processed_requests()]
    calls, original = [], LogitsProcessor._bincount

    def bincount(self, tokens):
        calls.append(len(tokens))
        if len(calls) == 8:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return original(self, tokens)
    monkeypatch.setattr(LogitsProcessor, "_bincount", bincount)
    run_until_done(engine, runs)
    assert len(calls) > 8
    for run, reference in zip(runs, alone):
        run.check_events()
        assert run.request.output_ids == reference.request.output_ids
        assert [lp.token_id for lp in run.request.output_logprobs] == run.request.output_ids


def test_a_request_still_compiling_its_grammar_when_the_drain_ends_is_refused(plain, monkeypatch):
    """Admitted before SIGTERM, still compiling its grammar (a worker thread) when the drain ran
    out and interrupted the open generations: it must not start generating afterwards (nothing
    would end it with an error and [DONE] before the server stops); a 503 to retry elsewhere."""
    from blockspec import structured
    state, engine = plain.app.state.server, plain.llm.engine
    entered, release = threading.Event(), threading.Event()
    compile_grammar = structured.compile_grammar

    def slow_compile(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return compile_grammar(*args, **kwargs)
    monkeypatch.setattr(structured, "compile_grammar", slow_compile)
    answers: list[httpx.Response] = []
    body = {"model": plain.name, "messages": HELLO, "tools": [CHAT_TIME], "tool_choice": "required", "max_tokens": 50}
    client = threading.Thread(target=lambda: answers.append(plain.post("/v1/chat/completions", body)))
    client.start()
    assert entered.wait(30)
    prompt_tokens = engine.counters.prompt_tokens
    drained = asyncio.run_coroutine_threadsafe(state.drain(0.0), state.loop)
    try:
        assert wait_until(lambda: getattr(state, "interrupted", False), 10)
        release.set()
        drained.result(30)
        client.join(30)
    finally:
        release.set()
        state.draining = state.interrupted = False
    [answer] = answers
    assert_error(answer, 503, "shutting down")
    assert answer.headers["retry-after"]
    assert engine.counters.prompt_tokens == prompt_tokens          # nothing reached the engine
