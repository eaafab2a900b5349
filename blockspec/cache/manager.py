"""The cache manager: which pages and state slots each sequence holds. The scheduler owns it;
the model runner only reads block tables and slot ids from the sequences it runs.

Pages are reference counted so that several sequences can share one (a prefix cache will hand
the same full page to every request that starts with its tokens): `allocate` gives pages with
one reference, `incref` adds one, `free` drops one per page and puts a page back on the free
list exactly when its count reaches 0. Dropping a reference a page does not hold is a bug
(a double free would give one page to two sequences): it raises instead of corrupting the pool.

State slots (hybrid targets' recurrent state) are plain ids here; the runner zeroes a slot's
tensors when its sequence's first prefill chunk runs.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.engine.sequence import Sequence


class DoubleFreeError(RuntimeError):
    """A page or slot released more often than it was taken."""


class PageAllocator:
    """Reference-counted page ids. Page 0 is never handed out: padded rows of a captured batch
    write their K/V there, so they can never touch a live sequence's pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a KV pool needs at least 2 pages (page 0 is reserved for padding)")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (vLLM's kv_cache_usage_perc, in 0..1)."""
        return 1.0 - self.num_free / (self.num_pages - 1)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise MemoryError(f"{num} pages asked for, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(num)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] == 0:
                raise DoubleFreeError(f"page {page} is free: it cannot be shared")
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference of each page; a page whose count reaches 0 is free again."""
        for page in pages:
            if page == 0 or self._refs[page] == 0:
                raise DoubleFreeError(f"page {page} freed more often than it was taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)


class SlotAllocator:
    """Ids of recurrent-state slots 1 … num_slots (slot 0: padding rows of a batch)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots + 1))
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free recurrent-state slot")
        slot = self._free.popleft()
        self._taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._taken:
            raise DoubleFreeError(f"state slot {slot} freed more often than it was taken")
        self._taken.remove(slot)
        self._free.append(slot)


class CacheManager:
    """Block tables and state slots of every sequence. num_state_slots 0: no recurrent layers."""

    def __init__(self, num_pages: int, page_size: int, num_state_slots: int = 0) -> None:
        self.page_size = page_size
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_state_slots) if num_state_slots else None

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    @property
    def num_usable_pages(self) -> int:
        return self.pages.num_pages - 1

    @property
    def usage(self) -> float:
        return self.pages.usage

    @property
    def has_states(self) -> bool:
        return self.slots is not None

    def pages_needed(self, seq: Sequence, num_positions: int) -> int:
        """More pages seq needs to hold positions [0, num_positions)."""
        return max(0, -(-num_positions // self.page_size) - len(seq.block_table))

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Give seq pages for positions [0, num_positions)."""
        seq.block_table += self.pages.allocate(self.pages_needed(seq, num_positions))

    def release(self, seq: Sequence) -> None:
        """Hand back everything seq holds; the block table and slot are cleared, so a second
        release frees nothing (a sequence is released by preemption and again when it ends)."""
        self.pages.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None

    def claim_state_slot(self, seq: Sequence) -> None:
        if self.slots is not None and seq.state_slot is None:
            seq.state_slot = self.slots.allocate()

    @property
    def has_free_state_slot(self) -> bool:
        return self.slots is None or self.slots.num_free > 0
