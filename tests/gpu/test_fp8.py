"""The FP8 kernels (kernels/fp8.py, the FP8 experts of kernels/moe.py) on the GPU against the
dequantizing references, at every row count the graphs use, and inside a CUDA graph.

Tolerance: bf16's. Both sides are compared with an fp32 product of the same e4m3 weights
(x rounded to bf16 as the model holds it; for FP8 × FP8, x quantized as the kernel does):
max |Δ| ≤ 1e-2 · max |ref|, what one bf16 rounding of the output and fp32 sums in another
order leave."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from blockspec.kernels import fp8 as K
from blockspec.kernels import moe as moe_kernels
from blockspec.layers import fp8
from blockspec.layers.moe import reference_experts, route

ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
# (out, in, scale block): 128 × 128 blocks; a scale per row (a fused q/k/v boundary inside a block)
# with a ragged K; per channel
CASES = {"block": (1536, 1024, fp8.ScaleBlock()), "per_row": (640, 1000, fp8.ScaleBlock(rows=1)),
         "per_channel": (512, 768, fp8.ScaleBlock(rows=1, cols=768))}
TOLERANCE = 1e-2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not K.has_fp8(torch.device("cuda")),
                                reason="FP8 kernels need CUDA of compute capability 8.9 or later")


def weights(out_features: int, in_features: int, block: fp8.ScaleBlock, seed: int = 0):
    """e4m3 weights [N, K] and their scales in `block`'s layout (per row: the 128 × 128 block
    scales repeated over their rows, as a fused module with a part boundary inside a block holds them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out_features, in_features, device="cuda", generator=gen) / in_features ** 0.5
    if block.cols != fp8.BLOCK:
        return fp8.quantize(w, block)
    q, scale = fp8.quantize(w)
    return q, fp8.part_scale_rows(scale, out_features, block)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", ROWS)
def test_weight_only_kernel_equals_the_reference(case, rows):
    out_features, in_features, block = CASES[case]
    q, scale = weights(out_features, in_features, block)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    bias = torch.randn(out_features, device="cuda").to(torch.bfloat16) if case == "block" else None
    expected = x.float() @ fp8.dequantize(q, scale, block).T + (0 if bias is None else bias.float())
    ours = K.weight_only_linear(x, q, scale, block, bias)
    assert ours.dtype == torch.bfloat16 and relative_error(ours, expected) < TOLERANCE
    assert relative_error(K.reference_linear(x, q, scale, block, bias), expected) < TOLERANCE


@pytest.mark.parametrize("split", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_weight_only_kernel_split_over_k(split, rows):
    out_features, in_features, block = CASES["per_row"]
    q, scale = weights(out_features, in_features, block, seed=4)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    bias = torch.randn(out_features, device="cuda").to(torch.bfloat16)
    expected = x.float() @ fp8.dequantize(q, scale, block).T + bias.float()
    tiles = K.WeightOnlyTiles(min(64, max(16, rows)), 32, 4, 4, split)
    assert relative_error(K.weight_only_linear(x, q, scale, block, bias, tiles), expected) < TOLERANCE


# The weight-only variants the sweep weighs (scripts/fp8_kernel_bench.py): the GEMV at 1-16 rows a
# program, x loaded either way; tl.dot over 2 and 4 scale blocks an iteration; K split, its parts
# summed in the kernel or by the second one.
VARIANTS = {
    "gemv1_summed": K.WeightOnlyTiles(1, 32, 4, 2, 4, gemv=True, k_blocks=4, reduce_in_kernel=True),
    "gemv2_broadcast": K.WeightOnlyTiles(2, 32, 4, 3, 4, gemv=True, k_blocks=2, reduce_in_kernel=True,
                                         broadcast_x=True),
    "gemv4_broadcast": K.WeightOnlyTiles(4, 16, 4, 2, 3, gemv=True, k_blocks=4, reduce_in_kernel=True,
                                         broadcast_x=True),
    "gemv1_prefetch": K.WeightOnlyTiles(1, 16, 4, 2, 3, gemv=True, k_blocks=4, reduce_in_kernel=True, broadcast_x=True,
                                        prefetch=True),
    "gemv4_prefetch": K.WeightOnlyTiles(4, 16, 4, 2, 2, gemv=True, k_blocks=2, broadcast_x=True, prefetch=True),
    "gemv8_two_launch": K.WeightOnlyTiles(8, 16, 4, 2, 2, gemv=True, k_blocks=2, broadcast_x=True),
    "gemv16_summed": K.WeightOnlyTiles(16, 16, 8, 2, 2, gemv=True, k_blocks=2, reduce_in_kernel=True),
    "dot_2_blocks": K.WeightOnlyTiles(16, 32, 4, 4, 4, k_blocks=2, reduce_in_kernel=True),
    "dot_4_blocks": K.WeightOnlyTiles(16, 64, 4, 3, 2, k_blocks=4, reduce_in_kernel=True),
}
GRAPH_ROWS = [1, 2, 3, 4, 8, 16]        # the graphs' buckets up to 16 rows, and a ragged count


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", GRAPH_ROWS)
def test_weight_only_variants_equal_the_reference(variant, case, rows):
    tiles = VARIANTS[variant]
    out_features, in_features, block = CASES[case]
    q, scale = weights(out_features, in_features, block, seed=6)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    bias = torch.randn(out_features, device="cuda").to(torch.bfloat16) if case == "block" else None
    expected = x.float() @ fp8.dequantize(q, scale, block).T + (0 if bias is None else bias.float())
    ours = K.weight_only_linear(x, q, scale, block, bias, tiles)
    assert ours.dtype == torch.bfloat16 and relative_error(ours, expected) < TOLERANCE
    if tiles.reduce_in_kernel:       # the sum kernel's bits, call after call; every count back at 0
        assert torch.equal(ours, K.weight_only_linear(x, q, scale, block, bias, replace(tiles, reduce_in_kernel=False)))
        assert torch.equal(ours, K.weight_only_linear(x, q, scale, block, bias, tiles))
        assert not K.split_counters(x.device).any()


@pytest.mark.parametrize("variant", ["gemv1_summed", "gemv4_broadcast", "gemv1_prefetch", "dot_2_blocks"])
def test_split_sums_in_the_kernel_replay_in_a_cuda_graph(variant):
    """Replays find the counts at 0 (the last program of each tile puts its count back)."""
    tiles = VARIANTS[variant]
    q, scale = weights(1024, 4096, fp8.ScaleBlock(), seed=7)
    x = torch.randn(max(1, tiles.block_m // 2), 4096, device="cuda").to(torch.bfloat16)
    K.weight_only_linear(x, q, scale, fp8.ScaleBlock(), None, tiles)                 # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.weight_only_linear(x, q, scale, fp8.ScaleBlock(), None, tiles)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        expected = K.weight_only_linear(x, q, scale, fp8.ScaleBlock(), None, replace(tiles, reduce_in_kernel=False))
        assert torch.equal(out, expected)
    assert not K.split_counters(x.device).any()


# (e4m3 rows, bf16 tail rows, K): Qwen3.5-35B-A3B's GDN in_proj (qkv | z, then b | a), and a tail
# of part of a column tile over a ragged K
TAIL_CASES = {"qwen3_5_35b_in_proj": (12288, 64, 2048), "ragged": (1536, 40, 1000)}


@pytest.mark.parametrize("case", list(TAIL_CASES))
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64])
def test_a_bf16_tail_rides_in_the_weight_only_launch(monkeypatch, case, rows):
    """linear_with_tail (BLOCKSPEC_FP8_BF16_TAIL=1): the e4m3 columns bit for bit what `linear`
    gives them alone, the tail's within bf16's tolerance of the fp32 product; replayed in a CUDA
    graph the same."""
    n, n_tail, k = TAIL_CASES[case]
    monkeypatch.setattr(K, "FP8_BF16_TAIL", True)
    q, scale = weights(n, k, fp8.ScaleBlock(), seed=8)
    tail = (torch.randn(n_tail, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    both = K.linear_with_tail(x, q, scale, fp8.ScaleBlock(), tail)
    assert both is not None and both.shape == (rows, n + n_tail) and both.dtype == torch.bfloat16
    assert torch.equal(both[:, :n], K.linear(x, q, scale, fp8.ScaleBlock()))
    assert relative_error(both[:, n:], x.float() @ tail.float().T) < TOLERANCE
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.linear_with_tail(x, q, scale, fp8.ScaleBlock(), tail)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, K.linear_with_tail(x, q, scale, fp8.ScaleBlock(), tail))
    assert not K.split_counters(x.device).any()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", ROWS)
def test_fp8_fp8_kernel_equals_its_reference(case, rows):
    out_features, in_features, block = CASES[case]
    q, scale = weights(out_features, in_features, block, seed=1)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    x_q, x_scale = K.quantize_rows(x)
    ref_q, ref_scale = K.quantize_rows_reference(x)
    assert torch.allclose(x_scale, ref_scale, rtol=1e-6, atol=0)        # Triton's fp32 division: ≤ 2 ulp
    assert (x_q.float() != ref_q.float()).float().mean() < 1e-3           # codes differ only at rounding ties
    expected = fp8.dequantize(x_q, x_scale, fp8.ScaleBlock(rows=1)) @ fp8.dequantize(q, scale, block).T
    assert relative_error(K.fp8_fp8_linear(x, q, scale, block, None), expected) < TOLERANCE
    assert relative_error(K.reference_fp8_fp8(x, q, scale, block, None), expected) < 5e-2


@pytest.mark.parametrize("rows", ROWS)
def test_linear_dispatch_by_rows(rows):
    out_features, in_features, block = CASES["block"]
    q, scale = weights(out_features, in_features, block, seed=2)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    ours = K.linear(x, q, scale, block)
    if rows <= K.WEIGHT_ONLY_MAX_ROWS:
        assert torch.equal(ours, K.weight_only_linear(x, q, scale, block, None))
    elif K.FP8_GEMM == "cublas" and K.blockwise_scaled_mm_serves(x, q):        # the default on Hopper
        assert torch.equal(ours, K.scaled_mm_linear(x, q, scale, block, None))
    else:
        assert torch.equal(ours, K.fp8_fp8_linear(x, q, scale, block, None))
    # against the plain dequantized product: FP8 × FP8 adds the activations' e4m3 rounding
    expected = x.float() @ fp8.dequantize(q, scale, block).T
    assert relative_error(ours, expected) < (TOLERANCE if rows <= K.WEIGHT_ONLY_MAX_ROWS else 8e-2)


@pytest.mark.parametrize("rows", [16, 512])
def test_linear_replays_in_a_cuda_graph(rows):
    out_features, in_features, block = CASES["per_row"]
    q, scale = weights(out_features, in_features, block, seed=3)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    K.linear(x, q, scale, block)                                                      # compile outside capture
    assert_replays_as_eager(x, q, scale, block)


def assert_replays_as_eager(x, q, scale, block):
    """K.linear captured in a CUDA graph, replayed on new x: the eager call's bits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.linear(x, q, scale, block)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, K.linear(x, q, scale, block))


# BLOCKSPEC_FP8_GEMM=cublas: torch._scaled_mm with 1 × 128 block scales above 64 rows, for K in whole
# blocks ("per_row" of CASES, K = 1000, stays on our kernel): 128 × 128 blocks, a scale per row (a fused
# q/k/v boundary inside a block), per channel.
SCALED_MM_CASES = {"block": CASES["block"], "per_row": (640, 1024, fp8.ScaleBlock(rows=1)),
                   "per_channel": CASES["per_channel"],
                   "block_k_of_9": (1536, 1152, fp8.ScaleBlock())}    # K/128 = 9: the weight's own scales not taken


@pytest.mark.parametrize("case", list(SCALED_MM_CASES))
@pytest.mark.parametrize("rows", [65, 80, 100, 130, 256, 512, 1000, 2048])     # rows padded to 16 for cuBLASLt
def test_blockwise_scaled_mm_equals_the_fp8_fp8_product(monkeypatch, case, rows):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch runs 1 x 128 block-scaled _scaled_mm on Hopper")
    assert K.has_blockwise_scaled_mm(torch.device("cuda")), "this torch lacks 1 x 128 block scales on Hopper"
    monkeypatch.setattr(K, "FP8_GEMM", "cublas")
    out_features, in_features, block = SCALED_MM_CASES[case]
    q, scale = weights(out_features, in_features, block, seed=8)
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    bias = torch.randn(out_features, device="cuda").to(torch.bfloat16)
    x_q, x_scale = K.quantize_rows(x)
    expected = fp8.dequantize(x_q, x_scale, fp8.ScaleBlock(rows=1)) @ fp8.dequantize(q, scale, block).T
    def not_ours(*args, **kwargs):
        raise AssertionError("the FP8 x FP8 kernel ran where cuBLASLt should have")
    monkeypatch.setattr(K, "fp8_fp8_linear", not_ours)                                 # the dispatch takes cuBLASLt
    if rows > K.WEIGHT_BLOCK_SCALES_ROWS:                           # with the weight's own 128 x 128 scales
        assert (K.weight_block_scales(scale, block, q, K.padded_rows(rows)) is not None) == (case == "block")
    ours = K.linear(x, q, scale, block)
    assert ours.dtype == torch.bfloat16 and relative_error(ours, expected) < TOLERANCE
    with_bias = K.linear(x, q, scale, block, bias)
    assert relative_error(with_bias, expected + bias.float()) < TOLERANCE
    assert_replays_as_eager(x, q, scale, block)


@pytest.mark.parametrize("rows", [65, 80, 256, 300, 512, 2048])
def test_silu_mul_quantized_where_it_is_made_is_the_unfused_product(monkeypatch, rows):
    """silu_mul_linear (an FP8 down_proj on cuBLASLt, BLOCKSPEC_FP8_FUSED_SILU=1): silu_mul_quantize's codes and scales are
    quantize_rows' of silu_mul's output padded with zero rows, and the product is the unfused one's
    bits, eagerly and replayed in a CUDA graph."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch runs 1 x 128 block-scaled _scaled_mm on Hopper")
    from blockspec.kernels.fused import silu_mul
    monkeypatch.setattr(K, "FP8_GEMM", "cublas")
    monkeypatch.setattr(K, "FUSED_SILU_QUANTIZE", True)
    out_features, inter = 1536, 1024
    q, scale = weights(out_features, inter, fp8.ScaleBlock(), seed=9)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    padded = K.padded_rows(rows)
    fused_q, fused_s = K.silu_mul_quantize(gate_up, padded)
    ref_q, ref_s = K.quantize_rows(torch.nn.functional.pad(silu_mul(gate_up), (0, 0, 0, padded - rows)),
                                   column_major=True)
    assert torch.equal(fused_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(fused_s, ref_s)
    unfused = K.linear(silu_mul(gate_up), q, scale, fp8.ScaleBlock())
    assert torch.equal(K.silu_mul_linear(gate_up, q, scale, fp8.ScaleBlock()), unfused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.silu_mul_linear(gate_up, q, scale, fp8.ScaleBlock())
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    assert torch.equal(out, K.linear(silu_mul(gate_up), q, scale, fp8.ScaleBlock()))


@pytest.mark.parametrize("inter", [128, 96], ids=["aligned", "straddling"])
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
def test_fp8_experts_equal_the_dequantized_reference(inter, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + inter)
    num_experts, hidden = 16, 512
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5
    block = fp8.fused_scale_block((inter, inter))
    halves = [fp8.quantize(half) for half in gate_up.chunk(2, dim=1)]
    gate_up_q = torch.cat([q for q, _ in halves], dim=1)
    gate_up_s = torch.cat([fp8.part_scale_rows(s, inter, block) for _, s in halves], dim=1)
    down_q, down_s = fp8.quantize(down)
    scales = moe_kernels.ExpertScales(gate_up_s, down_s, block, fp8.ScaleBlock())
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights_, experts = route(torch.randn(num_tokens, num_experts, device="cuda", generator=gen), 4, normalize=True)
    expected = reference_experts(x.float(), weights_.float(), experts, fp8.dequantize(gate_up_q, gate_up_s, block),
                                 fp8.dequantize(down_q, down_s, fp8.ScaleBlock()))
    ours = moe_kernels.fused_experts(x, weights_.to(torch.bfloat16), experts, gate_up_q, down_q, None, scales)
    assert relative_error(ours, expected) < TOLERANCE
    # an e4m3 shared expert as the last slot (id num_experts), its scales laid out as one expert's
    # (layers/moe.py SparseMoE.shared_slot, BLOCKSPEC_FP8_SHARED_SLOT): routed + sigmoid(x · g) · shared(x)
    sh_halves = [fp8.quantize(half) for half in (torch.randn(2 * inter, hidden, device="cuda", generator=gen)
                                                 / hidden ** 0.5).chunk(2, dim=0)]
    sh_gate_up_q = torch.cat([q for q, _ in sh_halves], dim=0)
    sh_gate_up_s = torch.cat([fp8.part_scale_rows(s, inter, block) for _, s in sh_halves], dim=0)
    sh_down_q, sh_down_s = fp8.quantize(torch.randn(hidden, inter, device="cuda", generator=gen) / inter ** 0.5)
    g = (torch.randn(1, hidden, device="cuda", generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    slot = torch.sigmoid(x.float() @ g.float().T)
    shared = moe_kernels.SharedExpert(*sh_gate_up_q.chunk(2, dim=0), sh_down_q, g, sh_gate_up_s, sh_down_s)
    sh = fp8.dequantize(sh_gate_up_q, sh_gate_up_s, block)
    expected = expected + slot * ((torch.nn.functional.silu(x.float() @ sh[:inter].T) * (x.float() @ sh[inter:].T))
                                  @ fp8.dequantize(sh_down_q, sh_down_s, fp8.ScaleBlock()).T)
    ids = torch.cat([experts, torch.full((num_tokens, 1), num_experts, device="cuda", dtype=experts.dtype)], 1)
    ours = moe_kernels.fused_experts(x, torch.cat([weights_, slot], 1).to(torch.bfloat16), ids, gate_up_q, down_q,
                                     shared, scales)
    assert relative_error(ours, expected) < TOLERANCE
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        replayed = moe_kernels.fused_experts(static_x, torch.cat([weights_, slot], 1).to(torch.bfloat16), ids,
                                             gate_up_q, down_q, shared, scales)
    graph.replay()
    assert torch.equal(replayed, ours)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    import fixtures
    directory = tmp_path_factory.mktemp("tokenizer")
    fixtures.write_tokenizer_files(directory, "qwen3")
    return sorted(directory.iterdir())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_bf16_tail"])
def test_fp8_targets_decode_on_the_gpu_as_on_the_cpu(kind, tmp_path, tokenizer_files, monkeypatch):
    """The FP8 fixtures of tests/test_fp8_targets.py in fp32 on the GPU, graphed (the weight-only
    kernel at every width, FP8 experts, GDN's mixed in_proj, also with its bf16 rows in the e4m3
    rows' launch: BLOCKSPEC_FP8_BF16_TAIL): plain and DFlash, batched and alone, decode what the
    CPU's dequantizing reference decodes (which tests/test_fp8_targets.py holds equal to transformers)."""
    import fixtures
    import fp8_fixtures
    from test_fp8_targets import PROMPTS, VOCAB, hf_model, randomise

    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams

    tail = kind.endswith("_bf16_tail")                  # on by default: the plain kind keeps two GEMMs
    kind = kind.removesuffix("_bf16_tail")
    monkeypatch.setattr(K, "FP8_BF16_TAIL", tail)
    model = hf_model(kind)
    randomise(model)
    path = fp8_fixtures.write_fp8_checkpoint(tmp_path / kind, model)
    for file in tokenizer_files:
        shutil.copy(file, path / file.name)
    params = SamplingParams(max_tokens=16)
    cpu = LLM(str(path), device="cpu", show_progress=False)
    expected = [cpu.generate_ids(p, params).token_ids for p in PROMPTS]
    assert all(len(set(tokens)) > 3 for tokens in expected)
    draft = fixtures.write_dflash_draft(tmp_path / "draft", path, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
    for draft_dir, block_size in ((None, None), (str(draft), 8)):
        llm = LLM(str(path), draft=draft_dir, block_size=block_size, device="cuda", dtype="float32",
                  show_progress=False)
        assert llm.weight_format == "fp8_e4m3"
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected, block_size
        assert [llm.generate_ids(p, params).token_ids for p in PROMPTS] == expected, block_size
