"""Fused projections (qkv_proj, gate_up_proj: one GEMM each) keep Hugging Face names everywhere
outside the module: the loader fills each part's rows, state_dict splits them again, and
load_state_dict joins them, so what we save is what transformers and z-lab write and read."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
from blockspec.layers.common import FusedLinear
from blockspec.loader import LoadError, load_draft, load_model
from blockspec.train.checkpoint import save_draft

from test_models import copy_checkpoint, hf_model


def fused_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, FusedLinear)]


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_parts_fill_their_rows_and_state_dict_is_the_checkpoint(checkpoints, kind):
    """Each fused parameter holds its parts' checkpoint tensors in order (bias too, Qwen2), and
    state_dict gives back exactly the checkpoint's names, in transformers' order, bit for bit."""
    path = checkpoints[kind]
    ours = load_model(str(path)).model
    on_disk = load_file(str(path / "model.safetensors"))
    attn = ours.model.layers[1].self_attn
    assert "model.layers.1.self_attn.qkv_proj" in fused_modules(ours)
    expected = torch.cat([on_disk[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected)
    if kind == "qwen2":
        assert torch.equal(attn.qkv_proj.bias, torch.cat([on_disk[f"model.layers.1.self_attn.{p}_proj.bias"]
                                                          for p in "qkv"]))
    mlp = ours.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((on_disk["model.layers.0.mlp.gate_proj.weight"],
                                                           on_disk["model.layers.0.mlp.up_proj.weight"])))
    state = ours.state_dict()
    ref_names = [n for n in hf_model(path).state_dict() if n != "lm_head.weight" or "lm_head.weight" in on_disk]
    assert [n for n in state if n in ref_names] == ref_names
    assert not [n for n in state if "qkv_proj" in n or "gate_up_proj" in n]
    for name, tensor in on_disk.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_transformers_loads_our_state_dict_and_we_load_its(checkpoints, kind):
    """strict load both ways: transformers ← ours (then equal logits), ours ← transformers."""
    path = checkpoints[kind]
    ours, ref = load_model(str(path)).model, hf_model(path)
    fresh = hf_model(path)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(ours.state_dict(), strict=False)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, ref(ids).logits)
    other = load_model(str(path)).model
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    result = other.load_state_dict({k: v for k, v in ref.state_dict().items()
                                    if k in ours.state_dict()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), (_, b) in zip(other.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), name


def test_hybrid_gated_attention_loads_fused(tmp_path):
    """Qwen3.5: q_proj (query and output gate per head), k_proj, v_proj in one qkv_proj, the
    multimodal prefix renamed first; state_dict gives the text model's names back."""
    path = fixtures.write_hybrid_checkpoint(tmp_path / "hybrid")
    ours = load_model(str(path)).model
    on_disk = load_file(str(path / "model.safetensors"))
    layer = next(i for i, t in enumerate(ours.config.layer_types) if t == "full_attention")
    prefix = next(n.rsplit("layers.", 1)[0] for n in on_disk if "layers." in n)
    attn = ours.model.layers[layer].self_attn
    expected = torch.cat([on_disk[f"{prefix}layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected)
    state = ours.state_dict()
    for name, tensor in on_disk.items():
        ours_name = "model." + name[len(prefix):] if name.startswith(prefix) else name
        if ours_name in state:
            assert torch.equal(state[ours_name], tensor), name
    assert f"model.layers.{layer}.self_attn.q_proj.weight" in state


def test_a_missing_part_is_named_by_its_checkpoint_name(qwen3_dir, tmp_path):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"lacks 1 tensors, first: 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(str(path))


def test_a_part_given_twice_is_refused(qwen3_dir, tmp_path):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    extra = {"model.layers.0.self_attn.k_proj.weight": weights["model.layers.0.self_attn.k_proj.weight"]}
    save_file(weights, str(path / "model-00001-of-00002.safetensors"))
    save_file(extra, str(path / "model-00002-of-00002.safetensors"))
    with pytest.raises(LoadError, match="given twice"):
        load_model(str(path))


def test_draft_save_load_round_trip(qwen3_dir, qwen3_draft_dir, tmp_path):
    """train-draft's writer saves Hugging Face / z-lab names (no fused names), and the draft
    loads back bit for bit, through the loader and through load_state_dict (--resume)."""
    import json
    target = load_model(str(qwen3_dir)).model
    draft = load_draft(str(qwen3_draft_dir), target)
    config = json.loads((qwen3_draft_dir / "config.json").read_text())
    save_draft(draft, config, tmp_path / "saved", torch.float32)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(load_file(str(qwen3_draft_dir / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in saved and "layers.0.mlp.gate_proj.weight" in saved
    again = load_draft(str(tmp_path / "saved"), target)
    for (name, a), (_, b) in zip(again.named_parameters(), draft.named_parameters()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again.load_state_dict(draft.state_dict(), strict=True)
    for (name, a), (_, b) in zip(again.named_parameters(), draft.named_parameters()):
        assert torch.equal(a, b), name


def test_kv_only_projection_equals_the_fused_one(qwen3_dir):
    """The draft's context K/V use only the k/v rows of qkv_proj (no q computed): same values."""
    target = load_model(str(qwen3_dir)).model
    attn = target.model.layers[0].self_attn
    x = torch.randn(5, target.hidden_size, generator=torch.Generator().manual_seed(3))
    rope = target.model.rotary_emb(torch.arange(5), x.dtype)
    _, k, v, _ = attn.project(x, rope)
    k_only, v_only = attn.project_kv(x, rope)
    torch.testing.assert_close(k_only, k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_only, v, rtol=1e-6, atol=1e-6)
