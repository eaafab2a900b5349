"""One training forward of the draft over many blocks at once (the DFlash recipe).

For each sequence we pick N anchor positions a. Block j is [x_a, MASK × (B − 1)] at positions
a … a + B − 1; its slot k (k ≥ 1) is trained to predict token a + k. As in decoding, the block
sees the context features of positions < a (the target has not run the anchor yet) and its own
B slots bidirectionally, nothing else: one [N·B, L + N·B] block-sparse mask lets all N blocks
of a sequence share one forward. Keys are [context K/V of all L positions | every block's K/V],
exactly the keys DFlashDraftModel's layers build in decoding (context then block).

Only the draft's parameters are used (HF / z-lab names); attention is written here because
decoding's attention works on a cache, not on many blocks at once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on x [B, heads, T, D] with cos/sin [B, 1, T, rot_dim] (rot_dim ≤ D)."""
    cos, sin = rope
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def heads(out: torch.Tensor, norm: nn.Module | None, num_heads: int, head_dim: int) -> torch.Tensor:
    """A projection [B, T, heads·D] → [B, heads, T, D] (qk-norm per head when the draft has it)."""
    out = out.reshape(out.shape[0], out.shape[1], num_heads, head_dim)
    return (norm(out) if norm is not None else out).transpose(1, 2)


def block_attention(attn: nn.Module, x: torch.Tensor, context: torch.Tensor, block_rope, context_rope,
                    mask: torch.Tensor, config) -> torch.Tensor:
    """x [B, Q, H] (all blocks), context [B, L, H] (fused features), mask [B, 1, Q, L + Q]."""
    num_heads, num_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k_block, v_block = attn.qkv_proj.split(attn.qkv_proj(x))             # one GEMM for the blocks
    k_context, v_context = attn.qkv_proj.project(context, "k_proj", "v_proj").split(num_kv * head_dim, dim=-1)
    q = rotate(heads(q, attn.q_norm, num_heads, head_dim), block_rope)
    k = torch.cat((rotate(heads(k_context, attn.k_norm, num_kv, head_dim), context_rope),
                   rotate(heads(k_block, attn.k_norm, num_kv, head_dim), block_rope)), dim=2)
    v = torch.cat((heads(v_context, None, num_kv, head_dim), heads(v_block, None, num_kv, head_dim)), dim=2)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=head_dim ** -0.5, enable_gqa=num_heads != num_kv)
    return attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], num_heads * head_dim))


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [B, N] → positions [B, N·block_size] of every block slot."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + offsets).flatten(1)


def block_sparse_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, N] → bool mask [B, 1, N·bs, L + N·bs]: block j sees context keys at
    positions < anchor_j and the keys of its own block (bidirectionally), nothing else."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)                          # [B, Q]
    sees_context = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[..., None]
    block_id = torch.arange(num_blocks, device=device).repeat_interleave(block_size)     # [Q]
    sees_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)
    return torch.cat((sees_context, sees_block), dim=2)[:, None]


def draft_hidden(draft: nn.Module, block_embeds: torch.Tensor, features: torch.Tensor,
                 block_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The draft's hidden states [B, Q, H] for all blocks (before the target's lm_head).

    block_embeds [B, Q, H]: the target's embedding of the blocks; features [B, L, K·H]."""
    config = draft.config
    batch, seq_len = features.shape[:2]
    context = draft.hidden_norm(draft.fc(features))
    context_pos = torch.arange(seq_len, device=features.device).expand(batch, -1)
    dtype = context.dtype
    context_rope = draft.rotary_emb(context_pos, dtype)
    block_rope = draft.rotary_emb(block_pos, dtype)
    x = block_embeds * config.input_embedding_scale
    for layer in draft.layers:
        x = x + block_attention(layer.self_attn, layer.input_layernorm(x), context, block_rope,
                                context_rope, mask, config)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x)


def position_weights(block_size: int, device: torch.device, decay: float | None = None) -> torch.Tensor:
    """Loss weight of block slot k = 1 … B − 1: exp(−(k − 1) / γ).

    Slot k only counts if slots 1 … k − 1 were accepted, so early slots matter most. γ is the
    DFlash paper's per block size (7 for 16, 5 for 10, 4 for 8), interpolated elsewhere."""
    gamma = decay if decay is not None else {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.2))
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_labels(input_ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of slots 1 … B − 1 of every block → (labels [B, N, B − 1], valid [B, N, B − 1])."""
    positions = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    valid = (positions < lengths[:, None, None]) & anchor_valid[..., None]
    seq_len = input_ids.shape[1]
    labels = torch.gather(input_ids, 1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)
    return labels, valid


def replay_greedy(tokens: list[int], drafts: list[list[int]], first: int) -> list[int]:
    """The acceptance lengths greedy DFlash decoding has while it writes tokens[first + 1:]
    (tokens: a prompt and the target's own greedy output, whose first token, at `first`, comes
    from the prefill) → tokens committed per cycle, as the engine counts them (request stats).

    drafts[p − first]: the draft's tokens for the block anchored at p (slot k for token p + k).
    Verify keeps d_k while it equals the target's token at p + k, then adds the target's own
    next token (the bonus), so a cycle at anchor p commits a + 1 tokens (fewer at the end)."""
    lengths, anchor = [], first
    while anchor < len(tokens) - 1:
        remaining = len(tokens) - 1 - anchor
        proposed = drafts[anchor - first][:remaining]
        accepted = next((k for k, d in enumerate(proposed) if d != tokens[anchor + 1 + k]), len(proposed))
        committed = min(accepted + 1, remaining)
        lengths.append(committed)
        anchor += committed
    return lengths


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ weight · cross-entropy over slots, fp32: logits [B, N, B − 1, V], weights [B, N, B − 1]."""
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
    return (ce * weights.flatten()).sum()


def block_positions_of(values: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """values [B, L, T] at slots 1 … B − 1 of every block → [B, N, B − 1, T] (block_labels'
    positions, the last position standing in past a row's end, where `valid` is False)."""
    positions = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    flat = positions.clamp(max=values.shape[1] - 1).flatten(1)                       # [B, N·(B − 1)]
    picked = torch.gather(values, 1, flat[..., None].expand(-1, -1, values.shape[-1]))
    return picked.view(*positions.shape, values.shape[-1])


def soft_block_loss(logits: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """Σ weight · cross-entropy against the target's (truncated) distribution over slots, fp32:
    logits [B, N, B − 1, V], target ids / probabilities [B, N, B − 1, T], weights [B, N, B − 1].
    −Σ_t q_t log p(id_t): the KL divergence from the target's distribution up to its entropy,
    which the draft cannot change, so the gradients are the KL's."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    ce = -(target_probs * log_probs.gather(-1, target_ids)).sum(-1)
    return (ce * weights).sum()


def num_anchor_candidates(length: int, prompt_len: int) -> tuple[int, int]:
    """First and last anchor positions: at least one context position, at least one label."""
    return max(1, prompt_len), length - 2


def sample_anchors(lengths: torch.Tensor, prompt_lens: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random anchors per sequence → (anchors [B, N], valid [B, N]); a sequence with
    fewer than N candidates fills the rest with anchor 0, marked invalid (no loss)."""
    anchors = torch.zeros(len(lengths), num_anchors, dtype=torch.long)
    valid = torch.zeros(len(lengths), num_anchors, dtype=torch.bool)
    for i, (length, prompt_len) in enumerate(zip(lengths.tolist(), prompt_lens.tolist())):
        first, last = num_anchor_candidates(length, prompt_len)
        count = max(0, last - first + 1)
        picked = torch.randperm(count, generator=generator)[:num_anchors] + first
        anchors[i, : len(picked)] = picked        # the rest stay at 0, marked invalid
        valid[i, : len(picked)] = True
    return anchors, valid


def default_num_anchors(seq_len: int, block_size: int) -> int:
    """Blocks that would tile the sequence; random anchors overlap, which is the point."""
    return max(1, math.ceil(seq_len / block_size))
