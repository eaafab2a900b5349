"""The DFlash draft (z-lab's `DFlashDraftModel` checkpoints).

A few Qwen3-style decoder layers that denoise a block [anchor, MASK, …, MASK] in one forward.
They have no embedding and no head: the block is embedded, and the draft's hidden states are
read out, by the target's own embedding and lm_head. Every layer attends to the target's
context features — the outputs of target layers `target_layer_ids`, fused by `fc` and
`hidden_norm` — projected once per position (`append_context`, right after the target forward
that produced them) and kept in the draft's paged K/V pool at the target's positions; the
block's own K/V is never cached (the next draft starts from fresh masks). The context K/V of a
position depends on that position's features alone, so positions a verify rejects are simply
past the sequence's length: masked, then overwritten.

Attention: full-attention layers are non-causal (every block slot sees the whole context and
the whole block); `sliding_attention` layers are causal, and windowed over the context. A
top-level `is_causal` overrides both (DFlash 2 drafts set it false: their sliding layers see the
block both ways, the window limiting the distance in either direction).
The draft's RoPE is its own config's, never the target's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockspec.config import ConfigError, RopeConfig
from blockspec.layers import MLP, Attention, AttentionMetadata, RMSNorm, RotaryEmbedding, paged_attention
from blockspec.models.base import PreNormLayer


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule: spread the draft's inputs evenly over layers 1 … L − 3 of the target."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)          # (a target of < 4 layers: its layer 1)
    if num_target_layers < 2:
        return [0] * num_draft_layers
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_is_causal: tuple[bool, ...]
    layer_window: tuple[int | None, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 only (models/dflash2.py); None in DFlash 1 drafts.
    vocab_size: int | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    @staticmethod
    def from_hf(d: dict[str, Any], num_target_layers: int | None = None) -> "DraftConfig":
        dflash = d.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, d.get(name, default))

        def optional_int(name: str) -> int | None:
            found = value(name)
            return None if found is None else int(found)

        num_layers = int(d["num_hidden_layers"])
        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise ConfigError("draft config has no dflash_config.mask_token_id")
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            num_target = value("num_target_layers", num_target_layers)
            if num_target is None:
                raise ConfigError("draft config has neither target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(int(num_target), num_layers)
        layer_types = d.get("layer_types") or ["full_attention"] * num_layers
        forced_causal = d.get("is_causal")
        is_causal = tuple(t == "sliding_attention" if forced_causal is None else bool(forced_causal)
                          for t in layer_types)
        window = tuple(d.get("sliding_window") if t == "sliding_attention" else None for t in layer_types)
        num_heads = int(d["num_attention_heads"])
        softcap = value("final_logit_softcapping")
        return DraftConfig(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(d),
            attention_bias=bool(d.get("attention_bias", False)),
            block_size=int(value("block_size", 16)), mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            layer_is_causal=is_causal, layer_window=window,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            vocab_size=optional_int("vocab_size"), conv_kernel_size=optional_int("conv_kernel_size"),
            conv_group_size=optional_int("conv_group_size"), selector_rank=optional_int("selector_rank"),
            selector_top_k=optional_int("selector_top_k"),
        )


class DraftAttention(Attention):
    """Qwen3-style attention of the draft: queries of the block see the committed context (from
    the pool) and the whole block (non-causal), or causally within a window (sliding layers)."""

    def __init__(self, config: DraftConfig, layer_idx: int) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim, config.rms_norm_eps, qkv_bias=config.attention_bias,
                         out_bias=config.attention_bias, qk_norm="plain", cache_index=layer_idx)
        self.is_causal = config.layer_is_causal[layer_idx]
        self.window = config.layer_window[layer_idx]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        q, k, v, gate = self.project(x, rope)                                  # the block's k, v: never cached
        k_pool, v_pool = meta.kv[self.cache_index]
        attn = paged_attention(q, k_pool, v_pool, meta, meta.context_lens, self.scale, self.is_causal,
                               self.window, block_kv=(k, v))
        return self.output(attn, gate)


class DraftLayer(PreNormLayer):
    def __init__(self, config: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DFlashDraftModel(nn.Module):
    layer_class: type[nn.Module] = DraftLayer

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def num_attention_layers(self) -> int:
        return self.config.num_hidden_layers

    def append_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Project target features [N, K·H] at positions [N] into every layer's context K/V,
        stored at slot_mapping [N] of the draft's pool."""
        context = self.hidden_norm(self.fc(features))
        rope = self.rotary_emb(positions, context.dtype)
        for layer, (k_pool, v_pool) in zip(self.layers, kv):
            layer.self_attn.store_kv(context, rope, k_pool, v_pool, slot_mapping)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Denoise B blocks: block_embeds [B·T, H] — the target's embedding of [anchor, MASK × (T − 1)]
        at positions [B·T] right after each sequence's committed context (meta.context_lens).
        Returns hidden states [B·T, H] after the final norm (read out with the target's head)."""
        meta.shared.clear()
        rope = self.rotary_emb(positions, block_embeds.dtype)
        x, residual = block_embeds * self.config.input_embedding_scale, None
        for layer in self.layers:
            x, residual = layer.forward_residual(x, residual, rope, meta)
        return self.norm.add(x, residual)[0]

    def read_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden)                                              # [..., V]
        own = False                                   # logits is a tensor made here (not the head's)
        if self.config.output_multiplier != 1.0:      # x · 1 == x: skip a pass over every logit
            logits, own = logits * self.config.output_multiplier, True
        cap = self.config.final_logit_softcapping
        if not cap:
            return logits
        if logits.requires_grad:                      # autograd keeps tanh's output: no in-place ops
            return torch.tanh(logits / cap) * cap
        # The same ops in place on a tensor of our own: the same bits, without a fresh [.., V]
        # tensor per op (on the CPU, allocating and faulting those in cost more than the ops).
        capped = logits.div_(cap) if own else logits / cap
        return capped.tanh_().mul_(cap)

    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Hidden states of B blocks [B, T, H] → logits [B, T − 1, V] of the draft slots (slot i
        predicts d_i; sampling happens per sequence, in engine/spec/dflash.py). anchors [B] are
        unused here: DFlash 2's selector needs them."""
        return self.read_logits(hidden[:, 1:], lm_head)


def draft_rename(name: str) -> str | None:
    # Some exports wrap the draft in `model.`; z-lab's own checkpoints name layers at the top.
    return name[len("model."):] if name.startswith("model.") else name
