"""Static runners for the target and the draft, replayed as CUDA graphs on the GPU.

The host on our GPU machine launches kernels slowly (tens of ms per eager forward), so every
decode step, every verify and every draft is a graph replay. Each runner owns one persistent
cache and computes positions on the device from scalars (`start`, `num_context`), so a graph
captured once per width serves every sequence length. The runners speak the model protocol the
decoding loops use (make_cache, __call__, embed, lm_head …), so plain and DFlash decoding run
unchanged on them. With use_graphs=False (the CPU tests) they run the same static path eagerly:
graph capture then adds nothing but replay.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from blockspec.cache import ModelCache
from blockspec.models.qwen3 import ForwardOutput


class GraphSet:
    """Graphs keyed by width. Every tensor a graph reads or writes stays referenced here:
    a freed input buffer would hand its memory to someone else while the graph still reads it."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, object]] = {}

    def capture(self, width: int, fn: Callable, *inputs: torch.Tensor) -> None:
        if not self.enabled:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up allocations and kernel selection outside the graph
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*inputs)
        self.graphs[width] = (graph, inputs, out)

    def replay(self, width: int, *values: torch.Tensor):
        """Copy values into the graph's inputs, replay, return its (static) outputs; None if no graph."""
        if width not in self.graphs:
            return None
        graph, inputs, out = self.graphs[width]
        for buffer, value in zip(inputs, values):
            buffer.copy_(value)
        graph.replay()
        return out


class StaticTarget:
    def __init__(self, target: nn.Module, max_len: int, max_width: int, capture_layers: tuple[int, ...] = (),
                 use_graphs: bool = True) -> None:
        self.target = target
        self.config = target.config
        self.lm_head = target.lm_head
        self.capture_layers = tuple(capture_layers)
        self.max_len = max_len
        self.device = target.lm_head.weight.device
        self.cache = target.make_cache(max_len)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        self.graphs = GraphSet(self.device, use_graphs)
        with torch.inference_mode():
            for width in range(1, min(max_width, max_len) + 1):
                self.graphs.capture(width, self._static_forward,
                                    torch.zeros((1, width), dtype=torch.long, device=self.device))

    num_layers = property(lambda self: self.target.num_layers)
    hidden_size = property(lambda self: self.target.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def _static_forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> ForwardOutput:
        positions = self.start + torch.arange(input_ids.shape[1], device=self.device)
        return self.target(input_ids, self.cache, capture_layers=self.capture_layers, positions=positions,
                           num_logits=num_logits)

    def make_cache(self, max_len: int, num_slots: int = 1) -> ModelCache:
        """The one persistent cache, reset (one engine thread runs one sequence at a time)."""
        if max_len > self.max_len:
            raise ValueError(f"max_len {max_len} exceeds the static cache's {self.max_len}")
        self.cache.length, self.cache.last_forward_start = 0, None
        return self.cache

    def __call__(self, input_ids: torch.Tensor, cache: ModelCache, *, capture_layers: tuple[int, ...] = (),
                 num_logits: int | None = None, keep_steps: bool = False) -> ForwardOutput:
        if tuple(capture_layers) not in ((), self.capture_layers):
            raise ValueError(f"this runner captures layers {self.capture_layers}")
        width = input_ids.shape[1]
        self.start.fill_(cache.advance(width))
        out = self.graphs.replay(width, input_ids)
        if out is None:   # a prefill: logits of the last positions only (a long prompt × vocab is GBs)
            out = self._static_forward(input_ids, num_logits)
        elif num_logits is not None:
            out = ForwardOutput(out.logits[:, width - num_logits:], out.features)
        # Graph outputs are overwritten by the next replay. Logits (up to 16 × vocab) are read
        # before the next call by every caller, so they are not copied: valid until the next
        # call. Features are copied: DFlash keeps them across calls until the next draft.
        features = out.features.clone() if out.features is not None else None
        return ForwardOutput(out.logits, features)


class StaticDraft:
    """The draft with context padded to max_context rows (a cycle commits at most a block)."""

    def __init__(self, draft: nn.Module, max_len: int, max_block: int, use_graphs: bool = True) -> None:
        self.draft = draft
        self.config = draft.config
        self.max_len = max_len
        self.max_context = max_block
        device = draft.fc.weight.device
        self.cache = draft.make_cache(max_len + max_block)   # slack for the padded rows
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.num_context = torch.zeros((), dtype=torch.long, device=device)
        self.features = torch.zeros((1, max_block, draft.fc.in_features), dtype=draft.fc.weight.dtype, device=device)
        self.graphs = GraphSet(device, use_graphs)
        with torch.inference_mode():
            for width in range(2, max_block + 1):
                embeds = torch.zeros((1, width, draft.config.hidden_size), dtype=draft.fc.weight.dtype, device=device)
                self.graphs.capture(width, self._static_forward, embeds)

    block_size = property(lambda self: self.draft.block_size)
    mask_token_id = property(lambda self: self.draft.mask_token_id)
    target_layer_ids = property(lambda self: self.draft.target_layer_ids)

    def read_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return self.draft.read_logits(hidden, lm_head)

    def _static_forward(self, block_embeds: torch.Tensor) -> torch.Tensor:
        return self.draft.forward_static(block_embeds, self.features, self.cache, self.start, self.num_context)

    def make_cache(self, max_len: int, num_slots: int = 1) -> ModelCache:
        if max_len > self.max_len:
            raise ValueError(f"max_len {max_len} exceeds the static cache's {self.max_len}")
        self.cache.length, self.cache.last_forward_start = 0, None
        return self.cache

    def __call__(self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        num_context = new_features.shape[1]
        if num_context > self.max_context:        # the prompt's context: once per request, eager
            return self.draft(block_embeds, new_features, cache)
        self.start.fill_(cache.advance(num_context))
        self.num_context.fill_(num_context)
        self.features[:, :num_context].copy_(new_features)   # rows past num_context: masked out
        out = self.graphs.replay(block_embeds.shape[1], block_embeds)
        if out is None:
            out = self._static_forward(block_embeds)
        return out.clone()
