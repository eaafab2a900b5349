"""The engine: `step()` = schedule → run → postprocess, for every running sequence at once.

Only the engine's caller touches models, pools and the GPU (invariant 2): the server runs
`step()` on one engine thread (`start()`), the in-process `LLM` calls it on its own thread, never
both. Requests from other threads arrive through `submit` (a thread-safe inbox). Each request's
events go to the callback given at submit, called on the engine's thread. A request ends exactly
once, with one finish reason (invariant 3), and its pages and state slot are freed then.

Failures cost as little as they can: a sequence whose own work fails (its prefill, its commit)
ends with an error alone; a batched forward that fails ends its batch; an out-of-memory error
preempts the batch (recomputed later, exact) and halves the seats until steps succeed again.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from blockspec.cache import CacheManager, PrefixCacheManager
from blockspec.cache.prefix import snapshot_slot_ids
from blockspec.config import EngineConfig
from blockspec.engine.model_runner import DecodeResult, ModelRunner
from blockspec.engine.request import Request, TokenEvent
from blockspec.engine.scheduler import Batch, Emitted, FirstToken, Scheduler
from blockspec.engine.sequence import Sequence, completes_prefill


logger = logging.getLogger("blockspec.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue; the client should retry later."""


@dataclass
class EngineCounters:
    """Totals since start, read by /metrics (written by the engine thread only)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_verify: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    decode_batch_sizes: Counter = field(default_factory=Counter)    # sequences per cycle → cycles
    # Speculation per cycle (issue 21): drafts verified and accepted by the whole batch (total →
    # cycles), each sequence's chosen width k and what it accepted of it (→ sequence-cycles).
    spec_verified_per_cycle: Counter = field(default_factory=Counter)
    spec_accepted_per_cycle: Counter = field(default_factory=Counter)
    spec_widths: Counter = field(default_factory=Counter)
    spec_accepted: Counter = field(default_factory=Counter)


EventCallback = Callable[[TokenEvent], None]
# Tests only (fault injection): called as hook(phase, seqs) before a step's forward for each
# prefill chunk ("prefill", [seq]: failing ends that sequence alone) and for its decoding
# sequences ("decode", batch: failing is the forward's failure), and before each sequence's
# commit ("commit", [seq]); it may raise.
FaultHook = Callable[[str, list[Sequence]], None]
SEATS_RESTORED_AFTER = 64          # successful steps after an out-of-memory before seats double


class Engine:
    def __init__(self, target: nn.Module, draft: nn.Module | None, config: EngineConfig,
                 on_finish: Callable[[Request], None] | None = None,
                 make_runner: Callable[..., ModelRunner] = ModelRunner) -> None:
        """make_runner: ModelRunner, or rank 0's runner of a tensor-parallel group (distributed/)."""
        self.config = config
        self.runner = make_runner(target, draft, config)
        num_slots = config.max_num_seqs if self.runner.is_hybrid else 0
        if config.prefix_cache:
            self.cache = PrefixCacheManager(self.runner.pool_size.num_pages, config.page_size, num_slots,
                                            snapshot_slot_ids(config.max_num_seqs, config.prefix_state_slots))
        else:
            self.cache = CacheManager(self.runner.pool_size.num_pages, config.page_size, num_slots)
        self.scheduler = Scheduler(config, self.cache, self.runner.width)
        self.scheduler.speculation = self.runner.speculation       # widths before the draft (policy.py)
        self.counters = EngineCounters()
        self.on_finish = on_finish
        self._callbacks: dict[int, EventCallback] = {}
        self._inbox: queue.SimpleQueue[tuple[Sequence, EventCallback]] = queue.SimpleQueue()
        self._num_inbox = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.fault_hook: FaultHook | None = None         # off: one `is None` test per call site
        # Events wait here until _send_events: with overlap, a step's events go to their
        # consumers after the next step's launch, while the device runs it (invariant 12); off
        # on CPU, where the launch is the compute and the wait would delay every token a step
        # (BLOCKSPEC_OVERLAP=0 turns it off on CUDA too, for side-by-side measurements).
        self._outbox: list[tuple[EventCallback, TokenEvent]] = []
        # A consumer whose callbacks wake another thread (the server: its event loop) sets this:
        # each hand-over of events runs inside it, so that thread is woken once for all of them.
        self.event_batch: Callable[[], AbstractContextManager[None]] | None = None
        self.overlap = self.runner.device.type == "cuda" and os.environ.get("BLOCKSPEC_OVERLAP", "1") != "0"
        self._steps_since_oom = 0

    # -- what other threads may call --------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_inbox + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def max_queue(self) -> int:
        return self.config.max_queue

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and those it served (metrics)."""
        prefix = getattr(self.cache, "prefix", None)
        return (prefix.queries, prefix.hits) if prefix is not None else (0, 0)

    @property
    def kv_cache_tokens(self) -> int:
        """Positions the K/V pool holds (its usable pages × page size)."""
        return self.cache.num_usable_pages * self.config.page_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len (+ a block) the pool holds at once (vLLM's figure)."""
        return self.kv_cache_tokens / self.config.max_positions_per_seq

    def submit(self, request: Request, on_event: EventCallback) -> None:
        """Thread-safe; raises QueueFullError instead of queueing beyond max_queue or after
        shutdown began (nothing would ever end the request)."""
        seq = Sequence(request, self.runner.device)
        request.submitted_at = time.perf_counter()
        with self._lock:
            if self._stopping.is_set():
                raise QueueFullError("the engine is shutting down")
            if self.num_waiting >= self.config.max_queue:
                raise QueueFullError(f"{self.num_waiting} requests are waiting (limit {self.config.max_queue})")
            self._num_inbox += 1
            self._inbox.put((seq, on_event))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="blockspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; every request still open ends with finish_reason abort."""
        with self._lock:
            self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._abort_all()

    # -- the step ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self._num_inbox > 0 or self.scheduler.has_work or bool(self._outbox)

    def step(self) -> None:
        self._take_inbox()
        self._drop_aborted()
        batch = self.scheduler.schedule()
        for seq in list(self.scheduler.unservable):
            if seq.request.output_ids:      # it streamed what the pool could hold: a length limit
                self._end(seq, "length")
                continue
            self._end(seq, "error", error=f"the sequence needs more KV-cache pages than the pool has "
                                          f"({self.cache.num_usable_pages}); raise the pool size "
                                          f"or lower --max-model-len")
        if not batch.is_empty:
            self._step(batch)
        if not self.overlap or batch.is_empty:
            self._send_events()

    def _step(self, batch: Batch) -> None:
        emitted: list[Emitted] = []
        out_of_memory = False
        try:
            self._run(batch, emitted)
        except torch.OutOfMemoryError:
            out_of_memory = True
        except Exception as exc:  # a failed batched forward costs its sequences, never the engine
            logger.exception("a batched step failed; its sequences end with an error")
            for seq in [s for s, _ in batch.prefill] + batch.decode:
                self._end(seq, "error", error=f"{type(exc).__name__}: {exc}")
        for item in emitted:
            self._emit_tokens(item)
        if out_of_memory:
            self._preempt_after_oom([s for s, _ in batch.prefill] + batch.decode)
        else:
            self._restore_seats()

    def _run(self, batch: Batch, emitted: list[Emitted]) -> None:
        """The step's forwards (runner.launch), the previous step's events sent while the device
        runs them (overlap), then each sequence's own postprocess of the results."""
        if self.fault_hook is not None:
            for seq, _ in batch.prefill:
                self._isolated(seq, lambda: self.fault_hook("prefill", [seq]))
            batch.prefill = [(seq, n) for seq, n in batch.prefill if seq in self.scheduler.running]
            if batch.decode:
                self.fault_hook("decode", batch.decode)
        if batch.is_empty:
            return
        if batch.decode:
            self.counters.decode_batch_sizes[len(batch.decode)] += 1
        started = time.perf_counter()
        launched = self.runner.launch(batch)
        self.runner.learn()                                  # while the device runs this step
        # The next step's widths, likewise, for the sequences it will decode unless one ends now:
        # these, and those whose prompt this step completes (an arrival is then planned for
        # here, not on the spot after the next sync).
        upcoming = batch.decode + [seq for seq, n in batch.prefill if completes_prefill(seq, n)]
        if upcoming:
            self.runner.speculation.plan_ahead(upcoming)
        # The next step's draft behind this step's verify, so the device works through what
        # follows until the next launch (model_runner.draft_ahead).
        self.runner.draft_ahead(launched)
        if self.overlap:
            self._send_events()
        result = self.runner.collect(launched)
        if result.decode is not None and self.runner.draft is not None:
            self._count_speculation(result.decode)
        for (seq, _), first_token in zip(batch.prefill, result.first_tokens):
            self._isolated(seq, lambda: self._first_token(seq, first_token, emitted))
        for b, seq in enumerate(batch.decode):
            self._isolated(seq, lambda: self._commit(seq, result.decode, b, emitted))
        if result.decode is not None and not batch.prefill:      # a decode-only step: its time is the cycle's
            seconds, widths, width, arm = time.perf_counter() - started, batch.num_drafts, batch.draft_width, batch.arm
            tokens, waited = sum(a + 1 for a in result.decode.num_accepted), result.waited
            drafting = None if batch.drafted is None else sum(k > 0 for k in batch.drafted)   # late widths
            learns = batch.learns
            self.runner.defer(lambda: self.runner.speculation.record_cycle(seconds, widths, tokens, width, arm, waited,
                                                                           drafting, learns))

    def _first_token(self, seq: Sequence, first_token: FirstToken | None, emitted: list[Emitted]) -> None:
        item = self.scheduler.postprocess_prefill(seq, first_token)
        if item is not None:
            emitted.append(item)

    def _commit(self, seq: Sequence, result: DecodeResult, b: int, emitted: list[Emitted]) -> None:
        if self.fault_hook is not None:
            self.fault_hook("commit", [seq])
        logprobs = result.logprobs[b] if result.logprobs else None
        emitted.append(self.scheduler.postprocess_decode(seq, result.num_accepted[b], result.new_tokens[b], logprobs,
                                                         result.num_drafts[b]))

    def _count_speculation(self, result: DecodeResult) -> None:
        widths = result.num_drafts if result.num_drafts is not None else \
            [self.runner.width - 1] * len(result.num_accepted)
        self.counters.spec_verified_per_cycle[sum(widths)] += 1
        self.counters.spec_accepted_per_cycle[sum(result.num_accepted)] += 1
        self.counters.spec_widths.update(widths)
        self.counters.spec_accepted.update(result.num_accepted)

    def _isolated(self, seq: Sequence, work: Callable[[], None]) -> None:
        """One sequence's own work: if it fails, that sequence ends with an error and the rest
        of the step goes on (out of memory is the batch's problem: re-raised)."""
        try:
            work()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            logger.exception("request %s failed; it ends with an error, the step goes on", seq.request_id)
            self._end(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _preempt_after_oom(self, seqs: list[Sequence]) -> None:
        """Out of memory in a step: free what the allocator cached, preempt the step's sequences
        (recompute is exact) and halve the seats; alone and still out of memory is an error."""
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        live = [seq for seq in seqs if seq in self.scheduler.running]
        self._steps_since_oom = 0
        if len(self.scheduler.running) <= 1:
            for seq in live:
                self._end(seq, "error", error="out of memory even with this request alone; lower "
                                              "--max-model-len or the prompt length")
            return
        self.scheduler.seat_limit = max(1, min(self.scheduler.seat_limit, len(self.scheduler.running)) // 2)
        for seq in reversed(live):
            self.scheduler.preempt(seq)
        logger.warning("blockspec: out of memory in a step of %d sequences: preempted them; seats now %d",
                       len(live), self.scheduler.seat_limit)

    def _restore_seats(self) -> None:
        if self.scheduler.seat_limit >= self.config.max_num_seqs:
            return
        self._steps_since_oom += 1
        if self._steps_since_oom >= SEATS_RESTORED_AFTER:
            self.scheduler.seat_limit = min(self.config.max_num_seqs, 2 * self.scheduler.seat_limit)
            self._steps_since_oom = 0

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # the step's own handler ends its sequences; never let the thread die
                logger.exception("an engine step failed")
        self._abort_all()

    # -- bookkeeping ------------------------------------------------------------------------

    def _take_inbox(self) -> None:
        while True:
            try:
                seq, on_event = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._num_inbox -= 1
            self._callbacks[id(seq)] = on_event
            if seq.request.is_aborted:        # gone before it started: no prefill for nobody
                self._end(seq, "abort")
                continue
            self.counters.prompt_tokens += len(seq.request.prompt_ids)
            seq.request.stats.speculative = self.runner.draft is not None
            self.scheduler.add(seq)

    def _drop_aborted(self) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request.is_aborted:
                self._end(seq, "abort")

    def _abort_all(self) -> None:
        self._take_inbox()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(seq, "abort")
        self._send_events()

    def _emit_tokens(self, item: Emitted) -> None:
        request = item.seq.request
        self.counters.generation_tokens += len(item.token_ids)
        if request.is_finished:
            self._end(item.seq, request.finish_reason, token_ids=item.token_ids, logprobs=self._logprobs(item))
        else:
            self._emit(item.seq, TokenEvent(request.request_id, item.token_ids, logprobs=self._logprobs(item)))

    @staticmethod
    def _logprobs(item: Emitted) -> list | None:
        """The logprobs of the tokens just committed (the request's last ones), if it asked."""
        request = item.seq.request
        if request.num_logprobs is None:
            return None
        return request.output_logprobs[len(request.output_logprobs) - len(item.token_ids):]

    def _end(self, seq: Sequence, reason: str, token_ids: list[int] | None = None, error: str | None = None,
             logprobs: list | None = None) -> None:
        """The one place a request ends: free its memory, count it, send its final event."""
        request = seq.request
        request.finish_reason = reason
        self.scheduler.finish(seq)
        self.runner.defer(lambda: self.runner.speculation.forget(seq))      # after its last observation
        if self.runner.draft is not None:
            self.counters.spec_verify += request.stats.cycles
            self.counters.spec_draft_tokens += request.stats.draft_tokens
            self.counters.spec_accepted_tokens += request.stats.accepted_tokens
        self._emit(seq, TokenEvent(request.request_id, token_ids or [], reason, request.stats, error=error,
                                   logprobs=logprobs))
        self._callbacks.pop(id(seq), None)
        if self.on_finish is not None:
            self.on_finish(request)

    def _emit(self, seq: Sequence, event: TokenEvent) -> None:
        """Queue the event for its consumer (_send_events hands the queue over, in order)."""
        callback = self._callbacks.get(id(seq))
        if callback is not None:
            self._outbox.append((callback, event))

    def _send_events(self) -> None:
        """Every queued event to its consumer, in the order they were made (inside event_batch)."""
        outbox, self._outbox = self._outbox, []
        if not outbox:
            return
        with self.event_batch() if self.event_batch is not None else nullcontext():
            for callback, event in outbox:
                try:
                    callback(event)
                except Exception:  # the consumer's failure is the consumer's; keep serving others
                    logger.exception("an event consumer failed (request %s)", event.request_id)
