"""Waking the event loop for events made on the engine thread: one call_soon_threadsafe (a write
to the loop's wake-up pipe, and one wake-up) for all the generations a step gave events to, not
one each.

A write to the wake-up pipe gives the GIL up, and the loop, woken, often took it there: it marked
ready the generations the step had handed over so far and ran their streams, while the engine
waited for the GIL to hand over the rest, which needed wake-ups of their own (1 to 4 a step, median
2.2, in bursts of 64 streams on the dev CPU). So the engine hands a step's events over inside
`wakeups_held` (Engine.event_batch), and each loop is woken once, when the whole batch is there.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.server.generation import Generation


class LoopWaker:
    """Wakes one loop's readers of events made on other threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._waiting: list[Generation] = []
        self._scheduled = False        # a wake-up is on its way: it takes whatever waits when it runs

    def wake(self, generation: Generation) -> None:
        """generation has an event pending: wake the loop for it now, or at the end of the batch
        of events this thread is handing over (wakeups_held)."""
        with self._lock:
            self._waiting.append(generation)
            if self._scheduled:
                return
            held = getattr(_held, "wakers", None)
            if held is not None:
                held[self] = None
                return
            self._scheduled = True
        self._schedule()

    def flush(self) -> None:
        """The wake-up a held batch left for its end, unless one is already on its way."""
        with self._lock:
            if self._scheduled or not self._waiting:
                return
            self._scheduled = True
        self._schedule()

    def _schedule(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._set_ready)
        except RuntimeError:      # the loop is closed: nobody is listening any more
            for waiting in self._take():
                waiting.request.abort()

    def _take(self) -> list[Generation]:
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self._scheduled = False
        return waiting

    def _set_ready(self) -> None:
        for generation in self._take():
            generation.mark_ready()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()
_held = threading.local()          # .wakers: the loops a held batch of this thread will wake at its end


def waker_of(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            waker = _wakers[loop] = LoopWaker(loop)
        return waker


@contextmanager
def wakeups_held() -> Iterator[None]:
    """Events handed over inside this (on this thread) wake their loops once each, at its end."""
    held: dict[LoopWaker, None] = {}
    _held.wakers = held
    try:
        yield
    finally:
        _held.wakers = None
        for waker in held:
            waker.flush()
