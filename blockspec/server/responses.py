"""The OpenAI Responses API (`POST /v1/responses`), as vLLM serves it: text in, output items out.

A Responses request is turned into the chat request it means (instructions → a system message,
input items → messages, flat function tools → chat tools), so it runs the chat path unchanged:
the chat template, the engine, the OutputProcessor. What comes back is regrouped into output
items — `reasoning`, `message` (output_text), `function_call` — by one state machine
(`OutputItems`) that both streams the typed events (response.created, response.output_item.added,
response.output_text.delta, …, response.completed) and builds the final object, so the streamed
and the whole answer cannot disagree.

No response is stored: `previous_response_id` (and `background`, stored `prompt`s and
`conversation`) are 400s naming them; `store` is accepted and every response says `store: false`.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationInfo, field_validator

from blockspec.server.chat import chat_processor, chat_prompt
from blockspec.server.errors import ApiError, GenerationFailed
from blockspec.server.generation import Choice, close_all, make_choices, merged_deltas, submit_all, total_usage
from blockspec.server.ids import new_id
from blockspec.server.images import check_images
from blockspec.server.output import OutputAccumulator, OutputDelta
from blockspec.server.protocol import ChatCompletionRequest, _Request
from blockspec.server.replies import UsageInfo
from blockspec.server.request_building import check_bounds, check_queue_room, read_body, validate
from blockspec.server.state import ServerState
from blockspec.server.streaming import SSEResponse, collected

TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None

    @field_validator("previous_response_id", "prompt", "conversation")
    @classmethod
    def _nothing_stored(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"'{info.field_name}' is not supported: this server stores no responses, "
                             "prompts or conversations; send the whole conversation in 'input'")
        return value

    @field_validator("background")
    @classmethod
    def _not_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported (they need stored responses)")
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if not value:
            raise ValueError("input must be a non-empty string or a non-empty list of items")
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in value or []:
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"only function tools {{'type': 'function', 'name': ...}} are supported "
                                 f"(got type {tool.get('type')!r})")
        return value

    @field_validator("text")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (value or {}).get("format") or {}
        kind = fmt.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"text.format type must be 'text', 'json_object' or 'json_schema' (got {kind!r})")
        if kind == "json_schema" and not isinstance(fmt.get("schema", {}), dict):
            raise ValueError("text.format json_schema needs 'schema': a JSON schema object")
        return value

    @property
    def response_format(self) -> dict[str, Any] | None:
        """text.format as chat's response_format: the same grammar enforces it (structured.py)."""
        fmt = (self.text or {}).get("format") or {}
        kind = fmt.get("type", "text")
        if kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
            return {"type": "json_schema", "json_schema": spec}
        return {"type": kind} if kind == "json_object" else None

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value not in (None, "disabled"):
            raise ValueError(f"truncation {value!r} is not supported (only 'disabled')")
        return value

    @field_validator("reasoning")
    @classmethod
    def _reasoning_effort_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """reasoning.effort is chat's reasoning_effort (validated there); summaries are not made."""
        others = {k: v for k, v in (value or {}).items() if k != "effort" and v is not None}
        if others:
            raise ValueError(f"reasoning {', '.join(others)} is not supported by this server (only effort)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)")
        return value


# ---------------------------------------------------------------------------------------------
# Request → chat request
# ---------------------------------------------------------------------------------------------


def part_text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string, parts joined by newlines."""
    content = message_content(content, where, images=False)
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def message_content(content: Any, where: str, images: bool = True) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or chat parts (text, and with images=True
    input_image parts as image_url parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif images and kind == "input_image":
            raise ValueError(f"{where}.content[{j}]: an input_image needs image_url (file_id is not served: "
                             "nothing is stored)")
        else:
            allowed = "text and input_image" if images else "text"
            raise ValueError(f"{where}: only {allowed} content parts are supported (got type {kind!r})")
    return parts if any(part["type"] == "image_url" for part in parts) else "\n".join(p["text"] for p in parts)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions + input → chat messages. Past reasoning items are dropped, as Qwen's chat
    templates drop the reasoning of earlier turns."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": message_content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else part_text(output, where)})
        elif kind != "reasoning":
            raise ValueError(f"{where}: input items of type {kind!r} are not supported "
                             "(message, function_call, function_call_output, reasoning)")
    return messages


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_request_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat request this Responses request means (validated by ChatCompletionRequest next)."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                               if t.get(k) is not None}} for t in body.tools or []]
    chat = {"messages": input_messages(body), "tools": tools or None, "tool_choice": chat_tool_choice(body.tool_choice),
            "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls,
            "reasoning_effort": (body.reasoning or {}).get("effort"), "response_format": body.response_format}
    return {k: v for k, v in chat.items() if v is not None}


CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                           "reasoning_effort": "reasoning.effort"}


def responses_param(param: str | None) -> str | None:
    """A chat parameter named in a validation error, as the Responses request calls it."""
    if param is None:
        return None
    head = re.split(r"[.\[]", param, maxsplit=1)[0]
    return CHAT_TO_RESPONSES_PARAM.get(head, head) + param[len(head):]


# ---------------------------------------------------------------------------------------------
# Output items and events
# ---------------------------------------------------------------------------------------------


@dataclass
class OutputItems:
    """Output deltas → output items, and (when streaming) the typed events that build them.

    The current item is open while its kind of delta keeps coming; a delta of another kind closes
    it (its *.done events) and opens the next. `events` collects the SSE payloads in order."""

    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None
    _call_index: int | None = None

    def add(self, delta: OutputDelta) -> None:
        if delta.reasoning:
            self._text("reasoning", delta.reasoning)
        if delta.content:
            self._text("message", delta.content)
        for piece in delta.tool_calls:
            if piece.index != self._call_index:
                self._start_call(piece.index, piece.id or new_id("call_"), piece.name or "")
            self._open["arguments"] += piece.arguments
            self._emit("response.function_call_arguments.delta", item_id=self._open["id"], delta=piece.arguments)
        if delta.finish_reason is not None:
            self.close()

    def close(self) -> None:
        item, self._open, self._call_index = self._open, None, None
        if item is None:
            return
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            self.events.append({"type": "response.output_text.done", **ids, "content_index": 0,
                                "text": part["text"], "logprobs": []})
            self.events.append({"type": "response.content_part.done", **ids, "content_index": 0, "part": part})
        elif item["type"] == "reasoning":
            self.events.append({"type": "response.reasoning_text.done", **ids, "content_index": 0,
                                "text": item["content"][0]["text"]})
        else:
            self.events.append({"type": "response.function_call_arguments.done", **ids,
                                "name": item["name"], "arguments": item["arguments"]})
        self.events.append({"type": "response.output_item.done", "output_index": ids["output_index"],
                            "item": json.loads(json.dumps(item))})

    def _text(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self.close()
            self._start_text(kind)
        part = self._open["content"][0]
        part["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        self._emit(event, item_id=self._open["id"], content_index=0, delta=text, **extra)

    def _start_text(self, kind: str) -> None:
        if kind == "message":
            item = {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": new_id("rs_"), "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._add_item(item)
        item["content"].append(part)
        if kind == "message":
            self._emit("response.content_part.added", item_id=item["id"], content_index=0, part=dict(part))

    def _start_call(self, index: int, call_id: str, name: str) -> None:
        self.close()
        self._call_index = index
        self._add_item({"type": "function_call", "id": new_id("fc_"), "call_id": call_id, "name": name,
                        "arguments": "", "status": "in_progress"})

    def _add_item(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item
        self.events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": json.loads(json.dumps(item))})

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "output_index": len(self.items) - 1, **fields})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def response_object(response_id: str, created_at: int, model: str, body: ResponsesRequest,
                    items: list[dict[str, Any]], status: str, usage: tuple[int, int, int] | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The Response object (status in_progress while streaming, then completed or incomplete)."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    usage_object = None
    if usage is not None:
        usage_object = {"input_tokens": usage[0], "input_tokens_details": {"cached_tokens": usage[2]},
                        "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": usage[0] + usage[1]}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status != "in_progress" else None,
        "model": model, "output": items, "usage": usage_object, "error": None,
        "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "previous_response_id": None, "store": False, "metadata": body.metadata or {},
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "truncation": "disabled",
        "reasoning": {"effort": body.reasoning["effort"], "summary": None} if (body.reasoning or {}).get("effort")
        else None,
        "background": False, "user": body.user,
    }


def usage_counts(usage: UsageInfo) -> tuple[int, int, int]:
    """(input, output, cached input) tokens: the prefix cache's hits count as chat counts them."""
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else 0


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def sse_event(sequence_number: int, event: dict[str, Any]) -> bytes:
    payload = json.dumps({**event, "sequence_number": sequence_number}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()


# ---------------------------------------------------------------------------------------------
# The route
# ---------------------------------------------------------------------------------------------


async def create_response(state: ServerState, request: Request) -> Response:
    """POST /v1/responses: the chat path under the Responses API's request and output shapes."""
    arrival = time.perf_counter()               # the clock of the engine's stamps (request.py)
    body = await read_body(state, request, ResponsesRequest)
    try:
        chat = validate(ChatCompletionRequest, chat_request_body(body))
        check_bounds(chat)
    except ValueError as exc:  # an input item the chat path has no message for
        raise ApiError(400, f"Invalid 'input': {exc}.", "input") from None
    except ApiError as exc:
        raise as_responses_error(exc) from None
    llm, engine = state.ready()
    check_queue_room(engine)
    response_id = new_id("resp_")
    try:
        check_images(llm, state.settings, chat)
        prompt, grammar = await chat_prompt(llm, state.settings, chat)   # a grammar: tool_choice required / named
        choices = make_choices(state, llm, engine, response_id, [prompt], chat, arrival,
                               lambda p: chat_processor(llm.tokenizer, p, chat), grammar=grammar)
    except ApiError as exc:
        raise as_responses_error(exc) from None
    submit_all(choices)
    model, created = state.settings.model_name, int(time.time())
    if body.stream:
        return SSEResponse(response_events(choices, response_id, created, model, body), lambda: close_all(choices))
    return await collected(choices, request, lambda outputs: whole_response(
        choices, outputs, response_id, created, model, body))


def whole_response(choices: list[Choice], outputs: list[OutputAccumulator], response_id: str, created: int,
                   model: str, body: ResponsesRequest) -> dict[str, Any]:
    items = OutputItems()
    for delta in outputs[0].deltas:
        items.add(delta)
    usage = total_usage(choices)
    finish = outputs[0].finish_reason
    return response_object(response_id, created, model, body, items.items, final_status(finish),
                           usage_counts(usage), finish)


def as_responses_error(exc: ApiError) -> ApiError:
    """A chat-path refusal, naming the parameter as the Responses request called it."""
    param = responses_param(exc.param)
    message = exc.message.replace(f"'{exc.param}'", f"'{param}'") if exc.param else exc.message
    return ApiError(exc.status, message, param, exc.headers)


async def response_events(choices: list[Choice], response_id: str, created: int, model: str,
                          body: ResponsesRequest) -> AsyncIterator[bytes]:
    """The typed SSE events of a streamed response, numbered in order; no [DONE] (OpenAI's)."""
    sequence = 0

    def send(event: dict[str, Any]) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse_event(sequence - 1, event)

    def snapshot(status: str, items: list, finish: str | None = None) -> dict[str, Any]:
        usage = total_usage(choices) if status != "in_progress" else None
        counts = usage_counts(usage) if usage else None
        return response_object(response_id, created, model, body, items, status, counts, finish)

    yield send({"type": "response.created", "response": snapshot("in_progress", [])})
    yield send({"type": "response.in_progress", "response": snapshot("in_progress", [])})
    items = OutputItems()
    try:
        async for _, delta in merged_deltas(choices):
            items.add(delta)
            for event in items.take_events():
                yield send(event)
            if delta.finish_reason is not None:
                # Always response.completed (its status may say incomplete), as vLLM sends it:
                # the SDK's stream helper and agent loops wait for exactly that event.
                status = final_status(delta.finish_reason)
                yield send({"type": "response.completed", "response": snapshot(status, items.items, delta.finish_reason)})
    except GenerationFailed as exc:
        failed = snapshot("failed", items.items)
        failed["error"] = {"code": "server_error", "message": exc.message}
        yield send({"type": "response.failed", "response": failed})
