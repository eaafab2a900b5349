"""Every parameter of the OpenAI chat-completions and completions references, walked: each is
honoured (a behavioural check), refused with a 400 whose message and `param` name it, or — for
caller identifiers and cache hints that cannot change an output — accepted with the output
unchanged. Nothing is accepted and silently ignored.

The parameters that change the distribution being sampled (penalties, logit_bias,
response_format, tool_choice; vLLM's min_tokens and ignore_eos) are walked with behavioural
checks of their own here; tests/test_logits.py holds them to plain decoding under DFlash.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from api_server import LiveServer, assert_error, load_llm

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Honoured:
    check: Callable[[LiveServer], None]


@dataclass(frozen=True)
class Refused:
    value: Any


@dataclass(frozen=True)
class NoEffect:
    """A caller identifier or cache hint: accepted, and the output is the same without it."""
    value: Any


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with LiveServer(load_llm(qwen3_dir), "qwen3") as live:
        yield live


def chat(server: LiveServer, **fields: Any) -> dict:
    return server.chat(HELLO, **{"max_tokens": 6, **fields})


def complete(server: LiveServer, **fields: Any) -> dict:
    return server.complete(fields.pop("prompt", PROMPT), **{"max_tokens": 6, **fields})


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# ---------------------------------------------------------------------------------------------
# The parameters that change the sampled distribution (engine/logits.py)
# ---------------------------------------------------------------------------------------------


def token_of(server: LiveServer, text: str) -> int:
    ids = server.llm.tokenizer.encode(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def end_of_turn(server: LiveServer) -> int:
    return token_of(server, "<|im_end|>")


def check_logit_bias(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        forced = token_of(server, " Paris")
        answer = call(server, logit_bias={str(forced): 100}, max_tokens=4)
        assert text_of(answer) == " Paris" * 4
        assert text_of(call(server, max_tokens=4)) != " Paris" * 4       # the bias did it
    return check


def check_penalty(name: str, value: float, call: Callable) -> Callable[[LiveServer], None]:
    """The random model's greedy output says no token twice in 24; a penalty that rewards what
    was already said (negative presence/frequency, repetition < 1) makes it repeat itself."""
    def check(server: LiveServer) -> None:
        tokenizer = server.llm.tokenizer
        plain = tokenizer.encode(text_of(call(server, max_tokens=24)))
        assert len(set(plain)) == len(plain), "the reference output repeats a token already"
        penalised = tokenizer.encode(text_of(call(server, max_tokens=24, **{name: value})))
        assert len(set(penalised)) < len(penalised)
    return check


def check_min_tokens(server: LiveServer) -> None:
    eot = str(end_of_turn(server))
    ends_at_once = chat(server, logit_bias={eot: 100}, max_tokens=8)
    assert ends_at_once["usage"]["completion_tokens"] == 1
    held = chat(server, logit_bias={eot: 100}, max_tokens=8, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def check_ignore_eos(server: LiveServer) -> None:
    eot = str(end_of_turn(server))
    answer = chat(server, logit_bias={eot: 100}, max_tokens=5, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"


def check_response_format(server: LiveServer) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = chat(server, max_tokens=10,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(text_of(answer)) in ("yes", "no")


def check_tool_choice(server: LiveServer) -> None:
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": city}},
             {"type": "function", "function": {"name": "time", "parameters": city}}]
    answer = chat(server, max_tokens=48, tools=tools, tool_choice={"type": "function", "function": {"name": "time"}})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "time"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


# ---------------------------------------------------------------------------------------------
# Behavioural checks shared by both routes (`call` is chat or complete)
# ---------------------------------------------------------------------------------------------


def check_max_tokens(name: str, call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        for limit in (2, 5):
            answer = call(server, **{name: limit, "max_tokens": None} if name != "max_tokens" else {name: limit})
            assert answer["usage"]["completion_tokens"] == limit
    return check


def check_model(call: Callable, path: str) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        assert call(server, model="qwen3")["model"] == "qwen3"
        body = {"messages": HELLO} if "chat" in path else {"prompt": PROMPT}
        assert_error(server.post(path, {**body, "model": "other"}), 404, "'other'")
    return check


def check_n(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        answer = call(server, n=2, temperature=1.0, seed=3)
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert text_of({"choices": answer["choices"][1:]}) == text_of(call(server, temperature=1.0, seed=4))
    return check


def check_seed(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        first = text_of(call(server, temperature=1.0, seed=5, max_tokens=10))
        assert text_of(call(server, temperature=1.0, seed=5, max_tokens=10)) == first
        assert text_of(call(server, temperature=1.0, seed=6, max_tokens=10)) != first
    return check


def check_stop(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        reference = text_of(call(server, max_tokens=12))
        stop = reference[4:7]
        answer = call(server, max_tokens=12, stop=[stop])
        assert text_of(answer) == reference[: reference.index(stop)]
        assert answer["choices"][0]["finish_reason"] == "stop"
    return check


def check_stream(path: str, body: dict) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        events = server.stream(path, {**body, "max_tokens": 4, "temperature": 0})
        assert events[-1] == "[DONE]" and len(events) > 2
    return check


def check_stream_options(path: str, body: dict) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        events = server.stream(path, {**body, "max_tokens": 4, "temperature": 0,
                                      "stream_options": {"include_usage": True}})
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
        plain = server.stream(path, {**body, "max_tokens": 4, "temperature": 0})
        assert all("usage" not in event for event in plain[:-1])
        # blockspec's own stream option (the playground's cycle data) is off unless asked for
        assert all("spec_cycles" not in event for event in plain[:-1])
        cycles = server.stream(path, {**body, "max_tokens": 4, "temperature": 0,
                                      "stream_options": {"include_spec_cycles": True}})
        assert sum(entry["tokens"] for event in cycles[:-1] for entry in event.get("spec_cycles", [])) == 4
    return check


def check_temperature(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        greedy = text_of(call(server, temperature=0, max_tokens=12))
        assert text_of(call(server, temperature=0, seed=1, max_tokens=12)) == greedy   # 0: no sampling
        assert text_of(call(server, temperature=2.0, seed=1, max_tokens=12)) != greedy
    return check


def check_top_p(call: Callable) -> Callable[[LiveServer], None]:
    def check(server: LiveServer) -> None:
        greedy = text_of(call(server, temperature=0, max_tokens=12))
        # a vanishing nucleus keeps only the most likely token: sampling becomes greedy
        assert text_of(call(server, temperature=2.0, seed=1, top_p=1e-9, max_tokens=12)) == greedy
        assert text_of(call(server, temperature=2.0, seed=1, top_p=1.0, max_tokens=12)) != greedy
    return check


# ---------------------------------------------------------------------------------------------
# Chat-only checks
# ---------------------------------------------------------------------------------------------


def check_messages(server: LiveServer) -> None:
    short, longer = chat(server), server.chat([{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=6)
    assert longer["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"]


def check_chat_logprobs(server: LiveServer) -> None:
    answer = chat(server, logprobs=True)
    assert len(answer["choices"][0]["logprobs"]["content"]) == answer["usage"]["completion_tokens"]
    assert chat(server, logprobs=False)["choices"][0]["logprobs"] is None


def check_top_logprobs(server: LiveServer) -> None:
    content = chat(server, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)


def check_tools(server: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert chat(server, tools=tools)["usage"]["prompt_tokens"] > chat(server)["usage"]["prompt_tokens"] + 20


def check_parallel_tool_calls(server: LiveServer) -> None:
    """false keeps only the first of the calls the model writes (the processor the route builds)."""
    from blockspec.server.chat import chat_processor
    from blockspec.server.request_building import Prompt
    from blockspec.server.protocol import ChatCompletionRequest
    tokenizer = server.app.state.server.llm.tokenizer
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in "ab"]
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    names = {}
    for parallel in (True, False):
        body = ChatCompletionRequest.model_validate({"messages": HELLO, "tools": tools, "parallel_tool_calls": parallel})
        processor = chat_processor(tokenizer, Prompt([1]), body)
        delta = processor.process(tokenizer.encode(text), "stop")
        names[parallel] = [call.name for call in delta.tool_calls if call.name]
    assert names == {True: ["a", "b"], False: ["a"]}
    assert chat(server, tools=tools, parallel_tool_calls=False)["choices"][0]["finish_reason"] in ("length", "stop",
                                                                                                 "tool_calls")


def check_reasoning_effort(server: LiveServer) -> None:
    """none turns a Qwen3-style template's thinking off (its empty <think></think>); high keeps it
    on (tests/test_api.py shows the rendered prompts)."""
    thinking_off = chat(server, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert chat(server, reasoning_effort="none")["usage"]["prompt_tokens"] == thinking_off
    assert chat(server, reasoning_effort="high")["usage"]["prompt_tokens"] == chat(server)["usage"]["prompt_tokens"]


CHAT_PATH, CHAT_BODY = "/v1/chat/completions", {"messages": HELLO}

CHAT: dict[str, Any] = {
    "messages": Honoured(check_messages),
    "model": Honoured(check_model(chat, CHAT_PATH)),
    "audio": Refused({"voice": "alloy", "format": "wav"}),
    "frequency_penalty": Honoured(check_penalty("frequency_penalty", -2.0, chat)),
    "function_call": Refused("auto"),
    "functions": Refused([{"name": "f", "parameters": {"type": "object"}}]),
    "logit_bias": Honoured(check_logit_bias(chat)),
    "logprobs": Honoured(check_chat_logprobs),
    "max_completion_tokens": Honoured(check_max_tokens("max_completion_tokens", chat)),
    "max_tokens": Honoured(check_max_tokens("max_tokens", chat)),
    "metadata": Refused({"purpose": "test"}),
    "modalities": Refused(["text", "audio"]),
    "moderation": Refused({"model": "omni-moderation-latest"}),
    "n": Honoured(check_n(chat)),
    "parallel_tool_calls": Honoured(check_parallel_tool_calls),
    "prediction": Refused({"type": "content", "content": "Hello"}),
    "presence_penalty": Honoured(check_penalty("presence_penalty", -2.0, chat)),
    "prompt_cache_key": NoEffect("user-42-session"),
    "prompt_cache_options": NoEffect({"ttl": "24h"}),
    "prompt_cache_retention": NoEffect("24h"),
    "reasoning_effort": Honoured(check_reasoning_effort),
    "response_format": Honoured(check_response_format),
    "safety_identifier": NoEffect("hashed-user-id"),
    "seed": Honoured(check_seed(chat)),
    "service_tier": Refused("flex"),
    "stop": Honoured(check_stop(chat)),
    "store": Refused(True),
    "stream": Honoured(check_stream(CHAT_PATH, CHAT_BODY)),
    "stream_options": Honoured(check_stream_options(CHAT_PATH, CHAT_BODY)),
    "temperature": Honoured(check_temperature(chat)),
    "tool_choice": Honoured(check_tool_choice),
    "tools": Honoured(check_tools),
    "top_logprobs": Honoured(check_top_logprobs),
    "top_p": Honoured(check_top_p(chat)),
    "user": NoEffect("user-42"),
    "verbosity": Refused("low"),
    "web_search_options": Refused({"search_context_size": "low"}),
}


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------


def check_best_of(server: LiveServer) -> None:
    assert text_of(complete(server, best_of=1)) == text_of(complete(server))
    assert [c["index"] for c in complete(server, n=2, best_of=2)["choices"]] == [0, 1]


def check_echo(server: LiveServer) -> None:
    assert text_of(complete(server, echo=True)) == PROMPT + text_of(complete(server))


def check_completion_logprobs(server: LiveServer) -> None:
    logprobs = complete(server, logprobs=2)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 6
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])


def check_prompt(server: LiveServer) -> None:
    one, two = complete(server), complete(server, prompt=[PROMPT, "Once upon a time"])
    assert text_of(two) == text_of(one) and len(two["choices"]) == 2
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]


COMPLETION_PATH, COMPLETION_BODY = "/v1/completions", {"prompt": PROMPT}

COMPLETIONS: dict[str, Any] = {
    "best_of": Honoured(check_best_of),             # equal to n; any other value: Refused below
    "echo": Honoured(check_echo),
    "frequency_penalty": Honoured(check_penalty("frequency_penalty", -2.0, complete)),
    "logit_bias": Honoured(check_logit_bias(complete)),
    "logprobs": Honoured(check_completion_logprobs),
    "max_tokens": Honoured(check_max_tokens("max_tokens", complete)),
    "model": Honoured(check_model(complete, COMPLETION_PATH)),
    "n": Honoured(check_n(complete)),
    "presence_penalty": Honoured(check_penalty("presence_penalty", -2.0, complete)),
    "prompt": Honoured(check_prompt),
    "seed": Honoured(check_seed(complete)),
    "stop": Honoured(check_stop(complete)),
    "stream": Honoured(check_stream(COMPLETION_PATH, COMPLETION_BODY)),
    "stream_options": Honoured(check_stream_options(COMPLETION_PATH, COMPLETION_BODY)),
    "suffix": Refused(" and that is all."),
    "temperature": Honoured(check_temperature(complete)),
    "top_p": Honoured(check_top_p(complete)),
    "user": NoEffect("user-42"),
}
COMPLETION_REFUSALS = {"best_of": 3}     # values refused beyond what the table honours

def check_top_k(server: LiveServer) -> None:
    greedy = text_of(chat(server, temperature=0, max_tokens=12))
    assert text_of(chat(server, temperature=2.0, seed=1, top_k=1, max_tokens=12)) == greedy
    assert text_of(chat(server, temperature=2.0, seed=1, top_k=-1, max_tokens=12)) != greedy


def check_min_p(server: LiveServer) -> None:
    greedy = text_of(chat(server, temperature=0, max_tokens=12))
    # min_p = 1 keeps only tokens as likely as the most likely one
    assert text_of(chat(server, temperature=2.0, seed=1, min_p=1.0, max_tokens=12)) == greedy


def check_template_controls(server: LiveServer) -> None:
    tokens = chat(server)["usage"]["prompt_tokens"]
    assert chat(server, add_generation_prompt=False)["usage"]["prompt_tokens"] < tokens
    thinking_off = chat(server, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off["usage"]["prompt_tokens"] > tokens                  # the empty <think></think>


def check_return_meta_info(server: LiveServer) -> None:
    assert chat(server, return_meta_info=True)["meta_info"]["spec_verify_ct"] == 0     # plain: no verify passes
    assert "meta_info" not in chat(server)


# vLLM's / SGLang's extensions: those of this branch walked here; the logits branch's ones with
# the rest once it is merged. (continue_final_message: tests/test_api.py.)
VLLM_EXTENSIONS: dict[str, Any] = {
    "top_k": Honoured(check_top_k),
    "min_p": Honoured(check_min_p),
    "add_generation_prompt": Honoured(check_template_controls),
    "chat_template_kwargs": Honoured(check_template_controls),
    "return_meta_info": Honoured(check_return_meta_info),
    "min_tokens": Honoured(check_min_tokens),
    "ignore_eos": Honoured(check_ignore_eos),
    "repetition_penalty": Honoured(check_penalty("repetition_penalty", 0.5, chat)),
}

# The OpenAI API reference, as of this writing (the request bodies of POST /v1/chat/completions
# and POST /v1/completions).
CHAT_REFERENCE = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store",
    "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
}
COMPLETIONS_REFERENCE = {
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
    "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
    "user",
}


def walked(table: dict[str, Any]) -> list[str]:
    return list(table)


def test_the_walk_covers_the_references():
    assert set(CHAT) == CHAT_REFERENCE and set(COMPLETIONS) == COMPLETIONS_REFERENCE
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    # the installed SDK sends nothing the walk does not know
    assert set(chat_create_params.CompletionCreateParamsBase.__annotations__) <= set(CHAT)
    assert set(completion_create_params.CompletionCreateParamsBase.__annotations__) <= set(COMPLETIONS)
    for table in (CHAT, COMPLETIONS, VLLM_EXTENSIONS):
        assert all(isinstance(e, (Honoured, Refused, NoEffect)) for e in table.values())


def assert_expectation(server: LiveServer, path: str, body: dict, name: str, expectation: Any) -> None:
    if isinstance(expectation, Honoured):
        expectation.check(server)
    elif isinstance(expectation, Refused):
        error = assert_error(server.post(path, {**body, name: expectation.value}), 400, name)
        assert error["param"] == name
    else:
        assert isinstance(expectation, NoEffect)
        base = {**body, "temperature": 0, "max_tokens": 6}
        without = server.post(path, base).json()
        with_it = server.post(path, {**base, name: expectation.value})
        assert with_it.status_code == 200, with_it.text
        assert text_of(with_it.json()) == text_of(without) and with_it.json()["usage"] == without["usage"]


@pytest.mark.parametrize("name", walked(CHAT))
def test_chat_parameter(server, name):
    assert_expectation(server, CHAT_PATH, CHAT_BODY, name, CHAT[name])


@pytest.mark.parametrize("name", walked(COMPLETIONS))
def test_completion_parameter(server, name):
    assert_expectation(server, COMPLETION_PATH, COMPLETION_BODY, name, COMPLETIONS[name])


@pytest.mark.parametrize("name", walked(VLLM_EXTENSIONS))
def test_extension_parameter(server, name):
    assert_expectation(server, CHAT_PATH, CHAT_BODY, name, VLLM_EXTENSIONS[name])


@pytest.mark.parametrize("name,value", sorted(COMPLETION_REFUSALS.items()))
def test_completion_values_refused(server, name, value):
    assert_expectation(server, COMPLETION_PATH, COMPLETION_BODY, name, Refused(value))


def test_accepted_defaults_of_refused_parameters(server):
    """The values that mean 'what this server does anyway' are accepted, with the same output."""
    reference = text_of(chat(server))
    for fields in ({"modalities": ["text"]}, {"service_tier": "auto"}, {"store": False}, {"metadata": {}},
                   {"audio": None}, {"functions": None}):
        assert text_of(chat(server, **fields)) == reference, fields
    assert json.loads(httpx.get(server.url + "/v1/models").text)["data"][0]["id"] == "qwen3"
