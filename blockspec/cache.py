"""Per-sequence caches. Every cache has a leading slot (batch) dimension and `trim(length)`.

Attention layers keep K/V preallocated up to max_len; rollback after a verify is `trim` to the
committed length (nothing is copied: positions past the length are simply overwritten later).
"""
from __future__ import annotations

import torch


class KVCache:
    """Static K/V buffers of one attention layer: [slots, kv_heads, max_len, head_dim]."""

    def __init__(self, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [slots, kv_heads, T, D] at [start, start+T); return views of [0, start+T)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > max_len {self.max_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def trim(self, length: int, verify_start: int | None) -> None:
        """Nothing to do: the model cache's length is the truth for attention layers."""


class ModelCache:
    """All layer caches of one model for its slots, plus the committed length.

    `length` is the number of positions whose K/V (or recurrent state) the cache holds.
    A forward over T new tokens advances it by T; `trim(n)` rolls it back to n after a verify.
    Layers that cannot roll back by truncation (recurrent ones) are told where the last
    forward started, so they can pick the state they saved after position n - 1.
    """

    def __init__(self, layers: list, max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.length = 0
        self.last_forward_start: int | None = None

    def advance(self, num_tokens: int) -> int:
        """Reserve num_tokens positions; return the start position. Called once per forward."""
        start = self.length
        if start + num_tokens > self.max_len:
            raise ValueError(f"sequence of {start + num_tokens} tokens exceeds the cache's {self.max_len}")
        self.last_forward_start = start
        self.length = start + num_tokens
        return start

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of length {self.length} to {length}")
        if length == self.length:
            return
        for layer in self.layers:
            layer.trim(length, self.last_forward_start)
        self.length = length
        self.last_forward_start = None
