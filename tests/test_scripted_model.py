"""A tool call and reasoning actually produced by a model: a target built so that its greedy
output after any chat prompt is `<think>…</think><tool_call>{…}</tool_call><|im_end|>`
(fixtures.write_chain_checkpoint), served plain and with a DFlash draft, streamed and not. The
response must carry reasoning_content, one parsed tool call, and finish_reason tool_calls."""
from __future__ import annotations

import json

import pytest

from api_server import LiveServer, load_llm
from chain_script import ASK, CALL, NEWLINE_ID, REASONING, SCRIPT, TOOLS


@pytest.fixture(scope="module", params=["plain", "dflash"])
def server(request, scripted_dirs):
    target, draft = scripted_dirs
    llm = load_llm(target, draft if request.param == "dflash" else None)
    with LiveServer(llm, "scripted") as live:
        yield live


def test_reasoning_and_tool_call_in_one_response(server):
    answer = server.chat(ASK, tools=TOOLS, max_tokens=64)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == REASONING
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_reasoning_and_tool_call_streamed(server):
    events = server.stream("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 64,
                                                    "temperature": 0})
    assert events[-1] == "[DONE]"
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ""
    pieces = [call for d in deltas for call in d.get("tool_calls") or []]
    assert {p["index"] for p in pieces} == {0}
    assert [p["function"]["name"] for p in pieces if p["function"].get("name")] == ["get_weather"]
    assert json.loads("".join(p["function"].get("arguments") or "" for p in pieces)) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


def test_without_tools_the_call_stays_text(server):
    """No tools in the request: the tool-call markup is ordinary content, finish_reason stop;
    the whole output is exactly the script and <|im_end|>."""
    llm = server.app.state.server.llm
    assert llm.tokenizer.encode_chat(ASK)[-1] == NEWLINE_ID
    answer = server.chat(ASK, max_tokens=64)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == REASONING
    assert choice["message"]["content"] == f"<tool_call>{CALL}</tool_call>"
    assert answer["usage"]["completion_tokens"] == len(llm.tokenizer.encode(SCRIPT)) + 1    # and <|im_end|>


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def test_responses_api_reasoning_and_function_call(server):
    """/v1/responses through the official client: a reasoning item, then a function_call item;
    streamed, the typed events build the same items."""
    import openai
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = api.responses.create(model="scripted", input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                                    max_output_tokens=64, temperature=0)
    assert response.status == "completed"
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    with api.responses.stream(model="scripted", input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                              max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == call.arguments
