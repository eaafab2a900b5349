"""Tiny FP8 checkpoints in Qwen's block-wise format, written by us from a transformers model.

`write_fp8_checkpoint` quantizes the linears Qwen's FP8 releases quantize (attention, MLP and
shared-expert projections, every expert, GDN's in_proj_qkv / in_proj_z / out_proj) into
float8_e4m3fn weights with a `weight_scale_inv` per 128 × 128 block (partial blocks at the
edges), experts per expert as Qwen ships them, and `quantization_config` in config.json. The
transformers model then takes the same weights dequantized (weight · scale in fp32), so it is
the reference for exactly the weights the checkpoint holds.

The quantizer here is written block by block, on purpose apart from blockspec's vectorised one.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 128
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
QUANTIZED = re.compile(r"(model\.)?(language_model\.)?layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj"
                       r"|mlp\.shared_expert\.(gate|up|down)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))"
                       r"\.weight")
FUSED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def quantize_block_by_block(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → (e4m3 [N, K], scale [⌈N/128⌉, ⌈K/128⌉]): scale = amax / 448 per block."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=scale_dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = (tile.abs().max() / 448.0).to(scale_dtype)
            s = torch.ones((), dtype=scale_dtype) if s == 0 else s
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (tile / s.float()).clamp(-448, 448).to(q.dtype)
    return q, scale


def dequantize_block_by_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            out[tile] = q[tile].float() * scale[i, j].float()
    return out


def write_fp8_checkpoint(directory: Path, model: torch.nn.Module, scale_dtype: torch.dtype = torch.float32,
                         fused_experts: bool = False) -> Path:
    """`model` (a transformers model) as an FP8 checkpoint in `directory`; afterwards `model`
    holds the dequantized weights. Returns the directory. fused_experts: the experts as
    transformers names them (`experts.gate_up_proj` [E, 2I, H] with `gate_up_proj_scale_inv`, each
    expert's [2I, H] blocked as one matrix, so a block may span gate and up)."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}

    def put(name: str, weight: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_block_by_block(weight, scale_dtype)
        tensors[name] = q
        tensors[name[: -len(".weight")] + ".weight_scale_inv"] = scale
        return dequantize_block_by_block(q, scale)

    for name, value in state.items():
        fused = FUSED_EXPERTS.fullmatch(name)
        if QUANTIZED.fullmatch(name):
            dequantized[name] = put(name, value)
        elif fused and fused_experts:
            pairs = [quantize_block_by_block(matrix, scale_dtype) for matrix in value]
            tensors[name] = torch.stack([q for q, _ in pairs])
            tensors[name + "_scale_inv"] = torch.stack([scale for _, scale in pairs])
            dequantized[name] = torch.stack([dequantize_block_by_block(q, scale) for q, scale in pairs])
        elif fused:                      # [E, 2I, H] / [E, H, I] → per expert, as Qwen's FP8 files hold them
            prefix, kind = fused.groups()
            experts = []
            for e, matrix in enumerate(value):
                if kind == "down_proj":
                    experts.append(put(f"{prefix}.{e}.down_proj.weight", matrix))
                else:
                    gate, up = matrix.chunk(2)
                    experts.append(torch.cat((put(f"{prefix}.{e}.gate_proj.weight", gate),
                                              put(f"{prefix}.{e}.up_proj.weight", up))))
            dequantized[name] = torch.stack(experts)
        else:
            tensors[name] = value.contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    model.load_state_dict({**state, **dequantized})
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    config["architectures"] = [type(model).__name__]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def fp8_tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return {name for name in handle.keys() if handle.get_slice(name).get_dtype() == "F8_E4M3"}
