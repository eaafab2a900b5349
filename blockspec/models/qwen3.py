"""Dense targets: Qwen3, Qwen2 and Llama (one file; they differ by qk-norm, biases and RoPE).

Module and parameter names are Hugging Face's, so checkpoints load by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from blockspec.cache import KVCache, ModelCache
from blockspec.config import ModelConfig
from blockspec.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope, attend, causal_mask


@dataclass
class ForwardOutput:
    logits: torch.Tensor                 # [B, num_logits, vocab]
    features: torch.Tensor | None        # [B, T, len(capture_layers) · hidden] or None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.attention_out_bias)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, start: int | torch.Tensor) -> torch.Tensor:
        """start: the first position (eager), or the positions [T] on the device (static path)."""
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x).view(batch, num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)                  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), *rope)
        if isinstance(start, torch.Tensor):
            keys, values = cache.write_at(start, k, v.transpose(1, 2))    # [B, Hkv, max_len, D]
            mask = torch.arange(cache.max_len, device=x.device)[None, :] <= start[:, None]
        else:
            keys, values = cache.write(start, k, v.transpose(1, 2))   # [B, Hkv, start+T, D]
            mask = causal_mask(num_tokens, keys.shape[2], x.device)
        return self.o_proj(attend(q, keys, values, mask, self.scale))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, start: int | torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class CausalLM(nn.Module):
    """What the decoding loops use of a target, shared by the dense and the hybrid families.

    Subclasses build `self.model` (embed_tokens, layers, norm, rotary_emb), `self.lm_head`,
    `make_cache` and `forward`; `run_layers` is the common body of every forward."""

    config: ModelConfig

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   call_layer: Callable[[nn.Module, torch.Tensor, tuple, int], torch.Tensor],
                   capture_layers: tuple[int, ...], num_logits: int | None) -> ForwardOutput:
        """Embed, run every decoder layer (call_layer(layer, x, rope, i)), read out logits.

        positions [1, T]; capture_layers: decoder layers whose outputs are returned as features
        (transformers' hidden_states[l + 1]); num_logits: logits of the last N positions only."""
        x = self.embed(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = call_layer(layer, x, rope, i)
            if i in capture_layers:
                captured[i] = x
        if num_logits is not None:
            x = x[:, x.shape[1] - num_logits:]
        logits = self.compute_logits(self.model.norm(x))
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if captured else None
        return ForwardOutput(logits, features)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (qk-norm), Qwen2 (qkv bias) and Llama (llama3 RoPE scaling) targets."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DenseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_cache(self, max_len: int, num_slots: int = 1) -> ModelCache:
        weight = self.lm_head.weight
        layers = [KVCache(num_slots, self.config.num_key_value_heads, max_len, self.config.head_dim,
                          weight.dtype, weight.device) for _ in range(self.num_layers)]
        return ModelCache(layers, max_len)

    def forward(self, input_ids: torch.Tensor, cache: ModelCache, *,
                capture_layers: tuple[int, ...] = (), num_logits: int | None = None,
                keep_steps: bool = False, positions: torch.Tensor | None = None) -> ForwardOutput:
        """Run T new tokens [B, T] after the cache's length (see CausalLM.run_layers).

        keep_steps is for recurrent layers (see cache.py); attention layers need nothing.
        positions [T] on the device selects the static path (CUDA graphs): the caller owns
        cache.length, and attention reads the whole static cache under a mask.
        """
        num_tokens = input_ids.shape[1]
        if positions is None:
            start = cache.advance(num_tokens)
            positions = torch.arange(start, start + num_tokens, device=input_ids.device)
        else:
            start = positions
        return self.run_layers(input_ids, positions[None],
                               lambda layer, x, rope, i: layer(x, rope, cache.layers[i], start),
                               capture_layers, num_logits)
