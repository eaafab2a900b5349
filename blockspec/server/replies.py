"""OpenAI wire format, the answers: chat completions and their chunks, completions, usage,
logprobs, SGLang's meta_info, the model list (the requests: protocol.py)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from blockspec.server.ids import new_id
from blockspec.server.protocol import FinishReason, ToolCall


def _drop_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0                # prompt tokens served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class MetaInfo(BaseModel):
    """SGLang's speculative-decoding stats (z-lab's benchmark client reads them)."""

    model_config = ConfigDict(extra="allow")
    spec_verify_ct: int = 0
    spec_accept_length: float = 0.0
    spec_accept_histogram: list[int] = Field(default_factory=list)
    spec_verify_width_histogram: list[int] = Field(default_factory=list)   # [k]: verify passes of k drafts


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("reasoning_content", "tool_calls"))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob} maps."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl-"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    meta_info: MetaInfo | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("meta_info",))


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("name", "arguments"))


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("id", "type"))


class DeltaMessage(BaseModel):
    """One chunk's increment; absent fields are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("role", "content", "reasoning_content", "tool_calls"))


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
    meta_info: MetaInfo | None = None
    spec_cycles: list[dict[str, Any]] | None = None   # stream_options.include_spec_cycles only (playground, #26)

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("usage", "meta_info", "spec_cycles"))

    @staticmethod
    def new_id() -> str:
        return new_id("chatcmpl-")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A /v1/completions body; streamed chunks use the same shape (usage only on the last)."""

    id: str = Field(default_factory=lambda: new_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    meta_info: MetaInfo | None = None
    spec_cycles: list[dict[str, Any]] | None = None   # stream_options.include_spec_cycles only (playground, #26)

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), ("usage", "meta_info", "spec_cycles"))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blockspec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
