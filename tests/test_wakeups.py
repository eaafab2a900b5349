"""The event loop's wake-ups for events made on the engine thread (server/wakeups.py): a batch of
events handed over inside wakeups_held wakes the loop once, at its end, and every generation in
it is marked ready in the order its events came; outside a batch an event wakes the loop at once."""
from __future__ import annotations

import asyncio
import threading
from contextlib import nullcontext

from blockspec.server.wakeups import wakeups_held, waker_of


class Marked:
    """Stands in for a Generation: records when the loop marks it ready."""

    def __init__(self, index: int, ready: list[int]) -> None:
        self.index, self.ready = index, ready

    def mark_ready(self) -> None:
        self.ready.append(self.index)


def wake_from_a_thread(held: bool, count: int) -> tuple[list[int], list[int], int]:
    """`count` generations woken from another thread (inside wakeups_held or not) → the loop's
    wake-ups already asked for after each wake, the order the loop marked them ready in, and the
    wake-ups in all."""
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        asked: list[str] = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            asked.append(getattr(callback, "__name__", ""))
            return real(callback, *args, **kwargs)
        loop.call_soon_threadsafe = counted
        ready: list[int] = []
        seen: list[int] = []
        done = threading.Event()

        def hand_over() -> None:
            with wakeups_held() if held else nullcontext():
                for i in range(count):
                    waker_of(loop).wake(Marked(i, ready))
                    seen.append(asked.count("_set_ready"))
            done.set()
        threading.Thread(target=hand_over).start()
        while not (done.is_set() and len(ready) == count):
            await asyncio.sleep(0.001)
        return seen, ready, asked.count("_set_ready")
    return asyncio.run(main())


def test_a_held_batch_wakes_the_loop_once_at_its_end_in_order():
    seen, ready, wakeups = wake_from_a_thread(held=True, count=64)
    assert seen == [0] * 64                 # nothing asked for while the batch was handed over
    assert wakeups == 1
    assert ready == list(range(64))


def test_an_event_outside_a_batch_wakes_the_loop_at_once():
    seen, ready, _ = wake_from_a_thread(held=False, count=3)
    assert seen[0] == 1
    assert ready == [0, 1, 2]


class ScriptedLoop:
    """Stands in for the event loop: keeps what is asked of it to run when the test says (or, closed,
    refuses as a closed asyncio loop does)."""

    def __init__(self, closed: bool = False) -> None:
        self.pending: list = []
        self.closed = closed

    def call_soon_threadsafe(self, callback, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.pending.append(callback)

    def run_pending(self) -> None:
        pending, self.pending = self.pending, []
        for callback in pending:
            callback()


class Aborted(Marked):
    """A generation whose request records an abort (what a closed loop's waiters get)."""

    def __init__(self, index: int, ready: list[int], aborted: list[int]) -> None:
        super().__init__(index, ready)
        self.request = self
        self.aborted = aborted

    def abort(self) -> None:
        self.aborted.append(self.index)


def test_a_wake_up_in_flight_when_a_batch_begins_takes_the_batch_too():
    """Woken outside a batch, then a batch handed over before the loop ran: the one wake-up on its way
    marks all three ready, in order, and the batch's end asks for no other."""
    loop, ready = ScriptedLoop(), []
    waker = waker_of(loop)
    waker.wake(Marked(0, ready))
    with wakeups_held():
        waker.wake(Marked(1, ready))
        waker.wake(Marked(2, ready))
    assert len(loop.pending) == 1
    loop.run_pending()
    assert ready == [0, 1, 2] and not loop.pending


def test_a_batch_whose_earlier_wake_up_ran_mid_way_is_woken_again_at_its_end():
    """The loop ran the wake-up on its way in the middle of a batch: what the batch hands over after
    that is not lost; its end asks for one more."""
    loop, ready = ScriptedLoop(), []
    waker = waker_of(loop)
    waker.wake(Marked(0, ready))
    with wakeups_held():
        waker.wake(Marked(1, ready))
        loop.run_pending()                     # the loop takes the GIL here
        waker.wake(Marked(2, ready))
        assert not loop.pending                # held: nothing asked for yet
    assert len(loop.pending) == 1
    loop.run_pending()
    assert ready == [0, 1, 2]


def test_a_batch_that_raises_still_wakes_and_an_empty_one_never_does():
    loop, ready = ScriptedLoop(), []
    waker = waker_of(loop)
    with wakeups_held():
        pass
    assert not loop.pending
    try:
        with wakeups_held():
            waker.wake(Marked(0, ready))
            raise ValueError("a callback failed")
    except ValueError:
        pass
    loop.run_pending()
    assert ready == [0]


def test_a_closed_loop_aborts_whoever_waits_for_it():
    """No loop to wake (the server is shutting down): the waiting generations' requests are aborted,
    in a batch and outside one, instead of waiting for a wake-up that never comes."""
    loop, ready, aborted = ScriptedLoop(closed=True), [], []
    waker = waker_of(loop)
    waker.wake(Aborted(0, ready, aborted))
    with wakeups_held():
        waker.wake(Aborted(1, ready, aborted))
        waker.wake(Aborted(2, ready, aborted))
    assert aborted == [0, 1, 2] and not ready


def test_a_batch_held_on_one_thread_does_not_hold_another_threads_events():
    """wakeups_held is per thread: while the engine thread hands a step over, an event made on any
    other thread (a second engine, an abort) wakes the loop at once, not at the end of a batch it
    is no part of."""
    loop, ready = ScriptedLoop(), []
    waker = waker_of(loop)
    inside, release = threading.Event(), threading.Event()

    def engine_thread() -> None:
        with wakeups_held():
            inside.set()
            release.wait(5)
    holder = threading.Thread(target=engine_thread)
    holder.start()
    try:
        assert inside.wait(5)
        waker.wake(Marked(0, ready))
        assert len(loop.pending) == 1          # asked for now, the other thread's batch still open
    finally:
        release.set()
        holder.join(5)
    loop.run_pending()
    assert ready == [0] and not loop.pending
