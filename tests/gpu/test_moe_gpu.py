"""GPU-only checks of the MoE path (collected only where CUDA is available). Written without a
GPU at hand: not yet run."""
from __future__ import annotations

import pytest
import torch

import fixtures
from blockspec.layers.moe import gathered_experts, grouped_experts, reference_experts, route
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams

from test_moe import PROMPT, VOCAB, hf_model, randomise


@pytest.mark.parametrize("num_tokens", [1, 16, 128, 2048])
def test_cuda_kernels_agree_with_the_reference(num_tokens):
    """Real-shape experts (Qwen3.5-35B-A3B: H 2048, I 512, 256 experts, top-8)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_experts, hidden, inter = 256, 2048, 512
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5
    weights, experts = route(logits, 8, normalize=True)
    expected = reference_experts(x, weights, experts, gate_up, down)
    if num_tokens <= 128:                       # N·k gathered weight copies: small batches only
        assert (gathered_experts(x, weights, experts, gate_up, down) - expected).abs().max() < 1e-3
    grouped = grouped_experts(x.bfloat16(), weights.bfloat16(), experts, gate_up.bfloat16(), down.bfloat16()).float()
    assert ((grouped - expected).abs().max() / expected.abs().max()).item() < 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_graphs_equal_eager(tmp_path, dtype):
    """Tiny Qwen3.5-MoE: graphed batches decode what eager decodes (fp32: plain and DFlash 4 and
    16, the gathered kernel; bf16: plain, the grouped kernel; in bf16 a verify's different
    shapes may round differently from plain steps, so DFlash is held to plain in fp32 only)."""
    ref = hf_model("qwen3_5_moe")
    randomise(ref)
    ref.save_pretrained(tmp_path / "target")
    fixtures.write_tokenizer_files(tmp_path / "target", "qwen3")
    draft = fixtures.write_dflash_draft(tmp_path / "draft", tmp_path / "target", target_layer_ids=[0, 2],
                                        mask_token_id=VOCAB - 1)
    prompts = [PROMPT, PROMPT[:7], [5, 6, 7]]
    params = SamplingParams(max_tokens=30)
    eager = LLM(str(tmp_path / "target"), device="cuda", dtype=dtype, cuda_graphs=False, show_progress=False)
    expected = [r.token_ids for r in eager.generate(prompts, params)]
    for block_size in (1, 4, 16) if dtype == "float32" else (1,):
        llm = LLM(str(tmp_path / "target"), draft=str(draft) if block_size > 1 else None,
                  block_size=block_size if block_size > 1 else None, device="cuda", dtype=dtype,
                  show_progress=False)
        assert llm.engine.runner.graphs.capture
        assert [r.token_ids for r in llm.generate(prompts, params)] == expected, block_size
