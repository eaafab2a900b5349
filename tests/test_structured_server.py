"""Structured output and logits processing over HTTP, with real clients: the official `openai`
SDK (`chat.completions.parse`, response_format json_object / json_schema, tool_choice required /
named), `instructor` (TOOLS and JSON_SCHEMA modes) and `pydantic-ai` (`output_type=` a pydantic
model). The model is a tiny random DFlash pair: only the grammar makes its output valid, so a
valid object coming back is the grammar's doing. Schemas are bounded (short strings, ranged
integers) so a random model always closes them within the context."""
from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import fixtures
from blockspec.llm import LLM
from blockspec.server.app import ServerSettings
from blockspec.tokenizer import Tokenizer
from test_server import InProcessServer

MODEL = "tiny-dflash"
ASK = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server(qwen3_dir, qwen3_draft_dir):
    llm = LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=4, max_model_len=1024, max_num_seqs=4,
              show_progress=False, cuda_graphs=False)
    with InProcessServer(lambda: llm, ServerSettings(model=str(qwen3_dir), served_model_name=MODEL)) as running:
        assert wait_ready(running.url)
        yield running


def wait_ready(url: str) -> bool:
    for _ in range(600):
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_json_object(client, qwen3_dir):
    """Any JSON object; a random model never closes a free key by itself, so logit_bias favours
    the quote and the closing brace; the grammar decides where they may go."""
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    bias = {str(tokenizer.encode(text)[0]): 60 for text in ('"', "}")}
    completion = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, logit_bias=bias,
                                                response_format={"type": "json_object"})
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_a_call_whose_arguments_validate(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    completion = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=tool_choice)
    result = completion.choices[0]
    assert result.finish_reason == "tool_calls" and len(result.message.tool_calls) == 1
    call = result.message.tool_calls[0].function
    if choice == "named":
        assert call.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            stream=True)
    arguments, names, reasons = "", [], []
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert names == ["get_weather"] and reasons == ["tool_calls"]
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_an_invalid_schema_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    error = caught.value.body
    assert error["param"] == "response_format" and "nonsense" in error["message"], error
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[broken], tool_choice="required")
    assert caught.value.body["param"] == "tools" and "parenthesis" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, logit_bias={"999999": 5})
    assert caught.value.body["param"] == "logit_bias"


def test_logit_bias_min_tokens_and_ignore_eos_over_http(client, qwen3_dir):
    forced = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logit_bias={"100": 100})
    assert forced.usage.completion_tokens == 5
    assert forced.choices[0].message.content == Tokenizer.from_dir(qwen3_dir).decode([100] * 5)
    end = {str(fixtures.IM_END_ID): 100}
    assert client.chat.completions.create(model=MODEL, messages=ASK, logit_bias=end).usage.completion_tokens == 1
    delayed = client.chat.completions.create(model=MODEL, messages=ASK, logit_bias=end, extra_body={"min_tokens": 4})
    assert delayed.usage.completion_tokens == 5 and delayed.choices[0].finish_reason == "stop"
    ignoring = client.chat.completions.create(model=MODEL, messages=ASK, logit_bias=end, max_tokens=6,
                                              extra_body={"ignore_eos": True})
    assert ignoring.usage.completion_tokens == 6 and ignoring.choices[0].finish_reason == "length"


# ---- real structured-output clients ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server, mode):
    import instructor
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model=MODEL, messages=ASK, response_model=Person, max_retries=0)
    assert isinstance(person, Person)


@pytest.mark.parametrize("output", ["tool", "native"])
def test_pydantic_ai_output_type(server, output):
    """pydantic-ai's default output mode is a forced tool call; NativeOutput is response_format
    json_schema."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    output_type = Person if output == "tool" else NativeOutput(Person)
    result = Agent(model, output_type=output_type, retries=0).run_sync("Describe a person.")
    assert isinstance(result.output, Person)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", max_retries=0)
    person = chat.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person)


@pytest.fixture(scope="module")
def plain_client(qwen3_dir):
    llm = LLM(str(qwen3_dir), max_model_len=1024, max_num_seqs=4, show_progress=False, cuda_graphs=False)
    with InProcessServer(lambda: llm, ServerSettings(model=str(qwen3_dir), served_model_name=MODEL)) as running:
        assert wait_ready(running.url)
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_responses_text_format_json_schema_is_chats_grammar(client, plain_client):
    """/v1/responses text.format json_schema (the SDK's responses.parse(text_format=…), what
    openai-agents' output_type sends): an object valid against the schema, DFlash == plain."""
    texts = []
    for each in (client, plain_client):
        response = each.responses.parse(model=MODEL, input=ASK, text_format=Person, temperature=0,
                                        max_output_tokens=200)
        assert response.status == "completed"
        assert isinstance(response.output_parsed, Person)
        jsonschema.validate(json.loads(response.output_text), Person.model_json_schema())
        assert response.text.format.type == "json_schema"
        texts.append(response.output_text)
    assert texts[0] == texts[1]
