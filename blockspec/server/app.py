"""The HTTP front end: FastAPI routes, SSE, auth, CORS, limits, metrics, lifespan.

A request's way through this file (ARCHITECTURE.md §1):

    read body (413) → JSON (400) → pydantic (400, never 422) → model name (404)
    → queue room (503 + Retry-After, before tokenizing) → chat template / tokenize (400)
    → engine.submit → events cross from the engine thread with call_soon_threadsafe
    → OutputProcessor (the one output path for plain and DFlash) → SSE chunks or one body

Every rejection happens before the first byte of a response. The engine thread is the only
code that touches the models; this file never does. A request that ends here for any reason
(stop string, client gone, error) is aborted in the engine, which stops it within one cycle:
nothing generates for a request nobody reads (seeds #224).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from blockspec.engine.engine import Engine, QueueFullError
from blockspec.engine.request import GenerationStats, TokenEvent
from blockspec.engine.request import Request as EngineRequest
from blockspec.sampling import SamplingParams
from blockspec.sampling import check_seed as check_seed_range
from blockspec.server import responses
from blockspec.server.logprobs import chat_logprobs, completion_logprobs
from blockspec.server.responses import ResponsesRequest
from blockspec.server.spec_cycles import SpecCycles, wants_spec_cycles  # playground (#26)
from blockspec.server.output import OutputAccumulator, OutputDelta, OutputProcessor
from blockspec.server.protocol import (ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                                       ChatCompletionChunkChoice, ChatCompletionMessage,
                                       ChatCompletionRequest, Completion, CompletionChoice,
                                       CompletionRequest, DeltaMessage, DeltaToolCall, FunctionCall,
                                       MetaInfo, ModelCard, ModelList, ToolCall, UsageInfo, error_body,
                                       validation_error_message)
from blockspec.tokenizer import IncrementalDetokenizer

RETRY_AFTER_S = 1
# After the drain (--shutdown-timeout) has ended every request, the streams get this long to
# write their last events; uvicorn's own cancel is only a backstop behind it.
FINAL_WRITE_S = 5.0
# torch.Generator.manual_seed takes seeds in [-2**63, 2**64); outside it the engine would fail.
# chat_template_kwargs may not replace the arguments the server itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
DONE = b"data: [DONE]\n\n"
# Bounds on what one request may ask the template and tokenizer to handle (besides
# --max-body-bytes): beyond them a 400, before any rendering.
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_TOOL_BYTES = 32 * 1024          # one tool definition, as JSON


# ---------------------------------------------------------------------------------------------
# Settings and errors
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    model: str
    draft: str | None = None
    block_size: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 64
    max_num_seqs: int = 32
    cors: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 30.0
    ui: bool = True                      # playground (#26): GET / (off with --no-ui)

    def __post_init__(self) -> None:
        # Engine limits (block size, queue, sequences) are checked once, by EngineConfig.
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1 (got {self.max_body_bytes})")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0 (got {self.shutdown_timeout})")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        names = cls.__dataclass_fields__
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    @property
    def model_name(self) -> str:
        """--served-model-name, else the last part of the model path or hub id."""
        return self.served_model_name or os.path.basename(self.model.rstrip("/\\")) or self.model

    @property
    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in (self.cors or "").split(",") if origin.strip()]


class ApiError(Exception):
    """An answer other than 200, sent as the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), self.status, self.headers)


class GenerationFailed(Exception):
    """The engine ended a request with an error, or dropped it at shutdown (finish_reason abort)."""

    def __init__(self, status: int, message: str, finish_reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.finish_reason = status, message, finish_reason
        self.index = 0                     # the choice it ended (set where several are merged)


def retry_later(message: str) -> ApiError:
    return ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


# ---------------------------------------------------------------------------------------------
# Server state: loading, the engine, metrics
# ---------------------------------------------------------------------------------------------


class EngineCollector:
    """Gauges and counters read from the engine at scrape time (its counters grow per event)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    def collect(self):
        engine = self._state.engine
        counters = engine.counters if engine is not None else None
        yield GaugeMetricFamily("blockspec_requests_running", "Requests being decoded",
                                value=engine.num_running if engine else 0)
        yield GaugeMetricFamily("blockspec_requests_waiting", "Requests queued for the engine",
                                value=engine.num_waiting if engine else 0)
        yield GaugeMetricFamily("blockspec_kv_cache_usage_perc", "Fraction of KV-pool pages in use (0..1)",
                                value=engine.kv_cache_usage if engine else 0.0)
        yield batch_size_histogram(counters.decode_batch_sizes if counters else {})
        for name, field, doc in (
            ("blockspec_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
            ("blockspec_generation_tokens", "generation_tokens", "Output tokens committed"),
            ("blockspec_spec_verify", "spec_verify", "DFlash verify passes"),
            ("blockspec_spec_draft_tokens", "spec_draft_tokens", "Draft tokens proposed and verified"),
            ("blockspec_spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
        ):
            yield CounterMetricFamily(name, doc, value=getattr(counters, field) if counters else 0)


BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_size_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Sequences per decode cycle, from the engine's exact counts (size → cycles)."""
    counts = dict.copy(counts)         # one atomic copy: the engine thread may add a size meanwhile
    cumulative = [sum(n for size, n in counts.items() if size <= bound) for bound in BATCH_SIZE_BUCKETS]
    buckets = [(str(bound), count) for bound, count in zip(BATCH_SIZE_BUCKETS, cumulative)]
    total = sum(counts.values())
    buckets.append(("+Inf", total))
    return HistogramMetricFamily("blockspec_batch_size", "Sequences per decode cycle", buckets=buckets,
                                 sum_value=sum(size * n for size, n in counts.items()))


class Metrics:
    """One registry per app, so several apps (tests) never share or clash."""

    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(state))
        self.requests = Counter("blockspec_requests", "Requests ended, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "blockspec_time_to_first_token_seconds", "Arrival to the first output token",
            registry=self.registry)
        self.e2e_latency = Histogram(
            "blockspec_e2e_request_latency_seconds", "Arrival to the end of the request",
            registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


LLMFactory = Callable[[], Any]


class ServerState:
    """What the routes share: settings, the loaded model and engine (None while loading)."""

    def __init__(self, settings: ServerSettings, llm_factory: LLMFactory) -> None:
        self.settings = settings
        self.llm_factory = llm_factory
        self.llm: Any = None
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.started_at = time.monotonic()
        self.metrics = Metrics(self)
        # The drain (SIGTERM): requests being answered, and the generations still open.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.interrupted = False        # the drain ran out: open generations were ended, none may start
        self.in_flight = 0
        self.generations: set[Generation] = set()

    def start_loading(self) -> None:
        """Load in a daemon thread, so /health answers "loading" meanwhile."""
        threading.Thread(target=self._load, name="blockspec-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            llm = self.llm_factory()
            engine = llm.engine               # the LLM built it; from now on only its thread steps it
            engine.start()
        except BaseException as exc:  # noqa: BLE001 - reported on /health and by serve()
            traceback.print_exc()
            self.load_error = exc
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        self.llm = llm
        self.engine = engine  # set last: a non-None engine means ready

    def ready(self) -> tuple[Any, Engine]:
        if self.engine is None:
            if self.load_error is not None:
                raise ApiError(500, f"the model failed to load: {self.load_error}")
            raise retry_later("the model is still loading; retry shortly")
        return self.llm, self.engine

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def drain(self, timeout: float) -> None:
        """SIGTERM: admit nothing more (503), let open requests finish for up to `timeout`
        seconds, then end the rest (a stream: error event and [DONE]; else a 503 body), queued
        ones included, and give them FINAL_WRITE_S to write it."""
        self.draining = True
        await wait_for_condition(lambda: self.in_flight == 0, timeout)
        self.interrupted = True  # a request admitted before the signal but not submitted yet (its
        # prompt or grammar still in a worker thread) would otherwise start after this point
        for generation in list(self.generations):
            generation.interrupt()
        await wait_for_condition(lambda: self.in_flight == 0, FINAL_WRITE_S)


async def wait_for_condition(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


class CountInFlight:
    """ASGI wrapper counting HTTP requests until their last byte is sent (a stream's too), so
    the drain knows when every answer is out."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def default_llm_factory(settings: ServerSettings) -> LLMFactory:
    def load() -> Any:
        from blockspec.llm import LLM
        return LLM(settings.model, draft=settings.draft, block_size=settings.block_size,
                   dtype=settings.dtype, device=settings.device, max_model_len=settings.max_model_len,
                   max_num_seqs=settings.max_num_seqs, max_queue=settings.max_queue)
    return load


def memory_info() -> dict[str, int]:
    """Resident memory of the process and, when CUDA is in use, the allocator's view."""
    info: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as statm:
            info["rss_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        info["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        info["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated())
        info["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved())
    return info


# ---------------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------------


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


def validate(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        message, param = validation_error_message(exc)
        raise ApiError(400, message, param) from None
    except Exception as exc:  # a validator tripped on an odd shape: still the input's fault
        raise ApiError(400, f"Invalid request: {exc}.") from None


def check_bounds(body: Any) -> None:
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


def sampling_params(body: Any, max_tokens: int, choice: int = 0) -> SamplingParams:
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


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    token_ids: list[int]
    reasoning: bool = False             # parse <think> … </think> out of the output
    reasoning_started: bool = False     # the template opened <think> in the prompt
    text: str | None = None             # the prompt as the client wrote it (completions' echo)


def template_message(message: Any) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if data["role"] == "developer":  # OpenAI's newer name for the system role
        data["role"] = "system"
    return data


def render_chat(tokenizer: Any, body: ChatCompletionRequest) -> Prompt:
    """Chat template → prompt ids; a template that refuses the conversation is a 400."""
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items()
              if k not in RESERVED_TEMPLATE_KWARGS}
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


def completion_prompt(tokenizer: Any, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(tokenizer.encode(prompt, add_special_tokens=True), text=prompt)
    too_big = [t for t in prompt if t >= tokenizer.vocab_size]
    if too_big:
        raise ApiError(400, f"Invalid 'prompt': token id {too_big[0]} is outside the vocabulary "
                            f"of {tokenizer.vocab_size}.", "prompt")
    return Prompt(list(prompt))


def render_prompts(tokenizer: Any, body: Any, kind: str) -> list[Prompt]:
    if kind == "chat":
        return [render_chat(tokenizer, body)]
    return [completion_prompt(tokenizer, prompt) for prompt in body.prompts]


def requested_max_tokens(body: Any) -> tuple[str, int] | None:
    """The output limit the client asked for, with its parameter name; None if it left it out."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name, None)
        if name in body.model_fields_set and value is not None:
            return name, value
    return None


def output_budget(max_model_len: int, prompt: Prompt, body: Any) -> int:
    """max_tokens for the engine: a limit beyond the context left by the prompt is a 400 (as
    OpenAI and vLLM answer); no limit means the rest of the context."""
    room = max_model_len - len(prompt.token_ids)
    asked = requested_max_tokens(body)
    if asked is None:
        return max(1, min(body.max_new_tokens or room, room))
    name, value = asked
    if room >= 1 and value > room:  # room < 1: make_request says the prompt is too long
        raise ApiError(400, f"Invalid '{name}': {value} output tokens plus the prompt's "
                            f"{len(prompt.token_ids)} exceed the context of {max_model_len} tokens; "
                            f"ask for at most {room} (or leave '{name}' out).", name)
    return value


def check_stop_token_ids(tokenizer: Any, body: Any) -> None:
    outside = [t for t in body.stop_token_ids or () if t >= tokenizer.vocab_size]
    if outside:
        raise ApiError(400, f"Invalid 'stop_token_ids': token id {outside[0]} is outside the vocabulary "
                            f"of {tokenizer.vocab_size}.", "stop_token_ids")


def check_logit_bias(llm: Any, body: Any) -> None:
    vocab = llm.target.lm_head.weight.shape[0] if hasattr(llm, "target") else llm.tokenizer.vocab_size
    outside = [t for t, _ in body.logit_bias_pairs if t >= vocab]
    if outside:
        raise ApiError(400, f"Invalid 'logit_bias': token id {outside[0]} is outside the vocabulary "
                            f"of {vocab}.", "logit_bias")


def request_grammar(llm: Any, body: Any) -> Any:
    """The compiled grammar the output must follow (structured.py), or None. Compiling takes
    milliseconds (the first one per model ~1 s: xgrammar's view of the vocabulary), so it runs
    off the event loop; a schema xgrammar cannot compile is the client's 400."""
    wanted = body.grammar_request if isinstance(body, ChatCompletionRequest) else None
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
        compiler = structured.grammar_compiler(llm.tokenizer, llm.target.lm_head.weight.shape[0])
        return structured.compile_grammar(compiler, structured.GrammarSpec(kind, schema, strict))
    except structured.GrammarError as exc:
        where = "the tools' parameters" if kind == "tool_call" else "response_format.json_schema.schema"
        raise ApiError(400, f"Invalid '{param}': {where} cannot be compiled to a grammar: {exc}.", param) from None


def make_engine_request(llm: Any, request_id: str, prompt: Prompt, body: Any, choice: int = 0,
                        grammar: Any = None) -> EngineRequest:
    """grammar: request_grammar's compiled grammar; one may serve several requests (each
    sequence makes its own matcher). choice: the index among n (its seed is seed + choice)."""
    check_stop_token_ids(llm.tokenizer, body)
    check_logit_bias(llm, body)
    params = sampling_params(body, output_budget(llm.max_model_len, prompt, body), choice)
    try:
        request = llm.make_request(request_id, prompt.token_ids, params)
    except ValueError as exc:  # too long for --max-model-len, or empty
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise ApiError(400, f"Invalid prompt: {exc}.", param) from None
    request.grammar = grammar
    request.num_logprobs = body.num_logprobs
    return request


# ---------------------------------------------------------------------------------------------
# One generation, seen from the event loop
# ---------------------------------------------------------------------------------------------


class Generation:
    """Submits one engine request and turns its events into OutputDeltas.

    Events are produced on the engine thread and cross to the event loop through
    call_soon_threadsafe into this request's own asyncio.Queue. The request ends here exactly
    once: finished (stop / length / tool_calls), aborted (stop string hit, client gone), or
    failed; `close` aborts the engine request unless it finished, so its compute stops.
    """

    def __init__(self, state: ServerState, engine: Engine, request: EngineRequest,
                 processor: OutputProcessor, arrival: float) -> None:
        self.state, self.engine, self.request, self.processor = state, engine, request, processor
        self.arrival = arrival
        self._loop = asyncio.get_running_loop()
        # One pending event, at most: the engine thread merges into it while this side is
        # behind (a slow reader), so it never blocks and memory stays bounded by the output.
        self._pending: TokenEvent | None = None
        self._pending_lock = threading.Lock()
        self._ready = asyncio.Event()
        self._has_first_token = False
        self._ended = False
        self._final_stats: GenerationStats | None = None
        self.spec_cycles: SpecCycles | None = None   # playground (#26): stream_options.include_spec_cycles

    @property
    def stats(self) -> GenerationStats:
        """Frozen when the output finished: after a stop string the engine may still finish
        the cycle in flight, which must not change what this response reports."""
        return self._final_stats or self.request.stats

    def submit(self) -> None:
        if self.state.interrupted:
            raise retry_later("the server is shutting down; retry on another server")
        try:
            self.engine.submit(self.request, self._on_event)
        except QueueFullError as exc:
            raise retry_later(f"the server is busy: {exc}; retry shortly") from None
        self.state.generations.add(self)

    def _on_event(self, event: TokenEvent) -> None:  # engine thread (or the loop, for interrupt)
        if self.spec_cycles is not None:  # playground (#26): before the event can be read
            self.spec_cycles.record(event, self.request.stats)
        with self._pending_lock:
            was_empty = self._pending is None
            self._pending = event if was_empty else merge_events(self._pending, event)
        if was_empty:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.request.abort()

    async def _next_event(self) -> TokenEvent:
        while True:
            await self._ready.wait()
            with self._pending_lock:
                event, self._pending = self._pending, None
                self._ready.clear()
            if event is not None:
                return event

    @property
    def num_pending_tokens(self) -> int:
        """Committed tokens not yet taken by the output side (tests: the slot stays bounded)."""
        with self._pending_lock:
            return len(self._pending.token_ids) if self._pending is not None else 0

    def interrupt(self) -> None:
        """The drain ran out: end this request now, whatever it is doing."""
        self.request.abort()
        self._on_event(TokenEvent(self.request.request_id, [], "shutdown"))

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        try:
            while not self.processor.is_finished:
                event = await self._next_event()
                self._check(event)
                self._observe_first_token(event)
                delta = self._process(event)
                if delta.stop_hit:
                    self.request.abort()  # the engine stops within one cycle
                if not delta.is_empty:
                    yield delta
            stats = self.request.stats
            self._final_stats = dataclasses.replace(stats, acceptance_lengths=list(stats.acceptance_lengths))
            self._end(self.processor.finish_reason or "stop")
        finally:
            self.close()

    def _process(self, event: TokenEvent) -> OutputDelta:
        try:
            if self.spec_cycles is not None:  # playground (#26)
                return self.spec_cycles.process(self.processor, event)
            return self.processor.process(event.token_ids, event.finish_reason, event.logprobs)
        except Exception as exc:  # a parser bug must cost one request, never the connection
            traceback.print_exc()
            self.request.abort()
            self._end("error")
            raise GenerationFailed(500, f"output processing failed: {type(exc).__name__}") from None

    async def collect(self) -> OutputAccumulator:
        accumulator = OutputAccumulator()
        async for delta in self.deltas():
            accumulator.add(delta)
        return accumulator

    def close(self) -> None:
        """Idempotent: abort what did not finish (client gone, error) and count it once."""
        if not self.processor.is_finished:
            self.request.abort()
        self._end("abort")

    def _check(self, event: TokenEvent) -> None:
        if event.finish_reason == "error":
            self._end("error")
            raise GenerationFailed(500, f"generation failed: {event.error or 'engine error'}")
        if event.finish_reason in ("abort", "shutdown"):  # not ours: the server is stopping
            self._end("abort")
            raise GenerationFailed(503, "the server shut down before this request finished; retry on "
                                        "another server", finish_reason="abort")

    def _observe_first_token(self, event: TokenEvent) -> None:
        if event.token_ids and not self._has_first_token:
            self._has_first_token = True
            self.state.metrics.time_to_first_token.observe(time.monotonic() - self.arrival)

    def _end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self.state.generations.discard(self)
        self.state.metrics.requests.labels(finish_reason=reason).inc()
        self.state.metrics.e2e_latency.observe(time.monotonic() - self.arrival)


def merge_events(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """Two events of one request not yet read, as one; a final event stays final."""
    if first.finish_reason is not None:
        return first
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return TokenEvent(then.request_id, first.token_ids + then.token_ids, then.finish_reason, then.stats, then.error,
                      logprobs)


def meta_info(choices: list[Choice]) -> MetaInfo:
    """SGLang's spec stats, computed as SGLang does: spec_accept_length = completion tokens ÷
    verify passes (the prefill's first token included, so it is the mean acceptance length plus
    1/verify passes); spec_accept_histogram[i] = verify passes that accepted i drafts (each
    committed i + 1 tokens). A plain server reports zeros, having no verify passes. Several
    choices (n > 1) add up."""
    stats = [c.generation.stats for c in choices if c.generation.stats.speculative]
    lengths = [length for s in stats for length in s.acceptance_lengths]
    histogram = [0] * max(lengths) if lengths else []
    for length in lengths:
        histogram[length - 1] += 1
    completion_tokens = sum(c.generation.processor.completion_tokens for c in choices)
    accepted, drafts, num_verify = sum(h * i for i, h in enumerate(histogram)), sum(s.draft_tokens for s in stats), len(lengths)
    return MetaInfo(spec_verify_ct=num_verify,
                    spec_accept_length=completion_tokens / num_verify if num_verify else 0.0,
                    spec_accept_histogram=histogram, spec_accept_rate=accepted / drafts if drafts else 0.0,
                    spec_accept_token_num=accepted, spec_draft_token_num=drafts)


# ---------------------------------------------------------------------------------------------
# The choices of one request: n per prompt, each its own engine request, decoded as one batch
# ---------------------------------------------------------------------------------------------


@dataclass
class Choice:
    index: int                  # prompt p, choice i → p · n + i (vLLM's order)
    prompt: Prompt
    generation: Generation
    counts_prompt: bool         # usage counts each prompt once, not once per choice
    echo: str = ""              # completions' echo: the prompt's text, sent before the output


def make_choices(state: ServerState, llm: Any, engine: Engine, response_id: str, prompts: list[Prompt],
                 body: Any, kind: str, arrival: float, grammar: Any = None) -> list[Choice]:
    n, choices = body.num_choices, []
    for p, prompt in enumerate(prompts):
        echo = ""
        if kind != "chat" and body.echo:
            echo = prompt.text if prompt.text is not None else llm.tokenizer.decode(prompt.token_ids)
        for i in range(n):
            index = p * n + i
            request = make_engine_request(llm, f"{response_id}-{index}", prompt, body, choice=i, grammar=grammar)
            processor = make_processor(llm.tokenizer, prompt, body, kind)
            generation = Generation(state, engine, request, processor, arrival)
            generation.spec_cycles = SpecCycles() if wants_spec_cycles(body) else None  # playground (#26)
            choices.append(Choice(index, prompt, generation, counts_prompt=i == 0, echo=echo))
    return choices


def submit_all(choices: list[Choice]) -> None:
    """All or none: a refusal part-way aborts those already submitted."""
    for k, choice in enumerate(choices):
        try:
            choice.generation.submit()
        except ApiError:
            close_all(choices[:k])
            raise


def close_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.generation.close()


def total_usage(choices: list[Choice]) -> UsageInfo:
    prompt_tokens = sum(len(c.prompt.token_ids) for c in choices if c.counts_prompt)
    return UsageInfo.of(prompt_tokens, sum(c.generation.processor.completion_tokens for c in choices))


_DONE_PUMPING = object()


async def merged_deltas(choices: list[Choice]) -> AsyncIterator[tuple[Choice, OutputDelta]]:
    """Every choice's deltas as they come (one choice: exactly its own order).

    Nothing here buffers without bound: one choice is read straight from its Generation, and
    several through a queue of one slot each, so a client that reads slowly leaves the rest
    merged in each Generation's one pending event (the engine never waits for a reader)."""
    try:
        if len(choices) == 1:
            async for delta in deltas_of(choices[0]):
                yield choices[0], delta
        else:
            async for item in interleaved(choices):
                yield item
    finally:
        close_all(choices)


async def deltas_of(choice: Choice) -> AsyncIterator[OutputDelta]:
    """One choice's deltas; a failure names the choice it ended."""
    try:
        async for delta in choice.generation.deltas():
            yield delta
    except GenerationFailed as exc:
        exc.index = choice.index
        raise


async def interleaved(choices: list[Choice]) -> AsyncIterator[tuple[Choice, OutputDelta]]:
    queue: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue(maxsize=len(choices))

    async def pump(choice: Choice) -> None:
        try:
            async for delta in deltas_of(choice):
                await queue.put((choice, delta))
            await queue.put((choice, _DONE_PUMPING))
        except GenerationFailed as exc:
            await queue.put((choice, exc))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    remaining = len(tasks)
    try:
        while remaining:
            choice, item = await queue.get()
            if item is _DONE_PUMPING:
                remaining -= 1
            elif isinstance(item, GenerationFailed):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()


# ---------------------------------------------------------------------------------------------
# Responses: SSE with abort on disconnect, or one body
# ---------------------------------------------------------------------------------------------


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    """Server-sent events that stop the generation when the client goes away.

    The body and a watcher for http.disconnect run side by side; whichever ends first ends
    the other, and `on_close` (the Generation's abort) always runs.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self._send_body(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, watcher):
                task.cancel()
            self.on_close()
            results = await asyncio.gather(body, watcher, return_exceptions=True)
            await self.chunks.aclose()
        if isinstance(results[0], Exception):  # a bug, not a disconnect: show it
            traceback.print_exception(results[0])

    async def _send_body(self, send: Send) -> None:
        headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:  # the client went away mid-send
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(choices: list[Choice], request: Request) -> list[OutputAccumulator] | None:
    """Collect every choice's whole output, or abort them all and return None if the client
    leaves first (or one fails: then the others stop too)."""
    async def collect_all() -> list[OutputAccumulator]:
        return await asyncio.gather(*(c.generation.collect() for c in choices))

    collect = asyncio.ensure_future(collect_all())  # a task: cancelling it leaves nothing unretrieved
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server stopping)
        collect.cancel()
        close_all(choices)
        raise
    finally:
        watcher.cancel()
    if not collect.done():  # the client left first
        collect.cancel()
        close_all(choices)
        return None
    try:
        return collect.result()
    finally:
        close_all(choices)


def sse(payload: pydantic.BaseModel | dict[str, Any]) -> bytes:
    text = payload.model_dump_json() if isinstance(payload, pydantic.BaseModel) else json.dumps(payload)
    return b"data: " + text.encode() + b"\n\n"


def delta_message(delta: OutputDelta) -> DeltaMessage | None:
    calls = [DeltaToolCall.model_validate(call.to_openai()) for call in delta.tool_calls]
    if not (delta.content or delta.reasoning or calls):
        return None
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        tool_calls=calls or None)


async def chat_chunks(choices: list[Choice], response_id: str, model: str, body: ChatCompletionRequest,
                      tokenizer: Any) -> AsyncIterator[bytes]:
    def chunk(index: int, delta: DeltaMessage, finish_reason: Any = None, logprobs: Any = None,
              **extra: Any) -> bytes:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=response_id, model=model, choices=[choice], **extra))

    for choice in choices:
        yield chunk(choice.index, DeltaMessage(role="assistant", content=""))
    finished: set[int] = set()
    try:
        async for choice, delta in merged_deltas(choices):
            message = delta_message(delta)
            logprobs = chat_logprobs(tokenizer, delta.logprobs) if delta.logprobs else None
            cycles = choice.generation.spec_cycles.take() if choice.generation.spec_cycles else None  # playground (#26)
            if message is not None or logprobs is not None or cycles:
                yield chunk(choice.index, message or DeltaMessage(content=""), logprobs=logprobs, spec_cycles=cycles)
            if delta.finish_reason is not None:
                finished.add(choice.index)
                meta = meta_info([choice]) if body.return_meta_info else None
                yield chunk(choice.index, DeltaMessage(), delta.finish_reason, meta_info=meta)
    except GenerationFailed as exc:
        for index in ended_by(exc, choices, finished):
            yield sse(with_finish_reason(chunk(index, DeltaMessage()), exc.finish_reason))
        yield sse(error_body(exc.status, exc.message))
    else:
        if body.include_usage:
            yield sse(ChatCompletionChunk(id=response_id, model=model, choices=[], usage=total_usage(choices)))
    yield DONE


async def completion_chunks(choices: list[Choice], response_id: str, model: str, body: CompletionRequest,
                            tokenizer: Any) -> AsyncIterator[bytes]:
    def chunk(choice: CompletionChoice, **extra: Any) -> bytes:
        return sse(Completion(id=response_id, model=model, choices=[choice], **extra))

    offsets = {choice.index: len(choice.echo) for choice in choices}
    for choice in choices:
        if choice.echo:
            yield chunk(CompletionChoice(index=choice.index, text=choice.echo))
    finished: set[int] = set()
    try:
        async for choice, delta in merged_deltas(choices):
            logprobs = None
            if delta.logprobs:
                logprobs, offsets[choice.index] = completion_logprobs(tokenizer, delta.logprobs, offsets[choice.index])
            cycles = choice.generation.spec_cycles.take() if choice.generation.spec_cycles else None  # playground (#26)
            if delta.content or logprobs is not None or cycles:
                yield chunk(CompletionChoice(index=choice.index, text=delta.content, logprobs=logprobs), spec_cycles=cycles)
            if delta.finish_reason is not None:
                finished.add(choice.index)
                meta = meta_info([choice]) if body.return_meta_info else None
                yield chunk(CompletionChoice(index=choice.index, text="", finish_reason=delta.finish_reason),
                            meta_info=meta)
    except GenerationFailed as exc:
        for index in ended_by(exc, choices, finished):
            final = sse(Completion(id=response_id, model=model, choices=[CompletionChoice(index=index, text="")]))
            yield sse(with_finish_reason(final, exc.finish_reason))
        yield sse(error_body(exc.status, exc.message))
    else:
        if body.include_usage:
            yield sse(Completion(id=response_id, model=model, choices=[], usage=total_usage(choices)))
    yield DONE


def ended_by(exc: GenerationFailed, choices: list[Choice], finished: set[int]) -> list[int]:
    """The choices a failed stream ends with exc's finish reason (abort: the server stopped),
    before its error event: every choice not finished yet, the failed one first (merged_deltas
    closed them all), so a client of n > 1 sees each choice end. An error has no finish reason."""
    if exc.finish_reason is None:
        return []
    rest = [c.index for c in choices if c.index not in finished and c.index != exc.index]
    return [exc.index, *rest]


def with_finish_reason(event: bytes, finish_reason: str) -> dict[str, Any]:
    """An SSE chunk's payload with a finish reason outside OpenAI's set (abort: ended by us)."""
    payload = json.loads(event[len(b"data: "):])
    payload["choices"][0]["finish_reason"] = finish_reason
    return payload


def chat_choice(choice: Choice, output: OutputAccumulator, body: ChatCompletionRequest,
                tokenizer: Any) -> ChatCompletionChoice:
    calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
             for call in output.tool_calls]
    message = ChatCompletionMessage(content=output.content if output.content or not calls else None,
                                    reasoning_content=output.reasoning or None, tool_calls=calls or None)
    logprobs = chat_logprobs(tokenizer, output.logprobs) if body.num_logprobs is not None else None
    return ChatCompletionChoice(index=choice.index, message=message, finish_reason=output.finish_reason,
                                logprobs=logprobs)


def chat_body(choices: list[Choice], outputs: list[OutputAccumulator], response_id: str, model: str,
              body: ChatCompletionRequest, tokenizer: Any) -> ChatCompletion:
    return ChatCompletion(id=response_id, model=model, usage=total_usage(choices),
                          choices=[chat_choice(c, o, body, tokenizer) for c, o in zip(choices, outputs)],
                          meta_info=meta_info(choices) if body.return_meta_info else None)


def completion_choice(choice: Choice, output: OutputAccumulator, body: CompletionRequest,
                      tokenizer: Any) -> CompletionChoice:
    logprobs = None
    if body.num_logprobs is not None:
        logprobs, _ = completion_logprobs(tokenizer, output.logprobs, len(choice.echo))
    return CompletionChoice(index=choice.index, text=choice.echo + output.content,
                            finish_reason=output.finish_reason, logprobs=logprobs)


def completion_body(choices: list[Choice], outputs: list[OutputAccumulator], response_id: str, model: str,
                    body: CompletionRequest, tokenizer: Any) -> Completion:
    return Completion(id=response_id, model=model, usage=total_usage(choices),
                      choices=[completion_choice(c, o, body, tokenizer) for c, o in zip(choices, outputs)],
                      meta_info=meta_info(choices) if body.return_meta_info else None)


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


def api_key_check(settings: ServerSettings) -> Callable[[Request], None]:
    expected = settings.api_key.encode() if settings.api_key else None

    def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("x-api-key")
        authorization = request.headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        if given is None and scheme.lower() == "bearer":
            given = token.strip()
        if given is None or not hmac.compare_digest(given.encode(), expected):
            raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>'.")
    return check


async def generate(state: ServerState, request: Request, kind: str) -> Response:
    """The shared path of both completion routes, from raw body to response."""
    arrival = time.monotonic()
    settings = state.settings
    check_not_draining(state)
    raw = await read_json_object(request, settings.max_body_bytes)
    body = validate(ChatCompletionRequest if kind == "chat" else CompletionRequest, raw)
    check_bounds(body)
    check_model_name(settings, body.model)
    check_seed(body.seed)
    llm, engine = state.ready()
    check_queue_room(engine, body.num_choices * (1 if kind == "chat" else len(body.prompts)))
    prompts = await asyncio.to_thread(render_prompts, llm.tokenizer, body, kind)
    response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    grammar = await asyncio.to_thread(request_grammar, llm, body)
    choices = make_choices(state, llm, engine, response_id, prompts, body, kind, arrival, grammar)
    submit_all(choices)  # last: every rejection above came before any work
    model = settings.model_name
    if body.stream:
        chunks = chat_chunks if kind == "chat" else completion_chunks
        return SSEResponse(chunks(choices, response_id, model, body, llm.tokenizer), lambda: close_all(choices))
    try:
        outputs = await until_disconnect(choices, request)
    except GenerationFailed as exc:
        return ApiError(exc.status, exc.message).response()
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    build = chat_body if kind == "chat" else completion_body
    return JSONResponse(build(choices, outputs, response_id, model, body, llm.tokenizer).model_dump(mode="json"))


async def create_response(state: ServerState, request: Request) -> Response:
    """POST /v1/responses: the chat path under the Responses API's request and output shapes."""
    arrival = time.monotonic()
    settings = state.settings
    check_not_draining(state)
    raw = await read_json_object(request, settings.max_body_bytes)
    body = validate(ResponsesRequest, raw)
    check_model_name(settings, body.model)
    check_seed(body.seed)
    try:
        chat = validate(ChatCompletionRequest, responses.chat_request_body(body))
        check_bounds(chat)
    except ValueError as exc:  # an input item the chat path has no message for
        raise ApiError(400, f"Invalid 'input': {exc}.", "input") from None
    except ApiError as exc:
        raise as_responses_error(exc) from None
    llm, engine = state.ready()
    check_queue_room(engine)
    response_id = responses.new_id("resp_")
    try:
        prompts = await asyncio.to_thread(render_prompts, llm.tokenizer, chat, "chat")
        grammar = await asyncio.to_thread(request_grammar, llm, chat)   # tool_choice required / named
        choices = make_choices(state, llm, engine, response_id, prompts, chat, "chat", arrival, grammar)
    except ApiError as exc:
        raise as_responses_error(exc) from None
    submit_all(choices)
    model, created = settings.model_name, int(time.time())
    if body.stream:
        return SSEResponse(response_events(choices, response_id, created, model, body), lambda: close_all(choices))
    try:
        outputs = await until_disconnect(choices, request)
    except GenerationFailed as exc:
        return ApiError(exc.status, exc.message).response()
    if outputs is None:
        return Response(status_code=499)
    items = responses.OutputItems()
    for delta in outputs[0].deltas:
        items.add(delta)
    usage = total_usage(choices)
    finish = outputs[0].finish_reason
    return JSONResponse(responses.response_object(response_id, created, model, body, items.items,
                                                  responses.final_status(finish),
                                                  (usage.prompt_tokens, usage.completion_tokens), finish))


def as_responses_error(exc: ApiError) -> ApiError:
    """A chat-path refusal, naming the parameter as the Responses request called it."""
    param = responses.responses_param(exc.param)
    message = exc.message.replace(f"'{exc.param}'", f"'{param}'") if exc.param else exc.message
    return ApiError(exc.status, message, param, exc.headers)


async def response_events(choices: list[Choice], response_id: str, created: int, model: str,
                          body: ResponsesRequest) -> AsyncIterator[bytes]:
    """The typed SSE events of a streamed response, numbered in order; no [DONE] (OpenAI's)."""
    sequence = 0

    def send(event: dict[str, Any]) -> bytes:
        nonlocal sequence
        sequence += 1
        return responses.sse_event(sequence - 1, event)

    def snapshot(status: str, items: list, finish: str | None = None) -> dict[str, Any]:
        usage = total_usage(choices) if status != "in_progress" else None
        counts = (usage.prompt_tokens, usage.completion_tokens) if usage else None
        return responses.response_object(response_id, created, model, body, items, status, counts, finish)

    yield send({"type": "response.created", "response": snapshot("in_progress", [])})
    yield send({"type": "response.in_progress", "response": snapshot("in_progress", [])})
    items = responses.OutputItems()
    try:
        async for _, delta in merged_deltas(choices):
            items.add(delta)
            for event in items.take_events():
                yield send(event)
            if delta.finish_reason is not None:
                # Always response.completed (its status may say incomplete), as vLLM sends it:
                # the SDK's stream helper and agent loops wait for exactly that event.
                status = responses.final_status(delta.finish_reason)
                yield send({"type": "response.completed", "response": snapshot(status, items.items, delta.finish_reason)})
    except GenerationFailed as exc:
        failed = snapshot("failed", items.items)
        failed["error"] = {"code": "server_error", "message": exc.message}
        yield send({"type": "response.failed", "response": failed})


def make_processor(tokenizer: Any, prompt: Prompt, body: Any, kind: str) -> OutputProcessor:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt.token_ids, skip_special_tokens=True)
    if kind != "chat":
        return OutputProcessor(detokenizer, body.stop_strings)
    # A grammar constrains the output from its first token, so none of it is reasoning, even
    # where the template opened <think> in the prompt.
    return OutputProcessor(detokenizer, body.stop_strings, reasoning=prompt.reasoning,
                           reasoning_started_in_prompt=prompt.reasoning_started and body.grammar_request is None,
                           tools_enabled=body.tools_enabled, tools=body.tools,
                           max_tool_calls=1 if body.parallel_tool_calls is False else None)


def health(state: ServerState) -> JSONResponse:
    if state.draining:  # load balancers: send nothing more here
        return JSONResponse({"status": "draining"}, 503)
    if state.engine is None:
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": str(state.load_error)}, 503)
        return JSONResponse({"status": "loading"}, 503, {"Retry-After": str(RETRY_AFTER_S)})
    llm, engine, settings = state.llm, state.engine, state.settings
    return JSONResponse({
        "status": "ok", "model": settings.model_name, "draft": settings.draft,
        "block_size": llm.block_size if llm.draft is not None else None,
        "running": engine.num_running, "waiting": engine.num_waiting,
        "uptime_s": round(time.monotonic() - state.started_at, 3), "memory": memory_info(),
    })


def model_list(state: ServerState) -> ModelList:
    max_model_len = state.llm.max_model_len if state.llm is not None else None
    return ModelList(data=[ModelCard(id=state.settings.model_name, max_model_len=max_model_len)])


def add_routes(app: FastAPI, state: ServerState) -> None:
    api = APIRouter(dependencies=[Depends(api_key_check(state.settings))])

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(state, request, "chat")

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(state, request, "completion")

    @api.post("/v1/responses")
    async def create_responses(request: Request) -> Response:
        return await create_response(state, request)

    @api.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> JSONResponse:
        raise ApiError(404, f"No response '{response_id}': this server stores no responses.", "response_id")

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(state).model_dump(mode="json"))

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        for card in model_list(state).data:
            if model_id in (card.id, state.settings.model):
                return JSONResponse(card.model_dump(mode="json"))
        raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                            f"'{state.settings.model_name}'.", "model")

    @app.get("/health")
    async def health_route() -> JSONResponse:
        return health(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)


def add_error_handlers(app: FastAPI) -> None:
    """Every error is the OpenAI error object; invalid input is 400, never 422."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, f"Invalid request: {exc.errors()[:1]}"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = 400 if exc.status_code == 422 else exc.status_code
        return JSONResponse(error_body(status, str(exc.detail)), status, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback.
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), 500)


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's own when it sent one (as vLLM and
    OpenAI echo it), else a fresh one. Pure ASGI, so streamed bodies pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given[:256] if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(llm: Any = None, settings: ServerSettings | None = None) -> FastAPI:
    """The app. `llm`: a loaded LLM, a zero-argument factory returning one (called in a
    background thread at startup), or None to load from `settings`."""
    if settings is None:
        raise ValueError("create_app needs ServerSettings")
    if llm is None:
        factory = default_llm_factory(settings)
    elif callable(llm) and not hasattr(llm, "make_request"):
        factory = llm
    else:
        factory = lambda: llm  # noqa: E731
    state = ServerState(settings, factory)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        yield
        await asyncio.to_thread(state.shutdown)  # after the drain of open requests

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestIdMiddleware)
    add_error_handlers(app)
    add_routes(app, state)
    if settings.ui:  # playground (#26): GET /, the chat page (blockspec/server/playground.py)
        from blockspec.server.playground import add_playground
        add_playground(app)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(CountInFlight, state=state)
    return app


# ---------------------------------------------------------------------------------------------
# `blockspec serve`
# ---------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn until SIGINT/SIGTERM; those drain open requests, then stop the engine."""
    import uvicorn
    settings = ServerSettings.from_args(args)
    app = create_app(None, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=FINAL_WRITE_S)
    server = draining_server(config, app.state.server)
    failures: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    app.state.server.on_load_error = on_load_error
    with _sigterm_as_clean_exit():
        server.run()
    if failures:
        print(f"blockspec serve: error: {failures[0]}", file=sys.stderr)
        return 2
    return 0


def draining_server(config: Any, state: ServerState) -> Any:
    """uvicorn's Server, but the first SIGTERM/SIGINT drains (ServerState.drain) while still
    listening, so new requests get a 503 rather than a refused connection; a second signal,
    or the drain's end, stops it."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.drain_task is not None or state.loop is None or self.should_exit:
                return super().handle_exit(sig, frame)
            self._captured_signals.append(sig)
            state.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if self.drain_task is None:
                self.drain_task = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await state.drain(state.settings.shutdown_timeout)
            finally:
                self.should_exit = True

    return DrainingServer(config)


class _sigterm_as_clean_exit:
    """uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that a no-op,
    so a drained server exits 0 rather than dying by the signal."""

    def __enter__(self) -> None:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: None)

    def __exit__(self, *_: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
