"""Streaming parsers for model output: <think> reasoning, and Qwen tool calls.

Both are fed text pieces of any size (a tag may arrive split at any character) and never emit
text they may later have to take back: a partial tag is held until the next piece resolves it.
Invariant: the concatenation of everything emitted is independent of how the text was split.

Tool-call formats (both inside <tool_call>...</tool_call>, both always accepted):
  hermes (Qwen3, Qwen2.5):    {"name": "f", "arguments": {"x": 1}}
  XML (Qwen3.5, Qwen3-Coder): <function=f>\n<parameter=x>\n1\n</parameter>\n</function>
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blockspec.server.ids import new_id

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def partial_suffix_len(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some pattern.

    That suffix is held back: the next piece may complete the pattern.
    """
    longest = max((len(p) for p in patterns), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(p.startswith(tail) for p in patterns):
            return size
    return 0


# ---------------------------------------------------------------------------------------------
# Reasoning
# ---------------------------------------------------------------------------------------------


class ReasoningParser:
    """Splits output into reasoning (before the end tag) and content (after it).

    Output is reasoning when the prompt already opened the start tag (Qwen3 thinking templates
    end the generation prompt with "<think>\\n") or when the output itself starts with it
    (leading whitespace allowed). Neither tag is ever emitted. Newlines around the reasoning and
    at the start of the content are dropped, as Qwen's own templates do when they split
    `reasoning_content` out of a past assistant turn.
    """

    def __init__(
        self, start: str = "<think>", end: str = "</think>", started_in_prompt: bool = False
    ) -> None:
        self._start, self._end = start, end
        self._mode = "reasoning" if started_in_prompt else "detect"  # detect | reasoning | content
        self._buffer = ""
        self._at_section_start = True  # newlines here are dropped

    @property
    def in_reasoning(self) -> bool:
        return self._mode == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """Add a piece; return the (reasoning, content) text it releases."""
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of output: release whatever was held (an unfinished tag is plain text)."""
        text, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            return self._section(text).rstrip("\n"), ""
        return "", (self._section(text) if self._mode == "content" else text)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer can decide; True when the mode changed (run again)."""
        if self._mode == "content":
            content.append(self._section(self._buffer))
            self._buffer = ""
            return False
        if self._at_section_start:  # detecting, or reasoning that has not begun yet
            opened = self._open_tag()
            if opened is None:
                return False  # only whitespace or part of the start tag so far
            if not opened and self._mode == "detect":
                self._mode, self._at_section_start = "content", False
                return True
            self._mode = "reasoning"
        return self._step_reasoning(reasoning)

    def _open_tag(self) -> bool | None:
        """Strip a leading start tag: True if stripped, False if absent, None if undecided."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(self._start):
            self._buffer = stripped[len(self._start):]
            return True
        return None if self._start.startswith(stripped) else False

    def _step_reasoning(self, reasoning: list[str]) -> bool:
        index = self._buffer.find(self._end)
        if index >= 0:
            reasoning.append(self._section(self._buffer[:index]).rstrip("\n"))
            self._buffer = self._buffer[index + len(self._end):]
            self._mode, self._at_section_start = "content", True
            return True
        held = partial_suffix_len(self._buffer, (self._end,))
        body = self._buffer[: len(self._buffer) - held]
        body = body.rstrip("\n")  # trailing newlines wait: they are dropped before the end tag
        self._buffer = self._buffer[len(body):]
        reasoning.append(self._section(body))
        return False

    def _section(self, text: str) -> str:
        if self._at_section_start:
            text = text.lstrip("\n")
            self._at_section_start = not text
        return text


# ---------------------------------------------------------------------------------------------
# Tool calls
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of tool call `index`; id and name come with a call's first piece.

    Concatenating a call's `arguments` pieces gives its arguments JSON object.
    """

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            delta.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        delta["function"] = function
        return delta


def new_tool_call_id() -> str:
    return new_id("call_")


def tool_schemas(tools: Iterable[Any] | None) -> dict[str, dict[str, Any]]:
    """Function name -> JSON schema of its parameters, from OpenAI tools (dicts or models)."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        function = tool.get("function") or {}
        if function.get("name"):
            schemas[function["name"]] = function.get("parameters") or {}
    return schemas


class ToolCallParser:
    """Splits output into content text and tool calls, for both Qwen formats.

    A call is emitted (one delta: id, name, the whole arguments JSON) when its closing tag
    arrives and its body parses; otherwise its raw text is content, so no text is ever lost:
    a malformed body, or a call still open at the end of the output. Whitespace-only content
    between, before or after parsed calls is dropped (it is only the model's layout).
    """

    def __init__(self, tools: Iterable[Any] | None = None) -> None:
        self._schemas = tool_schemas(tools)
        self._buffer = ""
        self._in_call = False
        self._scan_from = 0  # where to resume looking for the end tag in an open call
        self._pending_space = ""  # whitespace-only content of the current segment, held
        self._segment_has_text = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add a piece; return the content text and tool-call deltas it releases."""
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: an unclosed call, or a partial start tag, is content."""
        content: list[str] = []
        if self._in_call:
            self._add_text(TOOL_CALL_START + self._buffer, content)
        elif self._buffer:
            self._add_text(self._buffer, content)
        if not self._segment_has_text and self.num_calls == 0:
            content.append(self._pending_space)
        self._buffer, self._in_call, self._pending_space = "", False, ""
        return "".join(content), []

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        if not self._in_call:
            index = self._buffer.find(TOOL_CALL_START)
            if index < 0:
                held = partial_suffix_len(self._buffer, (TOOL_CALL_START,))
                self._add_text(self._buffer[: len(self._buffer) - held], content)
                self._buffer = self._buffer[len(self._buffer) - held:]
                return False
            self._add_text(self._buffer[:index], content)
            self._buffer = self._buffer[index + len(TOOL_CALL_START):]
            self._in_call, self._scan_from = True, 0
            return True
        index = self._buffer.find(TOOL_CALL_END, self._scan_from)
        if index < 0:
            self._scan_from = max(0, len(self._buffer) - len(TOOL_CALL_END) + 1)
            return False
        body = self._buffer[:index]
        self._buffer = self._buffer[index + len(TOOL_CALL_END):]
        self._in_call = False
        self._close_call(body, content, deltas)
        return True

    def _close_call(self, body: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        call = parse_tool_call_body(body, self._schemas)
        if call is None:
            self._add_text(TOOL_CALL_START + body + TOOL_CALL_END, content)
            return
        deltas.append(ToolCallDelta(self.num_calls, call.arguments, id=call.id, name=call.name))
        self.num_calls += 1
        self._pending_space, self._segment_has_text = "", False

    def _add_text(self, text: str, content: list[str]) -> None:
        if self._segment_has_text:
            content.append(text)
            return
        self._pending_space += text
        if self._pending_space.strip():
            content.append(self._pending_space)
            self._pending_space, self._segment_has_text = "", True


def parse_tool_calls_complete(
    text: str, tools: Iterable[Any] | None = None
) -> tuple[str, list[ParsedToolCall]]:
    """Non-streaming twin of ToolCallParser (written apart from it; the tests check they agree)."""
    schemas = tool_schemas(tools)
    segments: list[str] = [""]  # text between parsed calls; raw (failed) calls count as text
    calls: list[ParsedToolCall] = []
    position = 0
    while (start := text.find(TOOL_CALL_START, position)) >= 0:
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end < 0:
            break
        segments[-1] += text[position:start]
        call = parse_tool_call_body(text[start + len(TOOL_CALL_START) : end], schemas)
        if call is None:
            segments[-1] += text[start : end + len(TOOL_CALL_END)]
        else:
            calls.append(call)
            segments.append("")
        position = end + len(TOOL_CALL_END)
    segments[-1] += text[position:]
    if calls:
        segments = [s for s in segments if s.strip()]
    return "".join(segments), calls


def parse_tool_call_body(
    body: str, schemas: Mapping[str, Mapping[str, Any]]
) -> ParsedToolCall | None:
    """The call inside one <tool_call>...</tool_call>, or None when it is malformed."""
    body = body.strip()
    if body.startswith("{"):
        parsed = _parse_hermes(body)
    elif body.startswith("<function="):
        parsed = _parse_xml(body, schemas)
    else:
        parsed = None
    if parsed is None:
        return None
    name, arguments = parsed
    try:  # inf (from 1e999) has no JSON spelling: clients must get valid JSON
        arguments_json = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return ParsedToolCall(new_tool_call_id(), name, arguments_json)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_hermes(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # model output: any malformed body stays content
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models encode the object a second time
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


def _parse_xml(
    body: str, schemas: Mapping[str, Mapping[str, Any]]
) -> tuple[str, dict[str, Any]] | None:
    match = _FUNCTION.match(body)
    if match is None or body[match.end():].strip():
        return None  # text after </function> (a second function?) would be lost: not a call
    name = match.group(1).strip()
    if not name:
        return None
    schema = schemas.get(name)
    # client-given schemas are only loosely validated: anything not a mapping is "unknown type"
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    properties = properties if isinstance(properties, Mapping) else {}
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(match.group(2)):
        key = parameter.group(1).strip()
        value = _strip_one_newline(parameter.group(2))
        arguments[key] = convert_parameter(value, properties.get(key))
    return name, arguments


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    if not isinstance(options, list):
        return []
    return [t for option in options for t in _schema_types(option)]


_NOT_CONVERTED = object()


def convert_parameter(value: str, schema: Mapping[str, Any] | None) -> Any:
    """An XML parameter's text as its JSON-schema type; text when the type is unknown or the
    text does not fit it (the model's words are kept rather than dropped)."""
    types = _schema_types(schema)
    for kind in sorted(types, key=lambda k: k == "string"):  # "string" last: it always fits
        if kind == "string":
            return value
        converted = _as_type(value.strip(), kind)
        if converted is not _NOT_CONVERTED:
            return converted
    return value


def _as_type(text: str, kind: str) -> Any:
    if kind == "null":
        return None if text in ("null", "None") else _NOT_CONVERTED
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT_CONVERTED)
    value = _load_literal(text)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    wanted = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list,)}
    if isinstance(value, wanted.get(kind, ())) and not isinstance(value, bool):
        return value
    return _NOT_CONVERTED


def _load_literal(text: str) -> Any:
    """JSON, or failing that a Python literal (models sometimes write {'a': 1} or True)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_CONVERTED
