"""The HTTP server end to end: a real `blockspec serve` in a subprocess, driven with the official
`openai` client and raw httpx (translating SwiftLM's DFlash/server test scripts), plus an
in-process server over a scripted fake model for what a real tiny model can't stage on demand
(loading, a full queue, an engine failure).

Two subprocess servers share the module: DFlash (draft loaded) and plain (no draft, with
--api-key and --cors). Random tiny models write random text, so every expectation is a
reference taken from the server itself (or the plain server) first.
"""
from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.engine.request import Request, TokenEvent
from blockspec.server.app import ServerSettings
from blockspec.tokenizer import Tokenizer
from servers import MAX_BODY_BYTES, InProcessServer, ServerProcess, wait_until

API_KEY = "test-key-123"
ALLOWED_ORIGIN = "http://allowed.example"
DFLASH_NAME = "tiny-dflash"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    dflash = ServerProcess(logs / "dflash.log", "--model", str(qwen3_dir), "--draft", str(qwen3_draft_dir),
                           "--served-model-name", DFLASH_NAME, "--log-stats-interval", "0.2",
                           "--speculation", "fixed")      # its counts are whole blocks' whatever the default
    plain = ServerProcess(logs / "plain.log", "--model", str(qwen3_dir), "--api-key", API_KEY,
                          "--cors", ALLOWED_ORIGIN)
    try:
        dflash.wait_ready()
        plain.wait_ready()
        yield {"dflash": dflash, "plain": plain}
    finally:
        dflash.stop()
        plain.stop()


@pytest.fixture(scope="module")
def dflash(servers) -> ServerProcess:
    return servers["dflash"]


@pytest.fixture(scope="module")
def plain(servers) -> ServerProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen3_dir)


def client_for(server: ServerProcess) -> openai.OpenAI:
    key = API_KEY if server.process.args and "--api-key" in server.process.args else "unused"
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def headers_for(server: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"} if "--api-key" in server.process.args else {}


def model_of(server: ServerProcess) -> str:
    return DFLASH_NAME if "--draft" in server.process.args else "qwen3"


def post(server: ServerProcess, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **headers_for(server), **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120, **kwargs)


def chat(server: ServerProcess, messages=HELLO, **fields) -> dict:
    body = {"model": model_of(server), "messages": messages, "temperature": 0, "max_tokens": 16, **fields}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_text(server: ServerProcess, messages=HELLO, **fields) -> str:
    return chat(server, messages, **fields)["choices"][0]["message"]["content"]


def stream_events(server: ServerProcess, path: str, body: dict) -> list:
    """Every SSE payload of a streamed answer (dicts, and the final "[DONE]")."""
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers=headers_for(server), timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def streamed_chat_text(events: list) -> str:
    return "".join(choice["delta"].get("content") or ""
                   for event in events[:-1] if isinstance(event, dict) for choice in event["choices"])


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0] == name]
    return values[0] if values else 0.0


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= set(error)
    return error


# ---------------------------------------------------------------------------------------------
# Health, models, metrics
# ---------------------------------------------------------------------------------------------


def test_the_log_says_what_is_served_and_how_it_goes(dflash, qwen3_dir, qwen3_draft_dir):
    """The startup summary names what is served; while requests run, a stats line every
    --log-stats-interval seconds (throughput, queue, KV usage, acceptance)."""
    stats = re.compile(r"prompt throughput [0-9.]+ tokens/s, generation throughput [0-9.]+ tokens/s, running \d+, "
                       r"waiting \d+, KV cache usage [0-9.]+%, spec acceptance rate [0-9.]+%, mean acceptance "
                       r"length [0-9.]+ \(\d+ verify passes\)")
    chat(dflash, max_tokens=8)
    assert wait_until(lambda: stats.search(dflash.log_path.read_text()) is not None, timeout=10), dflash.log()
    summary = next(line for line in dflash.log_path.read_text().splitlines() if "serving " + DFLASH_NAME in line)
    for part in (f"model {qwen3_dir}", f"draft {qwen3_draft_dir}", "dtype float32", "device cpu",
                 "context ", "block size ", "speculation fixed block size", "KV pool ", "max concurrency ",
                 "CUDA graphs off"):
        assert part in summary, (part, summary)


def test_startup_summary_reads_only_the_properties_a_model_has():
    """The summary's typed accessor: a stand-in with the bare EngineHandle surface gets a shorter
    line, not an error; a property another build adds (speculation_policy) is used when present."""
    from blockspec.server.logs import startup_summary

    class Bare:
        speculative, block_size, max_model_len = False, 1, 64

    class Adaptive(Bare):
        speculative, block_size, speculation_policy, kv_cache_tokens = True, 8, "adaptive 1..8", 4096

    settings = ServerSettings(model="/m/tiny", draft="/m/draft")
    assert startup_summary(Bare(), settings) == "serving tiny: model /m/tiny, context 64 tokens, speculation none " \
                                                "(plain decoding)"
    assert startup_summary(Adaptive(), settings) == ("serving tiny: model /m/tiny, draft /m/draft, context 64 tokens, "
                                                     "block size 8, speculation adaptive 1..8, KV pool 4096 tokens")


def test_the_startup_line_names_the_speculation_the_engine_runs(qwen3_dir, qwen3_draft_dir):
    """A real LLM's summary names its mode (it said "fixed" for any mode that did not name itself);
    the default is adaptive (CPU and CUDA), fixed with tensor parallelism, as given otherwise."""
    from blockspec.config import EngineOptions, default_speculation
    from blockspec.llm import LLM
    from blockspec.server.logs import startup_summary
    settings = ServerSettings(model=str(qwen3_dir), draft=str(qwen3_draft_dir))
    for asked, said in ((None, "speculation adaptive (0..3 drafts verified a step, blocks of 4)"),
                        ("fixed", "speculation fixed block size 4")):
        llm = LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=4, max_num_seqs=2, max_model_len=64,
                  device="cpu", show_progress=False, **({"speculation": asked} if asked else {}))
        assert said in startup_summary(llm, settings), startup_summary(llm, settings)
    assert default_speculation(EngineOptions(device="cuda:1")) == "adaptive"
    assert default_speculation(EngineOptions(device="cpu")) == "adaptive"
    assert default_speculation(EngineOptions(device="cuda", tensor_parallel_size=2)) == "fixed"
    assert default_speculation(EngineOptions(speculation="off", tensor_parallel_size=2)) == "off"


def test_health_shape_and_startup_answers(dflash, plain, qwen3_draft_dir):
    for server in (dflash, plain):
        for status, body in server.startup_answers:  # before ready: only "loading"
            assert (status, body) == (503, {"status": "loading"})
    health = httpx.get(dflash.url + "/health").json()
    assert health["status"] == "ok"
    assert health["model"] == DFLASH_NAME and health["draft"] == str(qwen3_draft_dir)
    assert health["block_size"] == 16
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["uptime_s"] > 0 and health["memory"]["rss_bytes"] > 0
    assert httpx.get(plain.url + "/health").json()["draft"] is None


def test_models_and_metric_names(dflash):
    models = client_for(dflash).models.list()
    assert [m.id for m in models.data] == [DFLASH_NAME]
    generated, verified = (metric(dflash, name) for name in ("blockspec_generation_tokens_total",
                                                             "blockspec_spec_verify_total"))
    chat(dflash, max_tokens=2)
    text = httpx.get(dflash.url + "/metrics").text
    for name in ("blockspec_requests_running", "blockspec_requests_waiting", "blockspec_prompt_tokens_total",
                 "blockspec_generation_tokens_total", 'blockspec_requests_total{finish_reason="length"}',
                 "blockspec_spec_verify_total", "blockspec_spec_draft_tokens_total",
                 "blockspec_spec_accepted_tokens_total", "blockspec_time_to_first_token_seconds_count",
                 "blockspec_e2e_request_latency_seconds_count"):
        assert name in text, name
    # this request's own counts: 2 tokens, the first from prefill, the second from one verify
    assert metric(dflash, "blockspec_generation_tokens_total") - generated == 2
    assert metric(dflash, "blockspec_spec_verify_total") - verified == 1


def test_spec_accepted_tokens_counts_accepted_drafts_only(dflash):
    """blockspec_spec_accepted_tokens: drafts the target accepted, not drafts proposed. Each verify
    commits its accepted drafts plus one token, and the prefill one more, so the counters must
    satisfy generated = 1 + verify + accepted, and agree with the response's meta_info."""
    names = ("blockspec_generation_tokens_total", "blockspec_spec_verify_total",
             "blockspec_spec_draft_tokens_total", "blockspec_spec_accepted_tokens_total")
    before = [metric(dflash, name) for name in names]
    meta = chat(dflash, max_tokens=12, return_meta_info=True)["meta_info"]
    generated, verify, drafted, accepted = (metric(dflash, name) - b for name, b in zip(names, before))
    assert generated == 12 and verify == meta["spec_verify_ct"] > 0
    assert accepted == generated - 1 - verify == meta["spec_accept_token_num"]
    assert drafted == meta["spec_draft_token_num"] > accepted


# ---------------------------------------------------------------------------------------------
# Chat and completions
# ---------------------------------------------------------------------------------------------


def test_streaming_format_usage_and_meta_info(dflash):
    body = {"model": DFLASH_NAME, "messages": HELLO, "temperature": 0, "max_tokens": 12,
            "stream_options": {"include_usage": True}, "return_meta_info": True}
    events = stream_events(dflash, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    meta = next(c["meta_info"] for c in chunks if "meta_info" in c)
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"] > 0
    # every token after the prefill's first one was committed by a verify pass (index i: i drafts accepted)
    assert sum((i + 1) * n for i, n in enumerate(meta["spec_accept_histogram"])) == 12 - 1
    whole = chat(dflash, max_tokens=12, return_meta_info=True)
    assert streamed_chat_text(events) == whole["choices"][0]["message"]["content"]
    assert whole["usage"] == usage_chunk["usage"]
    assert whole["meta_info"]["spec_accept_histogram"] == meta["spec_accept_histogram"]


@pytest.mark.parametrize("messages", [HELLO, [{"role": "user", "content": "Write a poem about the sea."}]])
def test_stream_equals_nonstream_and_dflash_equals_plain(dflash, plain, messages):
    texts = {}
    for name, server in (("dflash", dflash), ("plain", plain)):
        client = client_for(server)
        stream = client.chat.completions.create(model=model_of(server), messages=messages, temperature=0,
                                                max_tokens=24, stream=True)
        texts[name + "-stream"] = "".join(chunk.choices[0].delta.content or ""
                                          for chunk in stream if chunk.choices)
        texts[name] = client.chat.completions.create(model=model_of(server), messages=messages, temperature=0,
                                                     max_tokens=24).choices[0].message.content
    assert texts["dflash"], texts
    assert len(set(texts.values())) == 1, texts


def test_early_stop_string_then_next_request(dflash):
    """Seeds #224: a stream ended early by a stop string must not leave work behind that
    the next request runs into; the next answer is exactly its own reference."""
    other = [{"role": "user", "content": "Name three colours."}]
    reference = chat_text(dflash, max_tokens=32)
    other_reference = chat_text(dflash, other, max_tokens=16)
    assert len(reference) >= 10, reference
    stop = reference[len(reference) // 2: len(reference) // 2 + 3]
    expected = reference[: reference.index(stop)]
    body = {"model": DFLASH_NAME, "messages": HELLO, "temperature": 0, "max_tokens": 32, "stop": [stop],
            "stream_options": {"include_usage": True}}
    generated_before = metric(dflash, "blockspec_generation_tokens_total")
    events = stream_events(dflash, "/v1/chat/completions", body)
    assert streamed_chat_text(events) == expected
    assert wait_until(lambda: metric(dflash, "blockspec_requests_running") == 0)
    # the stop string aborted the engine request: it did not run on to max_tokens
    assert metric(dflash, "blockspec_generation_tokens_total") - generated_before < 32
    assert [c["choices"][0]["finish_reason"] for c in events[:-1]
            if c["choices"] and c["choices"][0]["finish_reason"]] == ["stop"]
    assert 0 < events[-2]["usage"]["completion_tokens"] < 32
    assert chat_text(dflash, other, max_tokens=16) == other_reference  # at once, no overlap
    stopped = chat(dflash, max_tokens=32, stop=stop)
    assert stopped["choices"][0]["message"]["content"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == events[-2]["usage"]["completion_tokens"]
    assert httpx.get(dflash.url + "/health").json()["status"] == "ok"


def test_three_sequential_requests_and_system_message(dflash):
    prompts = ["What is 2 + 2?", "Tell me a joke.", "Translate 'cat' to French."]
    answers = [chat(dflash, [{"role": "user", "content": p}], max_tokens=8) for p in prompts]
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    assert len({a["id"] for a in answers}) == 3
    with_system = chat(dflash, [{"role": "system", "content": "You are terse."}, *HELLO], max_tokens=8)
    assert with_system["usage"]["prompt_tokens"] > chat(dflash, max_tokens=1)["usage"]["prompt_tokens"]
    assert with_system["choices"][0]["message"]["content"]


def test_usage_is_exact(dflash, tokenizer):
    answer = chat(dflash, max_tokens=5)
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] == len(tokenizer.encode_chat(HELLO))
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completions_endpoint(dflash, tokenizer):
    client = client_for(dflash)
    result = client.completions.create(model=DFLASH_NAME, prompt="The capital of France is", max_tokens=8,
                                       temperature=0)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    stream = client.completions.create(model=DFLASH_NAME, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert all(chunk.id.startswith("cmpl-") and chunk.object == "text_completion" for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text
    by_ids = client.completions.create(model=DFLASH_NAME, prompt=tokenizer.encode("The capital of France is"),
                                       max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == result.choices[0].text


def test_seed_reproducibility(dflash):
    def sample(seed: int) -> str:
        return chat_text(dflash, temperature=0.8, seed=seed, max_tokens=12)
    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_multipart_content_equals_string(dflash):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "who?"}]}]
    joined = [{"role": "user", "content": "Hello,\nwho?"}]
    a, b = chat(dflash, parts, max_tokens=8), chat(dflash, joined, max_tokens=8)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


def test_tools_and_template_kwargs_are_rendered(dflash):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    plain_tokens = chat(dflash, max_tokens=1)["usage"]["prompt_tokens"]
    with_tools = chat(dflash, max_tokens=4, tools=tools)
    assert with_tools["usage"]["prompt_tokens"] > plain_tokens + 20
    choice = with_tools["choices"][0]
    # the finish reason follows from the output: 4 tokens is length; fewer, a stop (or a tool call)
    if with_tools["usage"]["completion_tokens"] == 4:
        assert choice["finish_reason"] == "length"
    else:
        assert choice["finish_reason"] == ("tool_calls" if choice["message"].get("tool_calls") else "stop")
    assert chat(dflash, max_tokens=1, tools=tools, tool_choice="none")["usage"]["prompt_tokens"] == plain_tokens
    no_thinking = chat(dflash, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert no_thinking["usage"]["prompt_tokens"] > plain_tokens  # the template's empty <think></think>


def test_concurrent_requests_equal_sequential_references(dflash):
    prompts = [[{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}] for i in range(5)]
    references = [chat_text(dflash, p, max_tokens=10) for p in prompts]
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda p: chat_text(dflash, p, max_tokens=10), prompts))
    assert answers == references


# ---------------------------------------------------------------------------------------------
# Security: auth, CORS
# ---------------------------------------------------------------------------------------------


def test_api_key(plain):
    models = plain.url + "/v1/models"
    assert_error(httpx.get(models), 401)
    assert_error(httpx.get(models, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(plain.url + "/v1/chat/completions", json={"messages": HELLO}), 401)
    assert httpx.get(models, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(models, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(plain.url + "/health").status_code == 200
    assert httpx.get(plain.url + "/metrics").status_code == 200
    bad_client = openai.OpenAI(base_url=plain.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.chat.completions.create(model="qwen3", messages=HELLO, max_tokens=1)


def test_cors_on_and_off(dflash, plain):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(plain.url + "/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    simple = httpx.get(plain.url + "/health", headers={"Origin": ALLOWED_ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = httpx.get(plain.url + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    off = httpx.options(dflash.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    assert "access-control-allow-origin" not in httpx.get(dflash.url + "/health",
                                                          headers={"Origin": ALLOWED_ORIGIN}).headers


# ---------------------------------------------------------------------------------------------
# Bad input: the right status and the error object, never 422 or 500
# ---------------------------------------------------------------------------------------------

BAD_CHAT_BODIES = {
    "malformed json": (b'{"messages": [', 400),
    "not an object": ([1, 2], 400),
    "nan": (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    "no messages": ({"max_tokens": 4}, 400),
    "empty messages": ({"messages": []}, 400),
    "messages wrong type": ({"messages": "hello"}, 400),
    "bad role": ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
    "content wrong type": ({"messages": [{"role": "user", "content": 5}]}, 400),
    "max_tokens 0": ({"messages": HELLO, "max_tokens": 0}, 400),
    "max_tokens text": ({"messages": HELLO, "max_tokens": "many"}, 400),
    "temperature 3": ({"messages": HELLO, "temperature": 3}, 400),
    "top_p 0": ({"messages": HELLO, "top_p": 0}, 400),
    "stop int": ({"messages": HELLO, "stop": 5}, 400),
    "n 0": ({"messages": HELLO, "n": 0}, 400),
    "seed too big": ({"messages": HELLO, "seed": 2**70}, 400),
    "tool_choice odd shape": ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
                               "tool_choice": {"type": "function", "function": "f"}}, 400),
    "bad tool arguments": ({"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400),
    "template kwargs not a dict": ({"messages": HELLO, "chat_template_kwargs": [1]}, 400),
    "prompt too long": ({"messages": [{"role": "user", "content": "hello " * 5000}]}, 400),
    "max_tokens 10**9": ({"messages": HELLO, "max_tokens": 10**9}, 400),
    "max_tokens 2**40": ({"messages": HELLO, "max_tokens": 2**40}, 400),
    "max_tokens 10**21": ({"messages": HELLO, "max_tokens": 10**21}, 400),
    "max_completion_tokens beyond the context": ({"messages": HELLO, "max_completion_tokens": 4096}, 400),
    "stop_token_ids 10**23": ({"messages": HELLO, "stop_token_ids": [10**23]}, 400),
    "stop_token_ids outside vocabulary": ({"messages": HELLO, "stop_token_ids": [2, 10**9]}, 400),
    "top_k 10**23": ({"messages": HELLO, "top_k": 10**23}, 400),
    "unknown model": ({"model": "gpt-17", "messages": HELLO}, 404),
    "body too large": ({"messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}, 413),
}

BAD_COMPLETION_BODIES = {
    "no prompt": ({"max_tokens": 2}, 400),
    "empty prompt": ({"prompt": ""}, 400),
    "token id outside vocabulary": ({"prompt": [1, 10**9]}, 400),
    "strings and token ids mixed": ({"prompt": ["a", [1, 2]]}, 400),
    "echo with logprobs": ({"prompt": "a", "echo": True, "logprobs": 1}, 400),
    "max_tokens beyond the context": ({"prompt": "a", "max_tokens": 10**9}, 400),
    "stop_token_ids outside vocabulary": ({"prompt": "a", "stop_token_ids": [10**9]}, 400),
    "top_k 2**31": ({"prompt": "a", "top_k": 2**31}, 400),
}


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_input(dflash, case):
    body, status = BAD_CHAT_BODIES[case]
    assert_error(post(dflash, "/v1/chat/completions", body), status)


@pytest.mark.parametrize("case", list(BAD_COMPLETION_BODIES))
def test_bad_completion_input(dflash, case):
    body, status = BAD_COMPLETION_BODIES[case]
    assert_error(post(dflash, "/v1/completions", body), status)


def test_bad_input_rejected_before_the_stream_starts(dflash):
    response = post(dflash, "/v1/chat/completions", {"messages": [], "stream": True})
    assert not response.headers["content-type"].startswith("text/event-stream")
    assert_error(response, 400)



def test_max_tokens_beyond_the_context_says_how_many_fit(dflash):
    """OpenAI and vLLM refuse prompt + max_tokens beyond the context; capping it silently let one
    request decode for minutes."""
    error = assert_error(post(dflash, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 10**9}), 400)
    assert error["param"] == "max_tokens" and "ask for at most" in error["message"]


def test_declared_content_length_over_the_limit_is_413_unread(dflash):
    """The declared length alone decides: the server answers before reading a byte of the body."""
    with socket.create_connection(("127.0.0.1", dflash.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n{")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply
    assert json.loads(payload)["error"]["message"]


_leaf = st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=12)
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3), max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bard"]) | _json,
                                  "content": st.text(max_size=16) | _json})
# max_tokens is always small or invalid: a valid fuzzed request must stay cheap.
_max_tokens = st.integers(-2, 3) | st.text(max_size=3) | st.lists(st.integers(), max_size=2)
_chat_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _json, "max_tokens": _max_tokens},
    optional={"temperature": _json | st.floats(0, 2), "top_p": _json, "top_k": _json, "stop": _json,
              "stream": st.booleans(), "n": _json, "seed": _json, "tools": _json, "tool_choice": _json,
              "chat_template_kwargs": _json, "stop_token_ids": _json, "model": st.text(max_size=10),
              "stream_options": _json, "response_format": _json, "logit_bias": _json})
_fuzz_body = _chat_body.map(json.dumps) | _json.map(json.dumps) | st.binary(max_size=48)


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=_fuzz_body)
def test_fuzzed_bodies_never_5xx(dflash, body):
    with httpx.Client(timeout=60) as client:
        response = client.post(dflash.url + "/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
        response.read()
    assert response.status_code < 500 and response.status_code != 422, (body, response.text)
    if response.status_code >= 400:
        assert_error(response, response.status_code)


def test_normal_request_after_fuzzing(dflash):
    assert chat(dflash, max_tokens=2)["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------
# Client disconnect stops the work (seeds #224)
# ---------------------------------------------------------------------------------------------


def assert_generation_stops(server: ServerProcess) -> None:
    assert wait_until(lambda: metric(server, "blockspec_requests_running") == 0), "the engine kept running"
    before = metric(server, "blockspec_generation_tokens_total")
    time.sleep(0.5)
    assert metric(server, "blockspec_generation_tokens_total") == before


# A request abandoned after a couple of tokens may run on for the cycles until the disconnect is
# seen, never toward its 3000: this bound on its own generated tokens (not a timeout) tells.
ABANDONED_TOKEN_BOUND = 300


def test_disconnect_mid_stream_aborts(dflash):
    reference = chat_text(dflash, max_tokens=8)
    aborted_before = metric(dflash, 'blockspec_requests_total{finish_reason="abort"}')
    generated_before = metric(dflash, "blockspec_generation_tokens_total")
    body = {"model": DFLASH_NAME, "messages": [{"role": "user", "content": "Go on forever."}],
            "temperature": 0, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", dflash.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        content_chunks = 0
        while content_chunks < 2:
            line = next(lines)
            content_chunks += line.startswith("data: ") and '"content":"' in line and '"role"' not in line
    assert_generation_stops(dflash)
    assert metric(dflash, "blockspec_generation_tokens_total") - generated_before < ABANDONED_TOKEN_BOUND
    assert metric(dflash, 'blockspec_requests_total{finish_reason="abort"}') == aborted_before + 1
    assert chat_text(dflash, max_tokens=8) == reference


def test_disconnect_while_waiting_non_streaming_aborts(dflash):
    body = {"model": DFLASH_NAME, "messages": [{"role": "user", "content": "Go on forever."}],
            "temperature": 0, "max_tokens": 3000}
    aborted_before = metric(dflash, 'blockspec_requests_total{finish_reason="abort"}')
    generated_before = metric(dflash, "blockspec_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(dflash.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_generation_stops(dflash)
    assert httpx.get(dflash.url + "/health").json()["running"] == 0
    # stopped by the abort, not by running to its end: a bound on its tokens, the abort counted
    assert metric(dflash, "blockspec_generation_tokens_total") - generated_before < ABANDONED_TOKEN_BOUND
    assert metric(dflash, 'blockspec_requests_total{finish_reason="abort"}') == aborted_before + 1


# ---------------------------------------------------------------------------------------------
# In-process server over a scripted model: loading, a full queue, engine errors
# ---------------------------------------------------------------------------------------------


class ScriptedEngine:
    """Stands in for the engine: one request at a time on its own thread, decoding scripted.
    Each request emits the ids of " ok" up to max_tokens once `release` is set; a prompt
    containing FAIL fails mid-decode (an error event, as the engine sends)."""

    def __init__(self, llm: "ScriptedLLM", max_queue: int) -> None:
        import queue
        from blockspec.engine.engine import EngineCounters
        self.llm, self.max_queue, self.counters = llm, max_queue, EngineCounters()
        self.kv_cache_usage = 0.0
        self.prefix_cache_counts = (0, 0)              # (prompt tokens looked up, served from cache)
        self.num_running = 0
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def num_waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, request: Request, on_event) -> None:
        from blockspec.engine.engine import QueueFullError
        if self.num_waiting >= self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (limit {self.max_queue})")
        self._queue.put((request, on_event))

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            request, on_event = item
            self.num_running = 1
            try:
                for event in self._decode(request):
                    on_event(event)
            finally:
                self.num_running = 0

    def _decode(self, request: Request):
        while not self.llm.release.wait(0.01):
            if request.is_aborted:
                request.finish_reason = "abort"
                yield TokenEvent(request.request_id, [], "abort", request.stats)
                return
        if "FAIL" in self.llm.tokenizer.decode(request.prompt_ids):
            yield TokenEvent(request.request_id, request.commit(self.llm.word))
            request.finish_reason = "error"
            yield TokenEvent(request.request_id, [], "error", request.stats, error="scripted failure")
            return
        while not request.is_finished:
            emitted = request.commit(self.llm.word)
            yield TokenEvent(request.request_id, emitted, request.finish_reason,
                             request.stats if request.is_finished else None)


class ScriptedLLM:
    """Stands in for LLM: the real tokenizer and a scripted engine."""

    speculative = False
    block_size = 1
    max_model_len = 512

    def __init__(self, tokenizer: Tokenizer, max_queue: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.stop_ids = tokenizer.stop_token_ids
        self.release = threading.Event()
        self.word = tokenizer.encode(" ok")
        self.engine = ScriptedEngine(self, max_queue)

    def make_request(self, request_id, prompt_ids, params) -> Request:
        return Request(request_id, prompt_ids, params, self.stop_ids, self.max_model_len)


def scripted_chat(url: str, content: str = "hi", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_health_is_loading_until_the_model_is_ready(tokenizer):
    loaded = threading.Event()
    llm = ScriptedLLM(tokenizer)
    llm.release.set()

    def factory():
        loaded.wait(30)
        return llm

    with InProcessServer(factory, ServerSettings(model="/models/scripted")) as server:
        health = httpx.get(server.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        waiting = scripted_chat(server.url)
        assert_error(waiting, 503)
        assert waiting.headers["Retry-After"]
        loaded.set()
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        assert httpx.get(server.url + "/health").json()["model"] == "scripted"
        answer = scripted_chat(server.url).json()
        assert answer["choices"][0]["message"]["content"] == " ok ok ok"


def test_queue_full_is_503_with_retry_after(tokenizer):
    llm = ScriptedLLM(tokenizer, max_queue=1)
    with InProcessServer(lambda: llm, ServerSettings(model="scripted", max_queue=1)) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(scripted_chat, server.url, "first")
            assert wait_until(lambda: httpx.get(server.url + "/health").json()["running"] == 1)
            waiting = pool.submit(scripted_chat, server.url, "second")
            assert wait_until(lambda: httpx.get(server.url + "/health").json()["waiting"] == 1)
            rejected = scripted_chat(server.url, "third")
            assert_error(rejected, 503)
            assert rejected.headers["Retry-After"] == "1"
            streamed = scripted_chat(server.url, "fourth", stream=True)  # rejected before any byte
            assert_error(streamed, 503)
            llm.release.set()
            assert running.result().status_code == waiting.result().status_code == 200
        assert scripted_chat(server.url).status_code == 200


def test_engine_error_is_500_and_the_server_keeps_serving(tokenizer):
    llm = ScriptedLLM(tokenizer)
    llm.release.set()
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        failed = scripted_chat(server.url, "please FAIL")
        assert "scripted failure" in assert_error(failed, 500)["message"]
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "FAIL again"}], "max_tokens": 3, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "scripted failure" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        assert scripted_chat(server.url).json()["choices"][0]["message"]["content"] == " ok ok ok"
        metrics = httpx.get(server.url + "/metrics").text
        assert 'blockspec_requests_total{finish_reason="error"} 2.0' in metrics


def sse_payloads(raw: bytes) -> list:
    """A stream's raw bytes as its events: each must be one `data:` line ended by a blank line."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw
    return [e[6:].decode() if e == b"data: [DONE]" else json.loads(e[6:]) for e in events]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_failed_stream_ends_with_its_error_object_then_a_terminated_done(tokenizer, path):
    """Chat and completions alike: the error object (no finish reason before it: an error has
    none), then [DONE] as a whole SSE event (its blank line: clients dispatch on it)."""
    llm = ScriptedLLM(tokenizer)
    llm.release.set()
    body = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "FAIL"}]} if "chat" in path else {"prompt": "FAIL"})}
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 200
        events = sse_payloads(response.content)
        ok = httpx.post(server.url + path, json={**body, "stream": True,
                                                 **({"messages": HELLO} if "chat" in path else {"prompt": "hi"})},
                        timeout=30)
        ok_events = sse_payloads(ok.content)
    assert events[-2:] == [{"error": {"message": "generation failed: scripted failure", "type": "server_error",
                                      "param": None, "code": 500}}, "[DONE]"]
    assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
    assert ok_events[-1] == "[DONE]" and ok_events[-2]["choices"] == []
    assert ok_events[-2]["usage"]["completion_tokens"] == 3


class MergedFailureEngine(ScriptedEngine):
    """The scripted failure as a reader that fell behind sees it: the tokens committed before
    the error merged into the error's event (Generation's one pending slot)."""

    def _decode(self, request: Request):
        from blockspec.server.generation import merge_events
        events = list(super()._decode(request))
        while len(events) > 1:
            events[:2] = [merge_events(events[0], events[1])]
        yield from events


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_merged_into_a_failure_reach_the_stream_before_its_error(tokenizer, stream):
    """Work is never lost to a failure's timing: the tokens committed before an engine error
    are streamed first, then the error object and [DONE], whether or not the reader kept up;
    a whole (non-streamed) response fails with the 500 error object alone."""
    llm = ScriptedLLM(tokenizer)
    llm.engine = MergedFailureEngine(llm, 64)
    llm.release.set()
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        response = scripted_chat(server.url, "FAIL", stream=stream)
    error = {"error": {"message": "generation failed: scripted failure", "type": "server_error", "param": None,
                       "code": 500}}
    if not stream:
        assert response.status_code == 500 and response.json() == error
        return
    events = sse_payloads(response.content)
    assert events[-2:] == [error, "[DONE]"]
    text = "".join(c["delta"].get("content") or "" for e in events[:-2] for c in e["choices"])
    assert text == tokenizer.decode(llm.word)


def test_a_stop_string_in_tokens_merged_into_a_failure_finishes_the_request(tokenizer):
    """Carried tokens that complete a stop string end the output there: the request finished
    before its failure, so the stream ends with finish_reason stop and no error object."""
    llm = ScriptedLLM(tokenizer)
    llm.engine = MergedFailureEngine(llm, 64)
    llm.release.set()
    text = tokenizer.decode(llm.word)
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        response = scripted_chat(server.url, "FAIL", stream=True, stop=[text[-1]])
    events = sse_payloads(response.content)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == text[:-1]
    assert choices[-1]["finish_reason"] == "stop"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def scripted_tool_calls(tokenizer) -> ScriptedLLM:
    """A scripted model that answers two hermes tool calls, then <|im_end|>."""
    llm = ScriptedLLM(tokenizer)
    text = "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>\n'
                   for city in ("Rome", "Oslo"))
    llm.word = tokenizer.encode(text) + [tokenizer.encode("<|im_end|>")[0]]
    assert llm.word[-1] in tokenizer.stop_token_ids
    llm.release.set()
    return llm


def test_tool_calls_have_openais_shape_whole_and_streamed(tokenizer):
    """Parsed calls are message.tool_calls (content null), each arguments a JSON string, finish
    reason tool_calls; streamed as deltas of index, id, type, name and arguments; both calls
    unless parallel_tool_calls is false (then the first alone)."""
    llm = scripted_tool_calls(tokenizer)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 200}
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
        single = httpx.post(server.url + "/v1/chat/completions", json={**body, "parallel_tool_calls": False},
                            timeout=30).json()
        streamed = sse_payloads(httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                                           timeout=30).content)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"].pop("tool_calls")
    assert choice["message"] == {"role": "assistant", "content": None}
    assert [call["id"].startswith("call_") for call in calls] == [True, True]
    assert [{**call, "id": None} for call in calls] == [
        {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for city in ("Rome", "Oslo")]
    assert whole["usage"]["completion_tokens"] == len(llm.word)
    only = single["choices"][0]
    assert [c["function"]["arguments"] for c in only["message"]["tool_calls"]] == ['{"city": "Rome"}']
    assert only["finish_reason"] == "tool_calls" and only["message"]["content"] is None
    deltas = [c["delta"] for e in streamed[:-1] for c in e["choices"]]
    pieces = [piece for d in deltas for piece in d.get("tool_calls") or []]
    assert [{**p, "id": None} for p in pieces] == [
        {"index": i, "id": None, "type": "function",
         "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for i, city in enumerate(("Rome", "Oslo"))]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert [c["finish_reason"] for e in streamed[:-1] for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]
    assert streamed[-1] == "[DONE]"


def test_eight_concurrent_clients_get_their_answers_alone(dflash):
    """Greedy answers of 8 clients decoded together (one batch, mixed lengths, streamed and not)
    equal the answers each gets alone; the engine really ran them as a batch."""
    bodies = [{"messages": [{"role": "user", "content": f"Question {i}: " + "why? " * i}],
               "max_tokens": 6 + 3 * i, "stream": i % 2 == 1} for i in range(8)]

    def answer(body: dict) -> str:
        if body["stream"]:
            events = stream_events(dflash, "/v1/chat/completions",
                                   {"model": DFLASH_NAME, "temperature": 0, **body})
            return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        return chat_text(dflash, body["messages"], max_tokens=body["max_tokens"])
    alone = [answer(body) for body in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(answer, bodies))
    assert together == alone
    metrics = httpx.get(dflash.url + "/metrics").text
    batched = [line for line in metrics.splitlines() if line.startswith("blockspec_batch_size_bucket")]
    one = next(float(line.split()[-1]) for line in batched if 'le="1"' in line)
    total = next(float(line.split()[-1]) for line in batched if 'le="+Inf"' in line)
    assert total > one, "no decode cycle ran more than one sequence"
    assert "blockspec_kv_cache_usage_perc" in metrics


def test_server_logs_show_no_tracebacks(dflash, plain):
    for server in (dflash, plain):
        log = server.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]


# ---------------------------------------------------------------------------------------------
# SIGTERM drains (last: it stops the plain server)
# ---------------------------------------------------------------------------------------------


def test_sigterm_drains_open_streams_then_exits(plain):
    body = {"model": "qwen3", "messages": HELLO, "temperature": 0, "max_tokens": 200}
    first_chunk = threading.Event()
    events: list[str] = []

    def read_stream() -> None:
        with httpx.stream("POST", plain.url + "/v1/chat/completions", json={**body, "stream": True},
                          headers=headers_for(plain), timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_chunk.wait(30)
    plain.process.send_signal(signal.SIGTERM)
    reader.join(60)
    assert events[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in events)
    assert plain.process.wait(30) == 0


@pytest.mark.parametrize("value, expected", [(None, 0.0005), ("0.005", 0.005), ("fast", 0.0005), ("-1", 0.0005),
                                             ("nan", 0.0005)])
def test_the_switch_interval_setting_never_stops_the_server(value, expected, caplog):
    """BLOCKSPEC_SWITCH_INTERVAL: seconds for sys.setswitchinterval; anything but a positive number is
    named in one warning and the default kept."""
    import sys
    from blockspec.server.app import use_switch_interval
    before = sys.getswitchinterval()
    try:
        with caplog.at_level("WARNING", logger="blockspec.server"):
            use_switch_interval(value)
        assert sys.getswitchinterval() == pytest.approx(expected)
        warned = [r for r in caplog.records if "BLOCKSPEC_SWITCH_INTERVAL" in r.getMessage()]
        assert len(warned) == (1 if value not in (None, "0.005") else 0)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("value, loop_module, protocol", [(None, "uvloop", "HttpToolsProtocol"),
                                                          ("plain", "asyncio", "H11Protocol"),
                                                          ("fast", "uvloop", "HttpToolsProtocol"),
                                                          ("", "uvloop", "HttpToolsProtocol"),
                                                          ("auto", "uvloop", "HttpToolsProtocol")])
def test_serve_runs_on_uvloop_and_httptools(value, loop_module, protocol, caplog):
    """uvicorn's event loop and HTTP parser are the C ones (installed with blockspec, as vLLM's
    fastapi[standard] installs them); BLOCKSPEC_UVICORN=plain picks asyncio's and h11 for side-by-side
    runs; "auto" and an empty value (`BLOCKSPEC_UVICORN= blockspec serve`) are the default, unwarned;
    any other value is named in one warning and the C ones kept."""
    import uvicorn
    from blockspec.server.app import uvicorn_implementations
    with caplog.at_level("WARNING", logger="blockspec.server"):
        config = uvicorn.Config(object(), **uvicorn_implementations(value))
    config.load()
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.split(".")[0] == loop_module
    finally:
        loop.close()
    assert config.http_protocol_class.__name__ == protocol
    assert len([r for r in caplog.records if "BLOCKSPEC_UVICORN" in r.getMessage()]) == (value == "fast")



@pytest.mark.parametrize("value, loop, http", [(None, "auto", "auto"), ("plain", "asyncio", "h11")])
def test_serve_reads_blockspec_uvicorn_into_uvicorns_config(value, loop, http, monkeypatch):
    """`serve` hands uvicorn the loop and HTTP parser BLOCKSPEC_UVICORN names (read at serve time)."""
    from types import SimpleNamespace
    from blockspec.server import app as app_module
    monkeypatch.setattr(app_module, "configure_logging", lambda level: None)
    monkeypatch.setattr(app_module, "use_switch_interval", lambda value: None)
    monkeypatch.setattr(app_module, "load", lambda settings: SimpleNamespace(make_request=None))
    monkeypatch.setattr(app_module, "bind", lambda host, port: socket.create_server(("127.0.0.1", 0)))
    monkeypatch.setenv("BLOCKSPEC_GC_FREEZE", "0")
    if value is None:
        monkeypatch.delenv("BLOCKSPEC_UVICORN", raising=False)
    else:
        monkeypatch.setenv("BLOCKSPEC_UVICORN", value)
    seen: list[tuple[str, str]] = []

    class Server:
        should_exit = False

        def run(self, sockets) -> None:
            sockets[0].close()

    def draining(config, state):
        seen.append((config.loop, config.http))
        return Server()
    monkeypatch.setattr(app_module, "draining_server", draining)
    assert app_module.serve(ServerSettings(model="m")) == 0
    assert seen == [(loop, http)]

def test_serve_freezes_the_startup_heap_before_it_listens(monkeypatch):
    """What startup made lives as long as the server: `serve` moves it out of the garbage
    collector's reach (gc.freeze) before it listens, so an oldest-generation collection walks only
    what requests made (one over the demo pair's startup heap held the GIL for 60 ms)."""
    import gc
    import socket
    from types import SimpleNamespace
    from blockspec.server import app as app_module
    monkeypatch.setattr(app_module, "configure_logging", lambda level: None)
    monkeypatch.setattr(app_module, "use_switch_interval", lambda value: None)
    monkeypatch.setattr(app_module, "load", lambda settings: SimpleNamespace(make_request=None))
    monkeypatch.setattr(app_module, "bind", lambda host, port: socket.create_server(("127.0.0.1", 0)))
    seen: dict[str, int] = {}

    class Server:
        should_exit = False

        def run(self, sockets) -> None:
            seen["frozen"], seen["young"] = gc.get_freeze_count(), gc.get_count()[2]
            sockets[0].close()
    monkeypatch.setattr(app_module, "draining_server", lambda config, state: Server())
    gc.unfreeze()
    try:
        assert app_module.serve(ServerSettings(model="m")) == 0
    finally:
        gc.unfreeze()                     # the rest of the suite collects as before
    assert seen["frozen"] > 10_000 and seen["young"] == 0
