"""FP8 targets (layers/fp8.py, kernels/fp8.py): block-scaled e4m3 fp8_models in Qwen's format
loaded as they are, `--quantization fp8` on load, and the dequantizing reference path on CPU.

Checkpoints: tiny random transformers models written as FP8 fp8_models by tests/fp8_fixtures.py
(dense Qwen3 whose q/k/v and gate/up boundaries fall inside 128-row blocks; Qwen3-MoE with
aligned experts and bf16 scales; a Qwen3.5-MoE hybrid whose GDN in_proj mixes FP8 and bf16
parts and whose experts straddle blocks). The reference is transformers on the same weights
dequantized to fp32. fp32, CPU.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

import fixtures
from helpers import run_interpreted
import fp8_fixtures
from blockspec.kernels import fp8 as fp8_kernels
from blockspec.kernels import fused
from blockspec.layers import fp8
from blockspec.layers.moe import SparseMoE
from blockspec.llm import LLM
from blockspec.loader import LoadError, load_model
from blockspec.sampling import SamplingParams
from blockspec.tokenizer import Tokenizer

VOCAB = 512
KINDS = ["qwen3", "qwen3_moe", "qwen3_5_moe"]
PROMPT = [int(t) for t in torch.randint(0, VOCAB - 1, (40,), generator=torch.Generator().manual_seed(3))]
PROMPTS = [PROMPT[:6], PROMPT]


def hf_model(kind: str) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    if kind == "qwen3":        # q 192 | k 96 | v 96 rows, gate 320 | up 320: boundaries inside blocks
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=VOCAB, hidden_size=192, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=48, max_position_embeddings=1024))
    if kind == "qwen3_moe":    # experts 128 | 128: on block boundaries
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
            mlp_only_layers=[2], max_position_embeddings=1024))
    return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(   # experts 96 | 96, shared expert 96
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=96, shared_expert_intermediate_size=96, max_position_embeddings=1024,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]))


def randomise(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
        model.get_decoder().norm.weight.add_(8.0)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory, qwen3_dir) -> dict[str, tuple[torch.nn.Module, Path, Path]]:
    """kind → (transformers on the dequantized weights, the FP8 checkpoint, the bf16 original)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for kind in KINDS:
        model = hf_model(kind)
        randomise(model)
        model.save_pretrained(root / f"{kind}-bf16")
        scale_dtype = torch.bfloat16 if kind == "qwen3_moe" else torch.float32
        fp8_fixtures.write_fp8_checkpoint(root / kind, model, scale_dtype)
        out[kind] = (model.eval(), root / kind, root / f"{kind}-bf16")
    return out


@pytest.fixture(scope="module")
def one_tokenizer(qwen3_dir):
    """The session's Qwen3 tokenizer for every checkpoint here (their ids are < VOCAB)."""
    shared = Tokenizer.from_dir(qwen3_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tokenizer, "from_dir", staticmethod(lambda path: shared))
        yield


def transformers_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly num_tokens tokens (no early end)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
                                min_new_tokens=num_tokens, pad_token_id=0)
    return tokens[0, len(prompt):].tolist()


def assert_greedy_equals_transformers(reference, path, prompt: list[int], num_tokens: int = 12) -> None:
    """Our greedy decoding of the checkpoint at `path` equals transformers' on `reference`, and the
    answer is not one token repeated (where a wrong weight would still agree)."""
    want = transformers_greedy(reference, prompt, num_tokens)
    llm = LLM(str(path), max_model_len=64, show_progress=False)
    assert llm.generate_ids(prompt, SamplingParams(max_tokens=num_tokens)).token_ids == want
    assert len(set(want)) > 3


@pytest.fixture(scope="module")
def expected(fp8_models) -> dict[str, list[list[int]]]:
    return {kind: [transformers_greedy(model, prompt, 16) for prompt in PROMPTS]
            for kind, (model, _, _) in fp8_models.items()}


# ── the format ─────────────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("shape", [(128, 128), (200, 70), (1, 300), (384, 129)])
def test_quantize_matches_the_block_by_block_format(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    weight[: min(128, shape[0]), :64] = 0                       # an all-zero block gets scale 1
    q, scale = fp8.quantize(weight)
    q_ref, scale_ref = fp8_fixtures.quantize_block_by_block(weight, torch.float32)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    assert torch.equal(fp8.dequantize(q, scale, fp8.ScaleBlock()), fp8_fixtures.dequantize_block_by_block(q, scale))
    per_row = fp8.part_scale_rows(scale, shape[0], fp8.ScaleBlock(rows=1))
    assert torch.equal(fp8.dequantize(q, per_row, fp8.ScaleBlock(rows=1)), fp8.dequantize(q, scale, fp8.ScaleBlock()))


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_tensors_load_as_fp8(fp8_models, kind):
    """Every e4m3 tensor of the file is held as e4m3 (no bf16 copy), the rest as before."""
    _, path, _ = fp8_models[kind]
    model = load_model(str(path)).model
    on_disk = sum(torch.Size(s).numel() for s in shapes_of(path, fp8_fixtures.fp8_tensor_names(path)))
    held = sum(p.numel() for p in model.parameters() if p.dtype == fp8.FP8)
    assert held == on_disk > 0
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    model.to(torch.bfloat16)                                     # a cast keeps the format
    assert {p.dtype for n, p in model.named_parameters() if "scale_inv" in n} == {torch.float32}
    assert sum(p.numel() for p in model.parameters() if p.dtype == fp8.FP8) == held


def shapes_of(path: Path, names: set[str]) -> list[list[int]]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return [handle.get_slice(name).get_shape() for name in names]


@pytest.mark.parametrize("kind", KINDS)
def test_fused_modules_hold_each_parts_dequantized_weights(fp8_models, kind):
    """qkv, gate_up, GDN in_proj (FP8 and bf16 segments) and the stacked experts: dequantized,
    exactly the transformers model's (dequantized) parts side by side."""
    reference, path, _ = fp8_models[kind]
    state = reference.state_dict()
    model = load_model(str(path)).model
    checked = 0
    for name, module in model.named_modules():
        if ".segments." in name:                                 # checked through their SegmentedLinear
            continue
        if isinstance(module, (fp8.Fp8Linear, fp8.SegmentedLinear)) and module.part_sizes:
            parent = name.rsplit(".", 1)[0]
            expected = torch.cat([state[f"{parent}.{part}.weight"] for part in module.part_sizes])
            segments = module.segments if isinstance(module, fp8.SegmentedLinear) else [module]
            ours = torch.cat([s.dequantized(torch.float32) if isinstance(s, fp8.Fp8Linear) else s.weight
                              for s in segments])
            assert torch.equal(ours, expected), name
            checked += 1
        elif isinstance(module, fp8.Fp8Experts):
            gate_up, down = module.stacked(torch.float32)
            assert torch.equal(gate_up, state[name + ".gate_up_proj"]) and torch.equal(down, state[name + ".down_proj"])
            checked += 1
    assert checked >= 8
    if kind == "qwen3":
        assert model.model.layers[0].self_attn.qkv_proj.block.rows == 1          # k starts at row 192
    if kind == "qwen3_moe":
        assert model.model.layers[0].mlp.experts.gate_up_block.rows == 128
    if kind == "qwen3_5_moe":
        in_proj = model.model.layers[0].linear_attn.in_proj
        assert isinstance(in_proj, fp8.SegmentedLinear)
        assert [type(s).__name__ for s in in_proj.segments] == ["Fp8Linear", "PartsLinear"]
        assert in_proj.in_features == model.config.hidden_size      # read as a linear's (the GDN warm-up)


def test_a_segmented_in_proj_hands_its_parts_over_without_concatenating(fp8_models, monkeypatch):
    """SegmentedLinear.parts: split(forward(x)) bit for bit, each part a view of its own
    segment's output (no concatenation); GatedDeltaNet.project takes them, its (mixed, z, b, a)
    bit for bit what the concatenated output split gave, in fp32 and bf16."""
    from blockspec.models.qwen3_5 import GatedDeltaNet
    model = load_model(str(fp8_models["qwen3_5_moe"][1])).model
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(isinstance(m.in_proj, fp8.SegmentedLinear) for m in layers)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for layer in layers:
            in_proj = layer.in_proj
            for shape in ((1, 1), (1, 7), (5,)):
                x = torch.randn(*shape, in_proj.in_features, generator=gen).to(dtype)
                parts, whole = in_proj.parts(x), in_proj.split(in_proj(x))
                assert len(parts) == len(whole) == len(in_proj.part_sizes)
                assert all(torch.equal(p, w) and p.dtype == w.dtype for p, w in zip(parts, whole))
                storages = [p.untyped_storage().data_ptr() for p in parts]     # qkv, z | b, a
                assert storages[0] == storages[1] != storages[2] == storages[3]
            x = torch.randn(1, 7, in_proj.in_features, generator=gen).to(dtype)
            ours = layer.project(x)
            with monkeypatch.context() as patch:       # the path before parts: cat, then split
                patch.delattr(fp8.SegmentedLinear, "parts")
                before = layer.project(x)
            assert len(ours) == len(before) == 4
            assert all(torch.equal(o, b) and o.shape == b.shape for o, b in zip(ours, before))


# ── agreement with transformers, DFlash over FP8 ───────────────────────────────────────────────

@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers_on_the_dequantized_weights(fp8_models, one_tokenizer, expected, kind):
    llm = LLM(str(fp8_models[kind][1]), max_model_len=256, show_progress=False)
    outputs = [llm.generate_ids(prompt, SamplingParams(max_tokens=16)).token_ids for prompt in PROMPTS]
    assert outputs == expected[kind]
    assert all(len(set(tokens)) > 3 for tokens in outputs)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_moe"])          # dense; hybrid with MoE
def test_dflash_over_fp8_equals_plain(fp8_models, one_tokenizer, expected, kind, tmp_path):
    _, path, _ = fp8_models[kind]
    draft = fixtures.write_dflash_draft(tmp_path / "draft", path, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
    params = SamplingParams(max_tokens=16)
    llm = LLM(str(path), draft=str(draft), block_size=8, max_model_len=256, show_progress=False)
    assert [llm.generate_ids(p, params).token_ids for p in PROMPTS] == expected[kind]
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected[kind]
    assert all(p.dtype != fp8.FP8 for p in llm.draft.parameters())


# ── --quantization fp8 ─────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_moe"])
def test_quantization_on_load_equals_the_fp8_checkpoint(fp8_models, kind):
    """The bf16 original quantized on load holds, bit for bit, what the FP8 file of the same
    weights holds: the same modules, e4m3 codes and scales."""
    _, path, bf16 = fp8_models[kind]
    stored = load_model(str(path)).model.state_dict()
    quantized = load_model(str(bf16), quantization="fp8").model.state_dict()
    assert stored.keys() == quantized.keys()
    for name, tensor in stored.items():
        same = (torch.equal(tensor.view(torch.uint8), quantized[name].view(torch.uint8)) if tensor.dtype == fp8.FP8
                else torch.equal(tensor, quantized[name]))
        assert same and tensor.dtype == quantized[name].dtype, name


def test_quantization_on_load_keeps_routers_and_gdn_gates_in_bf16(fp8_models):
    model = load_model(str(fp8_models["qwen3_5_moe"][2]), quantization="fp8").model
    fp8_names = {n for n, p in model.named_parameters() if p.dtype == fp8.FP8}
    assert not any(".mlp.gate." in n or "shared_expert_gate" in n or "lm_head" in n or "embed" in n for n in fp8_names)
    assert "model.layers.0.linear_attn.in_proj.segments.0.weight" in fp8_names
    assert "model.layers.0.linear_attn.in_proj.segments.1.weight" not in fp8_names       # in_proj_b / a
    assert "model.layers.0.mlp.experts.gate_up_proj" in fp8_names


# ── refusals ───────────────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("change, message", [
    ({"fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
])
def test_other_quantization_configs_are_refused_in_one_line(fp8_models, tmp_path, change, message):
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_models["qwen3"][1], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        load_model(str(path))
    assert "\n" not in str(error.value)


def test_a_device_without_fp8_is_refused(fp8_models, monkeypatch):
    cuda = torch.device("cuda")
    assert not fp8_kernels.has_fp8(cuda, capability=(8, 0)) and fp8_kernels.has_fp8(cuda, capability=(9, 0))
    assert fp8_kernels.has_fp8(cuda, capability=(8, 9)) and fp8_kernels.has_fp8(torch.device("cpu"))
    monkeypatch.setattr(fp8_kernels, "has_fp8", lambda device: False)
    for path, quantization in ((fp8_models["qwen3"][1], None), (fp8_models["qwen3"][2], "fp8")):
        with pytest.raises(LoadError, match="FP8 weights need a GPU of compute capability 8.9"):
            load_model(str(path), quantization=quantization)
    load_model(str(fp8_models["qwen3"][2]))                                        # bf16 still loads


def test_cli_says_why_in_one_line(fp8_models, tmp_path, capsys):
    from blockspec.cli import main
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_models["qwen3"][1], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (path / "config.json").write_text(json.dumps(config))
    code = main(["generate", "--model", str(path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and "'e5m2' is not supported" in err
    with pytest.raises(SystemExit) as parser_exit:
        main(["generate", "--model", str(path), "--quantization", "int4"])
    assert parser_exit.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("block", [fp8.ScaleBlock(), fp8.ScaleBlock(rows=1), fp8.ScaleBlock(rows=1, cols=384),
                                   fp8.ScaleBlock(cols=256)], ids=["128x128", "rows-1", "per-channel", "cols-256"])
def test_column_scales_dequantize_the_weight_as_its_blocks_do(block):
    """torch._scaled_mm's 1 × 128 scales of the weight (BLOCKSPEC_FP8_GEMM=cublas) give the weight
    `dequantize` gives: each 128-column block of each row times its scale."""
    n, k = 200, 384
    q, scale = fp8.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), block)
    per_block = fp8_kernels.column_scales(scale, block, n, k)              # [⌈K/128⌉, N]
    assert per_block.shape == (3, n) and per_block.is_contiguous()
    assert torch.equal(q.float() * per_block.t().repeat_interleave(128, dim=1), fp8.dequantize(q, scale, block))
    kept = fp8_kernels.cached_column_scales(scale, block, n, k)                # made once per weight
    assert torch.equal(kept, per_block) and fp8_kernels.cached_column_scales(scale, block, n, k) is kept
    key = id(scale)
    del scale
    assert key not in fp8_kernels._column_scales                               # and dropped with it


def test_column_scales_refuse_blocks_of_part_of_128_columns_and_the_gemm_variable_is_checked(monkeypatch, caplog):
    q, scale = fp8.quantize(torch.randn(64, 384), fp8.ScaleBlock(cols=192))
    with pytest.raises(ValueError, match="not whole 128-column blocks"):
        fp8_kernels.column_scales(scale, fp8.ScaleBlock(cols=192), 64, 384)
    monkeypatch.setenv("BLOCKSPEC_FP8_GEMM", "Triton")
    with caplog.at_level("WARNING", logger="blockspec.engine"):
        assert fp8_kernels.fp8_gemm_from_env() == "cublas"
    assert "BLOCKSPEC_FP8_GEMM='Triton'" in caplog.text
    monkeypatch.setenv("BLOCKSPEC_FP8_GEMM", "triton")
    assert fp8_kernels.fp8_gemm_from_env() == "triton"


@pytest.mark.parametrize("block", [fp8.ScaleBlock(), fp8.ScaleBlock(rows=1, cols=200), fp8.ScaleBlock(cols=256)],
                         ids=["128x128", "per-channel", "cols-256"])
def test_column_scales_cover_a_ragged_last_block(block):
    """K = 200: ⌈K/128⌉ = 2 scale rows, the last covering 72 columns (floor division would leave
    those columns without a scale)."""
    n, k = 64, 200
    q, scale = fp8.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(4)), block)
    per_block = fp8_kernels.column_scales(scale, block, n, k)
    assert per_block.shape == (2, n)
    expanded = per_block.t().repeat_interleave(128, dim=1)[:, :k]
    assert torch.equal(q.float() * expanded, fp8.dequantize(q, scale, block))


def test_the_fp8_gemm_defaults_to_cublas_without_a_warning(monkeypatch, caplog):
    """cuBLASLt's GEMM is the default since round 59 (its GPU tests at 256-2,048 rows and an engine
    run): unset means cublas (where torch runs it; blockwise_scaled_mm_serves falls back otherwise)."""
    monkeypatch.delenv("BLOCKSPEC_FP8_GEMM", raising=False)
    with caplog.at_level("WARNING", logger="blockspec.engine"):
        assert fp8_kernels.fp8_gemm_from_env() == "cublas"
    assert not caplog.records


def test_the_fused_silu_quantization_is_on_unless_turned_off(monkeypatch):
    """silu_mul_linear's one-launch quantization is the default since its GPU run (round 64);
    BLOCKSPEC_FP8_FUSED_SILU=0, and only "0", turns it off."""
    monkeypatch.delenv("BLOCKSPEC_FP8_FUSED_SILU", raising=False)
    assert fp8_kernels.fused_silu_from_env() is True
    monkeypatch.setenv("BLOCKSPEC_FP8_FUSED_SILU", "1")
    assert fp8_kernels.fused_silu_from_env() is True
    monkeypatch.setenv("BLOCKSPEC_FP8_FUSED_SILU", "0")
    assert fp8_kernels.fused_silu_from_env() is False


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so the capture guard of cached_column_scales is reached."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_column_scales_made_inside_a_graph_capture_are_not_kept(monkeypatch):
    """A tensor made during capture holds nothing until the graph replays: keeping it would hand
    every later eager call garbage. The next eager call makes and keeps its own."""
    block = fp8.ScaleBlock()
    _, plain = fp8.quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(5)), block)
    scale = plain.as_subclass(OnCuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made = fp8_kernels.cached_column_scales(scale, block, 256, 256)
    assert torch.equal(made, fp8_kernels.column_scales(plain, block, 256, 256))
    assert id(scale) not in fp8_kernels._column_scales
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kept = fp8_kernels.cached_column_scales(scale, block, 256, 256)
    assert kept is not made and fp8_kernels._column_scales[id(scale)] is kept


def exact_operands(m: int, n: int, k: int, block: fp8.ScaleBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] bf16 and an e4m3 weight [n, k] with its scales, both halves in [-1, 1] with a 7 at
    the head of every 128 columns: every block's scale is 7/448 = 1/64, every code exact, and every
    product and sum exact in fp32, so any summation order gives the same bits."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-2, 3, (m, k), generator=gen).float() / 2
    w = torch.randint(-2, 3, (n, k), generator=gen).float() / 2
    x[:, ::128] = 7.0
    w[:, ::128] = 7.0
    q, scale = fp8.quantize(w, block)
    return x.to(torch.bfloat16), q, scale


def blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Stands in for torch._scaled_mm with 1 × 128 scales on a (cuBLASLt; no GPU here), refusing
    the layouts it refuses: b column-major (the weight transposed), a's scales [M, K/128] with
    strides (1, M), b's either 1 × 128 ([K/128, N] row-major) or 128 × 128 ([K/128, N/128] with
    strides (1, K/128), the transpose of the weight's own), and M not a multiple of 16 (the H100
    refused 65)."""
    (m, k), n = a.shape, b.shape[1]
    assert m % 16 == 0, f"cuBLASLt refuses {m} rows"
    assert a.dtype == b.dtype == fp8.FP8 and b.stride() == (1, k)
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
    if scale_b.shape == (k // 128, n // 128):        # cuBLASLt pads their K axis to 4 blocks (see BLOCK_SCALES_K_GROUP)
        assert n % 128 == 0 and scale_b.stride() == (1, k // 128) and (k // 128) % 4 == 0
        scale_b = scale_b.repeat_interleave(128, dim=1)
    assert scale_b.shape == (k // 128, n) and scale_b.stride() in ((n, 1), (1, k // 128))
    product = (a.float() * scale_a.repeat_interleave(128, dim=1)) @ (b.float() * scale_b.repeat_interleave(128, dim=0))
    return product.to(out_dtype)


def reference_quantize_rows(x: torch.Tensor, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows' values (the interpreter test holds the kernel to them), in either layout."""
    q, scales = fp8_kernels.quantize_rows_reference(x)
    return q, scales.t().contiguous().t() if column_major else scales


def refused(*_, **__) -> torch.Tensor:
    raise AssertionError("this path was not chosen")


@pytest.fixture
def cublas_path(monkeypatch):
    """fp8.linear as on a GPU whose torch runs block-scaled _scaled_mm; returns the patch."""
    monkeypatch.setattr(fp8_kernels, "use_triton", lambda *_: True)
    monkeypatch.setattr(fp8_kernels, "has_blockwise_scaled_mm", lambda device: True)
    monkeypatch.setattr(fp8_kernels, "has_block128_scaled_mm", lambda device: True)
    monkeypatch.setattr(fp8_kernels, "quantize_rows", reference_quantize_rows)
    monkeypatch.setattr(torch, "_scaled_mm", blockwise_scaled_mm, raising=False)
    return monkeypatch


@pytest.mark.parametrize("block", [fp8.ScaleBlock(), fp8.ScaleBlock(rows=1), fp8.ScaleBlock(rows=1, cols=256)],
                         ids=["128x128", "rows-1", "per-channel"])
def test_the_cublas_gemm_is_the_fp8_fp8_product_bit_for_bit(cublas_path, block):
    """BLOCKSPEC_FP8_GEMM=cublas above 64 rows: reference_fp8_fp8's bits, the bias added in fp32
    before the one rounding to bf16 (rounding the product first and again after the bias differs)."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    cublas_path.setattr(fp8_kernels, "fp8_fp8_linear", refused)
    x, q, scale = exact_operands(80, 48, 256, block)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    for b in (None, bias):
        out = fp8_kernels.linear(x.view(8, 10, 256), q, scale, block, b)
        assert out.shape == (8, 10, 48) and out.dtype == torch.bfloat16
        assert torch.equal(out.view(80, 48), fp8_kernels.reference_fp8_fp8(x, q, scale, block, b))
        # 65 and 70 rows: padded with zero rows to 80 for cuBLASLt, the padding's outputs dropped
        for rows in (65, 70):
            out = fp8_kernels.linear(x[:rows], q, scale, block, b)
            assert torch.equal(out, fp8_kernels.reference_fp8_fp8(x[:rows], q, scale, block, b))


def test_above_256_rows_cublas_takes_a_128_blocked_weights_own_scales(cublas_path):
    """Above WEIGHT_BLOCK_SCALES_ROWS (256) padded rows a 128 × 128-blocked weight's own scales go to
    cuBLASLt as they are (their transpose: no copy); at 256 rows and below, other blocks, N not in
    128s, K not in 512s (cuBLASLt's layout pads K to 4 blocks), or a torch without the form, its
    column scales; every one reference_fp8_fp8's bits."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    handed: list[tuple[int, bool]] = []

    def recording(a, b, scale_a, scale_b, out_dtype):
        handed.append((a.shape[0], scale_b.data_ptr() == scale.data_ptr() and scale_b.shape == scale.t().shape))
        return blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    cublas_path.setattr(torch, "_scaled_mm", recording, raising=False)
    x, q, scale = exact_operands(300, 256, 512, fp8.ScaleBlock())
    bias = torch.randn(256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for rows in (256, 241, 257, 300):
        for b in (None, bias):
            out = fp8_kernels.linear(x[:rows], q, scale, fp8.ScaleBlock(), b)
            assert torch.equal(out, fp8_kernels.reference_fp8_fp8(x[:rows], q, scale, fp8.ScaleBlock(), b)), rows
    assert handed == [(256, False)] * 4 + [(272, True)] * 2 + [(304, True)] * 2
    handed.clear()
    per_row = fp8.quantize(fp8.dequantize(q, scale, fp8.ScaleBlock()), fp8.ScaleBlock(rows=1))
    ragged, k_of_3_blocks = exact_operands(300, 208, 512, fp8.ScaleBlock()), exact_operands(300, 256, 384, fp8.ScaleBlock())
    for (xs, w, s), block in (((x, *per_row), fp8.ScaleBlock(rows=1)), (ragged, fp8.ScaleBlock()),
                              (k_of_3_blocks, fp8.ScaleBlock())):
        scale = s                       # what `recording` compares the handed scales with
        out = fp8_kernels.linear(xs, w, s, block)
        assert torch.equal(out, fp8_kernels.reference_fp8_fp8(xs, w, s, block, None))
    assert handed == [(304, False)] * 3
    cublas_path.setattr(fp8_kernels, "has_block128_scaled_mm", lambda device: False)
    handed.clear()
    x, q, scale = exact_operands(300, 256, 512, fp8.ScaleBlock())
    assert torch.equal(fp8_kernels.linear(x, q, scale, fp8.ScaleBlock()),
                       fp8_kernels.reference_fp8_fp8(x, q, scale, fp8.ScaleBlock(), None))
    assert handed == [(304, False)]


def test_a_refusal_of_the_weights_own_scales_falls_back_to_its_column_scales(cublas_path, caplog):
    """cuBLASLt refusing a weight's own 128 × 128 scales at a shape: that call and every later one of
    the shape take its 1 × 128 column scales (still cuBLASLt, one warning), not our kernel."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    cublas_path.setattr(fp8_kernels, "_refused_by_cublas", set())
    cublas_path.setattr(fp8_kernels, "_block_scales_refused", set())
    cublas_path.setattr(fp8_kernels, "fp8_fp8_linear", refused)
    forms: list[str] = []

    def refuses_own_scales(a, b, scale_a, scale_b, out_dtype):
        own = scale_b.shape[1] != b.shape[1]
        forms.append("own" if own else "column")
        if own:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    cublas_path.setattr(torch, "_scaled_mm", refuses_own_scales, raising=False)
    x, q, scale = exact_operands(300, 256, 512, fp8.ScaleBlock())
    with caplog.at_level(logging.WARNING, logger="blockspec.engine"):
        for _ in range(2):
            out = fp8_kernels.linear(x, q, scale, fp8.ScaleBlock())
            assert torch.equal(out, fp8_kernels.reference_fp8_fp8(x, q, scale, fp8.ScaleBlock(), None))
    assert forms == ["own", "column", "column"]
    assert not fp8_kernels._refused_by_cublas
    assert [r.getMessage() for r in caplog.records if "128 x 128" in r.getMessage()] == [
        "cuBLASLt refused a weight's own 128 x 128 scales at 304 rows (N 256, K 512): its 1 x 128 scales serve that shape"]


def reference_silu_mul_quantize(gate_up: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul_quantize's values (the interpreter test holds the kernel to them)."""
    x = torch.nn.functional.pad(fused.silu_mul_torch(gate_up), (0, 0, 0, padded - gate_up.shape[0]))
    return reference_quantize_rows(x, column_major=True)


def test_an_fp8_down_proj_quantizes_silu_mul_where_it_is_made(cublas_path):
    """silu_mul_linear above 64 rows on cuBLASLt: silu(gate) · up quantized in one launch
    (silu_mul_quantize, padded to 16 rows), no bf16 activation made, and the bits of
    linear(silu_mul(gate_up)); at ≤ 64 rows, with BLOCKSPEC_FP8_GEMM=triton, and for a shape
    cuBLASLt refused, silu_mul then the unfused linear. MLP.forward takes it for an FP8 down_proj."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    cublas_path.setattr(fp8_kernels, "_refused_by_cublas", set())
    cublas_path.setattr(fp8_kernels, "FUSED_SILU_QUANTIZE", False)             # BLOCKSPEC_FP8_FUSED_SILU=0
    made: list[tuple[str, int]] = []
    cublas_path.setattr(fp8_kernels, "silu_mul", lambda g: made.append(("silu_mul", g.shape[0])) or fused.silu_mul_torch(g))

    def fused_quantize(gate_up, padded):
        made.append(("fused", padded))
        return reference_silu_mul_quantize(gate_up, padded)
    cublas_path.setattr(fp8_kernels, "silu_mul_quantize", fused_quantize)
    cublas_path.setattr(fp8_kernels, "weight_only_linear", lambda x, w, s, b, bias: fp8_kernels.reference_linear(x, w, s, b, bias))
    cublas_path.setattr(fp8_kernels, "fp8_fp8_linear", fp8_kernels.reference_fp8_fp8)
    block = fp8.ScaleBlock()
    _, q, scale = exact_operands(96, 48, 256, block)
    fp8_kernels.silu_mul_linear(torch.randn(80, 512).bfloat16(), q, scale, block)
    assert made == [("silu_mul", 80)]
    made.clear()
    cublas_path.setattr(fp8_kernels, "FUSED_SILU_QUANTIZE", True)
    gate_up = torch.randn(96, 512, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    for rows, b in ((80, None), (70, bias), (96, None)):
        out = fp8_kernels.silu_mul_linear(gate_up[:rows], q, scale, block, b)
        expected = fp8_kernels.reference_fp8_fp8(fused.silu_mul_torch(gate_up[:rows]), q, scale, block, b)
        assert torch.equal(out, expected), rows
    assert made == [("fused", 80), ("fused", 80), ("fused", 96)]
    made.clear()
    fp8_kernels.silu_mul_linear(gate_up[:64], q, scale, block)                   # the weight-only rows
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "triton")
    fp8_kernels.silu_mul_linear(gate_up[:80], q, scale, block)
    assert made == [("silu_mul", 64), ("silu_mul", 80)]
    made.clear()
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")

    def refuses(*_, **__):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    cublas_path.setattr(torch, "_scaled_mm", refuses, raising=False)
    for _ in range(2):            # refused once (fused, then silu_mul for our kernel), then never asked
        out = fp8_kernels.silu_mul_linear(gate_up[:80], q, scale, block, bias)
        assert torch.equal(out, fp8_kernels.reference_fp8_fp8(fused.silu_mul_torch(gate_up[:80]), q, scale, block, bias))
    assert made == [("fused", 80), ("silu_mul", 80), ("silu_mul", 80)]
    from blockspec.layers.common import MLP
    mlp = MLP(48, 256)
    down = fp8.Fp8Linear(256, 48)
    down.weight.data, down.weight_scale_inv.data = fp8.quantize(torch.randn(48, 256))
    seen: list[torch.Tensor] = []
    cublas_path.setattr(fp8_kernels, "silu_mul_linear", lambda g, *_: seen.append(g) or torch.zeros(g.shape[0], 48))
    x = torch.randn(3, 48)
    mlp(x)
    assert seen == []                                                          # a bf16 / fp32 down_proj: untouched
    mlp.down_proj = down
    mlp(x)
    assert len(seen) == 1 and torch.equal(seen[0], mlp.gate_up_proj(x))


def test_the_cublas_gemms_weight_scales_are_made_before_the_pool_is_sized(cublas_path):
    """keep_column_scales makes every served FP8 linear's cuBLASLt scales up front (the runner calls it
    before measuring memory: made at the profile's forward they were counted three times); a linear it
    does not serve (N % 16, K not in whole blocks, fp16) gets none, and the GEMM then takes the kept ones."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    served, narrow, ragged = (fp8.Fp8Linear(256, 48), fp8.Fp8Linear(256, 40), fp8.Fp8Linear(200, 48))
    model = torch.nn.Sequential(served, narrow, ragged)
    for linear in model:
        linear.weight.data, linear.weight_scale_inv.data = fp8.quantize(torch.randn(linear.out_features,
                                                                                   linear.in_features))
    assert fp8.keep_column_scales(model, torch.float16) == 0
    made = fp8.keep_column_scales(model, torch.bfloat16)
    kept = fp8_kernels._column_scales.get(id(served.weight_scale_inv))
    assert kept is not None and made == kept.nbytes == 2 * 48 * 4                     # [K/128, N] fp32
    assert id(narrow.weight_scale_inv) not in fp8_kernels._column_scales
    assert id(ragged.weight_scale_inv) not in fp8_kernels._column_scales
    assert fp8_kernels.cached_column_scales(served.weight_scale_inv, served.block, 48, 256) is kept
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "triton")
    assert fp8.keep_column_scales(torch.nn.Sequential(fp8.Fp8Linear(256, 32)), torch.bfloat16) == 0


def test_the_cublas_gemm_is_taken_only_when_asked_for_and_for_shapes_it_serves(cublas_path):
    """BLOCKSPEC_FP8_GEMM=triton keeps our kernel even where cuBLASLt would serve; =cublas falls back to
    it for N not a multiple of 16, K not whole 128-column blocks, or fp16 activations."""
    chosen: list[str] = []
    cublas_path.setattr(fp8_kernels, "fp8_fp8_linear",
                        lambda x, w, *_: chosen.append("triton") or torch.zeros(x.shape[0], w.shape[0]))
    cublas_path.setattr(torch, "_scaled_mm", refused, raising=False)
    x, q, scale = exact_operands(70, 48, 256, fp8.ScaleBlock())
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "triton")
    fp8_kernels.linear(x, q, scale, fp8.ScaleBlock())
    assert chosen == ["triton"]
    serves = fp8_kernels.blockwise_scaled_mm_serves
    assert serves(x, q)
    assert not serves(x, q[:40])                                            # N = 40
    assert not serves(x[:, :200], q[:, :200])                               # K = 200
    assert not serves(x.half(), q)
    assert not serves(x.float(), q)
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")                    # what it does not serve: ours
    fp8_kernels.linear(x, q[:40], scale[:1], fp8.ScaleBlock())
    assert chosen == ["triton", "triton"]


def test_the_cublas_gemm_pads_only_rows_short_of_a_multiple_of_16_and_with_zeros(cublas_path):
    """cuBLASLt is handed x padded with zero rows up to the next multiple of SCALED_MM_ROWS (16):
    65 and 81 rows go in as 80 and 96, while 80 and 96 rows go in as they are (no copy, no wasted
    rows); the padding's outputs never come back."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    handed: list[tuple[int, bool]] = []

    def recording(a, b, scale_a, scale_b, out_dtype):
        handed.append((a.shape[0], bool((a[rows:].float() == 0).all())))
        return blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    cublas_path.setattr(torch, "_scaled_mm", recording, raising=False)
    block = fp8.ScaleBlock()
    x, q, scale = exact_operands(96, 48, 256, block)
    for rows in (65, 80, 81, 96):
        out = fp8_kernels.linear(x[:rows], q, scale, block)
        assert torch.equal(out, fp8_kernels.reference_fp8_fp8(x[:rows], q, scale, block, None))
    assert handed == [(80, True), (80, True), (96, True), (96, True)]


def test_a_shape_cublas_refuses_runs_on_our_kernel_from_then_on(cublas_path, caplog):
    """cuBLASLt answers a shape it does not serve with an error (65 rows on the H100, round 59): that
    call and every later one of the shape run on our FP8 x FP8 kernel, with one warning, and the step
    goes on; other shapes keep cuBLASLt. Inside a capture a refusal is raised, never swallowed."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    cublas_path.setattr(fp8_kernels, "_refused_by_cublas", set())
    tried: list[int] = []

    def refuses_80(a, b, scale_a, scale_b, out_dtype):
        tried.append(a.shape[0])
        if a.shape[0] == 80:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    ours: list[int] = []

    def our_kernel(x, w, s, b, bias):
        ours.append(x.shape[0])
        return fp8_kernels.reference_fp8_fp8(x, w, s, b, bias)
    cublas_path.setattr(torch, "_scaled_mm", refuses_80, raising=False)
    cublas_path.setattr(fp8_kernels, "fp8_fp8_linear", our_kernel)
    block = fp8.ScaleBlock()
    x, q, scale = exact_operands(96, 48, 256, block)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="blockspec.engine"):
        for rows in (70, 80, 96, 65):
            out = fp8_kernels.linear(x[:rows], q, scale, block, bias)
            assert torch.equal(out, fp8_kernels.reference_fp8_fp8(x[:rows], q, scale, block, bias))
        fp8_kernels.linear(x[:80, :128], q[:32, :128], scale[:1, :1], block)       # another shape at 80 rows
    assert tried == [80, 96, 80]                # 80 x 48 x 256 refused once, never asked again (65 pads to 80)
    assert ours == [70, 80, 65, 80]             # the unpadded rows, as the kernel takes them
    warnings = [r.getMessage() for r in caplog.records if "cuBLASLt refused" in r.getMessage()]
    assert warnings == [warnings[0]] and "80 rows (N 48, K 256)" in warnings[0]     # once a row count
    cublas_path.setattr(fp8_kernels, "_refused_by_cublas", set())

    def out_of_memory(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cublas_path.setattr(torch, "_scaled_mm", out_of_memory, raising=False)
    with pytest.raises(torch.OutOfMemoryError):                   # no refusal of the shape: raised, not kept
        fp8_kernels.linear(x[:96], q, scale, block, bias)
    assert not fp8_kernels._refused_by_cublas
    cublas_path.setattr(torch, "_scaled_mm", refuses_80, raising=False)
    cublas_path.setattr(fp8_kernels, "capturing", lambda x: True)
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        fp8_kernels.linear(x[:80], q, scale, block, bias)
    assert not fp8_kernels._refused_by_cublas


def row_wise_only(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm of a torch that has row-wise scaling ([M, 1] × [1, N]) but no 1 × 128 blocks."""
    if scale_a.shape != (a.shape[0], 1) or scale_b.shape != (1, b.shape[1]):
        raise RuntimeError("Invalid scaling configuration")
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def test_the_cublas_probe_runs_two_k_blocks_once_per_device_and_never_in_a_capture(monkeypatch):
    """has_blockwise_scaled_mm: off CUDA, or without torch._scaled_mm, no (no probe); on CUDA one
    probe of K = 2 blocks per device, kept: a torch that serves it says yes, one with row-wise
    scaling only says no (with K = 1 block its [16, 1] scales would pass as row-wise); inside a
    CUDA graph's capture it raises rather than be captured (nothing would run)."""
    probe = fp8_kernels.has_blockwise_scaled_mm
    cuda = torch.device("cuda")
    calls: list[tuple] = []

    def recording(serve):
        def scaled_mm(a, b, scale_a, scale_b, out_dtype):
            calls.append((tuple(a.shape), tuple(scale_a.shape), scale_a.stride(), tuple(scale_b.shape), out_dtype))
            return serve(a, b, scale_a, scale_b, out_dtype)
        return scaled_mm
    # the probe's tensors on this CPU-only machine: CUDA's placement dropped, nothing else changed
    for name in ("zeros", "ones"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, device=None, real=real, **kwargs: real(*args, **kwargs))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    probe.cache_clear()
    try:
        monkeypatch.setattr(torch, "_scaled_mm", recording(blockwise_scaled_mm), raising=False)
        assert not probe(torch.device("cpu")) and calls == []
        capturing[0] = True
        with pytest.raises(RuntimeError, match="run the linear once before capturing a CUDA graph"):
            probe(cuda)
        assert calls == []
        capturing[0] = False
        assert probe(cuda) and probe(cuda)
        assert calls == [((16, 256), (16, 2), (1, 16), (2, 16), torch.bfloat16)]        # once
        probe.cache_clear()
        monkeypatch.setattr(torch, "_scaled_mm", recording(row_wise_only), raising=False)
        assert not probe(cuda) and len(calls) == 2
        probe.cache_clear()
        monkeypatch.delattr(torch, "_scaled_mm", raising=False)
        assert not probe(cuda) and len(calls) == 2
    finally:
        probe.cache_clear()


def test_the_128_block_probe_asks_once_after_the_1x128_one(monkeypatch):
    """has_block128_scaled_mm: no where the 1 × 128 form is missing (no call of its own); else one
    call per device with the weight's scales [K/128, N/128] = [4, 2], strides (1, 4), its answer
    checked, kept; a torch that refuses the form, or answers other numbers, says no; inside a
    capture it raises."""
    probe = fp8_kernels.has_block128_scaled_mm
    cuda = torch.device("cuda")
    calls: list[tuple] = []

    def recording(serve):
        def scaled_mm(a, b, scale_a, scale_b, out_dtype):
            calls.append((tuple(a.shape), tuple(b.shape), tuple(scale_b.shape), scale_b.stride()))
            return serve(a, b, scale_a, scale_b, out_dtype)
        return scaled_mm
    for name in ("zeros", "ones", "arange"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, device=None, real=real, **kwargs: real(*args, **kwargs))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch, "_scaled_mm", recording(blockwise_scaled_mm), raising=False)
    probe.cache_clear()
    try:
        monkeypatch.setattr(fp8_kernels, "has_blockwise_scaled_mm", lambda device: False)
        assert not probe(cuda) and calls == []
        probe.cache_clear()
        monkeypatch.setattr(fp8_kernels, "has_blockwise_scaled_mm", lambda device: True)
        capturing[0] = True
        with pytest.raises(RuntimeError, match="run the linear once before capturing a CUDA graph"):
            probe(cuda)
        capturing[0] = False
        assert probe(cuda) and probe(cuda)
        assert calls == [((16, 512), (512, 256), (4, 2), (1, 4))]
        probe.cache_clear()
        monkeypatch.setattr(torch, "_scaled_mm", recording(row_wise_only), raising=False)
        assert not probe(cuda) and len(calls) == 2
        probe.cache_clear()

        def scales_read_row_major(a, b, scale_a, scale_b, out_dtype):     # the layout misread: other sums
            return blockwise_scaled_mm(a, b, scale_a, scale_b.contiguous().view(scale_b.shape[1], -1).t(), out_dtype)
        monkeypatch.setattr(torch, "_scaled_mm", recording(scales_read_row_major), raising=False)
        assert not probe(cuda) and len(calls) == 3
    finally:
        probe.cache_clear()


def test_keep_column_scales_counts_every_served_linear(cublas_path):
    """keep_column_scales returns the bytes of every served linear's kept scales together (the
    pool is sized after them), not the last one's."""
    cublas_path.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    first, second = fp8.Fp8Linear(256, 48), fp8.Fp8Linear(384, 32)
    model = torch.nn.Sequential(first, torch.nn.Sequential(second))
    for linear in (first, second):
        linear.weight.data, linear.weight_scale_inv.data = fp8.quantize(torch.randn(linear.out_features,
                                                                                   linear.in_features))
    assert fp8.keep_column_scales(model, torch.bfloat16) == 2 * 48 * 4 + 3 * 32 * 4
    for linear in (first, second):
        kept = fp8_kernels._column_scales[id(linear.weight_scale_inv)]
        assert torch.equal(kept, fp8_kernels.column_scales(linear.weight_scale_inv, linear.block,
                                                           linear.out_features, linear.in_features))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runner_keeps_the_cublas_scales_before_it_sizes_the_pool(fp8_models, one_tokenizer, monkeypatch, dtype):
    """ModelRunner.size_pool makes the target's cuBLASLt weight scales before the pool's memory is
    measured (engine/memory.size_pool), for the activations' dtype: a bf16 engine holds every FP8
    linear's by then (here all are served: K in 128s, N in 16s); an fp32 engine, whose linears
    never take cuBLASLt, none."""
    from blockspec.engine import model_runner
    monkeypatch.setattr(fp8_kernels, "FP8_GEMM", "cublas")
    monkeypatch.setattr(fp8_kernels, "has_blockwise_scaled_mm", lambda device: True)
    real, seen = model_runner.size_pool, []

    def sizing(config, target, *args, **kwargs):
        linears = [m for m in target.modules() if isinstance(m, fp8.Fp8Linear)]
        seen.append([(m, fp8_kernels._column_scales.get(id(m.weight_scale_inv))) for m in linears])
        return real(config, target, *args, **kwargs)
    monkeypatch.setattr(model_runner, "size_pool", sizing)
    llm = LLM(str(fp8_models["qwen3_moe"][1]), dtype=dtype, max_model_len=256, show_progress=False)
    assert llm.dtype == dtype and len(seen) == 1 and len(seen[0]) >= 4
    for linear, kept in seen[0]:
        if dtype == "float32":
            assert kept is None
        else:
            assert torch.equal(kept, fp8_kernels.column_scales(linear.weight_scale_inv, linear.block,
                                                               linear.out_features, linear.in_features))

def test_an_fp8_shared_expert_rides_in_the_experts_last_slot_where_asked(fp8_models, monkeypatch):
    """SparseMoE.shared_slot beside FP8 experts (Qwen3.5-MoE: experts and shared expert of 96):
    the shared expert's own e4m3 rows and scales, whose dequantized gate | up and down are its
    MLP's, and the gate's bf16 row; none with BLOCKSPEC_FP8_SHARED_SLOT=0."""
    from blockspec.layers.moe import SparseMoE
    model = load_model(str(fp8_models["qwen3_5_moe"][1])).model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(isinstance(m.experts, fp8.Fp8Experts) for m in layers)
    monkeypatch.setenv("BLOCKSPEC_FP8_SHARED_SLOT", "0")
    assert all(m.shared_slot() is None for m in layers)
    monkeypatch.delenv("BLOCKSPEC_FP8_SHARED_SLOT")
    for m in layers:
        slot, mlp = m.shared_slot(), m.shared_expert
        assert slot is not None and slot.gate.dtype == slot.down.dtype == fp8.FP8
        gate_up = fp8.dequantize(torch.cat([slot.gate, slot.up]), slot.gate_up_scale, m.experts.gate_up_block)
        assert torch.equal(gate_up, mlp.gate_up_proj.dequantized(torch.float32))
        assert torch.equal(fp8.dequantize(slot.down, slot.down_scale, m.experts.down_block),
                           mlp.down_proj.dequantized(torch.float32))
        assert slot.gate_logit is m.shared_expert_gate.weight
        assert slot.gate_up_scale.shape == m.experts.scales.gate_up.shape[1:]
    layer = layers[0]                       # scales laid out otherwise: it runs on its own again
    monkeypatch.setattr(layer.shared_expert.down_proj, "block", fp8.ScaleBlock(rows=1))
    assert layer.shared_slot() is None


# ── the Triton kernels in the interpreter (the GPU runs them for real: tests/gpu/test_fp8.py) ──

INTERPRETED_KERNEL_CHECK = """
from dataclasses import replace
import torch
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8
gen = torch.Generator().manual_seed(0)
# ragged K and N (the masked loads), K and N the tiles divide (the mask-free ones), per channel
for rows, n, k, block in [(1, 40, 200, fp8.ScaleBlock()), (5, 130, 256, fp8.ScaleBlock(rows=1)),
                          (17, 64, 96, fp8.ScaleBlock(rows=1, cols=96)), (1, 64, 512, fp8.ScaleBlock()),
                          (4, 96, 768, fp8.ScaleBlock()), (1, 32, 384, fp8.ScaleBlock(rows=1, cols=384))]:
    weight = torch.randn(n, k, generator=gen)
    q, scale = fp8.quantize(weight, block)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    ref = K.reference_linear(x, q, scale, block, bias)
    tiles = [K.WeightOnlyTiles(16, 32, 4, 2, split) for split in (1, 2, 3)]   # K split: partials added in order
    # tl.dot over 2 scale blocks an iteration; the GEMV over 1, 2 or 4 rows a program and 1 or 2
    # scale blocks, x loaded either way, the next tile prefetched or not; K split or not, its parts
    # summed in the kernel or after it
    tiles += [K.WeightOnlyTiles(16, 32, 4, 2, split, k_blocks=2, reduce_in_kernel=True) for split in (1, 2)]
    tiles += [K.WeightOnlyTiles(rows_a_program, 32, 4, 2, split, gemv=True, k_blocks=kb, reduce_in_kernel=summed,
                                broadcast_x=broadcast, prefetch=prefetch)
              for rows_a_program, split, kb, summed, broadcast, prefetch in (
                  (1, 1, 2, False, False, False), (1, 2, 1, True, True, True), (2, 3, 1, True, False, True),
                  (4, 2, 2, False, True, False), (4, 2, 1, True, True, False), (2, 1, 1, False, True, True))]
    if rows == 1:
        assert K.weight_only_tiles(1, n, k, 1).gemv                               # the default at one row
        assert (K.weight_only_linear(x, q, scale, block, bias) - ref).abs().max() < 1e-4 * ref.abs().max()
    for t in tiles:
        out = K.weight_only_linear(x, q, scale, block, bias, tiles=t)
        assert (out - ref).abs().max() < 1e-4 * ref.abs().max(), (rows, n, k, t)
        if t.gemv or t.reduce_in_kernel:
            assert (K.weight_only_linear(x, q, scale, block, None, tiles=t) + bias - ref).abs().max() \
                < 1e-4 * ref.abs().max(), (rows, n, k, t)
        if t.reduce_in_kernel:      # the sum kernel's bits, call after call: every count back at 0
            assert torch.equal(out, K.weight_only_linear(x, q, scale, block, bias, replace(t, reduce_in_kernel=False)))
            assert torch.equal(out, K.weight_only_linear(x, q, scale, block, bias, tiles=t)), (rows, n, k, t)
            assert not K.split_counters(x.device).any()
    # the fp16 dot (scripts/fp8_dot_f16_probe.py) on a bf16 x, against the fp32 product of the same
    # operands (not against the bf16 dot: the interpreter's e4m3 → bf16 conversion is not the GPU's)
    x_bf16 = x.bfloat16()
    f16_out = K.weight_only_linear(x_bf16, q, scale, block, bias, K.WeightOnlyTiles(16, 32, 4, 2, 2, dot_f16=True))
    exact = K.reference_linear(x_bf16.float(), q, scale, block, bias)
    assert f16_out.dtype == torch.bfloat16 and (f16_out.float() - exact).abs().max() <= 2 ** -6 * exact.abs().max()
    # FP8 x FP8 against the product of its own quantized activations (the interpreter's e4m3
    # conversion truncates, so its codes are not torch's; the GPU test compares those too)
    x_q, x_scale = K.quantize_rows(x)
    col_q, col_scale = K.quantize_rows(x, column_major=True)       # torch._scaled_mm's layout: the same values
    assert col_scale.stride() == (1, rows) and torch.equal(col_scale, x_scale) and torch.equal(col_q, x_q)
    assert torch.allclose(x_scale, K.quantize_rows_reference(x)[1], rtol=1e-6, atol=0)
    ref = fp8.dequantize(x_q, x_scale, fp8.ScaleBlock(rows=1)) @ fp8.dequantize(q, scale, block).T + bias
    assert (K.fp8_fp8_linear(x, q, scale, block, bias) - ref).abs().max() < 1e-4 * ref.abs().max(), (rows, n, k)
    for tiles in (K.Fp8Fp8Tiles(16, 32, 4, 2, group_m=2), K.Fp8Fp8Tiles(32, 16, 4, 4, group_m=1)):   # a sweep's tiles
        assert (K.fp8_fp8_linear(x, q, scale, block, bias, tiles) - ref).abs().max() < 1e-4 * ref.abs().max(), tiles

# quantize_rows over more scale groups than a program takes (8): 21 groups, the last one ragged.
# Each group is quantized on its own, so a call on one group's columns gives the same codes and
# scale (the interpreter's e4m3 conversion is not torch's, so the codes are held to the kernel's own)
x = torch.randn(3, 21 * 128 - 40, generator=gen) * torch.rand(3, 1, generator=gen) * 10
for column_major in (False, True):
    x_q, x_scale = K.quantize_rows(x, column_major)
    assert x_q.shape == x.shape and torch.allclose(x_scale, K.quantize_rows_reference(x)[1], rtol=1e-6, atol=0)
    for group in (0, 7, 8, 15, 16, 20):
        one_q, one_scale = K.quantize_rows(x[:, group * 128:(group + 1) * 128].contiguous())
        assert torch.equal(one_scale[:, 0], x_scale[:, group]), group
        assert torch.equal(one_q.view(torch.uint8), x_q[:, group * 128:(group + 1) * 128].view(torch.uint8)), group

# silu(gate) · up quantized where it is made: the codes and scales of silu_mul, padded with zero
# rows, then quantize_rows (both interpreted, so the same e4m3 conversion): bit for bit, ragged last group
import torch.nn.functional as F
from blockspec.kernels import fused
gate_up = (torch.randn(5, 2 * (21 * 128 - 40), generator=gen) * 3).bfloat16()
for padded in (5, 16):
    q, s = K.silu_mul_quantize(gate_up, padded)
    ref_q, ref_s = K.quantize_rows(F.pad(fused.silu_mul_triton(gate_up), (0, 0, 0, padded - 5)), column_major=True)
    assert q.shape == ref_q.shape == (padded, 21 * 128 - 40) and s.stride() == ref_s.stride() == (1, padded)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s), padded

# FP8 experts in the fused MoE kernel, gate | up of 24 rows each (a scale per row)
from blockspec.kernels import moe as M
from blockspec.layers.moe import reference_experts, route
gate_up, down = torch.randn(4, 48, 64, generator=gen), torch.randn(4, 64, 24, generator=gen)
block = fp8.fused_scale_block((24, 24))
halves = [fp8.quantize(half) for half in gate_up.chunk(2, dim=1)]
gate_up_q = torch.cat([q for q, _ in halves], dim=1)
gate_up_s = torch.cat([fp8.part_scale_rows(s, 24, block) for _, s in halves], dim=1)
down_q, down_s = fp8.quantize(down)
x = torch.randn(5, 64, generator=gen)
weights, experts = route(torch.randn(5, 4, generator=gen), 2, True)
ref = reference_experts(x, weights, experts, fp8.dequantize(gate_up_q, gate_up_s, block),
                        fp8.dequantize(down_q, down_s, fp8.ScaleBlock()))
ours = M.fused_experts(x, weights, experts, gate_up_q, down_q, None,
                       M.ExpertScales(gate_up_s, down_s, block, fp8.ScaleBlock()))
assert (ours - ref).abs().max() < 1e-4 * ref.abs().max()

# ... and an e4m3 shared expert riding along as the last slot (id 4), its scales laid out as one
# expert's: the routed experts' sum plus sigmoid(x · g) · shared(x), both dequantized
sh_halves = [fp8.quantize(half) for half in torch.randn(48, 64, generator=gen).chunk(2, dim=0)]
sh_gate_up_q = torch.cat([q for q, _ in sh_halves], dim=0)
sh_gate_up_s = torch.cat([fp8.part_scale_rows(s, 24, block) for _, s in sh_halves], dim=0)
sh_down_q, sh_down_s = fp8.quantize(torch.randn(64, 24, generator=gen))
g = torch.randn(1, 64, generator=gen)
slot = torch.sigmoid(x @ g.T)
shared = M.SharedExpert(*sh_gate_up_q.chunk(2, dim=0), sh_down_q, g, sh_gate_up_s, sh_down_s)
ours = M.fused_experts(x, torch.cat([weights, slot], 1), torch.cat([experts, torch.full((5, 1), 4)], 1),
                       gate_up_q, down_q, shared, M.ExpertScales(gate_up_s, down_s, block, fp8.ScaleBlock()))
sh = fp8.dequantize(sh_gate_up_q, sh_gate_up_s, block)
sh_ref = slot * (F.silu(x @ sh[:24].T) * (x @ sh[24:].T)) @ fp8.dequantize(sh_down_q, sh_down_s, fp8.ScaleBlock()).T
assert (ours - (ref + sh_ref)).abs().max() < 1e-4 * (ref + sh_ref).abs().max()

# ... the gate/up GEMM's K in two parts (BLOCKSPEC_MOE_SPLIT_K), K = 256: each part scales its own
# 128-column blocks, the shared slot's with its own scales; against the dequantized reference
gate_up, down = torch.randn(4, 48, 256, generator=gen), torch.randn(4, 256, 24, generator=gen)
halves = [fp8.quantize(half) for half in gate_up.chunk(2, dim=1)]
gate_up_q = torch.cat([q for q, _ in halves], dim=1)
gate_up_s = torch.cat([fp8.part_scale_rows(s, 24, block) for _, s in halves], dim=1)
down_q, down_s = fp8.quantize(down)
sh_halves = [fp8.quantize(half) for half in torch.randn(48, 256, generator=gen).chunk(2, dim=0)]
sh_gate_up_q = torch.cat([q for q, _ in sh_halves], dim=0)
sh_gate_up_s = torch.cat([fp8.part_scale_rows(s, 24, block) for _, s in sh_halves], dim=0)
sh_down_q, sh_down_s = fp8.quantize(torch.randn(256, 24, generator=gen))
g = torch.randn(1, 256, generator=gen)
shared = M.SharedExpert(*sh_gate_up_q.chunk(2, dim=0), sh_down_q, g, sh_gate_up_s, sh_down_s)
x = torch.randn(2, 256, generator=gen)                # 6 pairs of 4 experts + the shared: decode tiles
weights, experts = route(torch.randn(2, 4, generator=gen), 2, True)
slot = torch.sigmoid(x @ g.T)
ref = reference_experts(x, weights, experts, fp8.dequantize(gate_up_q, gate_up_s, block),
                        fp8.dequantize(down_q, down_s, fp8.ScaleBlock()))
sh = fp8.dequantize(sh_gate_up_q, sh_gate_up_s, block)
ref = ref + slot * (F.silu(x @ sh[:24].T) * (x @ sh[24:].T)) @ fp8.dequantize(sh_down_q, sh_down_s, fp8.ScaleBlock()).T
args = (x, torch.cat([weights, slot], 1), torch.cat([experts, torch.full((2, 1), 4)], 1), gate_up_q, down_q, shared,
        M.ExpertScales(gate_up_s, down_s, block, fp8.ScaleBlock()))
real_parts, splits = M.k_split, []
M.k_split = lambda *a: splits.append(real_parts(*a)) or splits[-1]
M.SPLIT_K = 2
parted = M.fused_experts(*args)
M.SPLIT_K, M.k_split = 1, real_parts
assert splits[0] == (2, 128), splits                  # the gate/up launch ran in two parts
assert (parted - ref).abs().max() < 1e-4 * ref.abs().max()
assert int(M.arrival_counters(x.device).abs().sum()) == 0
print("ok")
"""


def test_fp8_kernels_equal_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    done = run_interpreted(INTERPRETED_KERNEL_CHECK)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


INTERPRETED_TAIL_CHECK = """
from dataclasses import replace
import torch
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8
gen = torch.Generator().manual_seed(0)
# A tail of x's dtype in the e4m3 rows' weight-only launch: the e4m3 columns bit for bit the
# launch's without it, the tail's the product x · tailᵀ within one rounding of x's dtype. GEMV at
# 1-2 rows, tl.dot above (fp16 or fp32 there: the interpreter's bf16 tl.dot is not the GPU's, its
# sums are wrong; tests/gpu/test_fp8.py runs bf16); tails of part of a column tile and of
# several; ragged K; K split with its parts summed in the kernel or after it.
for rows, n, n_tail, k, block, dtype in [(1, 384, 8, 128, fp8.ScaleBlock(rows=1), torch.float32),
                                         (2, 64, 70, 200, fp8.ScaleBlock(), torch.float32),
                                         (5, 128, 8, 256, fp8.ScaleBlock(), torch.float16),
                                         (17, 64, 40, 512, fp8.ScaleBlock(rows=1), torch.float32),
                                         (1, 64, 64, 512, fp8.ScaleBlock(), torch.bfloat16)]:
    q, scale = fp8.quantize(torch.randn(n, k, generator=gen), block)
    tail = torch.randn(n_tail, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    exact = x.double() @ tail.double().T
    tolerance = (1e-5 if dtype == torch.float32 else 2 ** -7) * exact.abs().max()
    chosen = K.weight_only_tiles(rows, n, k, 1)
    tiles = [chosen, replace(chosen, split_k=2, reduce_in_kernel=False), replace(chosen, split_k=3)]
    if rows > 2:
        tiles.append(K.WeightOnlyTiles(16, 32, 4, 2, 2, k_blocks=2, reduce_in_kernel=True))
    else:
        tiles.append(K.WeightOnlyTiles(rows, 32, 4, 2, 2, gemv=True, k_blocks=1, reduce_in_kernel=True,
                                       broadcast_x=rows == 1, prefetch=True))
    for t in tiles:
        alone = K.weight_only_linear(x, q, scale, block, None, tiles=t)
        both = K.weight_only_linear(x, q, scale, block, None, tiles=t, tail=tail)
        assert both.shape == (rows, n + n_tail) and both.dtype == dtype, (rows, n, t)
        assert torch.equal(both[:, :n], alone), (rows, n, n_tail, k, t)
        assert (both[:, n:].double() - exact).abs().max() <= tolerance, (rows, n, n_tail, k, t)
        assert not K.split_counters(x.device).any()
    try:                                      # a column tile of both formats is refused
        K.weight_only_linear(x, q[:n - 8], scale, block, None, tiles=chosen, tail=tail)
        raise AssertionError("a tile across the formats ran")
    except ValueError:
        pass

# SegmentedLinear (GDN in_proj: qkv | z e4m3, b | a bf16) with the interpreter standing in for
# CUDA: BLOCKSPEC_FP8_BF16_TAIL's one launch gives its parts (views of one output) and forward;
# without it, two launches as before
K.use_triton = lambda *args: True
k = 256
for dtype, row_counts in ((torch.bfloat16, (1, 2)), (torch.float16, (5, 64, 65))):       # GEMV; tl.dot, two GEMMs
    segmented = fp8.SegmentedLinear([
        fp8.Fp8Linear(k, 384, block=fp8.fused_scale_block((256, 128)), parts={"in_proj_qkv": 256, "in_proj_z": 128}),
        fp8.PartsLinear(k, {"in_proj_b": 4, "in_proj_a": 4}, bias=False)]).to(dtype)
    fp8_run, bf16_run = segmented.segments
    fp8_run.weight.data, fp8_run.weight_scale_inv.data = fp8.quantize(torch.randn(384, k, generator=gen),
                                                                      fp8_run.block)
    bf16_run.weight.data = torch.randn(8, k, generator=gen).to(dtype)
    assert segmented.has_bf16_tail
    with torch.no_grad():
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            K.FP8_BF16_TAIL = False
            two = segmented.parts(x)
            assert segmented.joined(x) is None
            K.FP8_BF16_TAIL = True
            one, whole = segmented.parts(x), segmented(x)
            assert torch.equal(whole, torch.cat(one, dim=-1))
            assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]), rows
            exact = x.double() @ bf16_run.weight.double().T
            assert (torch.cat(one[2:], -1).double() - exact).abs().max() <= 2 ** -7 * exact.abs().max(), rows
            storages = {p.untyped_storage().data_ptr() for p in one}
            assert len(storages) == (1 if rows <= K.WEIGHT_ONLY_MAX_ROWS else 2), rows    # 65 rows: two GEMMs
print("ok")
"""


def test_a_bf16_tail_rides_in_the_weight_only_launch_in_the_interpreter():
    """kernels/fp8.linear_with_tail and SegmentedLinear.joined (BLOCKSPEC_FP8_BF16_TAIL=1)."""
    pytest.importorskip("triton")
    done = run_interpreted(INTERPRETED_TAIL_CHECK)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_bf16_tail_is_on_unless_turned_off_and_the_cpu_keeps_two_gemms(fp8_models, monkeypatch):
    """BLOCKSPEC_FP8_BF16_TAIL: on unless "0" (round 68, after its GPU run); on, a CPU target
    still runs the reference's two GEMMs (joined: None)."""
    for value, on in ((None, True), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv("BLOCKSPEC_FP8_BF16_TAIL", raising=False)
        else:
            monkeypatch.setenv("BLOCKSPEC_FP8_BF16_TAIL", value)
        assert fp8_kernels.bf16_tail_from_env() is on, value
    monkeypatch.setattr(fp8_kernels, "FP8_BF16_TAIL", True)
    model = load_model(str(fp8_models["qwen3_5_moe"][1])).model
    in_proj = model.model.layers[0].linear_attn.in_proj
    x = torch.randn(3, in_proj.in_features)
    assert in_proj.has_bf16_tail and in_proj.joined(x) is None
    assert torch.equal(in_proj(x), torch.cat([segment(x) for segment in in_proj.segments], dim=-1))


def test_quantize_model_in_memory_equals_quantization_on_load(fp8_models):
    """bench's path (random weights quantized where they are) makes what --quantization fp8 loads."""
    _, _, bf16 = fp8_models["qwen3_5_moe"]
    on_load = load_model(str(bf16), quantization="fp8").model.state_dict()
    in_memory = fp8.quantize_model(load_model(str(bf16)).model).state_dict()
    assert on_load.keys() == in_memory.keys()
    for name, tensor in on_load.items():
        if tensor.dtype == fp8.FP8:
            tensor, other = tensor.view(torch.uint8), in_memory[name].view(torch.uint8)
        else:
            other = in_memory[name]
        assert torch.equal(tensor, other), name


# ── what serve says about the weights ──────────────────────────────────────────────────────────

def test_startup_line_and_metrics_say_the_weight_format_and_bytes(fp8_models, one_tokenizer):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from blockspec.server.logs import startup_summary
    from blockspec.server.settings import ServerSettings
    from blockspec.server.state import weight_metrics

    _, path, bf16 = fp8_models["qwen3_moe"]
    figures = {}
    for name, checkpoint in (("fp8", path), ("bf16", bf16)):
        llm = LLM(str(checkpoint), max_model_len=256, show_progress=False)
        target = llm.target
        experts = [m.experts for m in target.modules() if isinstance(m, SparseMoE)]
        total = sum(p.numel() * p.element_size() for p in target.parameters())
        unchosen = sum(p.numel() * p.element_size() for m in experts for p in m.parameters()) * (1 - 2 / 4)
        assert llm.weight_bytes_per_step == int(total - unchosen)
        registry = CollectorRegistry()
        registry.register(type("Weights", (), {"collect": lambda self, llm=llm: weight_metrics(llm)})())
        samples = {s.name: s for family in text_string_to_metric_families(generate_latest(registry).decode())
                   for s in family.samples}
        assert samples["blockspec_weight_bytes_per_step"].value == llm.weight_bytes_per_step
        assert samples["blockspec_weight_format"].labels == {"format": llm.weight_format}
        line = startup_summary(llm, ServerSettings(model=str(checkpoint)))
        assert f"weights {llm.weight_format}, {llm.weight_bytes_per_step / 1e9:.3g} GB read per step" in line
        figures[name] = (llm.weight_format, llm.weight_bytes_per_step)
    assert figures["fp8"][0] == "fp8_e4m3" and figures["bf16"][0] == "float32"
    assert figures["fp8"][1] < 0.5 * figures["bf16"][1]


def test_bench_takes_quantization_in_its_default_mode_and_compare_speculation_only(capsys):
    from blockspec.cli import main
    assert main(["bench", "--device", "cpu", "--burst", "4", "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["blockspec bench: error: --quantization measures the default mode and --compare-speculation "
                   "only, not --burst"]


def test_compare_speculation_measures_every_mode_again_in_fp8(tmp_path, capsys):
    """`bench --compare-speculation --quantization fp8`: plain, fixed and adaptive on the bf16
    target, then on the same target quantized in place, each FP8 figure over its bf16 one (on CPU
    the reference path: a plumbing check); the target's linears really are FP8 the second time."""
    from blockspec.bench import speculation
    from blockspec.cli import main
    formats = []
    real = speculation.speculation_sweep

    def sweep(target, draft, *args, **kwargs):
        formats.append(fp8.weight_format(target))
        return real(target, draft, *args, **kwargs)
    out = tmp_path / "r.json"
    with mock.patch.object(speculation, "speculation_sweep", sweep):
        assert main(["bench", "--shape", "tiny", "--device", "cpu", "--block-size", "4", "--compare-speculation",
                     "--accept-profile", "latent:2.5", "--prompt-len", "8", "--max-tokens", "4",
                     "--quantization", "fp8", "--out", str(out)]) == 0
    assert formats == ["float32"] * 3 + ["fp8_e4m3"] * 3
    result = json.loads(out.read_text())
    row, bf16 = result["fp8"]["c1"], result["c1"]
    for mode in ("plain", "fixed", "adaptive"):
        assert row[f"{mode}_fp8_over_bf16"] == round(row[f"{mode}_tok_s"] / bf16[f"{mode}_tok_s"], 3)
    assert "fp8 target (fp8_e4m3) beside bf16" in capsys.readouterr().out


def test_bench_prints_fp8_beside_bf16(tmp_path, capsys):
    """`bench --quantization fp8`: the target measured, then quantized in place and measured
    again; the side-by-side rows hold both (on CPU the reference path: a plumbing check)."""
    from blockspec.cli import main
    out = tmp_path / "r.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--layers", "1", "--block-size", "2",
                 "--prompt-len", "8", "--max-tokens", "2", "--no-dflash2", "--accept-len", "1.5",
                 "--quantization", "fp8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["fp8_side_by_side"]
    assert result["weight_format"] == "fp8_e4m3"
    row = result["c1"]
    assert row["bf16_plain_ms_per_step"] > 0 and row["fp8_plain_ms_per_step"] > 0
    assert row["fp8_dflash_ms_per_cycle"] > 0 and row["fp8_dflash_acceptance_length"] >= 1
    assert "fp8 target (fp8_e4m3" in capsys.readouterr().out


def test_an_fp8_lm_head_is_refused(fp8_models, tmp_path):
    from safetensors.torch import load_file, save_file
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_models["qwen3"][1], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight_scale_inv"] = torch.ones(VOCAB // 128, 2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(LoadError, match="an FP8 lm_head is not supported"):
        load_model(str(path))


def test_a_gguf_file_with_quantization_is_refused_in_one_line(qwen3_dir, tmp_path):
    from gguf_fixtures import write_gguf
    path = write_gguf(qwen3_dir, tmp_path / "tiny.gguf", with_tokenizer=False)
    with pytest.raises(LoadError, match="--quantization fp8 takes a safetensors checkpoint, not a GGUF file"):
        load_model(str(path), quantization="fp8")


# ── audit 64c: checkpoint layouts and weights the fixtures above do not hold ────────────────────

def test_a_fused_expert_checkpoint_scales_gate_and_up_as_one_matrix(fp8_models, one_tokenizer, tmp_path):
    """Experts in transformers' fused names (`experts.gate_up_proj` + `gate_up_proj_scale_inv`,
    each expert's [2I, H] blocked whole): I = 96, so a 128-row block spans gate and up. Every
    expert dequantizes to exactly what was written, and greedy decoding equals transformers."""
    import copy
    reference = copy.deepcopy(fp8_models["qwen3_5_moe"][0])
    path = fp8_fixtures.write_fp8_checkpoint(tmp_path / "fused", reference, fused_experts=True)
    state = reference.state_dict()
    model = load_model(str(path)).model
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, fp8.Fp8Experts)]
    assert len(experts) == 4
    for name, module in experts:
        gate_up, down = module.stacked(torch.float32)
        assert torch.equal(gate_up, state[name + ".gate_up_proj"]) and torch.equal(down, state[name + ".down_proj"])
    assert_greedy_equals_transformers(reference, path, PROMPT[:6])


def test_a_dense_fp8_target_reports_its_format(fp8_models):
    """weight_format says fp8_e4m3 for a target whose FP8 modules are linears only (no experts)."""
    _, path, bf16 = fp8_models["qwen3"]
    assert fp8.weight_format(load_model(str(path)).model) == "fp8_e4m3"
    assert fp8.weight_format(load_model(str(bf16)).model) == "float32"


def test_fp8_projections_keep_their_bf16_biases(one_tokenizer, tmp_path):
    """Qwen2's q/k/v biases stay bf16 beside the FP8 weights: the fused qkv's bias rows are each
    part's, added after the product; greedy equals transformers on the dequantized weights."""
    import transformers as tf
    torch.manual_seed(0)
    reference = tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2))
    randomise(reference)
    with torch.no_grad():                    # biases large enough to decide tokens
        gen = torch.Generator().manual_seed(1)
        for name, param in reference.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.copy_(torch.randn(param.shape, generator=gen))
    path = fp8_fixtures.write_fp8_checkpoint(tmp_path / "qwen2", reference)
    model = load_model(str(path)).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, fp8.Fp8Linear) and qkv.bias is not None
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    state = reference.state_dict()
    parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    want = x @ torch.cat([state[p + ".weight"] for p in parts]).T + torch.cat([state[p + ".bias"] for p in parts])
    assert torch.allclose(qkv(x), want, rtol=1e-5, atol=1e-5)
    assert_greedy_equals_transformers(reference, path, PROMPT[:6])


def test_the_fp8_fp8_reference_quantizes_the_activations_per_row_and_128_columns():
    """reference_fp8_fp8 (the spec the FP8 × FP8 kernels are held to) rounds x to e4m3 with a
    scale per row and 128 columns (K = 200: a ragged last group) before the fp32 product; the
    bias is added before the one rounding. Operands that e4m3 does not hold exactly, so skipping
    the activations' rounding shows."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 200, generator=gen).to(torch.bfloat16)
    q, scale = fp8_fixtures.quantize_block_by_block(torch.randn(48, 200, generator=gen), torch.float32)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    x_deq = torch.empty(5, 200)
    for row in range(5):
        for start in (0, 128):
            tile = x[row, start:start + 128].float()
            s = tile.abs().max() / 448.0
            x_deq[row, start:start + 128] = (tile / s).to(fp8.FP8).float() * s
    w_deq = fp8_fixtures.dequantize_block_by_block(q, scale)
    ours = fp8_kernels.reference_fp8_fp8(x, q, scale, fp8.ScaleBlock(), bias)
    assert torch.equal(ours, (x_deq @ w_deq.T + bias.float()).to(torch.bfloat16))
    assert not torch.equal(ours, (x.float() @ w_deq.T + bias.float()).to(torch.bfloat16))
