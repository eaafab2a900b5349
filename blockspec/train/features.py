"""What training needs from the frozen target, behind two small functions.

This is the only file that calls the target's forward, so a change of the model protocol is
adapted here and nowhere else in blockspec/train.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """input_ids [B, L] → context features [B, L, len(layer_ids) · H]: the outputs of decoder
    layers `layer_ids` (transformers' hidden_states[l + 1]), as the engine feeds the draft."""
    batch, length = input_ids.shape
    cache = target.make_cache(length, num_slots=batch)
    return target(input_ids, cache, capture_layers=tuple(layer_ids), num_logits=1).features


@torch.no_grad()
def greedy_continue(target: nn.Module, prompt_ids: torch.Tensor, num_new: int) -> torch.Tensor:
    """Greedy continuations of equal-length prompts, batched: [B, P] → [B, num_new].

    Self-distillation data in bulk (the engine decodes one request at a time); the tokens equal
    plain greedy decoding of each prompt alone, up to batched-kernel rounding."""
    batch, prompt_len = prompt_ids.shape
    cache = target.make_cache(prompt_len + num_new, num_slots=batch)
    logits = target(prompt_ids, cache, num_logits=1).logits[:, -1]
    out = torch.empty(batch, num_new, dtype=torch.long, device=prompt_ids.device)
    for i in range(num_new):
        out[:, i] = logits.argmax(-1)
        if i + 1 < num_new:
            logits = target(out[:, i: i + 1], cache, num_logits=1).logits[:, -1]
    return out


def embed(target: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's token embedding (shared with the draft, never trained)."""
    return target.embed(token_ids)


def lm_head(target: nn.Module) -> nn.Module:
    """The target's output head (shared with the draft, never trained)."""
    return target.lm_head
