"""blockspec: an OpenAI-compatible LLM server with DFlash block speculative decoding.

Public API: `LLM` (load a target and optional DFlash draft, generate) and `SamplingParams`.
They are imported on first use, so `blockspec --help` does not pay for importing torch.
"""
from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from blockspec.llm import LLM
        return LLM
    if name == "SamplingParams":
        from blockspec.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
