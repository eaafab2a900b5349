"""Reasoning and tool-call parsers (fed in every possible split), and request validation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.server.parsers import (
    ReasoningParser,
    ToolCallDelta,
    ToolCallParser,
    parse_tool_calls_complete,
)
from blockspec.server.errors import error_body, validation_error_message
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest
from blockspec.server.replies import ChatCompletion, ChatCompletionChunk, Completion

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "<parameter=")


def splits(text: str) -> Iterator[list[str]]:
    """Whole, every two-piece split, and char by char."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)


# ---------------------------------------------------------------------------------------------
# ReasoningParser
# ---------------------------------------------------------------------------------------------


def run_reasoning(pieces: list[str], started_in_prompt: bool) -> tuple[str, str]:
    parser = ReasoningParser(started_in_prompt=started_in_prompt)
    outputs = [parser.feed(piece) for piece in pieces] + [parser.flush()]
    return "".join(r for r, _ in outputs), "".join(c for _, c in outputs)


REASONING_CASES = [
    # (output text, started in prompt, reasoning, content)
    ("Let me think.\n</think>\n\nParis.", True, "Let me think.", "Paris."),
    ("<think>\nLet me think.\n</think>\n\nParis.", False, "Let me think.", "Paris."),
    ("\n<think>a\n\nb</think>c", False, "a\n\nb", "c"),
    ("Paris is the capital.", False, "", "Paris is the capital."),
    ("\nHi <think>x</think>", False, "", "\nHi <think>x</think>"),
    ("still thinking\n\nabout it\n", True, "still thinking\n\nabout it", ""),
    ("<think>\nopened twice\n</think>\nok", True, "opened twice", "ok"),
    ("</think>answer", True, "", "answer"),
    ("abc</thi", True, "abc</thi", ""),
    ("<thi", False, "", "<thi"),
    ("  \n", False, "", "  \n"),
    ("a < b </ c </think>x </think> y", True, "a < b </ c ", "x </think> y"),
    ("<think>", False, "", ""),
    ("  indented</think>\n  code", True, "  indented", "  code"),
]


@pytest.mark.parametrize("text,started,reasoning,content", REASONING_CASES)
def test_reasoning_every_split(text: str, started: bool, reasoning: str, content: str) -> None:
    for pieces in splits(text):
        assert run_reasoning(pieces, started) == (reasoning, content), pieces


def test_reasoning_holds_partial_end_tag_until_resolved() -> None:
    parser = ReasoningParser(started_in_prompt=True)
    assert parser.feed("step one </th") == ("step one ", "")
    assert parser.feed("ink>") == ("", "")
    assert not parser.in_reasoning
    assert parser.feed("\n\nanswer") == ("", "answer")


def test_reasoning_not_in_prompt_emits_plain_output_at_once() -> None:
    parser = ReasoningParser(started_in_prompt=False)
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.feed(" <think>") == ("", " <think>")


# ---------------------------------------------------------------------------------------------
# ToolCallParser
# ---------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "configure",
            "parameters": {
                "type": "object",
                "properties": {
                    "count": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "enabled": {"type": "boolean"},
                    "options": {"type": "object"},
                    "ids": {"type": "array"},
                    "note": {"type": "string"},
                    "limit": {"type": ["integer", "null"]},
                    "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    },
]

HERMES_WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n'
    "</tool_call>"
)
XML_CONFIGURE = (
    "<tool_call>\n<function=configure>\n"
    "<parameter=count>\n5\n</parameter>\n"
    "<parameter=ratio>\n0.25\n</parameter>\n"
    "<parameter=enabled>\nTrue\n</parameter>\n"
    '<parameter=options>\n{"deep": {"x": [1, 2]}}\n</parameter>\n'
    "<parameter=ids>\n[1, 2, 3]\n</parameter>\n"
    "<parameter=note>\n\nline one\nline two\n\n</parameter>\n"
    "<parameter=limit>\nnull\n</parameter>\n"
    "<parameter=mode>\nfast\n</parameter>\n"
    "</function>\n</tool_call>"
)
CONFIGURE_ARGS = {
    "count": 5,
    "ratio": 0.25,
    "enabled": True,
    "options": {"deep": {"x": [1, 2]}},
    "ids": [1, 2, 3],
    "note": "\nline one\nline two\n",
    "limit": None,
    "mode": "fast",
}
WEATHER = ("get_weather", {"city": "Zürich", "days": 3})

TOOL_CASES = [
    # (output text, content, [(name, arguments)])
    ("Let me check.\n\n" + HERMES_WEATHER, "Let me check.\n\n", [WEATHER]),
    (HERMES_WEATHER + "\n" + HERMES_WEATHER + "\n", "", [WEATHER, WEATHER]),
    (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>',
        "",
        [("f", {"a": [1]})],
    ),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    (XML_CONFIGURE, "", [("configure", CONFIGURE_ARGS)]),
    ("\n\n" + XML_CONFIGURE + "\n" + HERMES_WEATHER, "", [("configure", CONFIGURE_ARGS), WEATHER]),
    (HERMES_WEATHER + "\n\nDone, it is sunny.", "\n\nDone, it is sunny.", [WEATHER]),
    # XML without a schema: text stays text.
    (
        "<tool_call>\n<function=unknown>\n<parameter=n>\n7\n</parameter>\n</function>\n"
        "</tool_call>",
        "",
        [("unknown", {"n": "7"})],
    ),
    # Values that do not fit their declared type are kept as text.
    (
        "<tool_call><function=configure><parameter=count>many</parameter>"
        "<parameter=enabled>maybe</parameter></function></tool_call>",
        "",
        [("configure", {"count": "many", "enabled": "maybe"})],
    ),
    # Missing </parameter> and </function>: tolerated inside a closed tool_call.
    (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n<parameter=city>\nRome\n"
        "</tool_call>",
        "",
        [("get_weather", {"days": 2, "city": "Rome"})],
    ),
    # Python-literal object from the model.
    (
        "<tool_call><function=configure><parameter=options>{'a': True}</parameter></function>"
        "</tool_call>",
        "",
        [("configure", {"options": {"a": True}})],
    ),
]

MALFORMED_CASES = [
    'A<tool_call>{"name": "f", "arguments": {</tool_call>B',  # bad JSON
    'text <tool_call>{"name": "f", "arguments": {"a": 1}}',  # never closed
    "x <tool_call>\n<function=f>\n<parameter=a>\n1",  # XML never closed
    "<tool_call>just words</tool_call>",  # neither format
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON
    "<tool_call><function=f></function><function=g></function></tool_call>",  # two functions
    "<tool_call><function=>x</function></tool_call>",  # empty name
    "use the <tool_ca tag, or </tool_call> alone",
    "ends with a partial <tool_cal",
]


def run_tools(pieces: list[str], tools: list | None = TOOLS) -> tuple[str, list[ToolCallDelta]]:
    parser = ToolCallParser(tools)
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        deltas.extend(new)
    text, new = parser.flush()
    return "".join(content + [text]), deltas + new


def merge_deltas(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """OpenAI streaming semantics: deltas of one index add up; the first names the call."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id is not None and delta.id.startswith("call_")
            assert delta.name
            assert delta.index == len(calls), "indexes are 0, 1, 2, ... in order"
            calls[delta.index] = [delta.id, delta.name, ""]
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index][2] += delta.arguments
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def check_tools(pieces: list[str], content: str, expected: list[tuple[str, dict]]) -> None:
    got_content, deltas = run_tools(pieces)
    calls = merge_deltas(deltas)
    assert got_content == content, pieces
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == expected, pieces
    assert len({call_id for call_id, _, _ in calls}) == len(calls)


@pytest.mark.parametrize("text,content,expected", TOOL_CASES)
def test_tool_calls_every_split(text: str, content: str, expected: list) -> None:
    for pieces in splits(text):
        check_tools(pieces, content, expected)
    if expected and not content:
        for tag in TAGS:
            assert tag not in run_tools([text])[0]


@pytest.mark.parametrize("text,content,expected", TOOL_CASES)
def test_complete_parse_agrees_with_streaming(text: str, content: str, expected: list) -> None:
    got_content, calls = parse_tool_calls_complete(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", MALFORMED_CASES)
def test_malformed_or_unclosed_calls_are_content(text: str) -> None:
    for pieces in splits(text):
        assert run_tools(pieces) == (text, []), pieces
    assert parse_tool_calls_complete(text, TOOLS) == (text, [])


def test_tool_call_waits_for_close_and_keeps_text_order() -> None:
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Checking. <tool") == ("Checking. ", [])
    assert parser.feed('_call>{"name": "get_weather", "arguments": {}}') == ("", [])
    text, deltas = parser.feed("</tool_call>")
    assert text == "" and len(deltas) == 1 and deltas[0].arguments == "{}"
    assert parser.num_calls == 1


def test_whitespace_only_output_without_calls_is_kept() -> None:
    for pieces in splits(" \n "):
        assert run_tools(pieces) == (" \n ", [])


def test_tools_given_as_pydantic_models_give_types() -> None:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    )
    _, calls = parse_tool_calls_complete(XML_CONFIGURE, request.tools)
    assert json.loads(calls[0].arguments) == CONFIGURE_ARGS


def test_tool_call_delta_openai_shape() -> None:
    first = ToolCallDelta(0, "", id="call_1", name="f").to_openai()
    assert first == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, '{"a": 1}').to_openai() == {
        "index": 0,
        "function": {"arguments": '{"a": 1}'},
    }


FRAGMENTS = [
    "Hello",
    " ",
    "\n",
    "<",
    "<tool",
    "</tool_call>",
    '{"a": 1}',
    HERMES_WEATHER,
    XML_CONFIGURE,
    "<tool_call>{broken</tool_call>",
    "<tool_call>",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
]


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
)
def test_streaming_equals_complete_for_random_outputs(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, deltas = run_tools(pieces)
    expected_content, expected_calls = parse_tool_calls_complete(text, TOOLS)
    assert content == expected_content
    streamed = [(name, json.loads(arguments)) for _, name, arguments in merge_deltas(deltas)]
    assert streamed == [(c.name, json.loads(c.arguments)) for c in expected_calls]


# ---------------------------------------------------------------------------------------------
# Request validation (protocol.py)
# ---------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
ONE_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def rejection(body: dict, model: type[pydantic.BaseModel] = ChatCompletionRequest) -> tuple:
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate(body)
    return validation_error_message(caught.value)


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({}, "messages", "Missing required parameter"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"messages": USER, "max_completion_tokens": -5}, "max_completion_tokens", "greater"),
        ({"messages": USER, "temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"messages": USER, "temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"messages": USER, "top_p": 0}, "top_p", "greater than 0"),
        ({"messages": USER, "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"messages": USER, "top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"messages": USER, "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"messages": USER, "stop": 5}, "stop", "string or a list of strings"),
        ({"messages": USER, "stop": ["a", 1]}, "stop", "string or a list of strings"),
        ({"messages": USER, "stop": {"a": 1}}, "stop", "string or a list of strings"),
        ({"messages": USER, "stop": ["x"] * 17}, "stop", "at most 16"),
        ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than"),
        ({"messages": USER, "n": 0}, "n", "must be in [1, 128]"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2]"),
        ({"messages": USER, "frequency_penalty": -3}, "frequency_penalty", "must be in [-2, 2]"),
        ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty", "must be in (0, 2]"),
        ({"messages": USER, "logit_bias": {"x": 1.0}}, "logit_bias", "keys must be token ids"),
        ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
        ({"messages": USER, "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        (
            {"messages": USER, "response_format": {"type": "yaml"}},
            "response_format",
            "'text', 'json_object' or 'json_schema'",
        ),
        (
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": "x"}},
            "response_format",
            "json_schema must be an object",
        ),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice", "requires 'tools'"),
        ({"messages": USER, "tool_choice": "always", "tools": ONE_TOOL}, "tool_choice", "must be"),
        (
            {
                "messages": USER,
                "tools": ONE_TOOL,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            "'nope', which is not in tools",
        ),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function", "Missing"),
        (
            {"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
            "tools[0].type",
            "'function'",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "needs content"),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content", "needs content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "needs image_url.url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content",
            "only text and image_url content parts",
        ),
        ({"messages": USER, "stream": "maybe"}, "stream", "boolean"),
        ({"messages": USER, "chat_template_kwargs": [1]}, "chat_template_kwargs", "dictionary"),
    ],
)
def test_chat_request_rejections(body: dict, param: str, words: str) -> None:
    message, got_param = rejection(body)
    assert got_param == param
    assert words in message
    assert param in message


@pytest.mark.parametrize(
    "fields,over",
    [
        ({"stop": [f"s{i}" for i in range(16)]}, {"stop": [f"s{i}" for i in range(17)]}),
        ({"logprobs": True, "top_logprobs": 20}, {"top_logprobs": 21, "logprobs": True}),
        ({"n": 128}, {"n": 129}),
        ({"temperature": 2}, {"temperature": 2.01}),
        ({"presence_penalty": -2, "frequency_penalty": 2}, {"presence_penalty": -2.01}),
        ({"logit_bias": {"5": -100, "6": 100}}, {"logit_bias": {"5": -100.5}}),
    ],
)
def test_each_limit_is_inclusive(fields: dict, over: dict) -> None:
    """The documented bounds themselves are accepted (16 stop strings, top_logprobs 20, n 128,
    ...); one past them is the 400 naming the parameter."""
    ChatCompletionRequest.model_validate({"messages": USER, **fields})
    _, param = rejection({"messages": USER, **over})
    assert param == next(iter(over))           # the first field of `over` is the one past its bound


@pytest.mark.parametrize(
    "body,words",
    [
        ({"prompt": ["a", [1]]}, "only strings or only token-id lists"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": ""}, "must not be empty"),
        ({"prompt": [1, -2]}, "non-negative"),
        ({"prompt": [1, True]}, "non-negative"),
        ({"prompt": 5}, "non-empty string"),
        ({"prompt": "x", "max_tokens": 0}, "greater than or equal to 1"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "not supported"),
        ({"prompt": "x", "logprobs": 21}, "less than or equal to 20"),
        ({"prompt": "x", "suffix": "y"}, "not supported"),
        ({"prompt": "x", "n": 0}, "must be in [1, 128]"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "must equal n"),
    ],
)
def test_completion_request_rejections(body: dict, words: str) -> None:
    message, _ = rejection(body, CompletionRequest)
    assert words in message


def test_request_body_that_is_not_json_or_not_an_object() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate_json("{not json")
    message, param = validation_error_message(caught.value)
    assert "not valid JSON" in message and param is None
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate_json("[1, 2]")
    message, param = validation_error_message(caught.value)
    assert (message, param) == ("The request body must be a JSON object.", None)


def test_full_chat_request_accepted_and_extras_ignored() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "look it up",
                    "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 1,
            "top_k": -1,
            "min_p": 0,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [5],
            "stream": True,
            "stream_options": {"include_usage": True},
            "tools": ONE_TOOL,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": False},
            "return_meta_info": True,
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "someone",
            "some_vendor_extension": {"x": 1},
        }
    )
    assert request.max_new_tokens == 20
    assert request.stop_strings == ["END"]
    assert request.include_usage and request.tools_enabled
    assert request.messages[1].text == "a\nb"
    assert request.messages[3].tool_calls[0].function.arguments == '{"city": "Rome"}'
    assert not hasattr(request, "some_vendor_extension")


def test_defaults() -> None:
    request = ChatCompletionRequest.model_validate({"messages": USER})
    assert request.max_new_tokens is None and not request.stream and request.stop_strings == []
    assert not request.tools_enabled and not request.include_usage
    none_choice = ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": ONE_TOOL, "tool_choice": "none"}
    )
    assert not none_choice.tools_enabled
    assert CompletionRequest.model_validate({"prompt": ["hi"]}).prompts == ["hi"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": "x"}).max_new_tokens == 16


def test_error_body() -> None:
    assert error_body(400, "bad", "temperature") == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": 400,
        }
    }
    assert error_body(401, "key")["error"]["type"] == "authentication_error"
    assert error_body(404, "model")["error"]["type"] == "not_found_error"
    assert error_body(413, "big")["error"]["type"] == "request_too_large"
    assert error_body(503, "busy", code="queue_full")["error"]["code"] == "queue_full"


def test_responses_parse_with_the_openai_client_types() -> None:
    openai_types = pytest.importorskip("openai.types")
    body = ChatCompletion.model_validate(
        {
            "model": "m",
            "choices": [
                {
                    "message": {
                        "content": None,
                        "reasoning_content": "r",
                        "tool_calls": [
                            {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    ).model_dump()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert "meta_info" not in body and body["choices"][0]["message"]["content"] is None
    openai_types.chat.ChatCompletion.model_validate(body)

    first_piece = ToolCallDelta(0, "{}", id="call_1", name="f")
    chunk = ChatCompletionChunk.model_validate(
        {
            "id": ChatCompletionChunk.new_id(),
            "model": "m",
            "choices": [{"delta": {"tool_calls": [first_piece.to_openai()]}}],
        }
    ).model_dump()
    assert chunk["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": "{}"},
            }
        ]
    }
    assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk
    openai_types.chat.ChatCompletionChunk.model_validate(chunk)

    text = Completion.model_validate(
        {
            "model": "m",
            "choices": [{"text": "hi", "finish_reason": "length"}],
            "meta_info": {
                "spec_verify_ct": 2,
                "spec_accept_length": 3.5,
                "spec_accept_histogram": [0, 1, 1],
            },
        }
    ).model_dump()
    assert text["id"].startswith("cmpl-") and text["object"] == "text_completion"
    assert text["meta_info"]["spec_verify_ct"] == 2
    openai_types.Completion.model_validate(text)


@pytest.mark.parametrize("choice", [{"type": "function", "function": "f"}, {"type": "function"},
                                    {"type": "other", "function": {"name": "f"}}, {"function": {"name": "f"}}])
def test_malformed_named_tool_choice_is_a_validation_error(choice):
    import pydantic
    from blockspec.server.protocol import ChatCompletionRequest
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tools": tools, "tool_choice": choice})


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"x": "integer"}},
    {"type": "object", "properties": ["x"]},
    {"type": "object", "properties": {"x": {"anyOf": {"type": "integer"}}}},
    "not a schema",
])
def test_malformed_client_schemas_never_break_xml_parsing(parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    content, calls = parse_tool_calls_complete(
        "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>", tools)
    assert [c.name for c in calls] == ["f"] and json.loads(calls[0].arguments) == {"x": "5"}


def test_unparseable_model_values_stay_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "object"}}}}}]
    content, calls = parse_tool_calls_complete(
        "<tool_call>\n<function=f>\n<parameter=x>\n{[1]: 2}\n</parameter>\n</function>\n</tool_call>", tools)
    assert json.loads(calls[0].arguments) == {"x": "{[1]: 2}"}
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    content, calls = parse_tool_calls_complete(deep, None)
    assert calls == [] and content == deep
