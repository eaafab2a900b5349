"""What the routes share: the settings, the loaded model and its engine (EngineHandle), the
drain's bookkeeping and the Prometheus metrics read from the engine's counters."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.types import ASGIApp, Receive, Scope, Send

from blockspec.engine.engine import Engine
from blockspec.engine.request import Request as EngineRequest
from blockspec.sampling import SamplingParams
from blockspec.server.errors import ApiError, retry_later
from blockspec.server.settings import ServerSettings
from blockspec.server.spec_metrics import speculation_histograms
from blockspec.server.wakeups import wakeups_held
from blockspec.tokenizer import Tokenizer

logger = logging.getLogger("blockspec.server")


class OpenGeneration(Protocol):
    """What the drain needs of an open generation (server/generation.py's Generation, which
    imports this module: the dependency points one way)."""

    def interrupt(self) -> None: ...


class EngineHandle(Protocol):
    """What the server uses of a loaded model (blockspec.llm.LLM; tests pass stand-ins): its
    public surface only, never its modules."""
    tokenizer: Tokenizer
    engine: Engine

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Rows of the logits: the ids logit_bias and grammars may name."""
        ...

    @property
    def speculative(self) -> bool: ...

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     multimodal: Any = None) -> EngineRequest: ...

    # Images (server/images.py): a checkpoint with a vision tower takes them.
    @property
    def takes_images(self) -> bool: ...

    @property
    def image_processor(self) -> Any: ...

    def image_prompt(self, prompt_ids: list[int], images: list[Any]) -> tuple[list[int], Any]: ...


# After the drain (--shutdown-timeout) has ended every request, the streams get this long to
# write their last events; uvicorn's own cancel is only a backstop behind it.
FINAL_WRITE_S = 5.0


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
        yield from speculation_histograms(counters)
        for name, field, doc in (
            ("blockspec_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
            ("blockspec_generation_tokens", "generation_tokens", "Output tokens committed"),
            ("blockspec_spec_verify", "spec_verify", "DFlash verify passes"),
            ("blockspec_spec_draft_tokens", "spec_draft_tokens", "Draft tokens proposed and verified"),
            ("blockspec_spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
        ):
            yield CounterMetricFamily(name, doc, value=getattr(counters, field) if counters else 0)
        queries, hits = engine.prefix_cache_counts if engine else (0, 0)
        yield CounterMetricFamily("blockspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=queries)
        yield CounterMetricFamily("blockspec_prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                  value=hits)
        yield from weight_metrics(getattr(self._state, "llm", None))   # a stand-in state may hold no handle


def weight_metrics(llm: EngineHandle | None):
    """The target's weight format (a label, value 1) and the weight bytes one decode step reads,
    once loaded and where the handle says them (test stand-ins may not)."""
    weights, step_bytes = getattr(llm, "weight_format", None), getattr(llm, "weight_bytes_per_step", None)
    if isinstance(weights, str):
        info = GaugeMetricFamily("blockspec_weight_format", "The target's weight format (fp8_e4m3 or its dtype)",
                                 labels=["format"])
        info.add_metric([weights], 1)
        yield info
    if isinstance(step_bytes, int):
        yield GaugeMetricFamily("blockspec_weight_bytes_per_step",
                                "Target weight bytes one decode step reads (unchosen experts excluded)",
                                value=step_bytes)


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


FIRST_TOKEN_STAGES = {
    "build": "Arrival (the handler) to the engine's submit: body, checks, prompt, request",
    "queue": "The engine's submit to the sequence's admission (the step that first schedules it)",
    "prefill": "Admission to the first token's commit (the prefill steps)",
    "delivery": "The first token's commit to its event read on the event loop",
}
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
        # The time to first token in its four stages, which add up to it (scripts/bench_streams.py
        # reports their means per burst): where a burst of arrivals waits.
        self.first_token_stages = {stage: Histogram(
            f"blockspec_first_token_{stage}_seconds", doc, buckets=STAGE_BUCKETS, registry=self.registry)
            for stage, doc in FIRST_TOKEN_STAGES.items()}

    def render(self) -> bytes:
        return generate_latest(self.registry)


LLMFactory = Callable[[], EngineHandle]


class ServerState:
    """What the routes share: settings, the loaded model and engine (None while loading)."""

    def __init__(self, settings: ServerSettings, llm_factory: LLMFactory) -> None:
        self.settings = settings
        self.llm_factory = llm_factory
        self.llm: EngineHandle | None = None
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.on_loaded: Callable[[EngineHandle], None] | None = None
        self.started_at = time.monotonic()
        self.metrics = Metrics(self)
        # The drain (SIGTERM): requests being answered, and the generations still open.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.interrupted = False        # the drain ran out: open generations were ended, none may start
        self.in_flight = 0
        self.generations: set[OpenGeneration] = set()

    def start_loading(self) -> None:
        """Load in a daemon thread, so /health answers "loading" meanwhile."""
        threading.Thread(target=self._load, name="blockspec-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            llm = self.llm_factory()
            engine = llm.engine               # the LLM built it; from now on only its thread steps it
            warm_request_path(llm, engine)
            engine.event_batch = wakeups_held     # one wake-up of the loop per step's events
            engine.start()
        except BaseException as exc:  # noqa: BLE001 - reported on /health and by serve()
            logger.error("the model failed to load", exc_info=True)
            self.load_error = exc
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        warm_grammars(llm)
        self.llm = llm
        if self.on_loaded is not None:
            self.on_loaded(llm)
        self.engine = engine  # set last: a non-None engine means ready

    def ready(self) -> tuple[EngineHandle, Engine]:
        if self.engine is None:
            if self.load_error is not None:
                raise ApiError(500, f"the model failed to load: {self.load_error}")
            raise retry_later("the model is still loading; retry shortly")
        assert self.llm is not None       # set before the engine
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

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


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


def warm_request_path(llm: EngineHandle, engine: Engine) -> None:
    """Before the port opens: the chat template rendered once (its compilation), and on CUDA a
    few requests through the engine (engine/warm.py `warm_requests`), in this thread, before the
    engine's own starts."""
    tokenizer = getattr(llm, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "chat_templates", None):
        try:
            tokenizer.encode_chat([{"role": "user", "content": "Hello"}], None, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that needs more than one user turn renders per request
            logger.debug("the chat template did not render a one-turn chat at startup", exc_info=True)
    runner = getattr(engine, "runner", None)
    vocab_size = getattr(llm, "vocab_size", None)
    if runner is not None and vocab_size is not None and runner.device.type == "cuda":
        from blockspec.engine.warm import warm_requests
        logger.info(f"blockspec: warmed the request path in {warm_requests(engine, vocab_size)}")


def warm_grammars(llm: EngineHandle) -> None:
    """The grammar compiler (the tokenizer's whole vocabulary for xgrammar) and the json_object
    grammar built before the server is ready, so the first structured request is as fast as the
    tenth; a handle without a tokenizer (a scripted engine) or without xgrammar has none to warm."""
    tokenizer, vocab_size = getattr(llm, "tokenizer", None), getattr(llm, "vocab_size", None)
    if tokenizer is None or vocab_size is None or getattr(tokenizer, "backend", None) is None:
        return
    from blockspec import structured
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    structured.compile_grammar(structured.grammar_compiler(tokenizer, vocab_size), structured.GrammarSpec("json_object"))
