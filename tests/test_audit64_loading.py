"""Audit 64c: what loading, the FP8 format's refusals and the option surface promise, where the
other files' tests leave it unsaid. Each test kills a planted bug (scripts/mutation_check.py,
group audit64c). CPU, the session's tiny Qwen3 checkpoint (tests/conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockspec.config import ConfigError, EngineOptions, resolve_engine_config
from blockspec.layers import fp8
from blockspec.loader import LoadError, load_model, resolve_model_path

BLOCKWISE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def with_config(source: Path, target: Path, change) -> Path:
    """`source`'s checkpoint with its config.json changed by `change` (the other files linked)."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    change(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


# ── quantization_config: what is refused, and where it is read ─────────────────────────────────

def test_an_fp8_config_without_block_scales_is_refused_in_one_line(qwen3_dir, tmp_path):
    """quant_method fp8 without weight_block_size is per-tensor FP8, not the 128 × 128 block format."""
    per_tensor = {k: v for k, v in BLOCKWISE.items() if k != "weight_block_size"}
    path = with_config(qwen3_dir, tmp_path / "ckpt", lambda c: c.update(quantization_config=per_tensor))
    with pytest.raises(LoadError) as error:
        load_model(str(path))
    assert str(error.value) == (f"{path / 'config.json'}: FP8 weight_block_size None is not supported "
                                "([128, 128] is)")


def test_a_quantization_config_inside_text_config_is_read():
    """Multimodal configs carry the language model's quantization_config in text_config."""
    assert fp8.check_quantization_config({"text_config": {"quantization_config": dict(BLOCKWISE)}}) is True
    assert fp8.check_quantization_config({"text_config": {}}) is False
    with pytest.raises(fp8.Fp8Error, match="FP8 format 'e5m2' is not supported"):
        fp8.check_quantization_config({"text_config": {"quantization_config": {**BLOCKWISE, "fmt": "e5m2"}}})


@pytest.mark.parametrize("name, quantized", [
    ("model.layers.0.self_attn.q_proj", True), ("model.layers.3.mlp.down_proj", True),
    ("model.layers.0.linear_attn.in_proj_qkvz", True), ("model.layers.0.linear_attn.in_proj_qkv", True),
    ("model.layers.0.linear_attn.in_proj_ba", False), ("model.layers.0.linear_attn.in_proj_a", False),
    ("model.layers.0.linear_attn.in_proj_b", False), ("model.layers.1.mlp.gate", False),
    ("model.layers.1.mlp.shared_expert_gate", False), ("lm_head", False), ("model.embed_tokens", False),
])
def test_quantization_on_load_leaves_routing_and_gdn_gates_and_the_head_in_bf16(name, quantized):
    """Qwen3-Next's fused in_proj_ba (decay and write strength) stays bf16 as Qwen3.5's a / b do."""
    assert fp8.quantizable(name) is quantized


# ── the loader ─────────────────────────────────────────────────────────────────────────────────

def test_a_sharded_checkpoint_missing_a_shard_names_it(qwen3_dir, tmp_path):
    path = tmp_path / "sharded"
    path.mkdir()
    for item in qwen3_dir.iterdir():
        (path / ("model-00001-of-00002.safetensors" if item.name == "model.safetensors" else item.name)).symlink_to(item)
    weights = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
               "lm_head.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    with pytest.raises(LoadError) as error:
        load_model(str(path))
    assert str(error.value) == f"missing weight shard: {path / 'model-00002-of-00002.safetensors'}"


def test_dtype_float16_loads_float16_weights(qwen3_dir):
    model = load_model(str(qwen3_dir), dtype="float16").model
    assert {p.dtype for p in model.parameters()} == {torch.float16}


@pytest.mark.parametrize("model", ["no/such/checkpoint", "NoSuchModel-8B"])
def test_only_owner_slash_name_is_looked_up_on_the_hub(model, monkeypatch):
    """A path of other shape that is not a directory is said so at once, never fetched."""
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("fetched " + model))
    with pytest.raises(LoadError, match=f"model path '{model}' is not a directory"):
        resolve_model_path(model)


def test_a_device_the_engine_does_not_run_on_is_refused_in_one_line(qwen3_dir, capsys):
    """--device meta (or mps): torch names it, but the load would pass and the first step fail
    with a traceback (exit 0 from generate)."""
    from blockspec.cli import main
    for device in ("meta", "mps"):
        assert main(["generate", "--model", str(qwen3_dir), "--prompt", "x", "--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"blockspec generate: error: --device '{device}' is not a device: use auto, cpu, cuda or cuda:N"]
    with pytest.raises(LoadError, match="--device 'meta' is not supported: use auto, cpu, cuda or cuda:N"):
        load_model(str(qwen3_dir), device="meta")
    with pytest.raises(LoadError, match="--device 'bogus' is not supported"):
        load_model(str(qwen3_dir), device="bogus")


# ── option bounds: the limits themselves are allowed ───────────────────────────────────────────

def test_the_limits_themselves_are_allowed():
    """--block-size equal to the draft's, --max-model-len equal to the model's positions and
    --gpu-memory-utilization 1 are allowed; one past each is refused."""
    config = resolve_engine_config(EngineOptions(block_size=16, max_model_len=4096), 4096, 16)
    assert (config.block_size, config.max_model_len) == (16, 4096)
    with pytest.raises(ConfigError, match="--block-size 17 exceeds the draft's block size 16"):
        resolve_engine_config(EngineOptions(block_size=17), 4096, 16)
    with pytest.raises(ConfigError, match="--max-model-len 4097 exceeds the model's 4096 positions"):
        resolve_engine_config(EngineOptions(max_model_len=4097), 4096, 16)
    assert EngineOptions(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        EngineOptions(gpu_memory_utilization=1.01)


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_command_takes_quantization_fp8_and_refuses_others(command, capsys):
    from blockspec.cli import build_parser
    assert build_parser().parse_args([command, "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([command, "--quantization", "int8"])
    assert exit.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
