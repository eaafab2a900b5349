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
