"""CUDA graphs of a decode-only step's two forwards (the draft's propose and the target's verify),
keyed by (padded number of sequences, keys per sequence).

The host launches kernels far slower than an H200 runs them, so each cycle is two graph
replays. A graph has fixed shapes: the batch is padded to the next captured size (padding rows
read and write page 0 and state slot 0, which no sequence owns). The Triton attention kernels
read each sequence's live length on the device, so their graphs take the pool's capacity as the
key bound and one graph serves every length (one per padded batch size). The torch reference
gathers a fixed number of keys per sequence, so with it (CPU, BLOCKSPEC_ATTENTION=reference, a
sliding-window draft layer) keys are bucketed: the live length rounded up to a power of two (at
least 256), so a short context never pays for the pool's whole capacity. Graphs are captured
on first use. Both
graphs of a shape read one static packed metadata buffer, filled by one copy per cycle; the
verify reads the drafts the runner writes into its input ids after the propose.

With capture=False the same padded, fixed-shape path runs eagerly: CPU tests hold it to the
eager path, and graph replay adds nothing to it but the replay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from blockspec.layers import AttentionMetadata
from blockspec.layers.attention import unpack

MIN_KEYS = 256


def padded_size(num: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= num)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(size, max_num_seqs) for size in sizes})


@dataclass
class StaticBatch:
    """The buffers the graphs of one (rows, keys) shape read: one packed int tensor whose views
    are the metadata (one host→device copy per cycle fills it), plus the graphs and their outputs.
    Every tensor a graph touches stays referenced here: a freed buffer would hand its memory to
    someone else while the graph still uses it."""
    meta: AttentionMetadata
    padding: torch.Tensor                                   # the packed buffer with padding rows only
    graphs: dict[str, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    stashed: dict[str, list] = field(default_factory=dict)  # recurrent per-step states a verify graph writes


class GraphedForwards:
    def __init__(self, width: int, max_num_seqs: int, pages_per_seq: int, page_size: int,
                 device: torch.device, capture: bool, bucket_keys: bool = True) -> None:
        self.width, self.page_size, self.device = width, page_size, device
        self.pages_per_seq = pages_per_seq
        self.bucket_keys = bucket_keys
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.batches: dict[tuple[int, int], StaticBatch] = {}

    def shape(self, num_seqs: int, live_keys: int) -> tuple[int, int, int]:
        """(rows, block-table columns, keys) of the graph that serves this batch."""
        max_keys = self.pages_per_seq * self.page_size
        keys = MIN_KEYS if self.bucket_keys else max_keys
        while keys < live_keys:
            keys *= 2
        return padded_size(num_seqs, self.sizes), self.pages_per_seq, min(keys, max_keys)

    def bind(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Copy a batch prepared in this shape into its static buffer; return the static metadata."""
        key = (meta.num_seqs, meta.max_context_len)
        static = self.batches.get(key)
        if static is None:
            static = self.batches[key] = self.make_static(meta)
        static.meta.packed.copy_(meta.packed)
        return static.meta

    def make_static(self, meta: AttentionMetadata) -> StaticBatch:
        packed = torch.zeros_like(meta.packed)
        num_tokens = meta.num_seqs * self.width
        views = unpack(packed, meta.num_seqs, num_tokens, self.pages_per_seq)
        if meta.state_slots is None:
            views["state_slots"] = None
        static_meta = dataclasses.replace(meta, **views, packed=packed, shared={})
        padding = packed.clone()
        padding_views = unpack(padding, meta.num_seqs, num_tokens, self.pages_per_seq)
        padding_views["positions"].copy_(torch.arange(self.width, device=self.device).repeat(meta.num_seqs))
        padding_views["slot_mapping"].copy_(padding_views["positions"] % self.page_size)   # inside page 0
        padding_views["query_start"].copy_(torch.arange(meta.num_seqs + 1, device=self.device) * self.width)
        padding_views["context_lens"].fill_(self.width)
        return StaticBatch(static_meta, padding)

    def run(self, kind: str, fn: Callable[[AttentionMetadata], torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """fn(meta) through the graph of (kind, meta's shape): meta is a bound static metadata."""
        static = self.batches[(meta.num_seqs, meta.max_context_len)]
        if not self.capture:
            return fn(meta)
        if kind not in static.graphs:
            self.record(static, kind, fn)
        static.graphs[kind].replay()
        if meta.states is not None and kind in static.stashed:
            meta.states.stashed = list(static.stashed[kind])
        return static.outputs[kind]

    def record(self, static: StaticBatch, kind: str, fn: Callable[[AttentionMetadata], torch.Tensor]) -> None:
        """Warm up and capture on padding-only inputs (touching nobody's pages or state), then
        put the batch back."""
        batch = static.meta.packed.clone()
        static.meta.packed.copy_(static.padding)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(static.meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.outputs[kind] = fn(static.meta)
        static.graphs[kind] = graph
        if static.meta.states is not None:
            static.stashed[kind] = list(static.meta.states.stashed)
        static.meta.packed.copy_(batch)
