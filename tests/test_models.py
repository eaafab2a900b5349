"""Our dense models and loader against transformers, on checkpoints transformers saved."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.loader import LoadError, load_model

from helpers import OneSequence, graph_shaped, make_engine, make_request, run_alone

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
        expected = ref(ids).logits[0]
    got, _ = OneSequence(ours, 512).forward(ids[0])
    assert rel_err(got, expected) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_decode_equals_one_forward(checkpoints, kind):
    ours = load_model(str(checkpoints[kind])).model
    ids = torch.randint(0, 151643, (1, 40), generator=torch.Generator().manual_seed(1))
    full, _ = OneSequence(ours, 64).forward(ids[0])
    seq = OneSequence(ours, 64, page_size=4)       # pages: 25 positions end mid-page
    parts = [seq.forward(ids[0, :25])[0]] + [seq.forward(ids[0, i:i + 1])[0] for i in range(25, 33)]
    parts.append(seq.forward(ids[0, 33:])[0])      # a multi-token step over the pool (a verify)
    assert rel_err(torch.cat(parts), full) < 1e-5


def test_rollback_by_length_is_exact(checkpoints):
    """A rejected block's K/V stays in the pool past the sequence's length: masked, then
    overwritten, so the next forward equals one over a pool that never saw it."""
    ours = load_model(str(checkpoints["qwen3"])).model
    ids = torch.randint(0, 151643, (1, 30), generator=torch.Generator().manual_seed(2))
    seq = OneSequence(ours, 64, page_size=8)
    seq.forward(ids[0, :20])
    seq.forward(torch.randint(0, 1000, (8,)), keep_steps=True)     # a rejected block
    seq.rollback(20)
    after_rollback, _ = seq.forward(ids[0, 20:])
    fresh = OneSequence(ours, 64, page_size=8)
    fresh.forward(ids[0, :20])
    expected, _ = fresh.forward(ids[0, 20:])
    assert torch.equal(after_rollback, expected)
    # the rejected block's K/V really was in the pool, at the positions rewritten since
    rejected = OneSequence(ours, 64, page_size=8)
    rejected.forward(ids[0, :20])
    rejected.forward(torch.randint(0, 1000, (8,)))
    assert not torch.equal(rejected.kv.layers[0][0], fresh.kv.layers[0][0])


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
        request = run_alone(lambda: make_engine(ours), make_request("r", prompt, stop_ids, max_tokens=40)).request
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                eos_token_id=sorted(stop_ids), pad_token_id=151643)[0, len(prompt):].tolist()
        assert request.output_ids == expected
        assert len(set(expected)) > 5  # the fixture's output is not degenerate


def test_seeded_sampling_is_reproducible(qwen3_dir):
    ours = load_model(str(qwen3_dir)).model

    def run(seed: int) -> list[int]:
        request = make_request("r", PROMPTS[0], max_tokens=20, temperature=1.0, seed=seed)
        return run_alone(lambda: make_engine(ours), request).output_ids

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


def test_an_untied_checkpoint_without_its_head_is_refused_not_tied(qwen3_dir, tmp_path):
    """Qwen3's config does not tie the head to the embedding: a checkpoint that lacks
    lm_head.weight is broken, and reading out through the embedding would serve garbage."""
    path = copy_checkpoint(qwen3_dir, tmp_path / "m")
    assert not json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    weights = load_file(str(path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(LoadError, match="lacks.*lm_head.weight"):
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


def test_graph_shaped_metadata_equals_eager(checkpoints):
    """What a CUDA graph replays — a batch padded with rows that write at page 0, and keys
    gathered over the pool's whole per-sequence capacity (fixed shapes) — computes what the
    eager metadata does, for a prefill, a verify block and a decode step."""
    ours = load_model(str(checkpoints["qwen3"])).model
    ids = torch.randint(0, 151643, (1, 40), generator=torch.Generator().manual_seed(4))
    eager, padded = OneSequence(ours, 64, page_size=8), OneSequence(ours, 64, page_size=8)
    for lo, hi in ((0, 30), (30, 38), (38, 39), (39, 40)):
        expected, _ = eager.forward(ids[0, lo:hi])
        got, _ = padded.forward(ids[0, lo:hi], shape=graph_shaped(3))
        assert rel_err(got, expected) < 1e-5, (lo, hi)
    # the padding rows really wrote at page 0 only: the sequence's pages hold the same K/V
    k_eager, k_padded = eager.kv.layers[1][0], padded.kv.layers[1][0]
    assert torch.allclose(k_eager[8:8 * 6], k_padded[8:8 * 6], atol=1e-5)
    assert not torch.equal(k_padded[:8], k_eager[:8])
