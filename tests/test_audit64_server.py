"""Audit 64a of the server's OpenAI surface: the contracts a mutation audit found no test holding
(logprobs at k = 0 and 1, seeds per choice, the output budget's two names and its default, the
vocabulary's bound on logit_bias, the queue's bound on n, the Responses API's seed and usage,
the usage chunk of a completions stream, ignore_eos against the request's own stop ids, merged
events' logprobs, a named tool_choice's schema). HTTP cases run against the in-process tiny
Qwen3 (conftest's `plain`); the rest call the product's functions directly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from api_server import LiveServer, assert_error

HELLO = [{"role": "user", "content": "Hello, who are you?"}]


def tokenizer_of(server: LiveServer):
    return server.app.state.server.llm.tokenizer


# ---------------------------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------------------------


def test_one_top_logprob_is_the_rows_best_token():
    """top_logprobs = 1 (chat) / logprobs = 1 (completions): each token gets exactly its row's
    best alternative, as torch's topk of the log-softmax gives it."""
    from blockspec.engine.logprobs import log_softmax_rows, token_logprobs
    rows = log_softmax_rows(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)))
    entries = token_logprobs(rows, [4, 0, 7], 1)
    best = rows.max(dim=-1)
    assert [e.token_id for e in entries] == [4, 0, 7]
    assert [e.logprob for e in entries] == pytest.approx([float(rows[0, 4]), float(rows[1, 0]), float(rows[2, 7])])
    assert [e.top for e in entries] == [((int(i), pytest.approx(float(v))),)
                                        for i, v in zip(best.indices, best.values)]


def test_completion_logprobs_zero_lists_each_chosen_token_alone(plain):
    """logprobs: 0 asks for the chosen tokens' logprobs and no alternatives: the legacy shape
    is there (not null), one entry per completion token, and each top_logprobs dict holds the
    chosen token only (OpenAI: up to k + 1 entries, the chosen one included)."""
    answer = plain.complete("The sea is", max_tokens=5, logprobs=0, ignore_eos=True)
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs is not None
    assert len(logprobs["tokens"]) == answer["usage"]["completion_tokens"] == 5
    assert logprobs["top_logprobs"] == [{token: value} for token, value
                                        in zip(logprobs["tokens"], logprobs["token_logprobs"])]
    assert "".join(logprobs["tokens"]) == answer["choices"][0]["text"]


def test_merged_events_keep_every_tokens_logprobs():
    """A reader behind the engine gets its events merged (generation.merge_events): the
    tokens and their logprobs of both, in order, one per token."""
    from blockspec.engine.logprobs import TokenLogprob
    from blockspec.engine.request import TokenEvent
    from blockspec.server.generation import merge_events
    first = TokenEvent("r", [1, 2], logprobs=[TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)])
    then = TokenEvent("r", [3], "length", logprobs=[TokenLogprob(3, -0.3)])
    merged = merge_events(first, then)
    assert merged.token_ids == [1, 2, 3] and merged.finish_reason == "length"
    assert [(e.token_id, e.logprob) for e in merged.logprobs] == [(1, -0.1), (2, -0.2), (3, -0.3)]


# ---------------------------------------------------------------------------------------------
# seeds, budgets and bounds
# ---------------------------------------------------------------------------------------------


def test_each_prompts_choices_use_seed_plus_their_index_among_n(plain):
    """Choice i of every prompt samples with seed + i (its index among n, not its index in the
    response): two equal prompts give equal choices at equal i."""
    body = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "ignore_eos": True}
    alone = [plain.complete("The sea is", **{**body, "seed": 5 + i})["choices"][0]["text"] for i in range(2)]
    together = plain.complete(["The sea is", "The sea is"], n=2, **body)
    assert [c["text"] for c in together["choices"]] == [alone[0], alone[1], alone[0], alone[1]]
    assert alone[0] != alone[1]


def test_max_completion_tokens_wins_over_max_tokens(plain):
    """Both sent: OpenAI's current name (max_completion_tokens) is the limit, either way round."""
    for small, large in (("max_completion_tokens", "max_tokens"), ("max_tokens", "max_completion_tokens")):
        answer = plain.chat(HELLO, ignore_eos=True, **{small: 3, large: 6})
        expected = 3 if small == "max_completion_tokens" else 6
        assert answer["usage"]["completion_tokens"] == expected
        assert answer["choices"][0]["finish_reason"] == "length"


def test_no_output_limit_fills_exactly_the_context_left(plain):
    """Without max_tokens a completion may use the whole context the prompt leaves (here 5 of
    the 512): exactly that many tokens, ending by length."""
    llm = plain.app.state.server.llm
    prompt = [100] * (llm.max_model_len - 5)
    answer = plain.post("/v1/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True}).json()
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(prompt), 5, llm.max_model_len)
    assert answer["choices"][0]["finish_reason"] == "length"


def test_logit_bias_on_the_last_logit_row_is_served_one_past_it_is_a_400(plain):
    vocab = plain.app.state.server.llm.vocab_size
    last = plain.chat(HELLO, max_tokens=2, logit_bias={str(vocab - 1): 100}, ignore_eos=True)
    assert last["usage"]["completion_tokens"] == 2
    error = assert_error(plain.post("/v1/chat/completions", {"messages": HELLO, "logit_bias": {str(vocab): 1}}),
                         400, str(vocab))
    assert (error["param"], error["type"]) == ("logit_bias", "invalid_request_error")


def test_a_request_of_exactly_the_queues_size_is_admitted():
    """check_queue_room: n × prompts up to max_queue is served (503 only while others wait);
    beyond it the request can never fit, a 400 naming n."""
    from blockspec.server.errors import ApiError
    from blockspec.server.request_building import check_queue_room
    check_queue_room(SimpleNamespace(max_queue=4, num_waiting=0), 4)
    with pytest.raises(ApiError) as never:
        check_queue_room(SimpleNamespace(max_queue=4, num_waiting=0), 5)
    assert (never.value.status, never.value.param) == (400, "n")
    check_queue_room(SimpleNamespace(max_queue=4, num_waiting=1), 3)
    with pytest.raises(ApiError) as busy:
        check_queue_room(SimpleNamespace(max_queue=4, num_waiting=1), 4)
    assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}


def test_token_id_zero_is_a_valid_prompt_token(plain):
    from blockspec.server.protocol import CompletionRequest
    assert CompletionRequest.model_validate({"prompt": [0, 5]}).prompts == [[0, 5]]
    answer = plain.complete([0, 5], max_tokens=1)
    assert answer["usage"]["prompt_tokens"] == 2


def test_ignore_eos_keeps_the_requests_own_stop_ids():
    """ignore_eos drops the model's end tokens only: a stop_token_ids id still ends the output,
    kept, with nothing after it."""
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(5,))
    request = Request("r", [1, 2], params, stop_ids=frozenset({9}), max_model_len=64)
    assert request.commit([3, 9, 5, 4]) == [3, 9, 5]
    assert request.finish_reason == "stop" and request.output_ids == [3, 9, 5]


# ---------------------------------------------------------------------------------------------
# /v1/responses and streamed usage
# ---------------------------------------------------------------------------------------------


def test_responses_honour_the_seed_and_count_usage_as_chat_does(plain):
    """A sampled Responses request with a seed is the chat request with that seed: the same
    text, the same token counts, and total_tokens = input + output."""
    chat = plain.chat(HELLO, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    response = plain.post("/v1/responses", {"input": HELLO[0]["content"], "temperature": 1.0, "seed": 7,
                                            "max_output_tokens": 6}).json()
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    assert text == chat["choices"][0]["message"]["content"]
    usage = response["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (chat["usage"]["prompt_tokens"],
                                                               chat["usage"]["completion_tokens"])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] == chat["usage"]["total_tokens"]


def test_completion_stream_ends_with_its_usage_chunk_then_done(plain):
    """stream_options.include_usage on /v1/completions: the last chunk before [DONE] has no
    choices and the usage of the whole (non-streamed) answer."""
    fields = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = plain.complete("The sea is", **fields)
    events = plain.stream("/v1/completions", {"prompt": "The sea is", **fields,
                                              "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    assert all(event.get("usage") is None for event in events[:-2])
    assert "".join(c["text"] for e in events[:-2] for c in e["choices"]) == whole["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------
# structured output
# ---------------------------------------------------------------------------------------------


def test_a_named_tool_choice_allows_only_that_function():
    """tool_choice {"function": {"name": ...}} among several tools: the call's schema is that
    function's alone (no anyOf that would let the model call another)."""
    from blockspec.structured import tool_call_schema
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    schema = tool_call_schema([weather, clock], "get_time")
    assert schema["properties"]["name"] == {"const": "get_time"} and "anyOf" not in schema
    either = tool_call_schema([weather, clock], None)
    assert [one["properties"]["name"]["const"] for one in either["anyOf"]] == ["get_weather", "get_time"]


def test_responses_report_the_prefix_caches_hits_as_chat_does(plain):
    """A repeated Responses request hits the prefix cache (on by default): its
    input_tokens_details.cached_tokens is the hit, the number chat reports for the same prompt
    (it was a constant 0), whole and in the streamed response.completed."""
    text = "Tell me a long story about the sea, the wind and the ships that sail between them. " * 3
    body = {"input": text, "max_output_tokens": 2, "temperature": 0}
    plain.post("/v1/responses", body)
    again = plain.post("/v1/responses", body).json()["usage"]
    chat = plain.chat([{"role": "user", "content": text}], max_tokens=2)["usage"]
    assert again["input_tokens"] == chat["prompt_tokens"]
    assert again["input_tokens_details"]["cached_tokens"] == chat["prompt_tokens_details"]["cached_tokens"] > 0
    events = plain.stream("/v1/responses", body)
    completed = [e["response"] for e in events if isinstance(e, dict) and e["type"] == "response.completed"]
    assert completed[0]["usage"]["input_tokens_details"] == again["input_tokens_details"]
