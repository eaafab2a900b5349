"""CUDA graphs for a dense target: one static cache, one graph per forward width.

The host on our GPU machine launches kernels slowly (tens of ms per eager forward), so every
decode step and every verify is a graph replay: the widths 1 … max_width are captured once over
a persistent cache, with positions computed on the device from one scalar (`start`) so a graph
serves every sequence length. The wrapper speaks the model protocol the decoding loops use
(make_cache, __call__, embed, lm_head), so plain and DFlash decoding run unchanged on it.
Widths without a graph (prefill) run eagerly through the same static path.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.cache import ModelCache
from blockspec.models.qwen3 import ForwardOutput


class GraphedTarget:
    def __init__(self, target: nn.Module, max_len: int, max_width: int, capture_layers: tuple[int, ...] = ()) -> None:
        self.target = target
        self.config = target.config
        self.lm_head = target.lm_head
        self.capture_layers = tuple(capture_layers)
        self.max_len = max_len
        self.device = target.lm_head.weight.device
        self.cache = target.make_cache(max_len)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        # width → (graph, its input ids, its position offsets, its outputs); every tensor a graph
        # reads must stay referenced here, or the allocator hands its memory to someone else
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, ForwardOutput]] = {}
        with torch.inference_mode():
            for width in range(1, max_width + 1):
                self.graphs[width] = self._capture(width)

    num_layers = property(lambda self: self.target.num_layers)
    hidden_size = property(lambda self: self.target.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def _static_forward(self, input_ids: torch.Tensor, offsets: torch.Tensor) -> ForwardOutput:
        return self.target(input_ids, self.cache, capture_layers=self.capture_layers, positions=offsets + self.start)

    def _capture(self, width: int):
        input_ids = torch.zeros((1, width), dtype=torch.long, device=self.device)
        offsets = torch.arange(width, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up allocations and kernel selection outside the graph
                self._static_forward(input_ids, offsets)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._static_forward(input_ids, offsets)
        return graph, input_ids, offsets, out

    def make_cache(self, max_len: int, num_slots: int = 1) -> ModelCache:
        """The one persistent cache, reset (a single engine thread runs one sequence at a time)."""
        if max_len > self.max_len:
            raise ValueError(f"max_len {max_len} exceeds the captured cache's {self.max_len}")
        self.cache.length, self.cache.last_forward_start = 0, None
        return self.cache

    def __call__(self, input_ids: torch.Tensor, cache: ModelCache, *, capture_layers: tuple[int, ...] = (),
                 num_logits: int | None = None, keep_steps: bool = False) -> ForwardOutput:
        if tuple(capture_layers) not in ((), self.capture_layers):
            raise ValueError("this graph set captures layers %s" % (self.capture_layers,))
        width = input_ids.shape[1]
        start = cache.advance(width)
        self.start.fill_(start)
        if width in self.graphs:
            graph, static_ids, _, out = self.graphs[width]
            static_ids.copy_(input_ids)
            graph.replay()
            # outputs live in graph memory that the next replay overwrites: hand out copies
            features = out.features.clone() if out.features is not None else None
            logits = out.logits if num_logits is None else out.logits[:, width - num_logits:]
            return ForwardOutput(logits.clone(), features)
        out = self._static_forward(input_ids, torch.arange(width, device=self.device))
        if num_logits is not None:
            out.logits = out.logits[:, width - num_logits:]
        return out
