"""Reliability (issue 14): SIGTERM drains a real server, faults cost only their own request, a
reader that stops never stalls the engine, templates run sandboxed, request sizes are bounded."""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import signal
import socket
import threading
import time
from multiprocessing.pool import ThreadPool

import httpx
import pytest
import torch

import fixtures
from blockspec.llm import LLM
from blockspec.loader import load_draft, load_model
from blockspec.server.app import ServerSettings
from blockspec.server.request_building import MAX_MESSAGES, MAX_TOOL_BYTES, MAX_TOOLS
from blockspec.tokenizer import ChatTemplateError, Tokenizer
from helpers import make_engine, make_request, run_alone, run_until_done, submit
from servers import InProcessServer, ServerProcess, wait_until

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
LONG = 3000                  # tokens: far longer than any drain here


# ---------------------------------------------------------------------------------------------
# SIGTERM: stop admitting, drain, end the rest with an error event and [DONE], exit 0
# ---------------------------------------------------------------------------------------------


class StreamReader(threading.Thread):
    """Reads one streamed request to its end, noting each SSE line and when it came."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines: list[tuple[float, str]] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first_line = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json={**self.body, "stream": True},
                              timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
                        self.first_line.set()
        except BaseException as exc:  # noqa: BLE001 - the test asserts there was none
            self.error = exc
        finally:
            self.first_line.set()

    @property
    def payloads(self) -> list:
        return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
                for _, line in self.lines]


def finish_reasons(payloads: list) -> list:
    return [c["choices"][0]["finish_reason"] for c in payloads
            if isinstance(c, dict) and c.get("choices") and c["choices"][0].get("finish_reason")]


# Long enough that the short stream's remaining tokens finish inside it on a loaded 2-core CI
# machine (two test workers: ~40 tokens/s there, 150 tokens took 3.7 s against a 3 s drain).
DRAIN_S = 8.0


@pytest.fixture()
def draining_server(qwen3_dir, tmp_path):
    server = ServerProcess(tmp_path / "drain.log", "--model", str(qwen3_dir), "--max-num-seqs", "2",
                           "--shutdown-timeout", str(DRAIN_S))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_sigterm_drains_then_ends_every_open_request_with_done(draining_server):
    """Running: a long stream (outlives the drain) and a short one (finishes inside it); queued
    behind them: a long non-stream and a long stream. After SIGTERM a new request is a 503;
    the short stream ends normally; the rest end at the drain's end: streams with an abort
    chunk, an error event and [DONE], the non-stream with a 503 error object; exit 0, no traceback."""
    server = draining_server
    url = server.url

    def body(max_tokens: int) -> dict:
        return {"model": "qwen3", "messages": HELLO, "temperature": 0, "max_tokens": max_tokens}

    long_stream, short_stream = StreamReader(url, body(LONG)), StreamReader(url, body(150))
    long_stream.start()
    assert long_stream.first_line.wait(60)
    short_stream.start()
    assert short_stream.first_line.wait(60)
    assert wait_until(lambda: httpx.get(url + "/health").json()["running"] == 2)
    queued_stream = StreamReader(url, body(LONG))
    queued_stream.start()
    queued_answer: dict = {}
    queued = threading.Thread(target=lambda: queued_answer.update(response=httpx.post(
        url + "/v1/chat/completions", json=body(LONG), timeout=120)), daemon=True)
    queued.start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 2)

    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=5)
    refused = httpx.post(url + "/v1/chat/completions", json=body(4), timeout=10)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "1"

    for reader in (long_stream, short_stream, queued_stream):
        reader.join(60)
        assert not reader.is_alive() and reader.error is None and reader.status == 200
    queued.join(60)
    assert server.process.wait(30) == 0
    ended = time.monotonic()

    # the short stream finished inside the drain, with output written after the signal
    short = short_stream.payloads
    assert short[-1] == "[DONE]" and finish_reasons(short) == ["length"]
    assert any(t > signalled for t, _ in short_stream.lines)
    # the others ran into the drain's end: abort, then an error event, then [DONE]
    for reader in (long_stream, queued_stream):
        payloads = reader.payloads
        assert payloads[-1] == "[DONE]"
        assert finish_reasons(payloads) == ["abort"]
        assert payloads[-2]["error"]["code"] == 503 and "shut down" in payloads[-2]["error"]["message"]
        assert reader.lines[-1][0] - signalled >= DRAIN_S - 0.5     # not before the drain was over
    response = queued_answer["response"]
    assert response.status_code == 503 and "shut down" in response.json()["error"]["message"]
    assert ended - signalled < DRAIN_S + 15
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "CancelledError" not in log and "Exception" not in log, log[-4000:]


# ---------------------------------------------------------------------------------------------
# Fault injection (Engine.fault_hook): one request's failure is its own; out of memory preempts
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    """kind → (target, draft): the dense Qwen3 pair and a hybrid Qwen3.5 with its draft."""
    target = load_model(str(qwen3_dir)).model
    root = tmp_path_factory.mktemp("reliability-hybrid")
    hybrid_dir = fixtures.write_hybrid_checkpoint(root / "target")
    hybrid = load_model(str(hybrid_dir)).model
    hybrid_draft_dir = fixtures.write_dflash_draft(root / "draft", hybrid_dir, target_layer_ids=[0, 2],
                                                   mask_token_id=fixtures.HYBRID_VOCAB - 1)
    return {"dense": (target, load_draft(str(qwen3_draft_dir), target)),
            "hybrid": (hybrid, load_draft(str(hybrid_draft_dir), hybrid))}


def prompts(kind: str) -> list[list[int]]:
    vocab = fixtures.HYBRID_VOCAB - 1 if kind == "hybrid" else 151643
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 23, 14)]


class FailOnce:
    """A fault hook raising `error` once: in `phase`, for request `request_id` (any when None),
    the `nth` time that phase is reached for it."""

    def __init__(self, phase: str, error: BaseException, request_id: str | None = None, nth: int = 3) -> None:
        self.phase, self.error, self.request_id, self.nth = phase, error, request_id, nth
        self.seen, self.fired = 0, False

    def __call__(self, phase: str, seqs) -> None:
        if self.fired or phase != self.phase:
            return
        if self.request_id is not None and all(s.request_id != self.request_id for s in seqs):
            return
        self.seen += 1
        if self.seen == self.nth:
            self.fired = True
            raise self.error


def engine_for(models, kind: str, spec: bool):
    target, draft = models[kind]
    return lambda: make_engine(target, draft if spec else None, block_size=4 if spec else 1)


def requests(kind: str) -> list:
    return [make_request(f"r{i}", p, max_tokens=12, max_model_len=1024) for i, p in enumerate(prompts(kind))]


def references(models, kind: str, spec: bool) -> list[list[int]]:
    return [run_alone(engine_for(models, kind, spec), r).output_ids for r in requests(kind)]


@contextlib.contextmanager
def engine_log():
    """The records of the blockspec.engine logger while the block runs (a handler of its own:
    configure_logging may have stopped the logger propagating to pytest's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("blockspec.engine")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def free_memory(engine) -> tuple[int, int | None]:
    cache = engine.cache
    return cache.num_free_pages, cache.slots.num_free if cache.slots is not None else None


@pytest.mark.parametrize("kind,spec,phase", [("dense", True, "commit"), ("dense", False, "commit"),
                                             ("hybrid", True, "commit"), ("dense", True, "prefill")])
def test_a_request_whose_decoding_raises_ends_alone(models, kind, spec, phase):
    expected = references(models, kind, spec)
    engine = engine_for(models, kind, spec)()
    initial = free_memory(engine)
    engine.fault_hook = FailOnce(phase, RuntimeError("injected fault"), "r1", nth=3 if phase == "commit" else 1)
    runs = [submit(engine, r) for r in requests(kind)]
    with engine_log() as records:
        run_until_done(engine, runs)
    assert engine.fault_hook.fired
    # the failure and its traceback go to the engine's logger (the server's log), not bare stderr
    assert [str(r.exc_info[1]) for r in records if r.levelname == "ERROR"] == ["injected fault"]
    failed = runs[1]
    failed.check_events()
    assert failed.finish_reason == "error" and "injected fault" in failed.events[-1].error
    if phase == "prefill":
        assert failed.output_ids == []
    elif not spec:                                  # the prefill's token, then two committed steps
        assert len(failed.output_ids) == 3
    assert failed.output_ids == expected[1][: len(failed.output_ids)]
    for run, reference in ((runs[0], expected[0]), (runs[2], expected[2])):
        run.check_events()
        assert (run.finish_reason, run.output_ids) == ("length", reference)
    assert free_memory(engine) == initial          # pages and state slot of the failed one are back


@pytest.mark.parametrize("kind,spec", [("dense", True), ("dense", False), ("hybrid", True)])
def test_out_of_memory_in_a_batch_preempts_and_the_output_stays_exact(models, kind, spec):
    expected = references(models, kind, spec)
    engine = engine_for(models, kind, spec)()
    initial = free_memory(engine)
    engine.fault_hook = FailOnce("decode", torch.OutOfMemoryError("injected: CUDA out of memory"), nth=3)
    runs = [submit(engine, r) for r in requests(kind)]
    for _ in range(2_000):
        if engine.fault_hook.fired:
            break
        engine.step()
    # the failed step's sequences were preempted (pages and slots freed), not failed
    assert engine.fault_hook.fired and engine.num_running == 0 and engine.scheduler.seat_limit == 1
    assert free_memory(engine) == initial
    run_until_done(engine, runs)
    for run, reference in zip(runs, expected):
        run.check_events()
        assert (run.finish_reason, run.output_ids) == ("length", reference)
    assert free_memory(engine) == initial


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_out_of_memory_inside_a_forward_preempts_and_the_output_stays_exact(models, kind):
    """Raised by a middle layer, after the layers before it wrote K/V and recurrent state: the
    preempted sequences recompute from their tokens, so nothing half-written survives."""
    expected = references(models, kind, True)
    engine = engine_for(models, kind, True)()
    initial = free_memory(engine)
    calls = {"n": 0}

    def fail_on_the_ninth_call(*_):
        calls["n"] += 1
        if calls["n"] == 9:
            raise torch.OutOfMemoryError("injected inside the forward")

    # on the MLP: layers run through forward_residual (not __call__), their submodules through __call__
    handle = models[kind][0].model.layers[2].mlp.register_forward_pre_hook(fail_on_the_ninth_call)
    try:
        runs = [submit(engine, r) for r in requests(kind)]
        run_until_done(engine, runs)
    finally:
        handle.remove()
    assert calls["n"] > 9 and engine.scheduler.seat_limit < 8
    for run, reference in zip(runs, expected):
        run.check_events()
        assert (run.finish_reason, run.output_ids) == ("length", reference)
    assert free_memory(engine) == initial


def test_out_of_memory_alone_is_an_error_for_that_request(models):
    engine = engine_for(models, "dense", True)()
    initial = free_memory(engine)
    engine.fault_hook = FailOnce("decode", torch.OutOfMemoryError("injected: CUDA out of memory"), nth=2)
    run = submit(engine, requests("dense")[0])
    run_until_done(engine, [run])
    run.check_events()
    assert run.finish_reason == "error" and "out of memory" in run.events[-1].error
    assert free_memory(engine) == initial
    engine.fault_hook = None
    again = submit(engine, requests("dense")[0])                     # the engine still serves
    run_until_done(engine, [again])
    assert again.finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# The same through HTTP (in-process server over a real tiny LLM): an error event for that
# request only; a reader that stops reading stalls nobody
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(qwen3_dir):
    llm = LLM(str(qwen3_dir), show_progress=False, max_num_seqs=4, max_model_len=2048)
    with InProcessServer(lambda: llm, ServerSettings(model="qwen3"), send_buffer=4096) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=60)
        yield llm, server
        llm.engine.fault_hook = None


def ask(url: str, content: str, max_tokens: int = 16, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_a_failing_request_gets_an_error_the_others_their_answers(live):
    llm, server = live
    questions = [f"Question {i}?" for i in range(3)]
    expected = [ask(server.url, q).json()["choices"][0]["message"]["content"] for q in questions]
    initial = llm.engine.cache.num_free_pages
    for stream in (False, True):
        target = llm.tokenizer.encode_chat([{"role": "user", "content": questions[1]}])
        llm.engine.fault_hook = fail_on_commit(target, 4)
        with ThreadPool(3) as pool:
            answers = pool.map(lambda q: answer_of(server.url, q, stream), questions)
        llm.engine.fault_hook = None
        assert answers[0] == ("ok", expected[0]) and answers[2] == ("ok", expected[2])
        status, message = answers[1]
        assert status == ("stream-error" if stream else 500) and "injected fault" in message
    assert wait_until(lambda: llm.engine.num_running == 0)
    assert llm.engine.cache.num_free_pages == initial


def fail_on_commit(prompt_ids: list[int], nth: int):
    """A fault hook: the nth commit of the request with these prompt ids raises."""
    seen = 0

    def hook(phase: str, seqs) -> None:
        nonlocal seen
        if phase == "commit" and seqs[0].request.prompt_ids == prompt_ids:
            seen += 1
            if seen == nth:
                raise RuntimeError("injected fault")
    return hook


def answer_of(url: str, question: str, stream: bool) -> tuple:
    """("ok", text), (status, error message), or ("stream-error", message) after which [DONE] came."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
    if not stream:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        if response.status_code != 200:
            return response.status_code, response.json()["error"]["message"]
        return "ok", response.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    payloads = [json.loads(line) for line in lines[:-1]]
    if "error" in payloads[-1]:
        return "stream-error", payloads[-1]["error"]["message"]
    return "ok", "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])


def read_stream_text(sock: socket.socket) -> str:
    """The content of a chunked SSE response read raw from `sock` until [DONE]."""
    sock.settimeout(60)
    raw = b""
    while b"data: [DONE]" not in raw:
        data = sock.recv(1 << 16)
        assert data, "the connection closed before [DONE]"
        raw += data
    body = raw.partition(b"\r\n\r\n")[2]
    payloads, rest = [], body
    while rest:                                          # undo the chunked transfer encoding
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        payloads.append(rest[:size])
        rest = rest[size + 2:]
        if size == 0:
            break
    events = [line[len("data: "):] for line in b"".join(payloads).decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])


def test_a_reader_that_stops_reading_stalls_nobody(live):
    """One client asks for a long stream and never reads it (a 4 KiB receive buffer, so the
    server's writes block); the engine runs on: others get their answers at once, the stuck
    request's tokens wait merged in its one pending event, and the engine finishes it."""
    llm, server = live
    questions = [f"Another question {i}?" for i in range(3)]
    expected = [ask(server.url, q).json()["choices"][0]["message"]["content"] for q in questions]
    body = json.dumps({"messages": HELLO, "max_tokens": 600, "temperature": 0, "stream": True}).encode()
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", server.port))
    try:
        stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: llm.engine.num_running == 1)
        started = time.monotonic()
        for question, reference in zip(questions, expected):
            assert ask(server.url, question).json()["choices"][0]["message"]["content"] == reference
        assert time.monotonic() - started < 30
        state = server.app.state.server
        generation = next(g for g in state.generations if g.request.params.max_tokens == 600)
        # the engine finished all 600 tokens while the client read none of them
        assert wait_until(lambda: generation.request.is_finished, timeout=120)
        assert generation.request.finish_reason == "length" and len(generation.request.output_ids) == 600
        assert generation.num_pending_tokens > 100      # waiting, merged, in one event
        # read at last: the merged events still carry every token, in order, then [DONE]
        text = read_stream_text(stuck)
        assert text == llm.tokenizer.decode(generation.request.output_ids, skip_special_tokens=True)
    finally:
        stuck.close()
    assert wait_until(lambda: not state.generations and llm.engine.num_running == 0)
    assert ask(server.url, questions[0]).json()["choices"][0]["message"]["content"] == expected[0]


# ---------------------------------------------------------------------------------------------
# Security: the chat template runs sandboxed; bounded requests
# ---------------------------------------------------------------------------------------------


HOSTILE_TEMPLATES = {
    "class walk": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "function globals": "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "constructor globals": "{{ cycler.__init__.__globals__.os }}",
    "mutating the input": "{% set _ = messages.append(1) %}{{ messages }}",
    "include a file": "{% include '/etc/passwd' %}",
    "extends a file": "{% extends '/etc/passwd' %}",
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
}


def hostile(tokenizer, template: str):
    evil = copy.copy(tokenizer)
    evil.chat_templates = {name: template for name in tokenizer.chat_templates}
    evil._compiled = {}
    return evil


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_a_hostile_template_fails_cleanly(qwen3_dir, template):
    tokenizer = hostile(Tokenizer.from_dir(qwen3_dir), template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="chat template failed to render"):
        tokenizer.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_a_hostile_template_is_a_400_and_the_server_goes_on(live):
    llm, server = live
    expected = ask(server.url, "Hi").json()["choices"][0]["message"]["content"]
    original = llm.tokenizer
    try:
        for template in ("{{ lipsum.__globals__['os'].popen('id').read() }}", "{% include '/etc/passwd' %}"):
            llm.tokenizer = hostile(original, template)
            response = ask(server.url, "Hi")
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages" and "chat template" in error["message"]
            assert "uid=" not in response.text and "root:" not in response.text
    finally:
        llm.tokenizer = original
    assert ask(server.url, "Hi").json()["choices"][0]["message"]["content"] == expected


def tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("field,value,param,limit", [
    ("messages", [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1), "messages", MAX_MESSAGES),
    ("tools", [tool(f"f{i}") for i in range(MAX_TOOLS + 1)], "tools", MAX_TOOLS),
    ("tools", [tool("big", "x" * MAX_TOOL_BYTES)], "tools", MAX_TOOL_BYTES),
])
def test_message_and_tool_bounds_are_400s(live, field, value, param, limit):
    _, server = live
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, field: value}
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and f"the limit is {limit}" in error["message"]
    assert time.monotonic() - started < 5
    within = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
              "tools": [tool(f"f{i}") for i in range(3)]}
    assert httpx.post(server.url + "/v1/chat/completions", json=within, timeout=30).status_code == 200
