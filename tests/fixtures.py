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
    config, weights = dflash_config_and_weights(target_dir, num_layers, block_size, layer_types, sliding_window,
                                                target_layer_ids, seed, mask_token_id)
    config.update({"rope_theta": rope_theta, "block_size": block_size})
    return save_draft(directory, config, weights)


def write_dflash2_draft(directory: Path, target_dir: Path, num_layers: int = 2, block_size: int = 16,
                        layer_types: list[str] | None = None, sliding_window: int | None = None,
                        target_layer_ids: list[int] | None = None, seed: int = 2,
                        mask_token_id: int = QWEN3_MASK_TOKEN_ID, conv_kernel_size: int = 3,
                        conv_group_size: int = 16, selector_rank: int = 8, selector_top_k: int = 4,
                        output_multiplier: float = 0.25, final_logit_softcapping: float | None = 20.0,
                        input_embedding_scale: float | None = None, codebook_keys_with_weight: bool = False) -> Path:
    """A random draft as z-lab's DFlash2DraftModel saves it: `is_causal: false`, the DFlash 2
    keys in `dflash_config`, transformers 5's `rope_parameters`; per layer `attention_conv` and
    `mlp_conv` (`base_kernel` [2, taps, H], `kernel_projection.weight` [2·taps·G, H]); the
    selector's codebooks saved without `.weight` (codebook_keys_with_weight: with it, as a
    re-save through their nn.Embedding modules would name them)."""
    config, weights = dflash_config_and_weights(target_dir, num_layers, block_size, layer_types, sliding_window,
                                                target_layer_ids, seed, mask_token_id)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    config["architectures"] = ["DFlash2DraftModel"]
    config["is_causal"] = False
    config["use_sliding_window"] = sliding_window is not None
    config["rope_parameters"] = {"rope_theta": 10_000.0, "rope_type": "default"}
    config["dflash_config"].update({
        "block_size": block_size, "conv_group_size": conv_group_size, "conv_kernel_size": conv_kernel_size,
        "final_logit_softcapping": final_logit_softcapping, "output_multiplier": output_multiplier,
        "selector_rank": selector_rank, "selector_top_k": selector_top_k})
    if input_embedding_scale is not None:
        config["dflash_config"]["input_embedding_scale"] = input_embedding_scale
    gen = torch.Generator().manual_seed(seed + 100)
    num_groups = hidden // conv_group_size
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * torch.randn(2, conv_kernel_size, hidden, generator=gen)
            base[:, 0] += 1.0                      # the current position passes through, the rest mixes in
            weights[f"layers.{i}.{conv}.base_kernel"] = base
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                0.3 * torch.randn(2 * conv_kernel_size * num_groups, hidden, generator=gen) / hidden ** 0.5)
    suffix = ".weight" if codebook_keys_with_weight else ""
    # codebooks large enough that the pairwise term changes the walk's choices against the unary logits
    weights["candidate_selector.predecessor_codebook" + suffix] = 2.0 * torch.randn(vocab, selector_rank, generator=gen)
    weights["candidate_selector.successor_codebook" + suffix] = 2.0 * torch.randn(vocab, selector_rank, generator=gen)
    weights["candidate_selector.hidden_projection.weight"] = torch.randn(selector_rank, hidden, generator=gen) / hidden ** 0.5
    return save_draft(directory, config, weights)


def dflash_config_and_weights(target_dir: Path, num_layers: int, block_size: int, layer_types: list[str] | None,
                              sliding_window: int | None, target_layer_ids: list[int] | None, seed: int,
                              mask_token_id: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """What DFlash 1 and 2 drafts share: the config's common keys, fc/norms and Qwen3-style layers."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden, head_dim = target["hidden_size"], 16
    heads, kv_heads, inter = 4, 2, 96
    layer_ids = target_layer_ids if target_layer_ids is not None else [0, target["num_hidden_layers"] - 2]
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "vocab_size": target["vocab_size"], "num_target_layers": target["num_hidden_layers"],
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
    return config, weights


def save_draft(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


HYBRID_VOCAB = 256
HYBRID_TEXT = dict(vocab_size=HYBRID_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4, max_position_embeddings=1024,
                   layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def write_hybrid_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 hybrid (gated attention + Gated DeltaNet) saved by transformers,
    every weight moved off its init and the logits sharpened (as tests/test_hybrid.py does),
    plus tokenizer files."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID_TEXT))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
        model.model.norm.weight.add_(8.0)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, "qwen3")
    return directory


if __name__ == "__main__":
    # `python tests/fixtures.py DIR`: a demo pair (tiny random Qwen3 target + DFlash draft) in DIR.
    import sys
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/blockspec-demo")
    write_dense_checkpoint(root / "target", "qwen3")
    write_dflash_draft(root / "draft", root / "target")
    print(f"wrote {root / 'target'} and {root / 'draft'}")


def write_chain_checkpoint(directory: Path, chain: list[int], tokenizer_dir: Path, margin: float = 4.0) -> Path:
    """A Qwen3 target whose greedy output is scripted: after chain[k] it always says chain[k + 1]
    (a bigram chain, built by construction, no training). Attention and MLP outputs are zero, so
    the last position's hidden state is its own token's embedding: token chain[k] embeds as the
    unit vector e_k, the final norm scales it to √H·e_k, and lm_head row chain[k + 1] reads e_k.
    Each chain token must appear once (one successor each); tokens off the chain predict id 0.
    The tokenizer files are copied from tokenizer_dir (building them takes seconds)."""
    import shutil
    from transformers import AutoModelForCausalLM, GenerationConfig
    if len(set(chain)) != len(chain) or len(chain) - 1 > TINY["hidden_size"]:
        raise ValueError("a chain needs distinct tokens, at most hidden_size + 1 of them")
    config = hf_dense_config("qwen3")
    with torch.device("meta"):                   # names and shapes only: no random init
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    weights = {name: (torch.ones if name.endswith("norm.weight") else torch.zeros)(shape)
               for name, shape in shapes.items()}
    for k, (token, successor) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token, k] = 1.0
        weights["lm_head.weight"][successor, k] = margin
    directory.mkdir(parents=True, exist_ok=True)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(directory)
    GenerationConfig(eos_token_id=[IM_END_ID, ENDOFTEXT_ID], bos_token_id=ENDOFTEXT_ID).save_pretrained(directory)
    save_file(weights, str(directory / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory
