"""The Triton paged attention kernels against the torch reference on the GPU (CI has no GPU;
tests/test_attention_interpreter.py runs a few of these cases on the CPU interpreter).

Tolerances, against the reference computed in fp64 on the same inputs: fp32 inputs 2e-5
(IEEE fp32 dots, fp32 online softmax), bf16 inputs 2e-2 (the kernel multiplies the
probabilities in bf16, as flash attention does; outputs are O(1)). Every case runs twice: with
the batch's longest length as the key bound (eager) and with a CUDA graph's bound (the pool's
capacity, 8192 keys), which splits the keys and leaves most programs past the live length.
"""
from __future__ import annotations

import pytest
import torch

from attention_cases import kernel, make_case, real_rows, reference

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
RAGGED = {1: [1], 3: [17, 5, 300], 32: [(37 * i) % 700 + 16 for i in range(32)]}   # not multiples of 16


def check(case, dtype):
    expected = real_rows(case, reference(case))
    for bound in (None, 8192):
        out = kernel(case, bound)
        assert out.dtype == dtype and out.shape == (case.q.shape[0], case.q.shape[1] * case.q.shape[2])
        assert torch.isfinite(out).all()                                   # padding rows too
        err = (real_rows(case, out).double() - expected).abs().max().item()
        assert err < TOLERANCE[dtype], (bound, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3, 32])
@pytest.mark.parametrize("width", [1, 4, 16])
def test_target_batches(dtype, num_seqs, width):
    """Decode (T = 1) and verify blocks, causal inside the block, ragged lengths, Qwen3-8B heads."""
    lens = [n + width for n in RAGGED[num_seqs]]
    check(make_case(lens, width, 32, 8, 128, dtype, "cuda", seed=num_seqs * width), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flat_ragged_step(dtype):
    """One step of the ragged engine: prefill chunks of two sequences (a 2048-token chunk, 300
    more of a long prompt), plain decode rows and verify rows of every width 2 … 16."""
    widths = [2048, 300, 1, 1] + list(range(2, 17))
    lens = [2048, 5000, 40, 7000] + [(97 * i) % 3000 + w for i, w in enumerate(range(2, 17))]
    check(make_case(lens, max(widths), 32, 8, 128, dtype, "cuda", widths=widths, seed=11), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_groups_and_head_sizes(dtype, group, head_dim):
    """GQA groups 1 / 4 / 8 at every head size (256: Qwen3.5), with graph padding rows."""
    case = make_case([9, 130, 48], 4, 4 * group, 4, head_dim, dtype, "cuda", num_padding=2, seed=group + head_dim)
    check(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3, 32])
@pytest.mark.parametrize("width", [4, 16])
def test_draft_blocks(dtype, num_seqs, width):
    """The draft: non-causal over its committed context (shorter than the block for some) plus
    its own block's K/V, never cached; padding rows with no context at all."""
    lens = [min(n, 3) if i == 0 else n for i, n in enumerate(RAGGED[num_seqs])]
    case = make_case(lens, width, 32, 8, 128, dtype, "cuda", draft=True, num_padding=1, seed=num_seqs + width)
    check(case, dtype)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_draft_causal_and_prefill_chunk(head_dim):
    """A draft forced causal (DFlash 2 style flags, no window), and a prefill chunk (B = 1,
    T = 300 after 200 cached positions)."""
    check(make_case([2, 40], 16, 16, 4, head_dim, torch.bfloat16, "cuda", draft=True, is_causal=True), torch.bfloat16)
    check(make_case([500], 300, 16, 2, head_dim, torch.float32, "cuda", seed=5), torch.float32)


@pytest.mark.parametrize("backend", ["triton-fa", "flash"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("group", [4, 2])
def test_long_prefill_chunks_take_flash_attention(monkeypatch, backend, head_dim, group):
    """A ragged step whose long prefill chunks (≥ LONG_PREFILL_ROWS) go to the FlashAttention form
    (kernels/flash_prefill.py: our Triton kernel, or FlashAttention-2) and the rest (a short chunk
    after them, decode and verify rows, padding) to the paged kernel: bf16 within the kernels'
    tolerance of the reference, and the routing really taken (a 2,048-row chunk over 16k keys, a
    512-row one, Qwen3-8B / 3.5 heads)."""
    from blockspec.kernels import flash_prefill, prefill_attention
    from blockspec.layers import attention
    monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", backend)
    widths = [2048, 40, 512, 60, 1, 3, 16]
    context = [16384, 9000, 4608, 70, 300, 2000, 5000]
    case = make_case(context, max(widths), 8 * group, 8 // (group // 2), head_dim, torch.bfloat16, "cuda",
                     widths=widths, num_padding=1, seed=head_dim + group)
    case.meta.num_prefill_seqs, case.meta.context_lens_host = 4, context + [max(widths)]
    calls, ours = [], []
    real, real_ours = flash_prefill.attend, prefill_attention.varlen_causal_triton
    monkeypatch.setattr(flash_prefill, "attend", lambda *a: calls.append(a[0].head) or real(*a))
    monkeypatch.setattr(prefill_attention, "varlen_causal_triton", lambda *a: ours.append(1) or real_ours(*a))
    out = attention.paged_attention(case.q, case.k_pool, case.v_pool, case.meta, case.meta.context_lens,
                                    case.scale, True)
    assert calls == [3], "the step's long chunks did not take FlashAttention"
    assert ours == ([1] if backend == "triton-fa" else []), "the backend was not the one asked for"
    err = (real_rows(case, out).double() - real_rows(case, reference(case))).abs().max().item()
    assert err < TOLERANCE[torch.bfloat16], err
    monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", "triton")
    case.meta.shared.clear()                        # another forward: its routing planned anew
    triton_out = attention.paged_attention(case.q, case.k_pool, case.v_pool, case.meta, case.meta.context_lens,
                                           case.scale, True)
    assert calls == [3]
    assert (real_rows(case, triton_out) - real_rows(case, out)).abs().max().item() < TOLERANCE[torch.bfloat16]


def test_dispatch_and_reference_switch(monkeypatch):
    """paged_attention picks the kernels on CUDA, the reference when BLOCKSPEC_ATTENTION=reference
    or a sliding window is asked for; both agree."""
    from blockspec.layers import attention
    case = make_case([40, 7], 4, 8, 2, 128, torch.float32, "cuda")
    calls = []
    real = attention.reference_paged_attention
    monkeypatch.setattr(attention, "reference_paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = (case.q, case.k_pool, case.v_pool, case.meta, case.meta.context_lens, case.scale, True)
    fast = attention.paged_attention(*args)
    assert calls == []
    attention.paged_attention(*args, window=4)
    assert calls == [1]
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "reference")
    slow = attention.paged_attention(*args)
    assert calls == [1, 1]
    assert (fast - slow).abs().max() < 1e-4


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])          # SmolLM2's, Qwen3-8B's
def test_batch_invariant_attention_gives_a_row_the_same_bits_in_any_call(monkeypatch, heads):
    """BLOCKSPEC_BATCH_INVARIANT (kernels.attention.BATCH_INVARIANT): one bf16 query row, the last
    of a verify block over 3,000 keys, has the same output bits decoded alone, under a graph's
    key bound, among 32 sequences, and as a row of a verify of 3 or 8 (tests/test_attention_interpreter.py
    holds the same in fp16 on the CPU); the bf16 DFlash-vs-plain differences of BENCHMARKS.md's round 44."""
    from blockspec.kernels import attention
    num_heads, num_kv_heads, head_dim = heads
    keys, width = 3000, 8
    case = make_case([keys], width, num_heads, num_kv_heads, head_dim, torch.bfloat16, "cuda", seed=3)
    m = case.meta

    def row(rows: list[int], bound: int | None = None, copies: int = 1) -> torch.Tensor:
        n = len(rows)
        out = attention.paged_attention(
            case.q[rows].repeat(copies, 1, 1), case.k_pool, case.v_pool, m.block_tables.repeat(copies, 1),
            torch.full((copies,), keys - (width - 1 - rows[-1]), device="cuda"), m.positions[rows].repeat(copies),
            torch.arange(copies + 1, device="cuda") * n, n, m.page_size, bound or keys, case.scale, True, None)
        return out[n - 1]
    monkeypatch.setattr(attention, "BATCH_INVARIANT", True)
    alone = row([width - 1])
    for rows, bound, copies in (([width - 1], 8192, 1), ([width - 1], 8192, 32), (list(range(width)), None, 1),
                                (list(range(width)), 8192, 32), ([5, 6, 7], None, 1)):
        assert torch.equal(row(rows, bound, copies), alone), (len(rows), bound, copies)
    err = (alone.double() - reference(case)[-1]).abs().max().item()
    assert err < TOLERANCE[torch.bfloat16], err
