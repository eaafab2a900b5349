"""The engine thread: the only code that touches models, caches and the GPU (invariant 2).

Requests queue FIFO and run one at a time (batching comes later, in the scheduler). Each
request's events go to the callback given at submit, called on the engine thread; the server
forwards them to its event loop. A request ends exactly once, with one finish reason.
"""
from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from blockspec.engine.request import Request, TokenEvent
from blockspec.llm import LLM


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue; the client should retry later."""


@dataclass
class EngineCounters:
    """Totals since start, read by /metrics (plain ints: written by the engine thread only)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_verify: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


EventCallback = Callable[[TokenEvent], None]


class Engine:
    def __init__(self, llm: LLM, max_queue: int = 64,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.counters = EngineCounters()
        self.on_finish = on_finish
        self._queue: queue.Queue[tuple[Request, EventCallback] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_waiting = 0
        self._running: Request | None = None
        self._thread = threading.Thread(target=self._loop, name="blockspec-engine", daemon=True)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return 1 if self._running is not None else 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish the running request, abort the waiting ones, stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, request: Request, on_event: EventCallback) -> None:
        """Thread-safe; raises QueueFullError instead of queueing beyond max_queue."""
        with self._lock:
            if self._num_waiting >= self.max_queue:
                raise QueueFullError(f"{self._num_waiting} requests are waiting (limit {self.max_queue})")
            self._num_waiting += 1
        self._queue.put((request, on_event))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._drain()
                return
            with self._lock:
                self._num_waiting -= 1
            request, on_event = item
            self._running = request
            try:
                self._run(request, on_event)
            finally:
                self._running = None

    def _run(self, request: Request, on_event: EventCallback) -> None:
        try:
            if request.is_aborted:  # gone before it started: no prefill for nobody
                request.finish_reason = "abort"
                self._emit(on_event, TokenEvent(request.request_id, [], "abort", request.stats))
                return
            self.counters.prompt_tokens += len(request.prompt_ids)
            self._decode(request, on_event)
        finally:
            if self.on_finish is not None:
                self.on_finish(request)

    def _decode(self, request: Request, on_event: EventCallback) -> None:
        """Run the request's iterator to its final event; exactly one final event is emitted."""
        events = self.llm.stream(request)
        finished = False
        try:
            for event in events:
                self._count(event)
                finished = event.finish_reason is not None
                self._emit(on_event, event)
                if finished:
                    break
        except Exception as exc:  # a failed request must not take the engine down with it
            traceback.print_exc()
            finished = True
            request.finish_reason = "error"
            self._emit(on_event, TokenEvent(request.request_id, [], "error", request.stats, error=str(exc)))
        finally:
            events.close()  # no compute outlives the request (seeds #224)
        if not finished:
            request.finish_reason = "error"
            self._emit(on_event, TokenEvent(request.request_id, [], "error", request.stats,
                                            error="the decoding loop ended without a finish reason"))

    def _count(self, event: TokenEvent) -> None:
        self.counters.generation_tokens += len(event.token_ids)
        if event.finish_reason is not None and self.llm.draft is not None:
            stats = event.stats
            self.counters.spec_verify += stats.cycles
            self.counters.spec_draft_tokens += stats.draft_tokens
            self.counters.spec_accepted_tokens += stats.accepted_tokens

    @staticmethod
    def _emit(on_event: EventCallback, event: TokenEvent) -> None:
        try:
            on_event(event)
        except Exception:  # the consumer's failure is the consumer's; keep serving others
            traceback.print_exc()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                request, on_event = item
                request.finish_reason = "abort"
                self._emit(on_event, TokenEvent(request.request_id, [], "abort", request.stats))
                if self.on_finish is not None:
                    self.on_finish(request)
