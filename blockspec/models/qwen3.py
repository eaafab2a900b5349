"""Full-attention targets: Qwen3, Qwen2, Llama and Qwen3-MoE (one file; they differ by qk-norm,
biases, RoPE and, for Qwen3-MoE, sparse feed-forward layers).

Module and parameter names are Hugging Face's, so checkpoints load by name.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.layers import Attention, AttentionMetadata, RMSNorm, RotaryEmbedding
from blockspec.layers.moe import make_mlp
from blockspec.models.base import CausalLM, PreNormLayer


class DecoderLayer(PreNormLayer):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                   config.head_dim, config.rms_norm_eps, qkv_bias=config.attention_bias,
                                   out_bias=config.attention_out_bias,
                                   qk_norm="plain" if config.use_qk_norm else None, cache_index=index)
        self.mlp = make_mlp(config.hidden_size, config.intermediate_size, config.moe, index, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DenseModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (qk-norm), Qwen2 (qkv bias), Llama (llama3 RoPE scaling) and Qwen3-MoE targets."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DenseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


# One class serves both: the config says which layers are sparse.
Qwen3MoeForCausalLM = Qwen3ForCausalLM
