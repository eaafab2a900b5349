"""The DFlash draft (z-lab's `DFlashDraftModel` checkpoints).

A few Qwen3-style decoder layers that denoise a block [anchor, MASK, …, MASK] in one forward.
They have no embedding and no head: the block is embedded, and the draft's hidden states are
read out, by the target's own embedding and lm_head. Every layer attends to the target's
context features — the outputs of target layers `target_layer_ids`, fused by `fc` and
`hidden_norm` — projected once per committed position and kept as that layer's K/V cache;
the block's own K/V is never cached (the next draft starts from fresh masks).

Attention: full-attention layers are non-causal (every block slot sees the whole context and
the whole block); `sliding_attention` layers are causal, and windowed over the context.
The draft's RoPE is its own config's, never the target's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockspec.cache import KVCache, ModelCache
from blockspec.config import ConfigError, RopeConfig
from blockspec.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope, attend


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule: spread the draft's inputs evenly over layers 1 … L − 3 of the target."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
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

    @staticmethod
    def from_hf(d: dict[str, Any], num_target_layers: int | None = None) -> "DraftConfig":
        dflash = d.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, d.get(name, default))

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
        )


def draft_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor | None,
               is_causal: bool, window: int | None) -> torch.Tensor | None:
    """Bool mask [T, L] from absolute positions: query_pos [T], key_pos [L], key_valid [L] or None.

    Full-attention layers see every valid key (the block is non-causal); sliding layers see
    keys at or before the query, within the window."""
    if not is_causal and window is None and key_valid is None:
        return None
    q, k = query_pos[:, None], key_pos[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=query_pos.device)
    if key_valid is not None:
        visible = visible & key_valid[None, :]
    if is_causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not is_causal:
            visible = visible & (k - q < window)
    return visible


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.is_causal = config.layer_is_causal[layer_idx]
        self.window = config.layer_window[layer_idx]
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] → k, v [B, Hkv, T, D] (k normed and rotated)."""
        batch, num_tokens, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), *rope), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor],
                context_rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                context_at: int | torch.Tensor, masks: dict) -> torch.Tensor:
        """context_at: first context position (eager: keys are the cache up to the context's
        end) or context positions [C] on the device (static: keys are the whole cache)."""
        batch, num_tokens, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, num_tokens, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), *block_rope)
        context_k, context_v = self.project_kv(context, context_rope)
        if isinstance(context_at, torch.Tensor):
            cached_k, cached_v = cache.write_at(context_at, context_k, context_v)
        else:
            cached_k, cached_v = cache.write(context_at, context_k, context_v)   # committed only
        block_k, block_v = self.project_kv(x, block_rope)                          # never cached
        keys, values = torch.cat((cached_k, block_k), dim=2), torch.cat((cached_v, block_v), dim=2)
        mask = masks[(self.is_causal, self.window)]
        return self.o_proj(attend(q, keys, values, mask, self.scale))


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, block_rope, context_rope,
                cache: KVCache, context_at: int | torch.Tensor, masks: dict) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, block_rope, context_rope, cache, context_at, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
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

    def make_cache(self, max_len: int, num_slots: int = 1) -> ModelCache:
        weight = self.fc.weight
        layers = [KVCache(num_slots, self.config.num_key_value_heads, max_len, self.config.head_dim,
                          weight.dtype, weight.device) for _ in self.layers]
        return ModelCache(layers, max_len)

    def forward(self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Denoise one block.

        block_embeds [B, T, H]: the target's embedding of [anchor, MASK × (T − 1)] at positions
        p … p + T − 1, where p = cache.length + C. new_features [B, C, K·H]: target features of
        the C positions committed since the last draft; their K/V join the cache for good.
        Returns hidden states [B, T, H] after the final norm (read out with the target's head).
        """
        num_context, num_block = new_features.shape[1], block_embeds.shape[1]
        context_start = cache.advance(num_context)
        device = block_embeds.device
        positions = torch.arange(context_start, context_start + num_context + num_block, device=device)
        num_keys = context_start + num_context + num_block
        return self._run(block_embeds, new_features, cache, context_at=context_start, positions=positions,
                         key_pos=torch.arange(num_keys, device=device), key_valid=None)

    def forward_static(self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: ModelCache,
                       context_start: torch.Tensor, num_context: torch.Tensor) -> torch.Tensor:
        """The graph-capturable draft: new_features [B, Cmax, K·H] of which the first
        `num_context` (a device scalar) are real; the rest are written past the context's end,
        hidden by the mask and overwritten by the next draft's context. The caller owns
        cache.length; the cache needs Cmax positions of slack."""
        num_padded, num_block = new_features.shape[1], block_embeds.shape[1]
        device = block_embeds.device
        context_pos = context_start + torch.arange(num_padded, device=device)
        context_end = context_start + num_context
        block_pos = context_end + torch.arange(num_block, device=device)
        max_len = cache.layers[0].max_len
        cache_pos = torch.arange(max_len, device=device)
        return self._run(block_embeds, new_features, cache, context_at=context_pos,
                         positions=torch.cat((context_pos, block_pos)),
                         key_pos=torch.cat((cache_pos, block_pos)),
                         key_valid=torch.cat((cache_pos < context_end,
                                              torch.ones(num_block, dtype=torch.bool, device=device))))

    def _run(self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: ModelCache,
             context_at: int | torch.Tensor, positions: torch.Tensor, key_pos: torch.Tensor,
             key_valid: torch.Tensor | None) -> torch.Tensor:
        num_context = new_features.shape[1]
        cos, sin = self.rotary_emb(positions[None], block_embeds.dtype)
        context_rope = (cos[..., :num_context, :], sin[..., :num_context, :])
        block_rope = (cos[..., num_context:, :], sin[..., num_context:, :])
        query_pos = positions[num_context:]
        masks = {kind: draft_mask(query_pos, key_pos, key_valid, *kind)
                 for kind in set(zip(self.config.layer_is_causal, self.config.layer_window))}
        context = self.hidden_norm(self.fc(new_features))
        x = block_embeds * self.config.input_embedding_scale
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer(x, context, block_rope, context_rope, layer_cache, context_at, masks)
        return self.norm(x)

    def read_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


def draft_rename(name: str) -> str | None:
    # Some exports wrap the draft in `model.`; z-lab's own checkpoints name layers at the top.
    return name[len("model."):] if name.startswith("model.") else name
