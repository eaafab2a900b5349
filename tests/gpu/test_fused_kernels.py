"""The fused Triton kernels (blockspec/kernels/fused.py) against their torch forms, and whole
models decoded with them against the unfused torch path (fp32, greedy: token for token).

Run on the GPU; `TRITON_INTERPRET=1 BLOCKSPEC_FUSED_TEST_DEVICE=cpu pytest tests/gpu/test_fused_kernels.py -k kernel`
runs the kernel checks on a CPU through Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

from blockspec.kernels import fused

DEVICE = torch.device(os.environ.get("BLOCKSPEC_FUSED_TEST_DEVICE", "cuda"))
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


def assert_near(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: reduction order and libm ulps only. bf16: the kernels round where torch rounds, so a
    few elements differ, each by one or two rounding steps (an ulp of an intermediate carried
    through one more rounded product)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    got, ref = got.float(), ref.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, ref, rtol=2 ** -6, atol=1e-2)
        assert (got != ref).float().mean() < 0.02          # nearly all bits equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 4096), (7, 100), (33, 2560), (3, 5120)])
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_kernel(dtype, rows, cols, zero_centred, with_residual):
    x = randn(rows, cols, dtype=dtype, seed=1)
    residual = randn(rows, cols, dtype=dtype, seed=2) if with_residual else None
    weight = randn(cols, dtype=dtype, seed=3) * 0.1 + (0 if zero_centred else 1)
    normed, summed = fused.add_rms_norm_triton(x, residual, weight, 1e-6, zero_centred)
    ref_normed, ref_summed = fused.add_rms_norm_torch(x, residual, weight, 1e-6, zero_centred)
    assert torch.equal(summed, ref_summed)                      # one rounded add on both sides
    assert_near(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 12288), (5, 100), (16, 3072), (2, 1)])
def test_silu_mul_kernel(dtype, rows, cols):
    gate_up = randn(rows, 2 * cols, dtype=dtype, seed=4) * 3
    assert_near(fused.silu_mul_triton(gate_up), fused.silu_mul_torch(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, dim", [(1, 32, 128), (16, 32, 128), (256, 32, 128), (7, 3, 100)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
def test_gated_rms_norm_kernel(dtype, rows, heads, dim, layout):
    """The GDN output norm's one kernel against its twelve torch ops (a verify's z is a view of
    the projection, sliced after any prefill rows: copied to one aligned layout first)."""
    x = randn(rows, heads, dim, dtype=dtype, seed=5)
    weight = randn(dim, dtype=dtype, seed=6) * 0.1 + 1
    wide = randn(rows + 1, heads, 2 * dim, dtype=dtype, seed=7) * 3
    gate = {"contiguous": wide[:rows, :, :dim].contiguous(), "strided": wide[:rows, :, dim:],
            "offset": wide.reshape(-1)[1: 1 + rows * heads * dim].view(rows, heads, dim)}[layout]
    assert_near(fused.gated_rms_norm_triton(x, weight, gate, 1e-6), fused.gated_rms_norm_torch(x, weight, gate, 1e-6),
                dtype)


QK_CASES = {   # (q heads, kv heads, head dim, rotary dims, q head stride factor, norm)
    "qwen3": (8, 2, 128, 128, 1, "plain"),
    "qwen3.5-gated-partial": (4, 1, 64, 16, 2, "zero_centred"),
    "qwen2-no-norm": (6, 2, 96, 96, 1, None),
    "context-only": (0, 3, 128, 128, 1, "plain"),
    "odd-head-dim": (3, 3, 80, 40, 1, "plain"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(QK_CASES))
@pytest.mark.parametrize("to_pool", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_qk_norm_rope_kernel(dtype, case, to_pool, num_tokens):
    num_q, num_kv, head_dim, rot, stride_factor, norm = QK_CASES[case]
    q_stride = head_dim * stride_factor
    qkv = randn(num_tokens, num_q * q_stride + 2 * num_kv * head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 4000, (num_tokens,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=DEVICE) / rot))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]        # [N, 1, rot] as the models pass
    q_norm = k_norm = None
    if norm is not None:
        q_norm = randn(head_dim, dtype=dtype, seed=7) * 0.1 + (norm == "plain")
        k_norm = randn(head_dim, dtype=dtype, seed=8) * 0.1 + (norm == "plain")
    results = []
    for run in (fused.qk_norm_rope_triton, fused.qk_norm_rope_torch):
        store = None
        if to_pool:
            pools = (torch.zeros(64, num_kv, head_dim, dtype=dtype, device=DEVICE),
                     torch.zeros(64, num_kv, head_dim, dtype=dtype, device=DEVICE))
            slots = torch.randperm(64, generator=torch.Generator().manual_seed(9))[:num_tokens].to(DEVICE)
            store = (*pools, slots)
        q, k, v = run(qkv, num_q, num_kv, head_dim, q_stride, q_norm, k_norm, 1e-6, norm == "zero_centred",
                      cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1), store)
        if to_pool:
            assert k is None and v is None
            k, v = store[0], store[1]
        results.append((q, k, v))
    (q, k, v), (ref_q, ref_k, ref_v) = results
    if num_q:
        assert_near(q, ref_q.contiguous(), dtype)
    else:
        assert q is None and ref_q is None
    assert_near(k, ref_k.contiguous(), dtype)
    assert torch.equal(v, ref_v)                                # a copy on both sides


def test_training_keeps_autograd():
    """The kernels have no backward: with gradients wanted the ops take the torch path."""
    x = randn(3, 64, dtype=torch.float32, seed=10).requires_grad_()
    weight = torch.ones(64, device=DEVICE)
    normed, _ = fused.add_rms_norm(x, None, weight, 1e-6)
    assert normed.grad_fn is not None
    with torch.no_grad():
        assert fused.add_rms_norm(x, None, weight, 1e-6)[0].grad_fn is None


# ---------------------------------------------------------------------------------------------
# whole models: fused (Triton) == unfused (torch) token for token, fp32, greedy

PROMPT = [int(t) for t in torch.randint(0, 250, (60,), generator=torch.Generator().manual_seed(11))]
PROMPTS = [PROMPT, PROMPT[:9], [5, 6, 7]]


def generate(target, draft=None, block_size=None, enabled=True, **kwargs) -> list[list[int]]:
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    previous = fused.set_enabled(enabled)
    try:
        llm = LLM(str(target), draft=None if draft is None else str(draft), block_size=block_size, device="cuda",
                  dtype="float32", show_progress=False, **kwargs)
        return [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(max_tokens=32))]
    finally:
        fused.set_enabled(previous)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="models run on the GPU")
def test_dense_fused_equals_unfused(qwen3_dir, qwen3_draft_dir):
    reference = generate(qwen3_dir, enabled=False, cuda_graphs=False)
    assert generate(qwen3_dir) == reference
    for block_size in (4, 16):
        assert generate(qwen3_dir, qwen3_draft_dir, block_size) == reference, block_size


@pytest.mark.skipif(DEVICE.type != "cuda", reason="models run on the GPU")
def test_hybrid_fused_equals_unfused(tmp_path):
    import fixtures
    target = fixtures.write_hybrid_checkpoint(tmp_path / "hybrid")
    reference = generate(target, enabled=False, cuda_graphs=False)
    assert generate(target) == reference
