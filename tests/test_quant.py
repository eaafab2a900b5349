"""GGUF blocks kept quantized on CPU (layers/quant.py): the blocks read from the file equal what
the gguf package dequantizes; each kernel equals its dequantizing reference (our native kernel
within fp32 summation order, torch's packed int4 within the bf16 rounding it does, both stated
below); their rows do not depend on the batch; a quantized tiny target decodes the tokens its
float32 twin decodes, and DFlash on it equals plain."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec import gguf
from blockspec.kernels import native
from blockspec.layers import quant
from blockspec.loader import load_draft, load_model
from gguf_fixtures import gguf_name, write_gguf
from helpers import make_engine, make_request, run_batch

LAYER_KINDS = {"self_attn.q_proj": "Q4_1", "self_attn.k_proj": "Q4_1", "self_attn.v_proj": "Q4_0",
               "self_attn.o_proj": "Q8_0", "mlp.gate_proj": "Q4_1", "mlp.up_proj": "Q4_1", "mlp.down_proj": "Q4_1"}
# The int4 kernel rounds each plane's product to bf16 (its output dtype): 2⁻⁸ of the largest
# output per plane covers it; a wrong block layout or scale is off by the output's own size.
BF16_OUTPUT = 2.0 ** -8
# The native kernel sums K fp32 products in another order than float64: K · 2⁻²⁴ of Σ|x·w| bounds it.
FP32_SUM = 2.0 ** -24


@pytest.fixture(scope="module")
def quantized_gguf(qwen3_dir, tmp_path_factory):
    kinds = {f"model.layers.{i}.{name}.weight": kind for i in range(4) for name, kind in LAYER_KINDS.items()}
    kinds |= {"model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q8_0"}
    path = write_gguf(qwen3_dir, tmp_path_factory.mktemp("quant") / "tiny-q.gguf", quantize=kinds, with_tokenizer=False)
    return path, kinds


def test_blocks_read_from_the_file_are_what_the_package_dequantizes(quantized_gguf):
    import gguf as gguf_package
    path, kinds = quantized_gguf
    stored = {t.name: t for t in gguf.open_gguf(path).reader.tensors}
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        name = next(n for n, k in kinds.items() if k == kind)
        tensor = stored[gguf_name(name)]
        blocks = gguf.blocks_of(tensor)
        expected = torch.from_numpy(gguf_package.quants.dequantize(tensor.data, tensor.tensor_type).reshape(blocks.shape))
        assert torch.equal(blocks.dequantized(), expected), kind
        planes = sum((p.codes.float() - 8) * p.scale.repeat_interleave(quant.GROUP, 1)
                     + p.zero.repeat_interleave(quant.GROUP, 1) for p in blocks.planes())
        assert (planes - expected).abs().max() <= 1e-6 * expected.abs().max(), kind      # m + 8d rounds once
    values, scales = gguf.q8_table(stored["token_embd.weight"])
    table = gguf_package.quants.dequantize(stored["token_embd.weight"].data, stored["token_embd.weight"].tensor_type)
    ids = torch.tensor([[0, 7], [151935, 42]])
    assert torch.equal(quant.QuantEmbedding(values, scales)(ids), torch.from_numpy(table.reshape(values.shape))[ids])


def random_blocks(kind: str, n: int = 96, k: int = 128, seed: int = 0) -> quant.Blocks:
    """Random blocks of a kind, their scales and minima fp16 as a file's are."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    if kind == "Q8_0":
        return quant.q8_blocks(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d)
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float() if kind == "Q4_1" else None
    return quant.q4_blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, m)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_int4_matmul_equals_its_reference_and_rows_do_not_depend_on_the_batch(kind):
    blocks = random_blocks(kind)
    bias = torch.randn(blocks.shape[0], generator=torch.Generator().manual_seed(1))
    layer = quant.QuantLinear(blocks, bias=bias, kernel="int4pack")
    x = torch.randn(9, blocks.shape[1], generator=torch.Generator().manual_seed(2))
    y, ref = layer(x), quant.reference_linear(x, blocks, layer.bias, kernel="int4pack")
    planes = blocks.planes()
    per_plane = max(float(F.linear(x.to(torch.bfloat16).float(), quant.reference_weight([p])).abs().max())
                    for p in planes)
    assert (y - ref).abs().max() <= len(planes) * BF16_OUTPUT * per_plane
    for m in (1, 3):
        assert torch.equal(layer(x[:m]), y[:m])                # a verify's rows are the rows alone
    assert layer.weight.shape == blocks.shape and layer.weight.stride() == (0, 0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_matmul_is_the_dequantized_matmul_and_rows_do_not_depend_on_the_batch(kind):
    blocks = random_blocks(kind, n=99, k=160)                  # tails: 99 columns, 5 blocks a row
    bias = torch.randn(blocks.shape[0], generator=torch.Generator().manual_seed(1))
    layer = quant.QuantLinear(blocks, bias=bias, kernel="native")
    x = torch.randn(19, blocks.shape[1], generator=torch.Generator().manual_seed(2))
    y, ref = layer(x), quant.reference_linear(x, blocks, layer.bias)
    bound = blocks.shape[1] * FP32_SUM * (x.abs() @ blocks.dequantized().abs().t() + bias.abs())
    assert ((y - ref).abs() <= bound).all()
    assert not torch.equal(y, quant.reference_linear(x, random_blocks(kind, n=99, k=160, seed=5), layer.bias))
    for rows in (slice(0, 1), slice(3, 4), slice(1, 8), slice(8, 19)):
        assert torch.equal(layer(x[rows]), y[rows])            # a verify's rows are the rows alone
    assert layer.weight.shape == blocks.shape and layer.weight.stride() == (0, 0)
    even = random_blocks(kind)                                  # the int4 kernel takes 16 columns at a time
    unfit = quant.Blocks(even.values, even.scale * (1 + 2 ** -20), even.shift)          # not an fp16 scale
    assert quant.QuantLinear(unfit).kernel == "int4pack"
    with pytest.raises(ValueError, match="fp16"):
        quant.QuantLinear(unfit, kernel="native")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_q8_matmul_is_its_reference_and_rows_do_not_depend_on_the_batch(kind, monkeypatch):
    """The default kernel: x quantized to int8 per block, exact integer block sums, fp32 scaling:
    within fp32 rounding of `reference_linear(kernel="q8")`, within 8-bit activations' error of the
    dequantized matmul, and a row the same alone or in any batch."""
    blocks = random_blocks(kind, n=99, k=160)                  # tails: 99 columns, 5 blocks a row (an odd count)
    bias = torch.randn(blocks.shape[0], generator=torch.Generator().manual_seed(1))
    layer = quant.QuantLinear(blocks, bias=bias)
    assert layer.kernel == "q8"
    x = torch.randn(19, blocks.shape[1], generator=torch.Generator().manual_seed(2))
    x[3, 32:64] = 0.0                                          # a block of zeros: d_x = 0
    y, ref = layer(x), quant.reference_linear(x, blocks, layer.bias, kernel="q8")
    q, dx, sums = quant.quantize_activations(x)
    magnitude = (q.abs() * dx[..., None].double()).flatten(1).float() @ blocks.dequantized().abs().t()
    assert ((y - ref).abs() <= 8 * blocks.shape[1] * FP32_SUM * (magnitude + x.abs() @ blocks.dequantized().abs().t()
                                                                 + bias.abs())).all()
    exact = quant.reference_linear(x, blocks, layer.bias)
    assert (y - exact).abs().max() < 0.02 * exact.abs().max() and not torch.equal(y, exact)
    assert not torch.equal(y, quant.reference_linear(x, random_blocks(kind, n=99, k=160, seed=5), layer.bias, "q8"))
    for rows in (slice(0, 1), slice(3, 4), slice(1, 8), slice(8, 19), slice(2, 11)):
        assert torch.equal(layer(x[rows]), y[rows])            # a verify's rows are the rows alone
    assert quant.QuantLinear(layer.blocks(), bias=bias)(x).equal(y)       # blocks() gives back what it holds
    broken = x[:2].clone()
    broken[0, 5] = float("nan")                                 # a NaN reaches the block's output, as in the reference
    broken[1, :32] = torch.tensor([1e-40, -2e-40, 3e-41] + [0.0] * 29)   # 127 / max overflows: those round to ±127
    out, spec = layer(broken), quant.reference_linear(broken, blocks, layer.bias, kernel="q8")
    assert out[0].isnan().all() and spec[0].isnan().all()
    assert out[1].isfinite().all() and torch.allclose(out[1], spec[1], rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("BLOCKSPEC_CPU_KERNELS", "fp32")
    assert quant.QuantLinear(blocks).kernel == "native"


# The q8 kernel's logits against its reference's, relative to the largest: where 8-bit rounding of
# the activations (a step of max|x| / 127 where two near values round apart) leaves two tokens
# this close, either may be picked (a tiny random model's 150k logits hold near-ties: 0.17 % in
# the case that set this).
NEAR_TIE = 0.005


def forced_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits [T, V] after every prefix of ids, in one prefill forward (teacher-forced)."""
    from blockspec.bench.forward import sequence_forward
    with torch.inference_mode():
        return sequence_forward(model, torch.device("cpu"), len(ids), input_ids=torch.tensor(ids))().float()


def as_reference(model):
    """The model with every QuantLinear computing its kernel's `reference_linear` (float64 inside)
    and the torch modules in place of the native stack."""
    model.native_stack = None
    for module in model.modules():
        if isinstance(module, quant.QuantLinear):
            blocks, kernel = module.blocks(), module.kernel
            module.forward = lambda x, m=module, b=blocks, k=kernel: quant.reference_linear(
                x.reshape(-1, m.in_features), b, m.bias, kernel=k).view(*x.shape[:-1], m.out_features)
    return model


def test_a_quantized_target_decodes_like_its_reference_and_dflash_equals_plain(quantized_gguf, qwen3_draft_dir,
                                                                               monkeypatch):
    """dtype auto on CPU keeps the blocks and runs the q8 kernel: after every prefix of its greedy
    output, its own reference (the same model with every projection `reference_linear(kernel="q8")`)
    picks the token it picked (teacher-forced: 8-bit rounding is discontinuous, so two free runs
    part at the first near-tie one of them rounds across), and DFlash equals plain on it. With
    BLOCKSPEC_CPU_KERNELS=fp32 (fp32 activations, the native kernel) the tokens are the float32
    twin's (the file dequantized), free-running."""
    path, _ = quantized_gguf
    prompts = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 9]

    def outputs(model, draft=None, block_size=1, prompts=prompts, max_tokens=20):
        requests = [make_request(f"r{i}", ids, max_tokens=max_tokens) for i, ids in enumerate(prompts)]
        engine = lambda: make_engine(model, draft, block_size=block_size, max_num_seqs=len(prompts))  # noqa: E731
        return [run.output_ids for run in run_batch(engine, requests)[1]]

    quantized = load_model(str(path), device="cpu").model                  # dtype auto on CPU: kept quantized
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, quant.QuantLinear)
    assert isinstance(quantized.lm_head, quant.QuantLinear) and isinstance(quantized.model.embed_tokens,
                                                                        quant.QuantEmbedding)
    assert {m.kernel for m in quantized.modules() if isinstance(m, quant.QuantLinear)} == {"q8"}
    assert isinstance(quantized.native_stack, native.DenseStack)             # the layers in one call, q8 inside
    plain = outputs(quantized)
    reference = as_reference(load_model(str(path), device="cpu").model)
    agree = 0
    for prompt, out in zip(prompts, plain):
        logits = forced_logits(reference, prompt + out)[len(prompt) - 1: -1]       # [len(out), V]
        best = logits.max(-1).values
        chosen = logits[torch.arange(len(out)), torch.tensor(out)]
        assert ((best - chosen) <= NEAR_TIE * best.abs()).all()
        agree += int((chosen == best).sum())
    assert agree >= 0.9 * sum(len(out) for out in plain)
    assert outputs(quantized, load_draft(str(qwen3_draft_dir), quantized), block_size=4) == plain

    monkeypatch.setenv("BLOCKSPEC_CPU_KERNELS", "fp32")
    exact = load_model(str(path), device="cpu").model
    assert {m.kernel for m in exact.modules() if isinstance(m, quant.QuantLinear)} == {"native"}
    dequantized = load_model(str(path), device="cpu", dtype="float32").model
    assert isinstance(dequantized.lm_head, torch.nn.Linear)
    assert outputs(exact) == outputs(dequantized)
    assert outputs(exact, load_draft(str(qwen3_draft_dir), exact), block_size=4) == outputs(exact)
