"""tests/gpu under several pytest-xdist workers on one device (scripts/gpu_round64.sh 1: every file in one call).

An engine sizes its KV pool from the device's memory: `gpu_memory_utilization` of the whole card less what
other processes hold. Eight workers' engines then race for one card, and whichever sizes its pool while
another's pool is live finds nothing left (round 65, H100: 597 passed and two refused "no memory left for
the KV cache", both passing alone). So under two or more workers each engine sizes its pool as
`--kv-cache-memory` would (SHARED_KV_BYTES), a share that fits beside the others'; a test that checks the
memory-sized pool itself is marked `measures_memory` and keeps the real sizing (the device scripts run it
alone, after the workers).

Each worker also hands its cached blocks back after every test (round 66, H100: one worker's allocator kept
29 GB cached from earlier tests, seven others ran out beside it, and an allocation that failed inside a graph
capture left that worker's stream capturing, so its next 38 tests failed at their first CUDA call)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from blockspec.engine import memory

SHARED_KV_BYTES = 2 << 30


def pytest_configure(config):
    config.addinivalue_line("markers", "measures_memory: sizes a KV pool from the device's memory (run it alone)")


def workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def shared_pages(config, device, per_page, profile, graph_bytes=0) -> memory.PoolSize:
    """measured_pages' stand-in under workers: the pages SHARED_KV_BYTES holds, as --kv-cache-memory sizes them."""
    return memory.PoolSize(memory.pages_in(SHARED_KV_BYTES, per_page), per_page, "kv-cache-memory")


@pytest.fixture(autouse=True)
def share_the_device(request, monkeypatch):
    if workers() > 1 and request.node.get_closest_marker("measures_memory") is None:
        monkeypatch.setattr(memory, "measured_pages", shared_pages)
    yield
    if workers() > 1:
        gc.collect()                     # a finished test's engines and tensors, then their cached blocks
        torch.cuda.empty_cache()
