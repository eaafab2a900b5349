"""The Triton fused MoE kernel on the GPU against the reference loop, at the real expert shapes
(Qwen3-30B-A3B: 128 experts, H 2048, I 768; Qwen3.5-35B-A3B: 256 experts, I 512), top-8.

Tolerances: fp32 (tl.dot in IEEE fp32, the reference in fp32 without TF32) max |Δ| ≤ 1e-4 ·
max |ref| (only the order of the sums differs); bf16 against the fp32 reference of the same
bf16-rounded inputs, max |Δ| ≤ 1e-2 · max |ref| (the reference's own bf16 run rounds after every
GEMM, the kernel once per GEMM in fp32 accumulation)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels import moe as K
from blockspec.layers.moe import reference_experts, route

SHAPES = {128: (2048, 768), 256: (2048, 512)}


def problem(num_experts: int, num_tokens: int, skewed: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed * 10**6 + num_tokens * 1000 + num_experts)
    hidden, inter = SHAPES[num_experts]
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    if skewed:                                       # every token chooses experts 0..7
        logits[:, :8] += 100.0
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5
    weights, experts = route(logits, 8, normalize=True)
    return [t.to(dtype) if t.is_floating_point() else t for t in (x, weights, experts, gate_up, down)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_experts", [128, 256])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 512])
@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "skewed"])
def test_fused_kernel_equals_the_reference(dtype, num_experts, num_tokens, skewed):
    x, weights, experts, gate_up, down = problem(num_experts, num_tokens, skewed, dtype)
    if skewed:
        assert experts.sort(dim=1).values.eq(torch.arange(8, device="cuda")).all()
    expected = reference_experts(*(t.float() if t.is_floating_point() else t
                                   for t in (x, weights, experts, gate_up, down)))
    ours = K.fused_experts(x, weights, experts, gate_up, down)
    assert ours.dtype == dtype and ours.shape == x.shape
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    assert ((ours.float() - expected).abs().max() / expected.abs().max()).item() < tolerance


@pytest.mark.parametrize("num_pairs", [8, 256, 4096])
def test_alignment_on_the_device_equals_the_torch_one(num_pairs):
    gen = torch.Generator(device="cuda").manual_seed(num_pairs)
    flat = torch.randint(0, 256, (num_pairs,), device="cuda", generator=gen)
    length = K.max_padded_pairs(num_pairs, 256, 16)
    reference = K.align_torch(flat, 256, 16, length)
    for ours, ref in zip(K.align(flat, 256, 16, length), reference):
        assert torch.equal(ours, ref)
    sorted_ids, ends, num_padded = reference
    real = sorted_ids[sorted_ids < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs, device="cuda", dtype=torch.int32))
    assert torch.equal(flat[real.long()], flat.sort().values)               # grouped by expert, in order
    assert int(num_padded) % 16 == 0 and int(num_padded) <= length


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_graphed_kernel_equals_eager_bit_for_bit(num_tokens):
    """Captured in a CUDA graph and replayed on new inputs (routing changes between replays)."""
    x, weights, experts, gate_up, down = problem(256, num_tokens, False, torch.bfloat16)
    static = [t.clone() for t in (x, weights, experts)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.fused_experts(*static, gate_up, down)                             # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.fused_experts(*static, gate_up, down)
    for seed in range(3):
        new_x, new_w, new_e, _, _ = problem(256, num_tokens, seed == 2, torch.bfloat16, seed)
        for dst, src in zip(static, (new_x, new_w, new_e)):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, K.fused_experts(new_x, new_w, new_e, gate_up, down))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_experts", [128, 256])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 512])
def test_fused_sparse_block_equals_the_reference(dtype, num_experts, num_tokens):
    """The whole block as the models run it on CUDA (router in one launch; Qwen3.5-35B-A3B's
    shared expert as a ninth slot). Routing: the same experts as torch.topk on the same logits
    (compared as the multiset of chosen logits, so that a tie between equal logits, which bf16
    makes possible, may go either way) with the same weights. Output: the reference loop plus
    the dense shared expert in fp32 on the same weights and the same routing."""
    from blockspec.config import MoeConfig
    from blockspec.layers.moe import SparseMoE
    hidden, inter = SHAPES[num_experts]
    config = MoeConfig(num_experts=num_experts, num_experts_per_tok=8, moe_intermediate_size=inter,
                       normalize=True, shared_expert_intermediate_size=inter if num_experts == 256 else 0)
    torch.manual_seed(num_tokens)
    layer = SparseMoE(hidden, config).cuda()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
    layer = layer.to(dtype)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    logits = layer.gate(x)
    weights, ids, _ = K.route_fused(logits, x, 8, True, None)
    ref_weights, ref_ids = route(logits, 8, True)
    assert torch.equal(logits.gather(1, ids.long()).sort(1).values, logits.gather(1, ref_ids).sort(1).values)
    assert (weights.float().sort(1).values - ref_weights.float().sort(1).values).abs().max() < 1e-2
    layer.kernel = K.fused_experts
    ours = layer(x).float()
    f = {name: p.float() for name, p in layer.named_parameters()}
    expected = reference_experts(x.float(), weights.float(), ids.long(), f["experts.gate_up_proj"],
                                 f["experts.down_proj"])
    if layer.has_shared_expert:
        expected += layer.float().gated_shared_expert(x.float())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((ours - expected).abs().max() / expected.abs().max()).item() < tolerance


def qwen35_sparse_layer(num_tokens: int, shared: bool, seed: int):
    """A bf16 sparse block of Qwen3.5-35B-A3B's shape on the fused kernels (random weights; the shared
    expert, of the experts' size, riding as a slot where `shared`), and `num_tokens` random inputs."""
    from blockspec.config import MoeConfig
    from blockspec.layers.moe import SparseMoE
    hidden, inter = SHAPES[256]
    config = MoeConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=inter, normalize=True,
                       shared_expert_intermediate_size=inter if shared else 0)
    torch.manual_seed(seed)
    layer = SparseMoE(hidden, config).cuda()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
    layer = layer.to(torch.bfloat16)
    layer.kernel = K.fused_experts
    return layer, torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)


def replays_as(layer, x: torch.Tensor, eager, first_seed: int) -> None:
    """The layer captured in a CUDA graph over a static copy of x, then three times: fresh inputs, a
    replay, its output bit for bit `eager`'s on the same inputs, every arrival count back at 0."""
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for seed in range(3):
        torch.manual_seed(first_seed + seed)
        static.copy_(torch.randn_like(static))
        graph.replay()
        assert torch.equal(out, eager(static)), seed
        assert int(K.arrival_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("num_tokens", [1, 7, 32, 512])
@pytest.mark.parametrize("shared", [False, True], ids=["experts", "shared_slot"])
def test_arrivals_give_the_same_bits_in_fewer_launches(num_tokens, shared):
    """BLOCKSPEC_MOE_ARRIVALS: routing + alignment in one launch and the slot sum in the down
    GEMM's, eager and replayed from a CUDA graph, equal the separate launches bit for bit (each
    pair's row is the same kernel's; the slots are added in order in fp32, as torch's sum), and
    every arrival count is back at 0 after each launch."""
    layer, x = qwen35_sparse_layer(num_tokens, shared, seed=num_tokens)
    before = K.ARRIVALS
    try:
        K.ARRIVALS = False
        separate = layer(x)
        K.ARRIVALS = True
        assert torch.equal(layer(x), separate)
        assert int(K.arrival_counters(x.device).abs().sum()) == 0
        def in_separate_launches(inputs: torch.Tensor) -> torch.Tensor:
            K.ARRIVALS = False
            try:
                return layer(inputs)
            finally:
                K.ARRIVALS = True
        replays_as(layer, x, in_separate_launches, first_seed=100)
    finally:
        K.ARRIVALS = before


@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_split_k_parts_sum_to_the_whole_and_replay_the_same(num_tokens, parts):
    """BLOCKSPEC_MOE_SPLIT_K: the gate/up GEMM's K (2,048, 16 tiles) in parts, each part's fp32 sums
    added in part order by the tile's last part: within bf16's rounding of the unsplit launch,
    deterministic (a CUDA-graph replay gives the eager bits), every count back at 0."""
    layer, x = qwen35_sparse_layer(num_tokens, True, seed=num_tokens + parts)
    before = K.SPLIT_K
    try:
        K.SPLIT_K = 1
        whole = layer(x)
        K.SPLIT_K = parts
        parted = layer(x)
        assert ((parted.float() - whole.float()).abs().max() / whole.float().abs().max()).item() < 2e-2
        assert int(K.arrival_counters(x.device).abs().sum()) == 0
        replays_as(layer, x, layer, first_seed=200)
    finally:
        K.SPLIT_K = before
