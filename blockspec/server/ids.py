"""Ids the API hands out (responses, tool calls, requests): hex digits from Python's generator.

Not uuid4: each uuid4 is a getrandom system call, and a thread that makes one gives up the GIL and
waits to take it back behind the engine thread (up to the switch interval): two per request, in a
64-request burst on the dev CPU 0.23 ms each on the event loop (round 54). An id names a response;
it is not a secret. A generator of its own, seeded from the OS at import and again in a forked
child: code that seeds Python's global one (for its own reproducibility) cannot make ids repeat."""
from __future__ import annotations

import os
import random

_IDS = random.Random()
os.register_at_fork(after_in_child=_IDS.seed)


def random_hex(digits: int) -> str:
    return f"{_IDS.getrandbits(4 * digits):0{digits}x}"


def new_id(prefix: str, digits: int = 24) -> str:
    """prefix + `digits` hex digits ("chatcmpl-…", "cmpl-…", "call_…", "resp_…")."""
    return prefix + random_hex(digits)
