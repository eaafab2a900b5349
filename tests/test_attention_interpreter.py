"""The Triton attention kernels under Triton's CPU interpreter, against the torch reference.

Runs only where Triton is installed (CI has none: it is a CUDA-side dependency); the full
matrix (bf16, real head sizes, large batches) is tests/gpu/test_attention_kernels.py. The
interpreter's flag is read when triton.language is imported, so the cases run in a child
process (~5 s); its bf16 tl.dot is wrong (triton 3.9), so only fp32 / fp16 here.
"""
from __future__ import annotations

import json

import pytest

from helpers import run_interpreted

pytest.importorskip("triton")

CHILD = """
import json, torch
from attention_cases import make_case, real_rows, reference, kernel
cases = {
    "decode": dict(context_lens=[5, 40, 17], width=1, num_heads=8, num_kv_heads=2),
    # five and three chunks of 64 keys a program, unsplit
    "long-context": dict(context_lens=[300, 150], width=2, num_heads=4, num_kv_heads=2),
    "verify-ragged": dict(context_lens=[4, 33, 20], width=4, num_heads=8, num_kv_heads=2),
    "verify-mha-padding": dict(context_lens=[16, 9], width=4, num_heads=4, num_kv_heads=4, num_padding=2),
    "prefill-chunk": dict(context_lens=[70], width=40, num_heads=4, num_kv_heads=1),
    "draft": dict(context_lens=[0, 3, 50], width=4, num_heads=8, num_kv_heads=2, draft=True, num_padding=1),
    "draft-causal": dict(context_lens=[3, 21], width=4, num_heads=4, num_kv_heads=2, draft=True, is_causal=True),
    # one flat ragged step: two prefill chunks, a plain decode row and verify rows of widths 3 and 5
    "ragged-step": dict(context_lens=[40, 70, 9, 33, 20], width=40, widths=[40, 23, 1, 3, 5], num_heads=8,
                        num_kv_heads=2),
}
errors = {}
for name, spec in cases.items():
    case = make_case(**spec, head_dim=32, dtype=torch.float32, device="cpu")
    for bound in (None, 1024):       # eager bound, and a CUDA graph's (the pool's capacity: split-K)
        out = kernel(case, bound)
        err = (real_rows(case, out).double() - real_rows(case, reference(case))).abs().max().item()
        errors[f"{name}/{bound}"] = [err, bool(torch.isfinite(out).all()), str(out.dtype)]
case = make_case([7, 30], width=4, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu")
out = kernel(case)
errors["fp16"] = [(out.double() - reference(case)).abs().max().item(), bool(torch.isfinite(out).all()), str(out.dtype)]
print(json.dumps(errors))
"""


def test_interpreted_kernels_match_reference():
    """fp32 within 1e-5 of the fp64 reference (fp16 within 2e-3), eagerly and with a graph's key
    bound; outputs finite on padding rows too; the output keeps q's dtype."""
    done = run_interpreted(CHILD, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 17
    for name, (err, finite, dtype) in errors.items():
        assert finite, name
        assert err < (2e-3 if name == "fp16" else 1e-5), (name, err)
        assert dtype == ("torch.float16" if name == "fp16" else "torch.float32"), name


INVARIANCE_CHILD = """
import json, torch
from attention_cases import make_case, real_rows, reference as attention_reference, kernel
from blockspec.kernels import attention
C, W = 300, 8            # a sequence of 300 keys; its last 8 positions as a verify block
case = make_case([C], W, 9, 3, 64, torch.float16, "cpu", seed=1)          # SmolLM2's heads
m = case.meta

def row(rows, bound=None, copies=1):
    # The verify's last position computed with these of its rows as the call's queries (their own
    # positions, keys up to the last of them), the sequence repeated `copies` times as a batch,
    # max_context_len = bound (a CUDA graph passes the pool's capacity).
    n = len(rows)
    out = attention.paged_attention(
        case.q[rows].repeat(copies, 1, 1), case.k_pool, case.v_pool, m.block_tables.repeat(copies, 1),
        torch.full((copies,), C - (W - 1 - rows[-1])), m.positions[rows].repeat(copies),
        torch.arange(copies + 1) * n, n, m.page_size, bound or C, case.scale, True, None)
    return out[n - 1]

shapes = {"decode alone": ([W - 1], None, 1), "decode, a graph's bound": ([W - 1], 1024, 1),
          "decode among 8": ([W - 1], 1024, 8), "verify of 8": (list(range(W)), None, 1),
          "verify of 8, a graph's bound": (list(range(W)), 1024, 1), "verify of 8 among 8": (list(range(W)), 1024, 8),
          "verify of 3": ([5, 6, 7], None, 1)}
result = {}
# Invariant ranges of 128 keys here (512 in serving), so the 300 keys take three ranges and a
# graph's bound of 1024 a grid of 8, most of them empty.
attention.INVARIANT_SPLIT_KEYS = 128
for invariant in (False, True):
    attention.BATCH_INVARIANT = invariant
    base = row(*shapes["decode alone"])
    result[str(invariant)] = {name: int((row(*args) != base).sum()) for name, args in shapes.items()}
reference = attention_reference(case)[-1]
result["error"] = float((base.double() - reference).abs().max())
result["splits"] = [attention.choose_num_splits(1, keys, 64, 64) for keys in (C, 1024)]
# The draft's own block rides with each sequence's last range (keys 0, 3 and 150: one, one, three).
draft = make_case([0, 3, 150], 4, 8, 2, 32, torch.float32, "cpu", draft=True, num_padding=1)
result["draft"] = max(float((real_rows(draft, kernel(draft, bound)).double()
                             - real_rows(draft, attention_reference(draft))).abs().max()) for bound in (None, 1024))
print(json.dumps(result))
"""


def test_batch_invariant_attention_gives_a_row_the_same_bits_in_any_call():
    """BLOCKSPEC_BATCH_INVARIANT: one query row (the last of a verify block, fp16) has the same
    output bits decoded alone, under a graph's key bound, among 8 sequences, and as a row of a
    verify of 3 or 8, its keys cut into fixed ranges (three here, the grid's others empty);
    without it the split count follows the call, and some of these differ (what made bf16 DFlash
    differ from plain decoding on the H200). The ranges' merge and the draft's block in its last
    range still give the reference's attention."""
    done = run_interpreted(INVARIANCE_CHILD, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(n == 0 for n in result["True"].values()), result["True"]
    assert any(n > 0 for n in result["False"].values()), result["False"]
    assert result["splits"] == [4, 8]                  # three ranges of keys (a fourth empty), 8 under the bound
    assert result["error"] < 2e-3                      # fp16 against the fp64 torch reference
    assert result["draft"] < 1e-5                      # fp32, as test_interpreted_kernels_match_reference


def test_pipeline_stages_follow_the_key_chunk_bytes_and_the_head_width():
    """tile_sizes' tuning (GPU-only: the interpreter ignores stages, so only this holds it): K/V
    chunks over 16 KB take two stages, and so do 128-wide bf16 heads' 16 KB chunks (round 58's
    sweep); 256-wide bf16 heads' 16 KB chunks keep three, smaller chunks three."""
    from blockspec.kernels.attention import tile_sizes

    # (rows a head, head_dim, element bytes) → (BLOCK_M, BLOCK_N, BLOCK_D, warps, stages)
    assert tile_sizes(1, 128, 2) == (16, 64, 128, 4, 2)        # Qwen3 decode: 64 × 128 × 2 B = 16 KB
    assert tile_sizes(33, 128, 2) == (64, 64, 128, 4, 2)       # verify rows: taller tiles, the same chunk
    assert tile_sizes(1, 256, 2) == (16, 32, 256, 4, 3)        # 32 × 256 × 2 B = 16 KB, not swept
    assert tile_sizes(1, 64, 2) == (16, 64, 64, 4, 3)          # 8 KB
    assert tile_sizes(1, 96, 2) == (16, 64, 128, 4, 2)         # padded to 128 wide
    assert tile_sizes(1, 128, 4) == (16, 64, 128, 4, 2)        # fp32: 32 KB
    assert tile_sizes(1, 256, 4) == (16, 32, 256, 4, 2)        # fp32: 32 KB


def test_64_wide_fp32_heads_16kb_chunks_take_two_stages_as_128_wide_bf16_heads_do():
    """The two-stage rule for 16 KB K/V chunks is by head width (≤ 128), not by dtype: 64 keys of
    a 64-wide fp32 head are 16 KB, as are 64 keys of a 128-wide bf16 head (tile_sizes' docstring
    names both); 32-wide fp32 chunks (8 KB) keep three."""
    from blockspec.kernels.attention import tile_sizes

    assert tile_sizes(1, 64, 4) == (16, 64, 64, 4, 2)          # 64 × 64 × 4 B = 16 KB
    assert tile_sizes(16, 48, 4) == (16, 64, 64, 4, 2)         # padded to 64 wide
    assert tile_sizes(1, 32, 4) == (16, 64, 32, 4, 3)          # 8 KB
