"""Our dense models and loader against transformers, on checkpoints transformers saved."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.engine.plain import generate_plain
from blockspec.engine.request import Request
from blockspec.loader import LoadError, load_model
from blockspec.sampling import SamplingParams

KINDS = ["qwen3", "llama", "qwen2"]


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(checkpoints, kind):
    path = checkpoints[kind]
    ours, ref = load_model(str(path)).model, hf_model(path)
    ids = torch.randint(0, 151643, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids, ours.make_cache(512)).logits
    assert rel_err(got, expected) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_decode_equals_one_forward(checkpoints, kind):
    ours = load_model(str(checkpoints[kind])).model
    ids = torch.randint(0, 151643, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = ours(ids, ours.make_cache(64)).logits
        cache = ours.make_cache(64)
        parts = [ours(ids[:, :25], cache).logits] + [ours(ids[:, i:i + 1], cache).logits for i in range(25, 33)]
        parts.append(ours(ids[:, 33:], cache).logits)   # a multi-token step over a cache (a verify)
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5


def test_trim_rolls_back_exactly(checkpoints):
    ours = load_model(str(checkpoints["qwen3"])).model
    ids = torch.randint(0, 151643, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = ours.make_cache(64)
        ours(ids[:, :20], cache)
        ours(torch.randint(0, 1000, (1, 8)), cache)      # a rejected block
        cache.trim(20)
        after_trim = ours(ids[:, 20:], cache).logits
        fresh_cache = ours.make_cache(64)
        ours(ids[:, :20], fresh_cache)
        fresh = ours(ids[:, 20:], fresh_cache).logits
    assert torch.equal(after_trim, fresh)


PROMPTS = [
    [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
    list(range(2000, 2013)),
    [int(t) for t in torch.randint(0, 151643, (260,), generator=torch.Generator().manual_seed(3))],
]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_generate_equals_transformers(checkpoints, kind):
    path = checkpoints[kind]
    ours, ref = load_model(str(path)).model, hf_model(path)
    stop_ids = frozenset({151645, 151643})
    for prompt in PROMPTS:
        request = Request("r", prompt, SamplingParams(max_tokens=40), stop_ids, 4096)
        for _ in generate_plain(ours, request):
            pass
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                eos_token_id=sorted(stop_ids), pad_token_id=151643)[0, len(prompt):].tolist()
        assert request.output_ids == expected
        assert len(set(expected)) > 5  # the fixture's output is not degenerate


def test_seeded_sampling_is_reproducible(qwen3_dir):
    ours = load_model(str(qwen3_dir)).model

    def run(seed: int) -> list[int]:
        request = Request("r", PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0, seed=seed),
                          frozenset(), 4096)
        for _ in generate_plain(ours, request):
            pass
        return request.output_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_tied_embeddings_share_the_head(checkpoints):
    ours = load_model(str(checkpoints["qwen2"])).model
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(qwen3_dir, tmp_path):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="GPT2LMHeadModel.*not supported"):
        load_model(str(path))


def test_missing_weights_file(qwen3_dir, tmp_path):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_model(str(path))


@pytest.mark.parametrize("edit, message", [
    ("shape", "has shape"), ("drop", "lacks"), ("extra", "has no place"),
])
def test_bad_weights_are_named(qwen3_dir, tmp_path, edit, message):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    if edit == "shape":
        weights[key] = weights[key][:-1].contiguous()
    elif edit == "drop":
        del weights[key]
    else:
        weights["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(LoadError, match=message):
        load_model(str(path))


def test_sharded_checkpoint_loads(qwen3_dir, tmp_path):
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(path / shard))
        weight_map.update({k: shard for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours, ref = load_model(str(path)).model, load_model(str(qwen3_dir)).model
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_hub_id_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LoadError, match="no-such-org/no-such-model"):
        load_model("no-such-org/no-such-model")


def test_static_cache_path_equals_eager(qwen3_dir):
    """The graph-capturable path (positions on the device, whole static cache under a mask)
    computes what the eager path does; CUDA graphs replay exactly this path."""
    ours = load_model(str(qwen3_dir)).model
    ids = torch.randint(0, 151643, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        eager_cache, static_cache = ours.make_cache(64), ours.make_cache(64)
        eager = [ours(ids[:, :30], eager_cache).logits, ours(ids[:, 30:], eager_cache).logits]
        static = []
        for lo, hi in ((0, 30), (30, 40)):
            static_cache.advance(hi - lo)
            static.append(ours(ids[:, lo:hi], static_cache, positions=torch.arange(lo, hi)).logits)
    for a, b in zip(eager, static):
        assert rel_err(b, a) < 1e-5
