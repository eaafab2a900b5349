"""Architecture name (config.json `architectures[0]`) → how to build it and name its weights.

The loader reads this table; models never import the loader (no import loop)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """How to build one architecture and map its checkpoint names onto our modules."""
    build: Callable[[dict[str, Any], str], nn.Module]
    rename: Callable[[str], str | None] = lambda name: name   # None = ignore this tensor


def dense_spec() -> ArchSpec:
    from blockspec.config import ModelConfig
    from blockspec.models.qwen3 import Qwen3ForCausalLM
    return ArchSpec(build=lambda d, arch: Qwen3ForCausalLM(ModelConfig.from_hf(d, arch)))


def hybrid_spec() -> ArchSpec:
    from blockspec.models.qwen3_5 import HybridConfig, Qwen3_5ForCausalLM, rename
    return ArchSpec(build=lambda d, arch: Qwen3_5ForCausalLM(HybridConfig.from_hf(d, arch)), rename=rename)


ARCHITECTURES: dict[str, Callable[[], ArchSpec]] = {
    "Qwen3ForCausalLM": dense_spec,
    "Qwen2ForCausalLM": dense_spec,
    "LlamaForCausalLM": dense_spec,
    "MistralForCausalLM": dense_spec,
    "Qwen3_5ForCausalLM": hybrid_spec,
    "Qwen3_5ForConditionalGeneration": hybrid_spec,
    "Qwen3NextForCausalLM": hybrid_spec,
}
