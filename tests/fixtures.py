"""Tiny random checkpoints in the Hugging Face format, written by transformers itself (so that
comparing against transformers compares against the real reference), and DFlash drafts in
z-lab's format written by us. Every checkpoint carries the real Qwen3 tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenizer_fixtures import write_tokenizer_files

QWEN3_VOCAB_SIZE = 151936          # the real Qwen3 embedding size (ranks + specials + padding)
QWEN3_MASK_TOKEN_ID = 151669       # z-lab's mask token for the Qwen3 vocabulary
IM_END_ID = 151645
ENDOFTEXT_ID = 151643

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def hf_dense_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=kind == "qwen2", eos_token_id=IM_END_ID,
                  bos_token_id=ENDOFTEXT_ID, **TINY)
    if kind == "qwen3":
        return Qwen3Config(rope_theta=1_000_000.0, **common)
    if kind == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, **common)
    if kind == "llama":
        return LlamaConfig(rope_theta=500_000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024}, **common)
    raise ValueError(kind)


def write_dense_checkpoint(directory: Path, kind: str, seed: int = 0) -> Path:
    """A random tiny target saved by transformers' save_pretrained, plus tokenizer files."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_dense_config(kind))
    scale_up_logits(model)
    model.generation_config = GenerationConfig(eos_token_id=[IM_END_ID, ENDOFTEXT_ID], bos_token_id=ENDOFTEXT_ID)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, "qwen3")
    return directory


def scale_up_logits(model: torch.nn.Module) -> None:
    """Random init gives near-uniform logits, where argmax hinges on rounding noise; a larger
    final norm makes greedy choices clear-cut so exact-equality tests test logic, not luck."""
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)


def write_dflash_draft(directory: Path, target_dir: Path, num_layers: int = 2, block_size: int = 16,
                       layer_types: list[str] | None = None, sliding_window: int | None = None,
                       target_layer_ids: list[int] | None = None, seed: int = 1,
                       rope_theta: float = 10_000.0, mask_token_id: int = QWEN3_MASK_TOKEN_ID) -> Path:
    """A random draft in z-lab's DFlashDraftModel format (their config keys and weight names)."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden, head_dim = target["hidden_size"], 16
    heads, kv_heads, inter = 4, 2, 96
    layer_ids = target_layer_ids if target_layer_ids is not None else [0, target["num_hidden_layers"] - 2]
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 4096,
        "vocab_size": target["vocab_size"], "block_size": block_size, "num_target_layers": target["num_hidden_layers"],
        "layer_types": layer_types or ["full_attention"] * num_layers,
        "sliding_window": sliding_window,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (1.0 / shape[-1] ** 0.5)

    weights = {"fc.weight": rand(hidden, hidden * len(layer_ids)),
               "hidden_norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
               "norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen)}
    for i in range(num_layers):
        p = f"layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": 1 + 0.1 * torch.randn(head_dim, generator=gen),
            p + "self_attn.k_norm.weight": 1 + 0.1 * torch.randn(head_dim, generator=gen),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        })
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


if __name__ == "__main__":
    # `python tests/fixtures.py DIR`: a demo pair (tiny random Qwen3 target + DFlash draft) in DIR.
    import sys
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/blockspec-demo")
    write_dense_checkpoint(root / "target", "qwen3")
    write_dflash_draft(root / "draft", root / "target")
    print(f"wrote {root / 'target'} and {root / 'draft'}")
