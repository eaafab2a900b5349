"""Real clients against the real server (in-process, a real tiny model): litellm's openai/
provider and langchain-openai's ChatOpenAI (invoke, stream, bind_tools parsing a tool call the
scripted model really produces). The official `openai` SDK is driven throughout test_server.py,
test_api.py and test_scripted_model.py.

Expectations are the server's own answers over raw HTTP: a client must neither lose nor change
anything on the way."""
from __future__ import annotations

import json
import os

import pytest

from api_server import LiveServer, load_llm
from chain_script import ASK, REASONING, TOOLS

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network at import (tests run offline)

HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def scripted(scripted_dirs):
    target, draft = scripted_dirs
    with LiveServer(load_llm(target, draft), "scripted") as server:
        yield server


def test_litellm_completion_stream_and_tool_call(plain, scripted):
    import litellm
    expected = plain.chat(HELLO, max_tokens=8)
    common = dict(api_base=plain.url + "/v1", api_key="unused", temperature=0, max_tokens=8)
    answer = litellm.completion(model="openai/qwen3", messages=HELLO, **common)
    assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"
    stream = litellm.completion(model="openai/qwen3", messages=HELLO, stream=True, **common)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == answer.choices[0].message.content
    called = litellm.completion(model="openai/scripted", messages=ASK, tools=TOOLS, api_base=scripted.url + "/v1",
                                api_key="unused", temperature=0, max_tokens=64)
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == REASONING
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_langchain_invoke_stream_and_bind_tools(plain, scripted):
    from langchain_openai import ChatOpenAI
    expected = plain.chat(HELLO, max_tokens=8)["choices"][0]["message"]["content"]
    model = ChatOpenAI(model="qwen3", base_url=plain.url + "/v1", api_key="unused", temperature=0, max_tokens=8,
                       max_retries=0)
    reply = model.invoke(HELLO[0]["content"])
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in model.stream(HELLO[0]["content"])) == expected
    tooled = ChatOpenAI(model="scripted", base_url=scripted.url + "/v1", api_key="unused", temperature=0,
                        max_tokens=64, max_retries=0).bind_tools([TOOLS[0]])
    message = tooled.invoke(ASK[0]["content"])
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in tooled.stream(ASK[0]["content"]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
