"""GPU-only checks, run on the lent H200 (CI has no GPU; conftest collects this folder only
where CUDA is available). Their output is recorded in BENCHMARKS.md."""
from __future__ import annotations

import pytest
import torch

from blockspec.engine.cuda_graphs import StaticDraft, StaticTarget
from blockspec.engine.plain import generate_plain
from blockspec.engine.request import Request
from blockspec.engine.speculative import generate_dflash
from blockspec.loader import load_draft, load_model
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


def decode(model, draft=None, block_size=None, max_tokens=40) -> list[int]:
    request = Request("r", PROMPT, SamplingParams(max_tokens=max_tokens), frozenset(), 1024)
    events = generate_plain(model, request) if draft is None else generate_dflash(model, draft, request, block_size)
    for _ in events:
        pass
    return request.output_ids


def test_cuda_graphs_equal_eager(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir), device="cuda", dtype="float32").model
    draft = load_draft(str(qwen3_draft_dir), target)
    reference = decode(target)
    graphed = StaticTarget(target, max_len=1024, max_width=16, capture_layers=draft.target_layer_ids)
    graphed_draft = StaticDraft(draft, max_len=1024, max_block=16)
    assert graphed.graphs.enabled and graphed_draft.graphs.enabled
    assert decode(graphed) == reference
    for block_size in (1, 4, 16):
        assert decode(graphed, graphed_draft, block_size) == reference, block_size
        assert decode(target, draft, block_size) == reference, block_size
