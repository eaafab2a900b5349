"""Paged K/V: every attention layer's keys and values in one flat pool of slots
[num_pages · page_size, Hkv, D]; a sequence's block table names its pages in order.

Rollback after a verify is by length only: positions past a sequence's committed length are
never read (the context length masks them) and are overwritten by its next forward. Nothing is
copied. The target and the draft keep separate pools but share one page allocator, since the
draft's context K/V lives at the same positions as the target's.
"""
from __future__ import annotations

from collections import deque

import torch


def pages_for(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


class PageAllocator:
    """Free-list of page ids. Page 0 is never handed out: padded rows of a captured batch
    write their K/V there, so they can never touch a live sequence's pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a KV pool needs at least 2 pages (page 0 is reserved for padding)")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        # Prefix cache (cache/prefix.py): its unpinned pages count as free and are evicted when
        # an allocation needs them, so everything above sees one number of free pages.
        self.cache = None

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (vLLM's kv_cache_usage_perc, in 0..1)."""
        return 1.0 - self.num_free / (self.num_pages - 1)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free) and self.cache is not None:
            self.cache.evict(num - len(self._free))
        if num > len(self._free):
            raise MemoryError(f"{num} pages asked for, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class KVPool:
    """K/V slots of num_layers attention layers: layers[i] = (k, v), each [num_slots, Hkv, D]."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)
