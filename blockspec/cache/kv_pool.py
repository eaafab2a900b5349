"""Paged K/V: every attention layer's keys and values in one flat pool of slots
[num_pages · page_size, Hkv, D]; a sequence's block table names its pages in order.

Rollback after a verify is by length only: positions past a sequence's committed length are
never read (the context length masks them) and are overwritten by its next forward. Nothing is
copied. The target and the draft keep separate pools but share the block tables (cache/manager.py),
since the draft's context K/V lives at the same positions as the target's.
"""
from __future__ import annotations

import torch


def pages_for(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


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
