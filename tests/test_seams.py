"""Where the features merged this session meet: the Responses API with the drain, the bounds and
the grammars; several choices with grammars, logprobs and faults; preemption of a sequence
whose logits are processed. Each test here failed on the merged tree before its fix."""
from __future__ import annotations

import json

import jsonschema
import pytest

from api_server import LiveServer, assert_error, load_llm
from blockspec.server.app import MAX_TOOLS

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
