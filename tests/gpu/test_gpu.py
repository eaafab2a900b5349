"""GPU-only checks, run on the lent H200 (CI has no GPU; conftest collects this folder only
where CUDA is available). Their output is recorded in BENCHMARKS.md."""
from __future__ import annotations

import pytest
import torch

from blockspec.llm import LLM
from blockspec.models.gated_delta import recurrent_gated_delta_rule, select_kernels
from blockspec.sampling import SamplingParams

from test_hybrid import gdn_inputs

PROMPT = [int(t) for t in torch.randint(0, 151643, (100,), generator=torch.Generator().manual_seed(9))]


@pytest.mark.parametrize("num_tokens", [1, 6, 200])
def test_fla_kernels_agree_with_torch(num_tokens):
    """The fast paths against the torch reference (chunk in TF32: looser)."""
    cuda = torch.device("cuda")
    q, k, v, g, beta, state = (x.to(cuda) for x in gdn_inputs(num_tokens, k_dim=128, v_dim=128))
    state = 0.1 * state
    kernels = select_kernels(cuda)
    out, final, steps = recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_steps=True)
    chunk_out, chunk_final = kernels.chunk(q, k, v, g, beta, state)
    fused_out, fused_final, no_steps = kernels.recurrent(q, k, v, g, beta, state, False)
    step_out, step_final, fla_steps = kernels.recurrent(q, k, v, g, beta, state, True)
    assert no_steps is None and fla_steps.shape == steps.shape
    assert (chunk_out - out).abs().max() < 1e-2 and (chunk_final - final).abs().max() < 1e-2
    for a, b in ((fused_out, out), (fused_final, final), (step_out, out), (fla_steps, steps)):
        assert (a - b).abs().max() < 1e-5


def run(llm, prompts, max_tokens=40) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]


PROMPTS = [PROMPT, PROMPT[:7], PROMPT[:33] * 2, [5, 6, 7]]


def test_cuda_graphs_equal_eager_for_batches(qwen3_dir, qwen3_draft_dir):
    """fp32 on the GPU: every graphed batch (plain and DFlash at several block sizes) decodes
    what the eager engine decodes, and what each prompt decodes alone."""
    eager = LLM(str(qwen3_dir), device="cuda", dtype="float32", cuda_graphs=False, show_progress=False)
    alone = [run(eager, [p])[0] for p in PROMPTS]
    assert run(eager, PROMPTS) == alone
    graphed = LLM(str(qwen3_dir), device="cuda", dtype="float32", show_progress=False)
    assert graphed.engine.runner.graphs.capture
    assert run(graphed, PROMPTS) == alone
    for block_size in (2, 4, 16):
        spec = LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=block_size, device="cuda",
                   dtype="float32", show_progress=False)
        assert run(spec, PROMPTS) == alone, block_size
        assert any(kind == "propose" and static.graph is not None
                   for (kind, _, _), static in spec.engine.runner.graphs.full.items())


def test_hybrid_graphs_equal_eager(tmp_path):
    """A tiny Qwen3.5 (fp32) on the GPU: graphed batches (plain, DFlash 4 and 16) decode what the
    eager plain engine decodes, prompt by prompt (fla's kernels on both sides)."""
    import fixtures
    from test_hybrid import HYBRID_PROMPTS
    fixtures.write_hybrid_checkpoint(tmp_path / "target")
    draft_dir = fixtures.write_dflash_draft(tmp_path / "draft", tmp_path / "target", target_layer_ids=[0, 2],
                                            mask_token_id=fixtures.HYBRID_VOCAB - 1)
    prompts = [HYBRID_PROMPTS["short"], HYBRID_PROMPTS["long"], [3, 4, 5]]
    params = SamplingParams(max_tokens=24)

    def decode(draft, block_size, graphs):
        llm = LLM(str(tmp_path / "target"), draft=draft, block_size=block_size, device="cuda",
                  dtype="float32", cuda_graphs=graphs, show_progress=False)
        return [r.token_ids for r in llm.generate(prompts, params)]
    expected = decode(None, None, False)
    assert len({t for row in expected for t in row}) > 3
    for draft, block_size in ((None, None), (str(draft_dir), 4), (str(draft_dir), 16)):
        for graphs in (False, True):
            assert decode(draft, block_size, graphs) == expected, (block_size, graphs)


def test_dflash2_graphs_equal_eager(qwen3_dir, tmp_path):
    """A DFlash 2 draft on the GPU (fp32): the propose graph (convs, selector, greedy walk on the
    device) decodes what plain decoding does, batched, at block sizes 2, 3 and 16; a sampling
    sequence walks outside the graph and runs too."""
    import fixtures
    draft_dir = fixtures.write_dflash2_draft(tmp_path / "d2", qwen3_dir)
    plain = LLM(str(qwen3_dir), device="cuda", dtype="float32", show_progress=False)
    alone = [run(plain, [p])[0] for p in PROMPTS]
    for block_size in (2, 3, 16):
        spec = LLM(str(qwen3_dir), draft=str(draft_dir), block_size=block_size, device="cuda", dtype="float32",
                   show_progress=False)
        assert run(spec, PROMPTS) == alone, block_size
        assert any(kind == "propose" and static.graph is not None
                   for (kind, _, _), static in spec.engine.runner.graphs.full.items())
    sampled = spec.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.8, seed=3))
    assert all(r.token_ids for r in sampled)
