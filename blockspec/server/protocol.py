"""OpenAI wire format: request validation and the error object (the answers' models: replies.py).

Everything rejectable is rejected here, before any work: the app turns a pydantic
ValidationError into one 400 answer with `validation_error_message` (never 422).
Unknown request fields are ignored (clients send vendor extensions freely).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 16
MAX_INT32 = 2**31 - 1  # bound on counts and token ids: beyond it, a request is nonsense
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_CHOICES = 128      # n × prompts of one request; each is an engine request

FinishReason = Literal["stop", "length", "tool_calls"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None   # accepted; the image processor's budget decides


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_as_object(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI sends it this way)

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_as_text(cls, value: Any) -> Any:
        # Some clients echo arguments back as an object; keep one representation.
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # before content: content's validator reads it
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            role = info.data.get("role")
            if role == "assistant" and info.data.get("tool_calls"):
                return value
            raise ValueError(
                f"a {role or 'chat'} message needs content (only an assistant message with "
                "tool_calls may omit it)"
            )
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError("an image_url part needs image_url.url (a data: or http(s) URL)")
            elif kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"only text and image_url content parts are supported (got type {kind!r})"
                )
        return value

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as the tokenizer renders
        them and as vLLM does), or None."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: bool = False
    # blockspec's extension (the playground, #26): per-chunk verify-cycle data (ARCHITECTURE.md §5)
    include_spec_cycles: bool = False


def _validate_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings (got {len(value)})")
    return value


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _reject_unless(value: Any, accepted: Any, name: str) -> Any:
    if value is not None and value != accepted:
        raise ValueError(f"{name}={value!r} is not supported by this server (only {accepted!r})")
    return value


class _SamplingFields(_Request):
    """Fields shared by chat and text completions, validated the same way."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    ignore_eos: bool = False
    return_meta_info: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        return _validate_stop(value)

    @field_validator("n")
    @classmethod
    def _some_choices(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}] (got {value})")
        return value

    @property
    def num_choices(self) -> int:
        """Choices per prompt."""
        return self.n or 1

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValueError(f"{info.field_name} must be in [-2, 2] (got {value})")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty_range(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (got {value})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids (got {key!r})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100] (got {bias} for token {key})")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings dropped."""
        return _stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# OpenAI's reasoning_effort values, lowest first.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class _ChatOnlyFields(_Request):
    """OpenAI chat parameters beyond sampling: refused with a 400 naming them where this server
    cannot honour them (never accepted and ignored), accepted where honouring them is the
    default answer (modalities ["text"], service_tier auto/default, store false). `user`,
    `safety_identifier` and `prompt_cache_key` identify the caller for OpenAI's abuse
    monitoring and cache routing, and `prompt_cache_options` / `prompt_cache_retention` are
    cache hints; none can change an output, so they are accepted."""

    audio: Any = None
    moderation: Any = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("audio", "moderation", "prediction", "web_search_options", "verbosity")
    @classmethod
    def _chat_only_not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _chat_only_known_effort(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} (got {value!r})")
        return value

    @property
    def thinking(self) -> bool | None:
        """The chat template's enable_thinking that reasoning_effort implies (Qwen3-style
        templates): none / minimal → off, low and above → on; None when it was not sent."""
        if self.reasoning_effort is None:
            return None
        return self.reasoning_effort not in ("none", "minimal")

    @field_validator("modalities")
    @classmethod
    def _chat_only_text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) != {"text"}:
            raise ValueError(f"modalities {value} are not supported by this server (only ['text'])")
        return value

    @field_validator("service_tier")
    @classmethod
    def _chat_only_one_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise ValueError(f"service_tier {value!r} is not supported by this server (only 'auto' or 'default')")
        return value

    @field_validator("store")
    @classmethod
    def _chat_only_nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("store=true is not supported: this server stores no completions")
        return value

    @field_validator("metadata")
    @classmethod
    def _chat_only_no_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value:
            raise ValueError("metadata is not supported: it tags stored completions, and this server stores none")
        return value


class ChatCompletionRequest(_SamplingFields, _ChatOnlyFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None  # declared before tool_choice: its validator reads it
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's prompt controls: continue_final_message leaves the last (assistant) message open,
    # so the model continues it; it needs add_generation_prompt false, as vLLM requires.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The legacy function-calling API (deprecated by OpenAI): refused, never ignored.
    functions: Any = None
    function_call: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            replacement = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"the legacy '{info.field_name}' API is not supported by this server; "
                             f"send '{replacement}' instead")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue_needs_no_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(send add_generation_prompt: false to continue the final message)")
        return value

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in ("none", "auto"):
            return value
        if isinstance(value, str) and value != "required":
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}} (got {value!r})"
            )
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("tool_choice requires 'tools' to be given")
        if isinstance(value, dict):
            function = value.get("function")
            if value.get("type") != "function" or not isinstance(function, dict):
                raise ValueError("a named tool_choice must be {'type': 'function', 'function': {'name': ...}}")
            name = function.get("name")
            known = [t.function.name for t in tools]
            if name not in known:
                raise ValueError(
                    f"tool_choice names function {name!r}, which is not in tools {known}"
                )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {value})")
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its top k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = None if value is None else value.get("type", "text")
        if value is None or kind in ("text", "json_object"):
            return value
        if kind != "json_schema":
            raise ValueError(f"type must be 'text', 'json_object' or 'json_schema' (got {kind!r})")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("json_schema must be an object {'name': ..., 'schema': {...}, 'strict': ...}")
        return value

    @property
    def grammar_request(self) -> tuple[str, dict[str, Any] | None, bool] | None:
        """What the output must follow: (kind, schema, strict), kind json_object | json_schema
        | tool_call (tool_choice required or named); None when the output is free."""
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            return "tool_call", None, True
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return "json_object", None, False
        if kind == "json_schema":
            spec = self.response_format["json_schema"]
            if not spec.get("schema"):          # no schema: any object
                return "json_object", None, False
            return "json_schema", spec["schema"], spec.get("strict") is not False
        return None

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (the current OpenAI name) wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    user: str | None = None  # identifies the caller to OpenAI; cannot change an output
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(f"best_of={value} is not supported by this server: it must equal n ({n}), "
                             "since choices are not ranked")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompts(cls, value: Any) -> Any:
        prompts = value if isinstance(value, list) and value and not _is_token_id(value[0]) else [value]
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"prompt holds {len(prompts)} prompts; at most {MAX_CHOICES}")
        for prompt in prompts:
            _check_one_prompt(prompt)
        if len({isinstance(prompt, str) for prompt in prompts}) > 1:
            raise ValueError("a prompt list must hold only strings or only token-id lists, not both")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one string or token-id list per prompt."""
        value = self.prompt
        return [value] if isinstance(value, str) or _is_token_id(value[0]) else list(value)

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo together with logprobs is not supported by this server (the prompt's "
                             "logprobs are not computed); send one of them")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_one_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("a prompt must be a non-empty string or a non-empty list of token ids")
    if not all(_is_token_id(t) and t >= 0 for t in prompt):
        raise ValueError("prompt token ids must be non-negative integers")
