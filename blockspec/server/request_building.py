"""Building engine requests from API bodies, shared by chat, completions and responses: the
body (413 / 400), the checks that come before any work (model name, seed, drain, queue room),
prompts (chat template or raw text / ids), the output budget, sampling parameters and grammars.
Every refusal here is an ApiError raised before anything is submitted."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import pydantic
from fastapi import Request
from starlette.requests import ClientDisconnect

from blockspec.config import context_overflow
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request as EngineRequest
from blockspec.sampling import SamplingParams
from blockspec.sampling import check_seed as check_seed_range
from blockspec.server.errors import ApiError, retry_later, validation_error_message
from blockspec.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from blockspec.server.settings import ServerSettings
from blockspec.server.state import EngineHandle, ServerState
from blockspec.tokenizer import Tokenizer

# A body of either completion API: the fields they share (sampling, limits, logprobs).
Body = Union[ChatCompletionRequest, CompletionRequest]
Model = TypeVar("Model", bound=pydantic.BaseModel)
Grammar = Any      # an xgrammar CompiledGrammar (xgrammar is imported only when a request needs one)

# torch.Generator.manual_seed takes seeds in [-2**63, 2**64); outside it the engine would fail.
# chat_template_kwargs may not replace the arguments the server itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})

# Bounds on what one request may ask the template and tokenizer to handle (besides
# --max-body-bytes): beyond them a 400, before any rendering.
MAX_MESSAGES = 1024

MAX_TOOLS = 128

MAX_TOOL_BYTES = 32 * 1024          # one tool definition, as JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: 413 beyond max_bytes (declared or actual), else 400."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"The request body has {int(declared)} bytes; the limit is {max_bytes}.")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise ApiError(413, f"The request body exceeds the limit of {max_bytes} bytes.")
    except ClientDisconnect:
        raise ApiError(400, "The client went away while sending the request body.") from None
    try:
        value = json.loads(bytes(body), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(value, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return value


def validate(model: type[Model], body: dict[str, Any]) -> Model:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        message, param = validation_error_message(exc)
        raise ApiError(400, message, param) from None
    except Exception as exc:  # a validator tripped on an odd shape: still the input's fault
        raise ApiError(400, f"Invalid request: {exc}.") from None


def check_bounds(body: Body) -> None:
    """Message count, tool count and tool size: 400 beyond MAX_MESSAGES / MAX_TOOLS / MAX_TOOL_BYTES."""
    messages = getattr(body, "messages", None) or []
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"Invalid 'messages': {len(messages)} messages; the limit is {MAX_MESSAGES}.", "messages")
    tools = getattr(body, "tools", None) or []
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"Invalid 'tools': {len(tools)} tools; the limit is {MAX_TOOLS}.", "tools")
    for i, tool in enumerate(tools):
        size = len(tool.model_dump_json(exclude_none=True))
        if size > MAX_TOOL_BYTES:
            raise ApiError(400, f"Invalid 'tools[{i}]': its definition has {size} bytes of JSON; the limit "
                                f"is {MAX_TOOL_BYTES}.", "tools")


def check_model_name(settings: ServerSettings, name: str | None) -> None:
    if name and name not in (settings.model_name, settings.model):
        raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                            f"'{settings.model_name}'.", "model")


def check_not_draining(state: ServerState) -> None:
    if state.draining:
        raise retry_later("the server is shutting down; retry on another server")


def check_queue_room(engine: Engine, count: int = 1) -> None:
    """503 while the queue has no room for `count` more requests, decided before any tokenizing."""
    if count > engine.max_queue:
        raise ApiError(400, f"This request makes {count} generations (n × prompts); this server queues at "
                            f"most {engine.max_queue} at once.", "n")
    if engine.num_waiting + count > engine.max_queue:
        raise retry_later(f"the server is busy ({engine.num_waiting} requests waiting); retry shortly")


def check_seed(seed: int | None) -> None:
    try:
        check_seed_range(seed)
    except ValueError as exc:
        raise ApiError(400, f"Invalid 'seed': {exc}.", "seed") from None


def sampling_params(body: Body, max_tokens: int, choice: int = 0) -> SamplingParams:
    """Choice i of a request samples with seed + i (vLLM's rule for n > 1): reproducible, and
    the choices differ."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            min_p=body.min_p or 0.0,
            seed=None if body.seed is None else body.seed + choice,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias_pairs,
            min_tokens=min(body.min_tokens, max_tokens),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


@dataclass
class Prompt:
    token_ids: list[int]
    reasoning: bool = False             # parse <think> … </think> out of the output
    reasoning_started: bool = False     # the template opened <think> in the prompt
    text: str | None = None             # the prompt as the client wrote it (completions' echo)
    multimodal: Any = None              # its images (multimodal/prompt.py), placeholders expanded in token_ids


def template_message(message: ChatMessage) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if data["role"] == "developer":  # OpenAI's newer name for the system role
        data["role"] = "system"
    return data


def render_chat(tokenizer: Tokenizer, body: ChatCompletionRequest) -> Prompt:
    """Chat template → prompt ids; a template that refuses the conversation is a 400."""
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items()
              if k not in RESERVED_TEMPLATE_KWARGS}
    if body.thinking is not None:       # reasoning_effort; an explicit enable_thinking wins
        kwargs = {"enable_thinking": body.thinking, "reasoning_effort": body.reasoning_effort, **kwargs}
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools_enabled else None
    messages = [template_message(message) for message in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tools, add_generation_prompt=body.add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # template errors, bad tool-call arguments: the request's fault
        raise ApiError(400, f"The chat template could not render these messages: {exc}", "messages") from None
    if body.continue_final_message:
        text = open_final_message(text, body.messages[-1].text or "")
    has_think = tokenizer.token_to_id("</think>") is not None
    reasoning = has_think and kwargs.get("enable_thinking") is not False
    started = text.rstrip().endswith("<think>")
    return Prompt(tokenizer.encode(text, add_special_tokens=False), reasoning, reasoning and started)


def open_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the final message's text, so the template's
    end-of-turn tokens are gone and the model continues that message (vLLM's and transformers'
    continue_final_message)."""
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[: text.rindex(needle) + len(needle)]
    raise ApiError(400, "Invalid 'continue_final_message': the final message has no text that the chat "
                        "template renders, so there is nothing to continue.", "continue_final_message")


def completion_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(tokenizer.encode(prompt, add_special_tokens=True), text=prompt)
    vocab_size = tokenizer.vocab_size       # once: a property that asks the tokenizer each time
    too_big = [t for t in prompt if t >= vocab_size]
    if too_big:
        raise ApiError(400, f"Invalid 'prompt': token id {too_big[0]} is outside the vocabulary "
                            f"of {tokenizer.vocab_size}.", "prompt")
    return Prompt(list(prompt))


# Prompt work (tokenizing, rendering the template) runs on the event loop when it is small and on
# a worker thread when it may be long. A hop to a thread and back costs a few microseconds alone,
# but under load it waits for the GIL twice, behind the engine thread and every other request:
# measured 20-40 ms per request in a burst of 64 on two cores (docs/ARCHITECTURE.md, first tokens),
# against ~0.1 ms of work for a 64-token prompt. Below this many characters of text the work is
# well under a millisecond, so it stays on the loop.
INLINE_PROMPT_CHARS = 4096


def completion_prompts_are_small(prompts: list[str | list[int]]) -> bool:
    """Whether a completion's prompts are cheap to build on the loop: a short text is one fast
    tokenizer call; token ids are only compared with the vocabulary's size (64k of them ~2 ms)."""
    return sum(len(p) for p in prompts if isinstance(p, str)) <= INLINE_PROMPT_CHARS \
        and sum(len(p) for p in prompts if not isinstance(p, str)) <= 16 * INLINE_PROMPT_CHARS


def chat_prompt_is_small(body: ChatCompletionRequest) -> bool:
    """Whether a chat request's prompt is cheap to build on the loop: short text messages, no
    tools (their JSON schemas go through the template), no images to fetch, no grammar to compile."""
    if body.tools or body.grammar_request is not None:
        return False
    size = 0
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                return False
            size += sum(len(part.text or "") for part in content)
        else:
            size += len(content or "") + len(message.reasoning_content or "")
        if message.tool_calls:
            return False
    return size <= INLINE_PROMPT_CHARS


def requested_max_tokens(body: Body) -> tuple[str, int] | None:
    """The output limit the client asked for, with its parameter name; None if it left it out."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name, None)
        if name in body.model_fields_set and value is not None:
            return name, value
    return None


def output_budget(max_model_len: int, prompt: Prompt, body: Body) -> int:
    """max_tokens for the engine: a limit beyond the context left by the prompt is a 400 (as
    OpenAI and vLLM answer); no limit means the rest of the context."""
    room = max_model_len - len(prompt.token_ids)
    asked = requested_max_tokens(body)
    if asked is None:
        return max(1, min(body.max_new_tokens or room, room))
    name, value = asked
    overflow = context_overflow(value, len(prompt.token_ids), max_model_len)
    if overflow is not None:  # a prompt too long by itself: make_request says so
        raise ApiError(400, f"Invalid '{name}': {overflow} (or leave '{name}' out).", name)
    return value


def check_stop_token_ids(tokenizer: Tokenizer, body: Body) -> None:
    if not body.stop_token_ids:
        return
    vocab_size = tokenizer.vocab_size
    outside = [t for t in body.stop_token_ids if t >= vocab_size]
    if outside:
        raise ApiError(400, f"Invalid 'stop_token_ids': token id {outside[0]} is outside the vocabulary "
                            f"of {tokenizer.vocab_size}.", "stop_token_ids")


def check_logit_bias(llm: EngineHandle, body: Body) -> None:
    vocab = llm.vocab_size
    outside = [t for t, _ in body.logit_bias_pairs if t >= vocab]
    if outside:
        raise ApiError(400, f"Invalid 'logit_bias': token id {outside[0]} is outside the vocabulary "
                            f"of {vocab}.", "logit_bias")


def request_grammar(llm: EngineHandle, body: ChatCompletionRequest) -> Grammar | None:
    """The compiled grammar the output must follow (structured.py), or None. Compiling takes
    milliseconds (the first one per model ~1 s: xgrammar's view of the vocabulary), so it runs
    off the event loop; a schema xgrammar cannot compile is the client's 400."""
    wanted = body.grammar_request
    if wanted is None:
        return None
    from blockspec import structured
    kind, schema, strict = wanted
    if kind == "tool_call":
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        name = body.tool_choice.function.name if body.tool_choice != "required" else None
        schema = structured.tool_call_schema(tools, name)
    param = "tools" if kind == "tool_call" else "response_format"
    try:
        compiler = structured.grammar_compiler(llm.tokenizer, llm.vocab_size)
        return structured.compile_grammar(compiler, structured.GrammarSpec(kind, schema, strict))
    except structured.GrammarError as exc:
        where = "the tools' parameters" if kind == "tool_call" else "response_format.json_schema.schema"
        raise ApiError(400, f"Invalid '{param}': {where} cannot be compiled to a grammar: {exc}.", param) from None


def make_engine_request(llm: EngineHandle, request_id: str, prompt: Prompt, body: Body, choice: int = 0,
                        grammar: Grammar | None = None) -> EngineRequest:
    """grammar: request_grammar's compiled grammar; one may serve several requests (each
    sequence makes its own matcher). choice: the index among n (its seed is seed + choice)."""
    check_stop_token_ids(llm.tokenizer, body)
    check_logit_bias(llm, body)
    params = sampling_params(body, output_budget(llm.max_model_len, prompt, body), choice)
    try:
        images = {"multimodal": prompt.multimodal} if prompt.multimodal is not None else {}
        request = llm.make_request(request_id, prompt.token_ids, params, **images)
    except ValueError as exc:  # too long for --max-model-len, or empty
        param = "prompt" if isinstance(body, CompletionRequest) else "messages"
        raise ApiError(400, f"Invalid prompt: {exc}.", param) from None
    request.grammar = grammar
    request.num_logprobs = body.num_logprobs
    return request


async def read_body(state: ServerState, request: Request, model: type[Model]) -> Model:
    """The checks every generating route makes first, in order: draining (503), the body (413 /
    400), its schema (400), its size in messages and tools (400), the model name (404), the seed (400)."""
    check_not_draining(state)
    raw = await read_json_object(request, state.settings.max_body_bytes)
    body = validate(model, raw)
    if isinstance(body, (ChatCompletionRequest, CompletionRequest)):
        check_bounds(body)
    check_model_name(state.settings, getattr(body, "model", None))
    check_seed(getattr(body, "seed", None))
    return body
