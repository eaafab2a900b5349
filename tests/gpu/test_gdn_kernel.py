"""The Gated DeltaNet step kernel (blockspec/kernels/gdn.py) on the GPU: real head sizes, fp32
and bf16, ragged rows, against its torch reference; and whole hybrid models decoding the same
tokens with the kernel as with the torch path (plain, graphed, DFlash)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.gdn import gdn_step
from blockspec.models.gated_delta import reference_step
from blockspec.models import gated_delta

from gdn_cases import make_case

CUDA = torch.device("cuda")


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all()
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [[1], [1] * 32, [8] * 32, [16, 1, 0, 9, 3]])
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
def test_step_kernel_matches_reference(dtype, tolerance, rows, with_norm):
    """Qwen3.5's GDN heads (16 key / 32 value heads of 128, conv 4): output rows, per-step states
    and stashed conv inputs of a verify (pools untouched), and a plain step's advanced pools,
    each sequence in its own slot; with_norm: the gated output norm fused in the kernel."""
    case = make_case(rows, num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, num_slots=len(rows) + 3,
                     dtype=dtype, device=CUDA, seed=len(rows), with_norm=with_norm)
    for keep in (True, False):
        got_pools = (case["conv_pool"].clone(), case["ssm_pool"].clone())
        ref_pools = (case["conv_pool"].clone(), case["ssm_pool"].clone())
        out, steps, stash = gdn_step(**dict(case, conv_pool=got_pools[0], ssm_pool=got_pools[1]), keep_steps=keep)
        ref_out, ref_steps, ref_stash = reference_step(**dict(case, conv_pool=ref_pools[0], ssm_pool=ref_pools[1]),
                                                       keep_steps=keep)
        assert out.dtype == dtype and relative(out, ref_out) < tolerance, keep
        if keep:
            width = [b - a for a, b in zip(case["cu_seqlens"][:-1].tolist(), case["cu_seqlens"][1:].tolist())]
            assert steps.dtype == torch.float32 and steps.shape[:2] == (len(rows), max(rows))
            for i, n in enumerate(width):                     # rows past a sequence's own are not written
                assert n == 0 or relative(steps[i, :n], ref_steps[i, :n]) < tolerance, i
                assert torch.equal(stash[i, :, :3 + n], ref_stash[i, :, :3 + n]), i
            assert torch.equal(got_pools[0], case["conv_pool"]) and torch.equal(got_pools[1], case["ssm_pool"])
        else:
            assert torch.equal(got_pools[0], ref_pools[0])
            assert relative(got_pools[1], ref_pools[1]) < tolerance


def test_step_kernel_under_a_graph_equals_eager():
    """Captured once, replayed on new inputs: the same results as an eager call (no host sync,
    nothing sized from the data)."""
    case = make_case([8] * 4, num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, num_slots=6,
                     dtype=torch.bfloat16, device=CUDA, with_norm=True)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    static["norm"] = (case["norm"][0], case["norm"][1].clone(), case["norm"][2])
    static["mixed"], static["a"], static["b"] = case["mixed"].clone(), case["a"].clone(), case["b"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gdn_step(**static, keep_steps=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = gdn_step(**static, keep_steps=True)
    fresh = make_case([8] * 4, num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, num_slots=6,
                      dtype=torch.bfloat16, device=CUDA, seed=5)
    for name in ("mixed", "a", "b", "ssm_pool", "conv_pool"):
        static[name].copy_(fresh[name])
    fresh_z = make_case([8] * 4, num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, num_slots=6,
                        dtype=torch.bfloat16, device=CUDA, seed=5, with_norm=True)["norm"][1]
    static["norm"][1].copy_(fresh_z)
    graph.replay()
    expected = gdn_step(**dict(static), keep_steps=True)
    for got, ref in zip(results, expected):
        assert torch.equal(got, ref)


def decode(target, draft=None, block_size=None, kernel=True, fuse_norm=True, **kwargs) -> list[list[int]]:
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    from test_hybrid import HYBRID_PROMPTS
    previous = gated_delta.STEP_KERNEL, gated_delta.FUSE_NORM
    gated_delta.STEP_KERNEL, gated_delta.FUSE_NORM = kernel, fuse_norm
    try:
        llm = LLM(str(target), draft=None if draft is None else str(draft), block_size=block_size, device="cuda",
                  dtype="float32", show_progress=False, **kwargs)
        prompts = [HYBRID_PROMPTS["short"], HYBRID_PROMPTS["long"], [3, 4, 5]]
        return [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=24))]
    finally:
        gated_delta.STEP_KERNEL, gated_delta.FUSE_NORM = previous


def test_hybrid_step_kernel_equals_torch_path(tmp_path):
    """fp32 tiny Qwen3.5: greedy tokens with the step kernel (eager and graphed, norm fused or not, DFlash 4 / 16
    verifying through its per-step states) equal the torch path's plain eager decoding."""
    import fixtures
    target = fixtures.write_hybrid_checkpoint(tmp_path / "target")
    draft = fixtures.write_dflash_draft(tmp_path / "draft", target, target_layer_ids=[0, 2],
                                        mask_token_id=fixtures.HYBRID_VOCAB - 1)
    expected = decode(target, kernel=False, cuda_graphs=False)
    assert len({t for row in expected for t in row}) > 3
    assert decode(target, cuda_graphs=False) == expected
    assert decode(target, fuse_norm=False) == expected
    assert decode(target) == expected
    for block_size in (4, 16):
        assert decode(target, draft, block_size) == expected, block_size
