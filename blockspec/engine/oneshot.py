"""Whole-sequence forwards outside the engine, for training and checks: B sequences of L tokens
through a target in one forward, on throwaway pools (one page per sequence)."""
from __future__ import annotations

import torch
from torch import nn

from blockspec.cache import KVPool, StatePool
from blockspec.layers import AttentionMetadata
from blockspec.models.base import ForwardOutput


@torch.no_grad()
def forward_sequences(target: nn.Module, input_ids: torch.Tensor, capture_layers: tuple[int, ...] = ()
                      ) -> ForwardOutput:
    """input_ids [B, L] → hidden [B, L, H] after the final norm, and the features of
    capture_layers [B, L, K·H] (transformers' hidden_states[l + 1]) or None."""
    batch, length = input_ids.shape
    device, dtype = input_ids.device, target.lm_head.weight.dtype
    config = target.config
    kv = KVPool(target.num_attention_layers, (batch + 1) * length, config.num_key_value_heads, config.head_dim,
                dtype, device)
    shapes = target.recurrent_shapes
    states = StatePool(batch + 1, shapes, dtype, device) if shapes else None
    rows = torch.arange(1, batch + 1, device=device)                 # page and slot 0: reserved
    positions = torch.arange(length, device=device).repeat(batch)
    meta = AttentionMetadata(
        num_seqs=batch, width=length, input_ids=input_ids.reshape(-1), positions=positions,
        slot_mapping=(rows[:, None] * length + torch.arange(length, device=device)).reshape(-1),
        block_tables=rows[:, None], context_lens=torch.full((batch,), length, device=device),
        max_context_len=length, page_size=length, kv=kv.layers, states=states,
        state_slots=rows if states is not None else None)
    out = target(meta.input_ids, meta.positions, meta, tuple(capture_layers))
    features = None if out.features is None else out.features.view(batch, length, -1)
    return ForwardOutput(out.hidden.view(batch, length, -1), features)
