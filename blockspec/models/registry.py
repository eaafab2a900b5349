"""Architecture name (config.json `architectures[0]`) → how to build it and name its weights.

The loader reads this table; models never import the loader (no import loop)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class ParamSlice:
    """A checkpoint tensor that is one piece of a stacked or fused parameter: it goes into
    `param[index].chunk(num_parts)[part]` (chunked along the piece's first dimension; an
    expert's piece), or into rows [rows[0], rows[1]) of `param` when index is None (one part of
    a FusedLinear: q_proj of qkv_proj, gate_proj of gate_up_proj)."""
    param: str
    index: int | None
    part: int = 0
    num_parts: int = 1
    rows: tuple[int, int] | None = None


Rename = Callable[[str], "str | ParamSlice | None"]     # None = ignore this tensor


@dataclass(frozen=True)
class ArchSpec:
    """How to build one architecture and map its checkpoint names onto our modules."""
    build: Callable[[dict[str, Any], str], nn.Module]
    rename: Rename = lambda name: name


# Per-expert tensors (what save_pretrained writes) → our stacked experts, the fused layout:
# gate_proj [I, H] and up_proj [I, H] are the halves of gate_up_proj[e] [2I, H]; down_proj [H, I]
# is down_proj[e]. Fused checkpoints (`mlp.experts.gate_up_proj` [E, 2I, H]) load by name.
EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                           r"\.weight")
EXPERT_PIECES = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),    # (param, part, parts)
                 "down_proj": ("down_proj", 0, 1)}


def expert_slice(name: str) -> ParamSlice | None:
    match = EXPERT_TENSOR.fullmatch(name)
    if match is None:
        return None
    param, part, num_parts = EXPERT_PIECES[match["proj"]]
    return ParamSlice(f"{match['experts']}.{param}", int(match["index"]), part, num_parts)


def stacking_experts(rename: Callable[[str], str | None]) -> Rename:
    """rename, then per-expert tensors into their slice of the stacked parameters."""
    def mapped(name: str) -> str | ParamSlice | None:
        ours = rename(name)
        return None if ours is None else expert_slice(ours) or ours
    return mapped


def dense_spec() -> ArchSpec:
    from blockspec.config import ModelConfig
    from blockspec.models.qwen3 import Qwen3ForCausalLM
    return ArchSpec(build=lambda d, arch: Qwen3ForCausalLM(ModelConfig.from_hf(d, arch)),
                    rename=stacking_experts(lambda name: name))


def hybrid_spec() -> ArchSpec:
    from blockspec.models.qwen3_5 import HybridConfig, Qwen3_5ForCausalLM
    from blockspec.models.qwen3_vl import multimodal_rename
    return ArchSpec(build=lambda d, arch: Qwen3_5ForCausalLM(HybridConfig.from_hf(d, arch)),
                    rename=stacking_experts(multimodal_rename))


def multimodal_hybrid_spec() -> ArchSpec:
    """Qwen3.5 (-MoE) ForConditionalGeneration: the hybrid text model and the vision tower."""
    from blockspec.models.qwen3_5 import HybridConfig, Qwen3_5ForCausalLM
    from blockspec.models.qwen3_vl import attach_vision, multimodal_rename
    return ArchSpec(build=lambda d, arch: attach_vision(Qwen3_5ForCausalLM(HybridConfig.from_hf(d, arch)), d),
                    rename=stacking_experts(multimodal_rename))


def qwen3_vl_spec() -> ArchSpec:
    """Qwen3VLForConditionalGeneration: a Qwen3 text model (M-RoPE, DeepStack) and the vision tower."""
    from blockspec.models.qwen3 import Qwen3ForCausalLM
    from blockspec.models.qwen3_vl import attach_vision, multimodal_rename, text_config
    return ArchSpec(build=lambda d, arch: attach_vision(Qwen3ForCausalLM(text_config(d, arch)), d),
                    rename=multimodal_rename)


ARCHITECTURES: dict[str, Callable[[], ArchSpec]] = {
    "Qwen3ForCausalLM": dense_spec,
    "Qwen2ForCausalLM": dense_spec,
    "LlamaForCausalLM": dense_spec,
    "MistralForCausalLM": dense_spec,
    "Qwen3MoeForCausalLM": dense_spec,
    "Qwen3_5ForCausalLM": hybrid_spec,
    "Qwen3_5ForConditionalGeneration": multimodal_hybrid_spec,
    "Qwen3VLForConditionalGeneration": qwen3_vl_spec,
    "Qwen3NextForCausalLM": hybrid_spec,
    "Qwen3_5MoeForCausalLM": hybrid_spec,
    "Qwen3_5MoeForConditionalGeneration": multimodal_hybrid_spec,
}
