"""What the engine uses of every target: one forward over a flat batch, logits, embeddings."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.layers import AttentionMetadata


@dataclass
class ForwardOutput:
    hidden: torch.Tensor                 # [N, hidden] after the final norm (logits: compute_logits)
    features: torch.Tensor | None        # [N, len(capture_layers) · hidden] or None


@dataclass
class MultimodalRows:
    """What a step's images change in a target forward (engine/multimodal.py builds it, for a
    step whose prefill chunks reach image rows)."""
    rope_positions: torch.Tensor                  # [3, N] M-RoPE (t, h, w) positions of every row
    rows: torch.Tensor                            # [n] rows of image tokens in this forward
    embeds: torch.Tensor                          # [n, hidden] the vision tower's tokens for them
    deepstack: tuple[torch.Tensor, ...] = ()      # per DeepStack tap j, [n, hidden]: added after layer j


class PreNormLayer(nn.Module):
    """A decoder layer: norm → token mixer → add + norm → MLP. Subclasses build input_layernorm,
    post_attention_layernorm, mlp and the mixer (`mix`: self_attn unless overridden).

    Between layers the stream travels as (x, residual), its sum, so that each norm runs fused
    with the residual add before it (kernels/fused.py); `forward` is the layer alone."""

    def mix(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.self_attn(h, rope, meta)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """The layer alone: the residual stream in, the stream out."""
        out, residual = self.forward_residual(x, None, rope, meta)
        return out + residual

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (x, residual)."""
        h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.mix(h, rope, meta), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """A target: `forward(input_ids [N], positions [N], meta)` → hidden states and features.

    Subclasses build `self.model` (embed_tokens, layers, norm, rotary_emb) and `self.lm_head`.
    capture_layers (an argument of each forward): decoder layers whose outputs are returned as
    the draft's context features (transformers' hidden_states[l + 1])."""

    config: ModelConfig
    native_stack = None      # kernels/native.DenseStack of a quantized CPU target: its layers in one call

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_attention_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def visual(self) -> nn.Module | None:
        """The vision tower of a multimodal checkpoint (models/qwen3_vl.py), else None."""
        return getattr(self.model, "visual", None)

    @property
    def recurrent_shapes(self) -> list:
        """Shapes of the recurrent layers' state (RecurrentShape); none in a dense target."""
        return []

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                capture_layers: tuple[int, ...] = (), multimodal: MultimodalRows | None = None) -> ForwardOutput:
        """positions [N]: the rows' rotary positions (an image sequence's are its cache positions,
        meta.positions, shifted by its M-RoPE delta). multimodal: image rows take the vision
        tower's tokens and every row rotates at its M-RoPE positions [3, N] instead."""
        meta.shared.clear()
        x = self.embed(input_ids)                                           # [N, hidden]
        if multimodal is not None:
            x = x.index_copy(0, multimodal.rows, multimodal.embeds.to(x.dtype))
        rope_positions = positions if multimodal is None else multimodal.rope_positions
        rope = self.model.rotary_emb(rope_positions, x.dtype, sections=multimodal is not None)              # cos, sin [N, 1, rot]
        if self.native_stack is not None and multimodal is None and meta.pieces is None:
            return ForwardOutput(*self.native_stack.forward(self, x, rope, meta, capture_layers))
        # Layers pass (x, residual), the stream being their sum: each layer's entry norm adds them
        # in the same kernel (RMSNorm.add), so the sum is never a kernel of its own, except for
        # the layers whose output the draft reads.
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer.forward_residual(x, residual, rope, meta)
            if i in capture_layers:
                captured[i] = x + residual
            if multimodal is not None and i < len(multimodal.deepstack):
                # DeepStack: added to the stream after the layer (transformers' hidden_states[i + 1]
                # are taken before it, so the draft's features are too).
                x = x.index_add(0, multimodal.rows, multimodal.deepstack[i].to(x.dtype))
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if captured else None
        return ForwardOutput(self.model.norm.add(x, residual)[0], features)
