"""One request's generations seen from the event loop: each choice (n per prompt) is its own
engine request, whose events cross from the engine thread into a Generation and come out as
OutputDeltas; the choices of a request are submitted all or none and read merged."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from blockspec.engine.engine import Engine, QueueFullError
from blockspec.engine.request import GenerationStats, TokenEvent
from blockspec.engine.request import Request as EngineRequest
from blockspec.server.errors import ApiError, GenerationFailed, retry_later
from blockspec.server.output import OutputAccumulator, OutputDelta, OutputProcessor
from blockspec.server.replies import MetaInfo, UsageInfo
from blockspec.server.request_building import Body, Grammar, Prompt, make_engine_request
from blockspec.server.spec_cycles import SpecCycles, wants_spec_cycles  # playground (#26)
from blockspec.server.state import EngineHandle, ServerState
from blockspec.server.wakeups import waker_of

logger = logging.getLogger("blockspec.server")

# The output side of one choice, made per prompt (chat: reasoning and tool parsing; completions:
# stop strings only) and its echo (completions' echo=true: the prompt's text, else "").
ProcessorFactory = Callable[[Prompt], OutputProcessor]
EchoText = Callable[[Prompt], str]


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
            waker_of(self._loop).wake(self)

    def mark_ready(self) -> None:
        """On the loop: an event is pending (LoopWaker)."""
        self._ready.set()

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
                event, failure = split_failure(await self._next_event())
                self._check(event)
                self._observe_first_token(event)
                delta = self._process(event)
                if delta.stop_hit:
                    self.request.abort()  # the engine stops within one cycle
                if not delta.is_empty:
                    yield delta
                if failure is not None and not self.processor.is_finished:
                    self._check(failure)
            stats = self.request.stats
            self._final_stats = dataclasses.replace(stats, acceptance_lengths=list(stats.acceptance_lengths),
                                                    verify_widths=list(stats.verify_widths))
            self._end(self.processor.finish_reason or "stop")
        finally:
            self.close()

    def _process(self, event: TokenEvent) -> OutputDelta:
        try:
            if self.spec_cycles is not None:  # playground (#26)
                return self.spec_cycles.process(self.processor, event)
            return self.processor.process(event.token_ids, event.finish_reason, event.logprobs)
        except Exception as exc:  # a parser bug must cost one request, never the connection
            logger.exception("output processing failed")
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
            now = time.perf_counter()
            self.state.metrics.time_to_first_token.observe(now - self.arrival)
            self._observe_stages(now)

    def _observe_stages(self, now: float) -> None:
        """The first token's time in its stages (state.FIRST_TOKEN_STAGES), from the engine's
        stamps on the request (an engine stand-in may leave them unset: nothing observed)."""
        request = self.request
        stamps = (self.arrival, getattr(request, "submitted_at", None), getattr(request, "admitted_at", None),
                  getattr(request, "first_token_at", None), now)
        if any(stamp is None for stamp in stamps):
            return
        for histogram, start, end in zip(self.state.metrics.first_token_stages.values(), stamps, stamps[1:]):
            histogram.observe(max(0.0, end - start))

    def _end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self.state.generations.discard(self)
        self.state.metrics.requests.labels(finish_reason=reason).inc()
        self.state.metrics.e2e_latency.observe(time.perf_counter() - self.arrival)


FAILURES = ("error", "abort", "shutdown")


def split_failure(event: TokenEvent) -> tuple[TokenEvent, TokenEvent | None]:
    """A failure that carries tokens (committed before it, merged into its event while the
    reader was behind) as those tokens first, then the failure: what was generated reaches the
    client before the error, as it would have had the reader kept up."""
    if event.finish_reason not in FAILURES or not event.token_ids:
        return event, None
    tokens = TokenEvent(event.request_id, event.token_ids, None, None, None, event.logprobs)
    return tokens, TokenEvent(event.request_id, [], event.finish_reason, event.stats, event.error)


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
    committed i + 1 tokens); spec_verify_width_histogram[k] = verify passes that verified k
    drafts (the width adaptive speculation chose, cut to what max_tokens allowed). A plain
    server reports zeros, having no verify passes. Several choices (n > 1) add up."""
    stats = [c.generation.stats for c in choices if c.generation.stats.speculative]
    lengths = [length for s in stats for length in s.acceptance_lengths]
    histogram = counts([length - 1 for length in lengths])
    width_histogram = counts([k for s in stats for k in s.verify_widths])
    completion_tokens = sum(c.generation.processor.completion_tokens for c in choices)
    accepted, drafts, num_verify = sum(h * i for i, h in enumerate(histogram)), sum(s.draft_tokens for s in stats), len(lengths)
    return MetaInfo(spec_verify_ct=num_verify,
                    spec_accept_length=completion_tokens / num_verify if num_verify else 0.0,
                    spec_accept_histogram=histogram, spec_verify_width_histogram=width_histogram,
                    spec_accept_rate=accepted / drafts if drafts else 0.0,
                    spec_accept_token_num=accepted, spec_draft_token_num=drafts)


def counts(values: list[int]) -> list[int]:
    """[i] = how many of the values (≥ 0) are i, up to the largest."""
    out = [0] * (max(values) + 1) if values else []
    for value in values:
        out[value] += 1
    return out


@dataclass
class Choice:
    index: int                  # prompt p, choice i → p · n + i (vLLM's order)
    prompt: Prompt
    generation: Generation
    counts_prompt: bool         # usage counts each prompt once, not once per choice
    echo: str = ""              # completions' echo: the prompt's text, sent before the output


def make_choices(state: ServerState, llm: EngineHandle, engine: Engine, response_id: str, prompts: list[Prompt],
                 body: Body, arrival: float, processor_for: ProcessorFactory,
                 echo_for: EchoText | None = None, grammar: Grammar | None = None) -> list[Choice]:
    n, choices = body.num_choices, []
    for p, prompt in enumerate(prompts):
        echo = echo_for(prompt) if echo_for is not None else ""
        for i in range(n):
            index = p * n + i
            request = make_engine_request(llm, f"{response_id}-{index}", prompt, body, choice=i, grammar=grammar)
            generation = Generation(state, engine, request, processor_for(prompt), arrival)
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
    cached_tokens = sum(c.generation.stats.cached_tokens for c in choices if c.counts_prompt)
    return UsageInfo.of(prompt_tokens, sum(c.generation.processor.completion_tokens for c in choices), cached_tokens)


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
    queue: asyncio.Queue[tuple[Choice, OutputDelta | GenerationFailed | object]] = asyncio.Queue(maxsize=len(choices))

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
