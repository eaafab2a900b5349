"""CUDA graphs of the decode cycle's two forwards (the draft's propose and the target's verify),
keyed by (padded number of sequences, keys gathered per sequence).

The host launches kernels far slower than an H200 runs them, so each cycle is two graph
replays. A graph has fixed shapes: the batch is padded to the next captured size (padding rows
read and write page 0 and state slot 0, which no sequence owns), and attention gathers a fixed
number of keys per sequence — the live length rounded up to a power of two (at least 256), so a
short context never pays for the pool's whole capacity. Graphs are captured on first use.

With capture=False the same padded, fixed-shape path runs eagerly: CPU tests hold it to the
eager path, and graph replay adds nothing to it but the replay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from blockspec.layers import AttentionMetadata

MIN_KEYS = 256


def padded_size(num: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= num)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(size, max_num_seqs) for size in sizes})


@dataclass
class StaticForward:
    """The buffers one graph reads and writes. Every tensor a graph touches stays referenced
    here: a freed buffer would hand its memory to someone else while the graph still uses it."""
    ids: torch.Tensor                   # [B·T]
    meta: AttentionMetadata             # positions, slot_mapping, block_tables, context_lens, state_slots
    output: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    stashed: list | None = None         # recurrent per-step states the graph writes (verify)


class GraphedForwards:
    def __init__(self, width: int, max_num_seqs: int, pages_per_seq: int, page_size: int,
                 device: torch.device, capture: bool) -> None:
        self.width, self.page_size, self.device = width, page_size, device
        self.pages_per_seq = pages_per_seq
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.forwards: dict[tuple[str, int, int], StaticForward] = {}

    def num_keys(self, live: int) -> int:
        capacity = self.pages_per_seq * self.page_size
        keys = MIN_KEYS
        while keys < live:
            keys *= 2
        return min(keys, capacity)

    def run(self, kind: str, fn: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
            ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """fn(ids [B·T], meta) → output [B·T, ...] (or [B, ...]), through the static buffers of
        (kind, padded B, keys); returns the output of the B real rows."""
        num_seqs = meta.num_seqs
        key = (kind, padded_size(num_seqs, self.sizes), self.num_keys(meta.max_context_len))
        static = self.forwards.get(key)
        if static is None:
            static = self.forwards[key] = self.make_static(key[1], key[2], meta)
            self.record(static, fn)
        self.fill(static, ids, meta)
        if static.graph is None:
            static.output = fn(static.ids, static.meta)
        else:
            static.graph.replay()
            if meta.states is not None:
                meta.states.stashed = list(static.stashed)
        rows = num_seqs * self.width if static.output.shape[0] == static.ids.shape[0] else num_seqs
        return static.output[:rows]

    def make_static(self, num_seqs: int, num_keys: int, meta: AttentionMetadata) -> StaticForward:
        """Buffers holding padding rows: page 0, slot 0, positions 0 … T − 1."""
        width, device = self.width, self.device
        positions = torch.arange(width, device=device).repeat(num_seqs)
        static_meta = dataclasses.replace(
            meta, num_seqs=num_seqs, positions=positions, slot_mapping=positions.clone(),
            block_tables=torch.zeros(num_seqs, self.pages_per_seq, dtype=torch.long, device=device),
            context_lens=torch.full((num_seqs,), width, dtype=torch.long, device=device),
            max_context_len=num_keys,
            state_slots=None if meta.state_slots is None else torch.zeros(num_seqs, dtype=torch.long, device=device))
        return StaticForward(torch.zeros(num_seqs * width, dtype=torch.long, device=device), static_meta)

    def record(self, static: StaticForward, fn: Callable) -> None:
        """Warm up and capture on padding-only inputs (touching nobody's pages or state)."""
        if not self.capture:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(static.ids, static.meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        static.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(static.graph, pool=self.pool):
            static.output = fn(static.ids, static.meta)
        if static.meta.states is not None:
            static.stashed = list(static.meta.states.stashed)

    def fill(self, static: StaticForward, ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy the batch into the first rows; reset the rest to padding."""
        rows, tokens = meta.num_seqs, meta.num_seqs * self.width
        m = static.meta
        static.ids[:tokens].copy_(ids)
        static.ids[tokens:].zero_()
        m.positions[:tokens].copy_(meta.positions)
        m.slot_mapping[:tokens].copy_(meta.slot_mapping)
        padding = torch.arange(self.width, device=self.device).repeat(m.num_seqs - rows)
        m.positions[tokens:].copy_(padding)
        m.slot_mapping[tokens:].copy_(padding)
        m.block_tables.zero_()
        m.block_tables[:rows, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        m.context_lens.fill_(self.width)
        m.context_lens[:rows].copy_(meta.context_lens)
        if m.state_slots is not None:
            m.state_slots.zero_()
            m.state_slots[:rows].copy_(meta.state_slots)
