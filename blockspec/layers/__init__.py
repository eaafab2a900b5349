"""Layers shared by every model: norms, RoPE, the SwiGLU MLP, and the one paged Attention."""
from blockspec.layers.attention import Attention, AttentionMetadata, paged_attention, write_kv
from blockspec.layers.common import MLP, RMSNorm, RotaryEmbedding, apply_rope

__all__ = ["Attention", "AttentionMetadata", "MLP", "RMSNorm", "RotaryEmbedding", "apply_rope",
           "paged_attention", "write_kv"]
