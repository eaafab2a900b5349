"""Building blocks shared by the model files: RMSNorm, RoPE, fused projections, the SwiGLU MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import RopeConfig
from blockspec.kernels.fused import add_rms_norm, apply_rope, rms_norm, rotate_half, silu_mul  # noqa: F401


class RMSNorm(nn.Module):
    """w · x / rms(x), computed in fp32 like the reference implementations.

    zero_centred=True is Qwen3.5's variant: the stored weight is an offset, the scale is (1 + w).
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-entry form: (norm(x + residual), x + residual) in one kernel on CUDA; the
        residual stream stays un-normed (residual None: the first layer, x is the stream)."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centred)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [rot_dim / 2] in fp32, with llama3 / linear scaling applied."""
    rot_dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; rotates the first rot_dim dims of each head (partial RoPE)."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.reset_buffers()

    def reset_buffers(self) -> None:
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16,
        # and it must be real after the loader builds the model on the meta device.
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                sections: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] → cos, sin [N, 1, rot_dim]; sections: M-RoPE positions [3, N] (t, h, w)
        # likewise (said by the caller: training passes batched positions [B, T], which are not)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        if sections:
            freqs = self.interleave_sections(freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def interleave_sections(self, freqs: torch.Tensor) -> torch.Tensor:
        """[3, N, rot/2] angles by (t, h, w) → [N, rot/2]: frequency i takes the height angle where
        i ≡ 1 (mod 3) and the width angle where i ≡ 2, within 3 × their section's length; the
        temporal angle elsewhere. Text rows have t = h = w, so they rotate as 1-D RoPE."""
        out = freqs[0].clone()
        for axis in (1, 2):
            picked = slice(axis, 3 * self.rope.mrope_section[axis], 3)
            out[:, picked] = freqs[axis, :, picked]
        return out


class FusedLinear(nn.Linear):
    """Several projections of the same input stacked by output rows, so they run as one GEMM
    (q/k/v, gate/up). On disk and in `state_dict` each part keeps its own Hugging Face name, a
    sibling of this module (`self_attn.q_proj.weight`, not `self_attn.qkv_proj.weight`): the
    loader fills each part's rows as it reads it (`parts_of`), state_dict splits them again and
    load_state_dict joins them (the parent registers `join_fused_parts`), so checkpoints,
    training state and transformers see the names they always saw."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.part_sizes = dict(parts)
        starts = [0]
        for size in parts.values():
            starts.append(starts[-1] + size)
        self.part_rows = {name: (start, start + size) for name, start, size in zip(parts, starts, parts.values())}
        self.register_state_dict_post_hook(FusedLinear._split_state)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused output [..., sum(parts)] → one view per part, in order."""
        return out.split(list(self.part_sizes.values()), dim=-1)

    def project(self, x: torch.Tensor, first: str, last: str | None = None) -> torch.Tensor:
        """Only the consecutive parts first … last (one GEMM over their rows, a view of the weight)."""
        start, stop = self.part_rows[first][0], self.part_rows[last or first][1]
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(x, self.weight[start:stop], bias)

    @staticmethod
    def _names(prefix: str) -> str:
        """`a.b.qkv_proj.` → `a.b.`: the parts are siblings of the fused module."""
        return prefix[: prefix.rstrip(".").rfind(".") + 1]

    def _split_state(self, state: dict, prefix: str, local_metadata: dict) -> None:
        # Runs right after this module's own entries were added (they are last), so the parts
        # land where the fused tensor was: the order of a Hugging Face state_dict.
        parent = FusedLinear._names(prefix)
        fused = {kind: state.pop(prefix + kind) for kind in ("weight", "bias") if prefix + kind in state}
        for name, (start, stop) in self.part_rows.items():
            for kind, tensor in fused.items():
                state[f"{parent}{name}.{kind}"] = tensor[start:stop]



def join_fused_parts(parent: nn.Module, state: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a module holding FusedLinear children: their parts, stored
    under their own names (siblings of the fused module), become the fused tensor. It runs on
    the parent because torch hands each child only the keys under the child's own prefix."""
    for child_name, child in parent.named_children():
        if not isinstance(child, FusedLinear):
            continue
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in child.part_rows]
            if all(key in state for key in keys):
                state[f"{prefix}{child_name}.{kind}"] = torch.cat([state.pop(key) for key in keys])


def parts_of(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Checkpoint name of every fused part → (fused parameter, first row, end row)."""
    out = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, FusedLinear):
            continue
        prefix = module_name + "."
        parent = FusedLinear._names(prefix)
        for kind in ("weight",) + (("bias",) if module.bias is not None else ()):
            for name, (start, stop) in module.part_rows.items():
                out[f"{parent}{name}.{kind}"] = (prefix + kind, start, stop)
    return out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), gate and up as one GEMM (gate_up_proj; on disk
    gate_proj / up_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size},
                                        bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.register_load_state_dict_pre_hook(join_fused_parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        of_silu_mul = getattr(self.down_proj, "of_silu_mul", None)      # an FP8 down_proj quantizes silu · up
        return of_silu_mul(gate_up) if of_silu_mul is not None else self.down_proj(silu_mul(gate_up))
