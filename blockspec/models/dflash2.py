"""The DFlash 2 draft (z-lab's `DFlash2DraftModel` checkpoints): DFlash 1 (models/dflash.py)
plus two parts that raise acceptance.

Grouped dynamic causal convolutions. Each layer wraps its attention in `attention_conv` and its
MLP in `mlp_conv`. `prepare` mixes every block position with the taps − 1 positions before it,
`finish` mixes the sub-layer's output the same way:

    out[t] = Σ_j (base_kernel[side, j] + c[t, j, g]) ⊙ x[t − j]        j < taps, side 0 | 1

c [T, 2, taps, G] is projected from the normed sub-layer input (`kernel_projection`), one
coefficient per group of `conv_group_size` channels; side 0 serves `prepare`, side 1 `finish`.
The convolution runs over each sequence's block only (the context has no convolution); a
position before the block's start is zero, so a block shorter than the taps is fine.

The candidate selector. Drafts are chosen jointly, not by per-slot argmax: slot i keeps the
top-k of its logits (scaled and soft-capped as DFlash 1's) as candidates, and a walk from left
to right picks

    d_i = argmax over candidates c of  u_i(c) + ⟨P[d_{i−1}] ⊙ W·h_i, S[c]⟩        d_0 = anchor

with u_i the logit, h_i the draft's hidden state, P, S the predecessor and successor codebooks
[V, r] and W the hidden projection [H → r]. Every (predecessor candidate, candidate) edge score
is computed at once (`CandidateWalk.edge_scores`), so the walk itself is one gather and one
argmax per slot, all on the device: the greedy walk runs inside the propose CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.config import ConfigError
from blockspec.layers import AttentionMetadata
from blockspec.models.dflash import DFlashDraftModel, DraftConfig, DraftLayer, draft_rename

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size")


def check_dflash2_config(config: DraftConfig) -> None:
    missing = [key for key in DFLASH2_KEYS if getattr(config, key) is None]
    if missing:
        raise ConfigError(f"a DFlash 2 draft config needs {', '.join(missing)} (in dflash_config or at the top level)")
    if config.hidden_size % config.conv_group_size:
        raise ConfigError(f"conv_group_size {config.conv_group_size} does not divide hidden_size {config.hidden_size}")
    if not 1 <= config.selector_top_k <= config.vocab_size:
        raise ConfigError(f"selector_top_k {config.selector_top_k} must be in [1, vocab_size {config.vocab_size}]")


class GroupedDynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash 2 layer (the module docstring has the formula)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))            # [side, tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def prepare(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B·T, H] (the normed sub-layer input) → (x mixed by side 0, side 1's coefficients
        [B·T, taps, G] for `finish`)."""
        coefficients = self.kernel_projection(x).view(-1, 2, self.taps, self.num_groups)
        return self.mix(x, coefficients[:, 0], 0, width), coefficients[:, 1]

    def finish(self, x: torch.Tensor, coefficients: torch.Tensor, width: int) -> torch.Tensor:
        return self.mix(x, coefficients, 1, width)

    def mix(self, x: torch.Tensor, coefficients: torch.Tensor, side: int, width: int) -> torch.Tensor:
        """out[t] = Σ_j (base[side, j] + c[t, j]) ⊙ x[t − j] within each block of width T."""
        x_groups = x.view(-1, width, self.num_groups, self.group_size)                  # [B, T, G, gs]
        c = coefficients.reshape(-1, width, self.taps, self.num_groups, 1)              # [B, T, taps, G, 1]
        base = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size)
        out = (base[0] + c[:, :, 0]) * x_groups
        for j in range(1, min(self.taps, width)):        # taps reaching before the block see zeros
            out[:, j:] += (base[j] + c[:, j:, j]) * x_groups[:, : width - j]
        return out.view_as(x)


class DFlash2Layer(DraftLayer):
    """A DFlash 1 layer whose attention and MLP each sit inside a grouped dynamic convolution:
    the attention's queries and block K/V come from the mixed input."""

    def __init__(self, config: DraftConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        conv = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*conv)
        self.mlp_conv = GroupedDynamicConv(*conv)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        width = meta.width
        h, residual = self.input_layernorm.add(x, residual)
        h, coefficients = self.attention_conv.prepare(h, width)
        h, residual = self.post_attention_layernorm.add(
            self.attention_conv.finish(self.self_attn(h, rope, meta), coefficients, width), residual)
        h, coefficients = self.mlp_conv.prepare(h, width)
        return self.mlp_conv.finish(self.mlp(h), coefficients, width), residual


@dataclass
class CandidateWalk:
    """The selector's output for B blocks of L = T − 1 draft slots (the propose graph's output).

    edge_scores[b, i, p, c] = u_i(c) + ⟨P[prev_p] ⊙ W·h_i, S[c]⟩ where prev_p is candidate p of
    slot i − 1 (for slot 0 every row p stands for the anchor). A walk is a candidate index per
    slot; the next slot's row is the index just chosen (row 0 for slot 0)."""
    candidate_ids: torch.Tensor          # [B, L, k]
    edge_scores: torch.Tensor            # [B, L, k, k] fp32
    drafts: torch.Tensor                 # [B, L]: the greedy walk's tokens
    vocab_size: int

    def rows(self, num_seqs: int) -> "CandidateWalk":
        return CandidateWalk(self.candidate_ids[:num_seqs], self.edge_scores[:num_seqs],
                             self.drafts[:num_seqs], self.vocab_size)


def greedy_walk(edge_scores: torch.Tensor) -> torch.Tensor:
    """edge_scores [B, L, k, k] → chosen candidate indices [B, L]: per slot, the argmax of the
    row of the index chosen one slot earlier. Device ops only (no host sync): graph-capturable."""
    num_seqs, num_slots = edge_scores.shape[:2]
    rows = torch.arange(num_seqs, device=edge_scores.device)
    chosen = torch.zeros(num_seqs, dtype=torch.long, device=edge_scores.device)
    path = []
    for i in range(num_slots):
        chosen = edge_scores[rows, i, chosen].argmax(-1)
        path.append(chosen)
    return torch.stack(path, dim=1)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.vocab_size = top_k, vocab_size
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> CandidateWalk:
        """hidden [B, L, H], logits [B, L, V] of the draft slots, anchors [B] → CandidateWalk."""
        unary, ids = logits.topk(self.top_k, dim=-1)                                    # [B, L, k]
        unary = unary.float()
        projected = self.hidden_projection(hidden)                                      # [B, L, r]
        previous = torch.cat((anchors[:, None, None].expand(-1, 1, self.top_k), ids[:, :-1]), dim=1)
        left = self.predecessor_codebook[previous] * projected[:, :, None]              # [B, L, k, r]
        right = self.successor_codebook[ids]                                            # [B, L, k, r]
        edges = unary[:, :, None, :] + (left @ right.transpose(-1, -2)).float()         # [B, L, k, k]
        drafts = ids.gather(-1, greedy_walk(edges)[..., None])[..., 0]
        return CandidateWalk(ids, edges, drafts, self.vocab_size)


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2Layer

    def __init__(self, config: DraftConfig) -> None:
        check_dflash2_config(config)
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                    config.selector_top_k)

    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Module) -> CandidateWalk:
        """Hidden states of B blocks [B, T, H] and their anchors [B] → the candidates of the
        T − 1 draft slots, their edge scores and the greedy walk."""
        slots = hidden[:, 1:]
        return self.candidate_selector(slots, self.read_logits(slots, lm_head), anchors)


def dflash2_rename(name: str) -> str | None:
    # z-lab's codebooks are nn.Embedding in their module but saved without `.weight`
    # (their from_pretrained maps the names back); accept both spellings.
    name = draft_rename(name)
    if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
        return name[: -len(".weight")]
    return name
