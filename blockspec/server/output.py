"""Per-request output processing: token ids -> content, reasoning and tool-call deltas.

One path for plain and DFlash decoding (invariant 7): both hand over committed token ids, in
pieces of any size, and everything textual happens here, once:

    token ids -> detokenizer -> stop strings (on the raw text, as vLLM does)
              -> <think> reasoning parser -> tool-call parser -> OutputDelta

Streaming sends each OutputDelta; non-streaming adds them up (OutputAccumulator), so the two
can't disagree. Text is never taken back: whatever might still turn into a stop string or a
tag is held until the next piece decides it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from blockspec.server.parsers import (
    ParsedToolCall,
    ReasoningParser,
    ToolCallDelta,
    ToolCallParser,
    partial_suffix_len,
)


class Detokenizer(Protocol):
    def add(self, ids: list[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    stop_hit: bool = False  # a stop string matched: the caller must abort the engine request
    finish_reason: str | None = None  # set on the last delta of a request, exactly once
    logprobs: list[Any] = field(default_factory=list)  # of the tokens counted here (when asked)

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls or self.finish_reason or self.logprobs)


class StopStringFilter:
    """Releases text up to (never including) the first stop string.

    The longest tail that could still grow into a stop string is held back. When several
    stop strings match, the one completed first wins, as if the text came one char at a time:
    that makes the result independent of how the text was split.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stop = [s for s in stop if s]
        self._held = ""

    @property
    def is_empty(self) -> bool:
        """No stop strings: every text is released as it comes."""
        return not self._stop

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text released, whether a stop string matched)."""
        self._held += text
        match = self._first_match()
        if match is not None:
            released, self._held = self._held[:match], ""
            return released, True
        keep = partial_suffix_len(self._held, self._stop)
        released = self._held[: len(self._held) - keep]
        self._held = self._held[len(released):]
        return released, False

    def flush(self) -> str:
        """End of output: a held partial match is plain text after all."""
        released, self._held = self._held, ""
        return released

    def _first_match(self) -> int | None:
        """Start of the match that ends first (ties: the longer one)."""
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = self._held.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]


class OutputProcessor:
    """Turns one request's token ids into OutputDeltas; ends exactly once.

    `process(ids, finished)` is called with each batch of committed ids the engine emits
    (already cut at stop ids); `finished` is the engine's reason on the last batch ("stop",
    "length", "abort", ...). A stop string ends the output itself (stop_hit); after the end,
    further ids are refused: no text, no usage.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: Sequence[str] = (),
        *,
        reasoning: bool = False,
        reasoning_started_in_prompt: bool = False,
        tools_enabled: bool = False,
        tools: Iterable[Any] | None = None,
        max_tool_calls: int | None = None,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = StopStringFilter(stop)
        self._reasoning = (
            ReasoningParser(started_in_prompt=reasoning_started_in_prompt) if reasoning else None
        )
        self._tool_calls = ToolCallParser(tools) if tools_enabled else None
        self._max_tool_calls = max_tool_calls   # parallel_tool_calls: false → 1; later calls dropped
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tool_calls(self) -> int:
        return self._tool_calls.num_calls if self._tool_calls else 0

    def process(self, token_ids: Sequence[int], finished: str | None = None,
                logprobs: Sequence[Any] | None = None) -> OutputDelta:
        """`logprobs`, when given, has one entry per id; the delta keeps those of counted ids."""
        delta = OutputDelta()
        if self.is_finished:
            return delta
        if self._stop.is_empty:      # nothing can end the count early: the ids' text at once
            self.completion_tokens += len(token_ids)
            if logprobs is not None:
                delta.logprobs.extend(logprobs[: len(token_ids)])
            self._add_text(self._detokenizer.add(list(token_ids)), delta)
        else:                         # one id at a time: a stop string ends the count at the id that completed it
            for i, token_id in enumerate(token_ids):
                self.completion_tokens += 1
                if logprobs is not None:
                    delta.logprobs.append(logprobs[i])
                if self._add_text(self._detokenizer.add([token_id]), delta):
                    return self._finish(delta, "stop", stop_hit=True)
        if finished is None:
            return delta
        if self._add_text(self._detokenizer.flush(), delta):
            return self._finish(delta, "stop", stop_hit=True)
        self._parse(self._stop.flush(), delta)
        return self._finish(delta, finished)

    def _add_text(self, text: str, delta: OutputDelta) -> bool:
        released, is_stop = self._stop.feed(text)
        self._parse(released, delta)
        return is_stop

    def _parse(self, text: str, delta: OutputDelta, is_last: bool = False) -> None:
        reasoning, content = ("", text)
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if is_last:
                more_reasoning, more_content = self._reasoning.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        delta.reasoning += reasoning
        if self._tool_calls is not None:
            content, calls = self._tool_calls.feed(content)
            delta.tool_calls.extend(self._allowed(calls))
            if is_last:
                more_content, calls = self._tool_calls.flush()
                content += more_content
                delta.tool_calls.extend(self._allowed(calls))
        delta.content += content

    def _allowed(self, calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
        if self._max_tool_calls is None:
            return calls
        return [call for call in calls if call.index < self._max_tool_calls]

    def _finish(self, delta: OutputDelta, reason: str, stop_hit: bool = False) -> OutputDelta:
        self._parse("", delta, is_last=True)
        if reason == "stop" and self.num_tool_calls:
            reason = "tool_calls"
        self.finish_reason = delta.finish_reason = reason
        delta.stop_hit = stop_hit
        return delta


@dataclass
class OutputAccumulator:
    """Adds OutputDeltas up into a whole response (the non-streaming answer)."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    deltas: list[OutputDelta] = field(default_factory=list)      # as they came (the Responses API regroups them)
    _calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [id, name, arguments]

    def add(self, delta: OutputDelta) -> None:
        self.deltas.append(delta)
        self.content += delta.content
        self.logprobs += delta.logprobs
        self.reasoning += delta.reasoning
        for piece in delta.tool_calls:
            call = self._calls.setdefault(piece.index, ["", "", ""])
            call[0] = piece.id if piece.id is not None else call[0]
            call[1] = piece.name if piece.name is not None else call[1]
            call[2] += piece.arguments
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        return [ParsedToolCall(*self._calls[index]) for index in sorted(self._calls)]
