"""The OpenAI surface beyond the basics (issue 13): model lookup, request ids, prompt controls,
refused legacy parameters, SGLang's meta_info, logprobs, n > 1, prompt lists and echo; against
in-process servers over the tiny random Qwen3 (plain and DFlash)."""
from __future__ import annotations

import httpx
import openai
import pytest

from api_server import LiveServer, assert_error, load_llm

HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def dflash(qwen3_dir, qwen3_draft_dir):
    with LiveServer(load_llm(qwen3_dir, qwen3_draft_dir), "qwen3-dflash") as server:
        yield server


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------------------------------------
# Defects
# ---------------------------------------------------------------------------------------------


def test_models_retrieve_and_unknown_model_is_404(plain):
    model = client(plain).models.retrieve("qwen3")
    assert (model.id, model.object) == ("qwen3", "model")
    assert httpx.get(plain.url + "/v1/models/%2Fmodels%2Fqwen3").json()["id"] == "qwen3"  # the path works too
    error = assert_error(httpx.get(plain.url + "/v1/models/nope"), 404, "'nope'")
    assert error["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client(plain).models.retrieve("nope")


def test_x_request_id_on_every_response(plain):
    echoed = plain.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1},
                        headers={"x-request-id": "client-id-42"})
    assert echoed.headers["x-request-id"] == "client-id-42"
    fresh = [httpx.get(plain.url + "/health"), httpx.get(plain.url + "/v1/models"),
             httpx.get(plain.url + "/v1/models/nope"), plain.post("/v1/chat/completions", {"messages": []})]
    ids = [response.headers["x-request-id"] for response in fresh]
    assert all(len(i) == 32 for i in ids) and len(set(ids)) == 4
    with httpx.stream("POST", plain.url + "/v1/chat/completions", timeout=60,
                      json={"messages": HELLO, "max_tokens": 2, "stream": True},
                      headers={"x-request-id": "streamed-7"}) as response:
        assert response.headers["x-request-id"] == "streamed-7"
        assert response.read().endswith(b"data: [DONE]\n\n")


def test_a_request_draws_its_ids_without_a_system_call(plain, monkeypatch):
    """Response, tool-call and request ids come from Python's generator (server/ids.py), not uuid4:
    each uuid4 is a getrandom system call, at which the event loop gives up the GIL and waits to
    take it back behind the engine thread. The ids keep their forms and stay distinct."""
    import os
    import re
    from blockspec.server.ids import new_id
    drawn: list[int] = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: (drawn.append(n), real(n))[1])
    chat = plain.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    with httpx.stream("POST", plain.url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as response:
        streamed = response.read()
    response_id = plain.post("/v1/responses", {"input": "Hello", "max_output_tokens": 2}).json()["id"]
    assert drawn == []
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", chat.json()["id"]) and len(chat.headers["x-request-id"]) == 32
    assert re.search(rb'"id":"cmpl-[0-9a-f]{24}"', streamed) and re.fullmatch(r"resp_[0-9a-f]{24}", response_id)
    assert len({new_id("call_") for _ in range(10_000)}) == 10_000
    import random
    state = random.getstate()
    try:
        random.seed(0)                           # the global generator seeded: ids do not repeat
        first = new_id("cmpl-")
        random.seed(0)
        assert new_id("cmpl-") != first
    finally:
        random.setstate(state)


def test_continue_final_message_continues_the_prefill(plain, dflash):
    """vLLM's semantics: the final assistant message stays open (no <|im_end|>), and the output
    continues it; equal to a completion of the rendered, cut prompt."""
    llm = plain.app.state.server.llm
    prefill = "The answer is"
    messages = [*HELLO, {"role": "assistant", "content": prefill}]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    prompt = rendered[: rendered.rindex(prefill) + len(prefill)]
    assert rendered.endswith("<|im_end|>\n") and not prompt.endswith("<|im_end|>\n")
    expected = plain.complete(llm.tokenizer.encode(prompt), max_tokens=8)["choices"][0]["text"]
    for server in (plain, dflash):
        answer = server.chat(messages, continue_final_message=True, add_generation_prompt=False)
        assert answer["choices"][0]["message"]["content"] == expected
        assert answer["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(prompt))
    closed = plain.chat(messages, add_generation_prompt=False)   # closed turn, no generation prompt
    assert closed["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(rendered))
    both = plain.post("/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert_error(both, 400, "add_generation_prompt")["param"] == "continue_final_message"


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
])
def test_legacy_function_calling_is_refused_by_name(plain, field, value):
    error = assert_error(plain.post("/v1/chat/completions", {"messages": HELLO, field: value}), 400, field)
    assert error["param"] == field


def test_best_of_must_equal_n(plain):
    assert plain.complete("Hi", best_of=1, max_tokens=2)["choices"][0]["text"]
    error = assert_error(plain.post("/v1/completions", {"prompt": "Hi", "best_of": 3}), 400, "best_of")
    assert error["param"] == "best_of"


def test_meta_info_as_sglang_computes_it(dflash, plain):
    answer = dflash.chat(HELLO, max_tokens=12, return_meta_info=True)
    meta, tokens = answer["meta_info"], answer["usage"]["completion_tokens"]
    histogram = meta["spec_accept_histogram"]
    assert sum(histogram) == meta["spec_verify_ct"] > 0
    # index i counts verify passes that accepted i drafts; with the prefill's token they make all
    assert sum((i + 1) * n for i, n in enumerate(histogram)) == tokens - 1
    assert meta["spec_accept_length"] == pytest.approx(tokens / meta["spec_verify_ct"])
    assert meta["spec_accept_token_num"] == sum(i * n for i, n in enumerate(histogram))
    assert 0 <= meta["spec_accept_rate"] <= 1
    plain_meta = plain.chat(HELLO, max_tokens=4, return_meta_info=True)["meta_info"]
    assert (plain_meta["spec_verify_ct"], plain_meta["spec_accept_length"]) == (0, 0.0)


def test_max_tokens_limits(plain):
    """Beyond the context: 400 naming the parameter. The completions default (16) is capped by
    the context left, silently, as vLLM does (documented in ARCHITECTURE.md §7)."""
    llm = plain.app.state.server.llm
    error = assert_error(plain.post("/v1/completions", {"prompt": "Hi", "max_tokens": 10_000}), 400, "max_tokens")
    assert error["param"] == "max_tokens"
    long_prompt = [100] * (llm.max_model_len - 5)
    answer = plain.post("/v1/completions", {"prompt": long_prompt, "temperature": 0}).json()
    assert answer["usage"]["completion_tokens"] <= 5 and answer["choices"][0]["finish_reason"] in ("length", "stop")


# ---------------------------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------------------------

PROMPT_IDS = [785, 6722, 315, 9625, 374, 264, 3460, 3283, 11, 323]


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """transformers' greedy continuation of PROMPT_IDS and the fp32 log-softmax of every position
    that chose an output token."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    ids = list(PROMPT_IDS)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return ids[len(PROMPT_IDS):], logprobs[len(PROMPT_IDS) - 1: -1]


def test_completion_logprobs_equal_transformers_plain_and_dflash(plain, dflash, reference):
    output_ids, rows = reference
    llm = plain.app.state.server.llm
    answers = {s.name: s.complete(PROMPT_IDS, max_tokens=8, logprobs=5)["choices"][0] for s in (plain, dflash)}
    expected = [float(rows[i, t]) for i, t in enumerate(output_ids)]
    texts = [llm.tokenizer.decode([t]) for t in output_ids]
    for answer in answers.values():
        logprobs = answer["logprobs"]
        assert answer["text"] == llm.tokenizer.decode(output_ids)
        assert logprobs["tokens"] == texts
        assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
        assert logprobs["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(texts))]
        for i, top in enumerate(logprobs["top_logprobs"]):
            best = rows[i].topk(5)
            assert sorted(top.values(), reverse=True)[:5] == pytest.approx(best.values.tolist(), abs=1e-4)
            assert set(top) == {llm.tokenizer.decode([t]) for t in best.indices.tolist()} | {texts[i]}
    events = dflash.stream("/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 8, "logprobs": 5, "temperature": 0})
    pieces = [c["logprobs"] for e in events[:-1] for c in e["choices"] if c.get("logprobs")]
    streamed = {key: [v for piece in pieces for v in piece[key]] for key in ("tokens", "token_logprobs", "text_offset")}
    whole = answers["qwen3-dflash"]["logprobs"]
    assert streamed == {key: whole[key] for key in streamed}
    plain_lp = answers["qwen3"]["logprobs"]["token_logprobs"]
    dflash_lp = answers["qwen3-dflash"]["logprobs"]["token_logprobs"]
    # fp32 rounding of different forward shapes (1 vs 16 rows); measured ≤ 8e-6 over 32 tokens
    assert max(abs(a - b) for a, b in zip(plain_lp, dflash_lp)) < 5e-5


def test_chat_logprobs_streamed_equal_whole_and_dflash_equals_plain(plain, dflash):
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    results = {}
    for server in (plain, dflash):
        whole = server.chat(**body)["choices"][0]
        content = whole["logprobs"]["content"]
        assert len(content) == 10 and all(len(entry["top_logprobs"]) == 3 for entry in content)
        assert all(entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6 for entry in content)
        assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
        events = server.stream("/v1/chat/completions", body)
        streamed = [entry for event in events[:-1] for choice in event["choices"]
                    for entry in ((choice.get("logprobs") or {}).get("content") or [])]
        assert [e["token"] for e in streamed] == [e["token"] for e in content]
        assert [e["logprob"] for e in streamed] == [e["logprob"] for e in content]
        results[server.name] = content
    for a, b in zip(results["qwen3"], results["qwen3-dflash"]):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 5e-5
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
    without = plain.chat(HELLO, max_tokens=2)["choices"][0]
    assert without["logprobs"] is None
    only_chosen = plain.chat(HELLO, max_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [entry["top_logprobs"] for entry in only_chosen] == [[], []]


@pytest.mark.parametrize("fields,param", [
    ({"top_logprobs": 2}, "top_logprobs"),                       # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_logprobs_limits(plain, fields, param):
    error = assert_error(plain.post("/v1/chat/completions", {"messages": HELLO, **fields}), 400, param)
    assert error["param"] == param


def test_completion_logprobs_limits_and_echo(plain):
    assert_error(plain.post("/v1/completions", {"prompt": "Hi", "logprobs": 21}), 400, "logprobs")
    error = assert_error(plain.post("/v1/completions", {"prompt": "Hi", "logprobs": 1, "echo": True}), 400, "echo")
    assert error["param"] == "echo"


# ---------------------------------------------------------------------------------------------
# n > 1, prompt lists, echo
# ---------------------------------------------------------------------------------------------


def batch_cycles(server: LiveServer) -> tuple[float, float]:
    """(decode cycles so far, those that ran more than one sequence)."""
    lines = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
             if line.startswith("blockspec_batch_size_bucket")]
    one = next(float(line.split()[-1]) for line in lines if 'le="1.0"' in line or 'le="1"' in line)
    total = next(float(line.split()[-1]) for line in lines if 'le="+Inf"' in line)
    return total, total - one


@pytest.mark.parametrize("name,temperature", [("plain", 0.9), ("dflash", 0.0)])
def test_chat_n_choices_use_seed_plus_index_and_run_as_one_batch(request, name, temperature):
    server = request.getfixturevalue(name)
    sampling = {"temperature": temperature, "seed": 11, "max_tokens": 4}
    alone = [server.chat(HELLO, **{**sampling, "seed": 11 + i}) for i in range(3)]
    _, batched_before = batch_cycles(server)
    together = server.chat(HELLO, n=3, **sampling)
    _, batched_after = batch_cycles(server)
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["message"] for c in together["choices"]] == [a["choices"][0]["message"] for a in alone]
    if temperature > 0:
        assert len({c["message"]["content"] for c in together["choices"]}) > 1   # seeds 11, 12, 13 differ
    assert together["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]    # the prompt once
    assert together["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert batched_after > batched_before                      # the three decoded in shared cycles
    events = server.stream("/v1/chat/completions", {"messages": HELLO, "n": 3, **sampling})
    streamed = {i: "" for i in range(3)}
    finishes = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert [streamed[i] for i in range(3)] == [c["message"]["content"] for c in together["choices"]]
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_completion_prompt_lists_each_their_own_choices(plain, dflash):
    llm = plain.app.state.server.llm
    prompts = ["The sea is", "Once upon a time", "Numbers: 1, 2,"]
    alone = [plain.complete(p, max_tokens=6)["choices"][0]["text"] for p in prompts]   # greedy: plain == DFlash
    for server in (plain, dflash):
        together = server.complete(prompts, max_tokens=6, n=2)
        assert [c["index"] for c in together["choices"]] == list(range(6))
        assert [c["text"] for c in together["choices"]] == [text for text in alone for _ in range(2)]
        assert together["usage"]["prompt_tokens"] == sum(len(llm.tokenizer.encode(p)) for p in prompts)
    token_lists = plain.complete([llm.tokenizer.encode(p) for p in prompts[:2]], max_tokens=6)
    assert [c["text"] for c in token_lists["choices"]] == alone[:2]
    events = dflash.stream("/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    streamed = {i: "" for i in range(3)}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert [streamed[i] for i in range(3)] == alone


def test_echo_prepends_the_prompt(plain):
    llm = plain.app.state.server.llm
    plain_answer = plain.complete("The sea is", max_tokens=5)["choices"][0]["text"]
    echoed = plain.complete("The sea is", max_tokens=5, echo=True)
    assert echoed["choices"][0]["text"] == "The sea is" + plain_answer
    ids = llm.tokenizer.encode("Numbers: 1, 2,")
    by_ids = plain.complete(ids, max_tokens=5, echo=True)["choices"][0]["text"]
    assert by_ids.startswith(llm.tokenizer.decode(ids)) and len(by_ids) > len(llm.tokenizer.decode(ids))
    events = plain.stream("/v1/completions", {"prompt": "The sea is", "max_tokens": 5, "temperature": 0, "echo": True})
    assert events[0]["choices"][0]["text"] == "The sea is"
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == echoed["choices"][0]["text"]


@pytest.mark.parametrize("body,param", [
    ({"messages": HELLO, "n": 0}, "n"),
    ({"messages": HELLO, "n": 129}, "n"),
    ({"messages": HELLO, "n": 100}, "n"),            # more generations than the queue holds (64)
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
])
def test_choice_counts_and_prompt_lists_are_validated(plain, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = assert_error(plain.post(path, body), 400, param)
    assert error["param"] == param


# ---------------------------------------------------------------------------------------------
# /v1/responses
# ---------------------------------------------------------------------------------------------


def test_responses_text_equals_chat_and_streams(plain, dflash):
    """A Responses request is the chat request it means: instructions as the system message,
    max_output_tokens as max_tokens; streamed events build the same output."""
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    expected = plain.chat(messages, max_tokens=8)["choices"][0]["message"]["content"]
    for server in (plain, dflash):
        api = client(server)
        response = api.responses.create(model=server.name, instructions="Be brief.", input=HELLO[0]["content"],
                                        max_output_tokens=8, temperature=0)
        assert response.output_text == expected
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 8 and response.id.startswith("resp_")
        [message] = response.output
        assert message.type == "message" and message.content[0].type == "output_text"
        items = api.responses.create(model=server.name, instructions="Be brief.", max_output_tokens=8,
                                     temperature=0, input=[{"role": "user", "content": [
                                         {"type": "input_text", "text": HELLO[0]["content"]}]}])
        assert items.output_text == expected
        events = list(api.responses.create(model=server.name, instructions="Be brief.", input=HELLO[0]["content"],
                                           max_output_tokens=8, temperature=0, stream=True))
        kinds = [event.type for event in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]   # vLLM's: status says incomplete
        assert events[-1].response.status == "incomplete"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
        assert events[-1].response.output_text == expected
        with api.responses.stream(model=server.name, instructions="Be brief.", input=HELLO[0]["content"],
                                  max_output_tokens=8, temperature=0) as stream:
            assert stream.get_final_response().output_text == expected


def test_responses_multi_turn_items_render_as_chat(plain):
    """function_call and function_call_output items render as the assistant's tool call and
    the tool's answer: the prompt equals the chat request with those messages."""
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}]
    expected = plain.chat(messages, tools=chat_tools, max_tokens=4)
    response = plain.post("/v1/responses", {"input": items, "tools": [tool], "max_output_tokens": 4,
                                            "temperature": 0}).json()
    assert response["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    assert text == (expected["choices"][0]["message"]["content"] or "")


def test_reasoning_effort_switches_thinking_in_the_rendered_prompt(plain):
    """reasoning_effort (chat) and reasoning.effort (responses) on a Qwen3-style template:
    none / minimal render the template's thinking-off prompt (the empty <think></think>), low and
    above the thinking-on one; an explicit chat_template_kwargs enable_thinking wins."""
    from blockspec.server.protocol import ChatCompletionRequest
    from blockspec.server.request_building import render_chat
    tokenizer = plain.app.state.server.llm.tokenizer

    def rendered(**fields) -> str:
        body = ChatCompletionRequest.model_validate({"messages": HELLO, **fields})
        return tokenizer.decode(render_chat(tokenizer, body).token_ids, skip_special_tokens=False)

    thinking_off = rendered(chat_template_kwargs={"enable_thinking": False})
    thinking_on = rendered()
    assert thinking_off.endswith("<think>\n\n</think>\n\n") and thinking_on != thinking_off
    for effort in ("none", "minimal"):
        assert rendered(reasoning_effort=effort) == thinking_off
    for effort in ("low", "medium", "high"):
        assert rendered(reasoning_effort=effort) == thinking_on
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == thinking_on
    tokens = {effort: plain.chat(HELLO, max_tokens=1, reasoning_effort=effort)["usage"]["prompt_tokens"]
              for effort in ("none", "high")}
    assert tokens["none"] == len(tokenizer.encode(thinking_off, add_special_tokens=False)) > tokens["high"]
    for effort in ("none", "high"):
        response = plain.post("/v1/responses", {"input": HELLO[0]["content"], "max_output_tokens": 1,
                                                "reasoning": {"effort": effort}}).json()
        assert response["usage"]["input_tokens"] == tokens[effort]
        assert response["reasoning"]["effort"] == effort


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": ""}, "input"),
])
def test_responses_refusals_name_the_parameter(plain, fields, param):
    error = assert_error(plain.post("/v1/responses", {"input": "Hi", **fields}), 400, param)
    assert error["param"] == param
    assert_error(httpx.get(plain.url + "/v1/responses/resp_123"), 404, "resp_123")


# ---------------------------------------------------------------------------------------------
# The first token's way through the host (issue 30's HTTP item)
# ---------------------------------------------------------------------------------------------


def test_small_prompts_are_built_on_the_loop_and_large_ones_in_one_thread_call(plain, monkeypatch):
    """A hop to a worker thread waits for the GIL twice under load, so a short prompt is built on
    the event loop; above INLINE_PROMPT_CHARS one thread call builds it (chat: the template, the
    images and the grammar together). The output is the same either way."""
    import asyncio

    from blockspec.server import request_building
    hops = []
    to_thread = asyncio.to_thread

    async def counted(func, *args, **kwargs):
        hops.append(func)
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)

    def answers() -> tuple[str, str, str]:
        chat = plain.chat(HELLO, max_tokens=4)["choices"][0]["message"]["content"]
        text, ids = (plain.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
                     ["choices"][0]["text"] for prompt in ("Hello there", [9707, 1052, 525]))
        return chat, text, ids

    on_the_loop = answers()
    assert hops == []
    monkeypatch.setattr(request_building, "INLINE_PROMPT_CHARS", 4)
    assert answers() == on_the_loop
    assert len(hops) == 2        # the chat prompt, the text completion's (3 token ids stay on the loop)


def test_the_api_key_check_runs_on_the_loop():
    """FastAPI runs a plain-function dependency on anyio's worker threads: a hop per request."""
    import inspect

    from blockspec.server.routes import api_key_check
    from blockspec.server.settings import ServerSettings
    assert inspect.iscoroutinefunction(api_key_check(ServerSettings(model="m", api_key="k")))
    assert inspect.iscoroutinefunction(api_key_check(ServerSettings(model="m")))


def metric_sums(server: LiveServer) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("blockspec_first_token_", "blockspec_time_to_first_token_")) and \
                name.endswith(("_sum", "_count")):
            values[name] = float(value)
    return values


def test_first_token_stages_add_up_to_the_time_to_first_token(plain):
    """/metrics splits each request's time to first token into build, queue, prefill and delivery
    (scripts/bench_streams.py reports their means per burst): one observation each per request,
    their sums the TTFT's."""
    before = metric_sums(plain)
    with httpx.stream("POST", plain.url + "/v1/chat/completions", timeout=60,
                      json={"messages": HELLO, "max_tokens": 3, "stream": True}) as response:
        assert response.read().endswith(b"data: [DONE]\n\n")
    plain.chat(HELLO, max_tokens=2)
    after = metric_sums(plain)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    stages = ("build", "queue", "prefill", "delivery")
    assert all(grew[f"blockspec_first_token_{stage}_seconds_count"] == 2 for stage in stages)
    assert grew["blockspec_time_to_first_token_seconds_count"] == 2
    total = sum(grew[f"blockspec_first_token_{stage}_seconds_sum"] for stage in stages)
    assert total == pytest.approx(grew["blockspec_time_to_first_token_seconds_sum"], abs=1e-6)
    assert all(grew[f"blockspec_first_token_{stage}_seconds_sum"] >= 0 for stage in stages)


@pytest.fixture(scope="module")
def bench_streams():
    """scripts/bench_streams.py, imported as a module (its main is not run)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_streams", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "bench_streams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_streams_holds_the_clients_collector_off_for_a_burst_unless_asked(plain, bench_streams, monkeypatch):
    """--client-gc quiet (the default): the client's garbage collector is off while a burst's
    streams run (the thread client's and each client process's) and on again after it, also when
    a stream raised; --client-gc on leaves it on."""
    import gc
    assert gc.isenabled()
    with bench_streams.collector_quiet():
        assert not gc.isenabled()
    assert gc.isenabled()
    with bench_streams.collector_quiet(False):
        assert gc.isenabled()
    with pytest.raises(RuntimeError, match="a stream failed"):
        with bench_streams.collector_quiet():
            raise RuntimeError("a stream failed")
    assert gc.isenabled()
    during: list[bool] = []
    real = bench_streams.timed_stream

    def timed_stream(*args, **kwargs):
        during.append(gc.isenabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(bench_streams, "timed_stream", timed_stream)
    prompt = [9707, 11, 1879, 13]
    for quiet in (True, False):
        result = bench_streams.bursts(plain.url, [[prompt, prompt]], 2, quiet_gc=quiet)
        assert len(result) == 1 and result[0]["ttft_p50_ms"] >= 0 and gc.isenabled()
    assert during == [False, False, True, True]

    class Pipe:                                      # client_worker's end of a ClientProcesses pipe
        def __init__(self, jobs):
            self.jobs, self.sent = list(jobs), []

        def recv(self):
            return self.jobs.pop(0)

        def send(self, message):
            self.sent.append(message)
    import time
    pipe = Pipe([([prompt], 2, time.monotonic()), None])
    bench_streams.client_worker(plain.url, pipe)
    assert pipe.sent[0] == "ready" and len(pipe.sent[1]) == 1 and pipe.sent[1][0][0]
    assert during[4:] == [False] and gc.isenabled()


@pytest.mark.parametrize("flag, quiet", [((), True), (("--client-gc", "on"), False), (("--client-gc", "quiet"), True)])
def test_bench_streams_client_gc_defaults_to_quiet(bench_streams, monkeypatch, capsys, flag, quiet):
    """`--bursts` hands bursts() quiet_gc: on by default (since round 59), off with --client-gc on."""
    import sys
    from types import SimpleNamespace
    asked: list[bool] = []
    server = SimpleNamespace(pid=None, send_signal=lambda signal: None, wait=lambda timeout: 0)
    monkeypatch.setattr(bench_streams, "start_server", lambda *args: server)
    monkeypatch.setattr(bench_streams, "burst_prompt_sets", lambda *args: [[[1, 2]]])
    monkeypatch.setattr(bench_streams, "bursts", lambda *args: asked.append(args[-1]) or [{"ttft_p50_ms": 1.0}])
    monkeypatch.setattr(sys, "argv", ["bench_streams.py", "--bursts", "1", *flag])
    assert bench_streams.main() == 0
    assert asked == [quiet]
    assert '"first_over_last_p50": 1.0' in capsys.readouterr().out
