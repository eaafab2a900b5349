"""What training needs from the frozen target, behind a few small functions.

This is the only file of blockspec/train that runs the target, so a change of the model protocol
is adapted here and nowhere else. Whole sequences go through `engine.oneshot.forward_sequences`
(throwaway pools, one page per sequence).
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.engine.oneshot import forward_sequences


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """input_ids [B, L] → context features [B, L, len(layer_ids) · H]: the outputs of decoder
    layers `layer_ids` (transformers' hidden_states[l + 1]), as the engine feeds the draft."""
    return forward_sequences(target, input_ids, tuple(layer_ids)).features


@torch.no_grad()
def features_and_choices(target: nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...],
                         chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """target_features of input_ids [B, L], and from the same forward the target's greedy choice
    at every position [B, L]: at p, its argmax for token p given the row's tokens before p
    (position 0, which nothing predicts, keeps the row's own token). The head runs over `chunk`
    rows at a time: a whole batch's logits would be B · L · V floats."""
    out = forward_sequences(target, input_ids, tuple(layer_ids))
    hidden = out.hidden.flatten(0, 1)
    argmax = torch.cat([target.compute_logits(hidden[i: i + chunk]).argmax(-1) for i in range(0, len(hidden), chunk)])
    choices = torch.cat((input_ids[:, :1], argmax.view_as(input_ids)[:, :-1]), dim=1)
    return out.features, choices


@torch.no_grad()
def features_and_distributions(target: nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...], top: int,
                               chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_features of input_ids [B, L], and from the same forward the target's distribution
    for every position, truncated to its `top` most likely tokens and renormalised: ids and
    probabilities [B, L, top] (fp32), at p those for token p given the row's tokens before p
    (position 0, which nothing predicts, is the row's own token with probability 1). The head
    runs over `chunk` rows at a time; only the top survive, not B · L · V floats."""
    out = forward_sequences(target, input_ids, tuple(layer_ids))
    hidden = out.hidden.flatten(0, 1)
    ids, probs = [], []
    for i in range(0, len(hidden), chunk):
        values, indices = target.compute_logits(hidden[i: i + chunk]).float().topk(top, dim=-1)
        ids.append(indices)
        probs.append(values.softmax(-1))          # softmax over the top = the renormalised truncation
    shape = (*input_ids.shape, top)
    ids, probs = torch.cat(ids).view(shape), torch.cat(probs).view(shape)
    first_ids = torch.zeros_like(ids[:, :1]).copy_(input_ids[:, :1, None].expand(-1, -1, top))
    first_probs = torch.zeros_like(probs[:, :1])
    first_probs[..., 0] = 1.0
    return (out.features, torch.cat((first_ids, ids[:, :-1]), dim=1), torch.cat((first_probs, probs[:, :-1]), dim=1))


@torch.no_grad()
def greedy_continue(target: nn.Module, prompt_ids: torch.Tensor, num_new: int) -> torch.Tensor:
    """Greedy continuations of equal-length prompts, batched: [B, P] → [B, num_new].

    Self-distillation data in bulk. Each step re-runs the whole sequence (no cache outside the
    engine): quadratic, which is cheap at the few hundred tokens this is used for. The tokens
    equal plain greedy decoding of each prompt alone, up to batched-kernel rounding."""
    sequences = prompt_ids
    for _ in range(num_new):
        hidden = forward_sequences(target, sequences).hidden[:, -1]           # [B, H]
        next_ids = target.compute_logits(hidden).argmax(-1, keepdim=True)     # [B, 1]
        sequences = torch.cat((sequences, next_ids), dim=1)
    return sequences[:, prompt_ids.shape[1]:]


def embed(target: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's token embedding (shared with the draft, never trained)."""
    return target.embed(token_ids)


def lm_head(target: nn.Module) -> nn.Module:
    """The target's output head (shared with the draft, never trained)."""
    return target.lm_head
