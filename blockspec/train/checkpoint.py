"""Drafts in z-lab's format, and the training state that makes `--resume` exact.

A draft directory holds config.json (architectures ["DFlashDraftModel"], dflash_config
{mask_token_id, target_layer_ids}, block_size, num_target_layers, the layer shapes) and
model.safetensors with the draft's own weights only: the embedding and the LM head are the
target's and are never saved. `blockspec.loader.load_draft` loads it.
A checkpoint (out/checkpoints/step-N/) is a draft directory plus train_state.pt: fp32 weights,
optimizer state, step and RNG states.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from blockspec.models.dflash import DFlashDraftModel, DraftConfig

KEEP_CHECKPOINTS = 3
STATE_FILE = "train_state.pt"


def rope_fields(rope) -> dict[str, Any]:
    """The draft copies the target's RoPE into its own config (the engine reads the draft's)."""
    fields: dict[str, Any] = {"rope_theta": rope.theta}
    if rope.rope_type != "default":
        fields["rope_scaling"] = {"rope_type": rope.rope_type, "factor": rope.factor,
                                  "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                                  "original_max_position_embeddings": rope.original_max_position_embeddings}
    return fields


def draft_config_dict(target_config, num_layers: int, block_size: int, layer_ids: list[int],
                      mask_token_id: int) -> dict[str, Any]:
    """z-lab's config.json for a draft with the target's layer shapes."""
    c = target_config
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, **rope_fields(c.rope),
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "layer_types": ["full_attention"] * num_layers,
        "block_size": block_size, "num_target_layers": c.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
    }


def build_draft(config: dict[str, Any], device: torch.device, seed: int) -> DFlashDraftModel:
    """A fresh fp32 draft: linear weights ~ N(0, 0.02), norms at 1 (the Qwen3 init)."""
    torch.manual_seed(seed)
    draft = DFlashDraftModel(DraftConfig.from_hf(config)).to(device=device, dtype=torch.float32)
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return draft


def save_draft(draft: nn.Module, config: dict[str, Any], directory: Path, dtype: torch.dtype) -> None:
    """Write config.json and model.safetensors (atomically: a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    # Fused projections come back from state_dict as row views of one tensor under their Hugging
    # Face names (layers/common.FusedLinear); safetensors wants each as a tensor of its own.
    tensors = {name: p.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
               for name, p in draft.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(directory / "model.safetensors.tmp", directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(out: Path, step: int, draft: nn.Module, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], run_args: dict[str, Any], dtype: torch.dtype) -> Path:
    directory = out / "checkpoints" / f"step-{step:08d}"
    save_draft(draft, config, directory, dtype)
    state = {"step": step, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": rng_states(), "run_args": run_args}
    torch.save(state, directory / (STATE_FILE + ".tmp"))
    os.replace(directory / (STATE_FILE + ".tmp"), directory / STATE_FILE)
    for old in sorted((out / "checkpoints").glob("step-*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)
    return directory


def latest_checkpoint(out: Path) -> Path | None:
    done = [d for d in sorted((out / "checkpoints").glob("step-*")) if (d / STATE_FILE).exists()]
    return done[-1] if done else None


def load_state(directory: Path, device: torch.device) -> dict[str, Any]:
    return torch.load(directory / STATE_FILE, map_location=device, weights_only=False)
