"""Hybrid targets: Qwen3.5, Qwen3.5-MoE and Qwen3-Next, gated attention + Gated DeltaNet layers,
with dense or sparse (mixture-of-experts, shared expert) feed-forward layers as the config says.

Three checkpoint layouts load into one module tree with Hugging Face's names:
- Qwen3_5ForCausalLM: `model.*`, `lm_head.weight`.
- Qwen3_5ForConditionalGeneration (the released Qwen3.5 checkpoints): config under `text_config`,
  text weights under `model.language_model.*`, the vision tower under `model.visual.*`
  (models/qwen3_vl.py); `mtp.*` is not served.
- Qwen3NextForCausalLM: as the first, with the GDN input projections fused per key head.
Qwen3.5-MoE comes in the first two layouts too (Qwen3_5MoeForCausalLM / …ForConditionalGeneration).
Experts load per expert (`mlp.experts.{e}.gate_proj.weight` …) or fused (`mlp.experts.gate_up_proj`).

Every `full_attention` layer keeps K/V in the paged pool, every `linear_attention` layer a slot
of the state pool; verify forwards (meta.keep_steps) stash per-step states so that each sequence
rolls back to its own accepted position (StatePool.select).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.cache.state_pool import RecurrentShape
from blockspec.config import ConfigError, ModelConfig, eos_ids
from blockspec.kernels import fused
from blockspec.layers import Attention, AttentionMetadata, RMSNorm, RotaryEmbedding
from blockspec.layers.attention import from_padded, mixer, padded_rows, shared, to_padded
from blockspec.layers.common import FusedLinear, join_fused_parts
from blockspec.layers.moe import make_mlp
from blockspec.models.base import CausalLM, PreNormLayer
from blockspec.models.gated_delta import (gdn_rows_step, prefill_kernel_fits, select_kernels, state_dtype,
                                         step_kernel_fits)

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """ModelConfig plus the hybrid fields; `layer_types[i]` says which mixer layer i has."""
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    attn_output_gate: bool = True
    fused_gdn_projections: bool = False      # Qwen3-Next: in_proj_qkvz / in_proj_ba

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ConfigError(f"layer_types {sorted(unknown)} are not supported ({', '.join(LAYER_TYPES)} are)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @staticmethod
    def from_hf(d: dict[str, Any], architecture: str) -> "HybridConfig":
        text = d.get("text_config") or d      # the multimodal layout nests the text model's config
        if text.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (silu is)")
        base = ModelConfig.from_hf(text, architecture)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        # transformers ties by the outermost config; the nested text_config may say otherwise.
        fields["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id")
        fields["eos_token_ids"] = eos_ids(d.get("eos_token_id") if eos is None else eos)
        fields["raw"] = d
        return HybridConfig(
            **fields,
            layer_types=layer_types_of(text),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            fused_gdn_projections=architecture == "Qwen3NextForCausalLM" or text.get("model_type") == "qwen3_next",
        )


def layer_types_of(text: dict[str, Any]) -> tuple[str, ...]:
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = int(text.get("full_attention_interval", 4))
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(int(text["num_hidden_layers"])))


class GatedRMSNorm(nn.Module):
    """GDN output norm: w · rmsnorm(o) · silu(z), per value head (a plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, self.weight, gate, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer: projections → causal depthwise conv + SiLU → delta rule → gated norm.

    The conv runs over [q | k | v] channels (conv_dim); the conv cache holds its last K−1 inputs.
    """

    def __init__(self, config: HybridConfig, state_index: int = 0) -> None:
        super().__init__()
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_width, self.value_width = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_width + self.value_width
        self.conv_kernel = config.linear_conv_kernel_dim
        self.is_fused = config.fused_gdn_projections
        hidden = config.hidden_size
        # All input projections are one GEMM (in_proj); on disk they keep their own names.
        if self.is_fused:
            parts = {"in_proj_qkvz": self.conv_dim + self.value_width, "in_proj_ba": 2 * self.num_v_heads}
        else:
            parts = {"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_width, "in_proj_b": self.num_v_heads,
                     "in_proj_a": self.num_v_heads}
        self.in_proj = FusedLinear(hidden, parts, bias=False)
        self.register_load_state_dict_pre_hook(join_fused_parts)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_width, hidden, bias=False)

    @property
    def state_shape(self) -> RecurrentShape:
        return RecurrentShape(self.conv_dim, self.conv_kernel, self.num_v_heads, self.k_dim, self.v_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] → mixed [B, T, conv_dim] (q | k | v), z [B, T, Hv, Dv], b, a [B, T, Hv]."""
        batch, num_tokens, _ = x.shape
        # An FP8 in_proj of mixed formats (layers/fp8.SegmentedLinear) hands its parts over
        # without concatenating its GEMMs' outputs first; one GEMM's output is split in views.
        parts = getattr(self.in_proj, "parts", None)
        projected = parts(x) if parts is not None else self.in_proj.split(self.in_proj(x))
        if not self.is_fused:
            mixed, z, b, a = projected
            return mixed, z.reshape(batch, num_tokens, self.num_v_heads, self.v_dim), b, a
        # Fused: per key head [q (Dk) | k (Dk) | v (r·Dv) | z (r·Dv)] and [b (r) | a (r)], r = Hv / Hk;
        # value head j = key head · r + i, so j // r is its key head as in the unfused layout.
        ratio = self.num_v_heads // self.num_k_heads
        qkvz, ba = projected
        qkvz = qkvz.reshape(batch, num_tokens, self.num_k_heads, -1)
        q, k, v, z = qkvz.split((self.k_dim, self.k_dim, ratio * self.v_dim, ratio * self.v_dim), dim=-1)
        b, a = ba.reshape(batch, num_tokens, self.num_k_heads, -1).split((ratio, ratio), dim=-1)
        mixed = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)
        z = z.reshape(batch, num_tokens, self.num_v_heads, self.v_dim)
        return mixed, z, b.flatten(2), a.flatten(2)

    def convolve(self, mixed: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU after the cached window [B, conv_dim, K−1]; returns
        (output [B, T, conv_dim], conv inputs [B, conv_dim, K−1+T])."""
        conv_inputs = torch.cat((window, mixed.transpose(1, 2)), dim=-1)
        out = F.conv1d(conv_inputs, self.conv1d.weight, groups=self.conv_dim)   # [B, conv_dim, T]
        return F.silu(out).transpose(1, 2), conv_inputs

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [N, hidden]: the flat ragged batch, each sequence continuing the state in its slot."""
        mixed, z, b, a = self.project(x[None])
        out = mixer(meta, self.mix_rows, mixed[0], z[0], b[0], a[0])          # [N, Hv, Dv], normed
        return self.out_proj(out.flatten(1))

    def mix_rows(self, meta: AttentionMetadata, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                 a: torch.Tensor) -> torch.Tensor:
        """Conv + delta rule + gated norm of the projected rows [N, ·] → [rows, Hv, Dv]. Prefill
        chunks (the first meta.num_prefill_seqs sequences) and decode / verify rows (the rest)
        run as two groups, each padded to its longest sequence: padding rows come after a
        sequence's real ones and are made inert (β = 0 writes nothing, g = 0 decays nothing), so
        every state is exactly the one after the sequence's own last row. A bounded batch (a
        FULL graph's) is one decode / verify group over every row, max_rows long at most."""
        parts = []
        split = meta.num_prefill_seqs
        for first, last, stash in ((0, split, False), (split, meta.num_seqs, meta.keep_steps)):
            if last <= first:
                continue
            if meta.bounded:
                rows, max_rows = slice(0, mixed.shape[0]), meta.max_rows
            else:
                lens = meta.lens
                rows, max_rows = slice(sum(lens[:first]), sum(lens[:last])), max(lens[first:last])
            fits = prefill_kernel_fits if first < split else step_kernel_fits
            if not fits(mixed, max_rows):
                out = self.run_group(meta, first, last, stash, mixed, b, a)
                parts.append(self.norm(out, z[rows]))
                continue
            # CUDA decode / verify rows and short prefill chunks: kernels/gdn.py, conv + delta
            # rule + gated norm in place
            # each group's row offsets made once a forward, not two launches a layer (60 of
            # Qwen3.5-35B-A3B's plain step)
            offsets = shared(meta, ("gdn_row_offsets", first, last),
                             lambda: (meta.starts[first:last + 1] - meta.starts[first]).to(torch.int32))
            parts.append(gdn_rows_step(self, mixed[rows], b[rows], a[rows], z[rows], meta.states,
                                       meta.state_slots[first:last], offsets, max_rows, stash))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run_group(self, meta: AttentionMetadata, first: int, last: int, stash: bool, mixed: torch.Tensor,
                  b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Sequences first … last − 1 → their output rows [n, Hv, Dv] in token order."""
        lens = None if meta.bounded else meta.lens[first:last]
        num_tokens = meta.max_rows if lens is None else max(lens)
        slots = meta.state_slots[first:last]
        mixed, b, a = (to_padded(t, meta, first, last) for t in (mixed, b, a))  # [B, T, ·]
        batch = mixed.shape[0]
        window, initial = meta.states.read(self.state_index, slots)
        mixed, conv_inputs = self.convolve(mixed, window)
        q, k, v = mixed.split((self.key_width, self.key_width, self.value_width), dim=-1)
        q = q.reshape(batch, num_tokens, self.num_k_heads, self.k_dim)
        k = k.reshape(batch, num_tokens, self.num_k_heads, self.k_dim)
        v = v.reshape(batch, num_tokens, self.num_v_heads, self.v_dim)
        beta = b.sigmoid()
        dtype = state_dtype(a.dtype)
        g = -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))  # log decay ≤ 0
        uniform = lens is not None and all(n == num_tokens for n in lens)
        if not uniform:
            valid = padded_rows(meta, first, last)[1][..., None]                           # [B, T, 1]
            beta, g = beta * valid, g * valid
        kernels = select_kernels(mixed.device)
        if stash:
            out, _, steps = kernels.recurrent(q, k, v, g, beta, initial, True)
            meta.states.stash(self.state_index, steps, conv_inputs)
        else:
            if num_tokens == 1:
                out, state, _ = kernels.recurrent(q, k, v, g, beta, initial, False)
            else:
                out, state = kernels.chunk(q, k, v, g, beta, initial, None if uniform else lens)
            if uniform:
                lengths = None
            elif lens is None:
                lengths = meta.starts[first + 1:last + 1] - meta.starts[first:last]
            else:
                lengths = lens
            meta.states.write(self.state_index, slots, conv_inputs, state, lengths)
        return from_padded(out, meta, first, last)


class HybridDecoderLayer(PreNormLayer):
    def __init__(self, config: HybridConfig, layer: int, layer_type: str, cache_index: int) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, state_index=cache_index)
        else:
            self.self_attn = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim, config.rms_norm_eps, qkv_bias=config.attention_bias,
                                       out_bias=config.attention_bias, qk_norm="zero_centred",
                                       output_gate=config.attn_output_gate, cache_index=cache_index)
        self.mlp = make_mlp(config.hidden_size, config.intermediate_size, config.moe, layer, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)

    def mix(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.linear_attn(h, meta) if self.is_linear else self.self_attn(h, rope, meta)


class HybridModel(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Attention layers number their K/V in the pool, recurrent layers their state, each in order.
        indices = [config.layer_types[:i].count(t) for i, t in enumerate(config.layer_types)]
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, t, j)
                                    for i, (t, j) in enumerate(zip(config.layer_types, indices)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 and Qwen3.5-MoE (text and multimodal layouts) and Qwen3-Next targets."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def num_attention_layers(self) -> int:
        return self.config.layer_types.count("full_attention")

    @property
    def recurrent_shapes(self) -> list[RecurrentShape]:
        return [layer.linear_attn.state_shape for layer in self.model.layers if layer.is_linear]


# One class serves all: the config says whether the GDN projections are fused and which layers are sparse.
Qwen3NextForCausalLM = Qwen3_5MoeForCausalLM = Qwen3_5ForCausalLM
