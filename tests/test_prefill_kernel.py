"""The Triton prefill attention kernel (kernels/prefill_attention.py) under Triton's CPU
interpreter, against flash_prefill's torch reference in float64.

Runs only where Triton is installed (CI has none). The interpreter's flag is read when
triton.language is imported, so the cases run in a child process; its bf16 tl.dot is wrong
(triton 3.9), so fp32 / fp16 here. Small tiles (16 rows, 16 keys) so that a few dozen keys
already cross the kernel's paths: unmasked blocks below the diagonal, diagonal blocks, split
ranges that begin on the diagonal or hold no key of a tile, tiles past a short sequence's rows.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from blockspec.kernels import prefill_attention as P  # noqa: E402  (after the skip: CI has no triton)
from helpers import run_interpreted  # noqa: E402


CHILD = """
import json, torch
from blockspec.kernels import flash_prefill
from blockspec.kernels.prefill_attention import PrefillConfig, varlen_causal_triton

def run(query_lens, key_lens, heads, kv_heads, head_dim, dtype, config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q = randn(sum(query_lens), heads, head_dim)
    keys, values = randn(sum(key_lens), kv_heads, head_dim), randn(sum(key_lens), kv_heads, head_dim)
    cu_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + key_lens).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = varlen_causal_triton(q, keys, values, cu_q, cu_k, max(query_lens), max(key_lens), scale, config)
    ref = flash_prefill.varlen_causal_reference(q.double(), keys.double(), values.double(), cu_q, cu_k, scale)
    return [(out.double() - ref).abs().max().item(), bool(torch.isfinite(out).all()), str(out.dtype),
            list(out.shape) == list(q.shape)]

# Sequences: a chunk after cached keys, a single row, a whole prompt (n = L), a chunk whose
# rows start mid-block, one whose first row sees all but the last key of a block (the edge of
# the unmasked range); key counts off every block boundary.
RAGGED = ([37, 1, 20, 9, 18], [90, 33, 20, 61, 32])
small = PrefillConfig(16, 16, 4, 2, num_splits=1, use_tma=False)
cases = {
    "fp32/gqa4/pointers": (*RAGGED, 8, 2, 32, torch.float32, small),
    "fp32/mha/tma": (*RAGGED, 4, 4, 32, torch.float32, PrefillConfig(16, 16, 4, 2, num_splits=1, use_tma=True)),
    "fp32/gqa4/split3": (*RAGGED, 4, 1, 32, torch.float32, PrefillConfig(16, 16, 4, 2, num_splits=3, use_tma=False)),
    "fp32/gqa2/split2-tma": (*RAGGED, 4, 2, 64, torch.float32, PrefillConfig(32, 16, 4, 2, num_splits=2, use_tma=True)),
    "fp32/gqa2/default": ([70, 1], [70, 45], 4, 2, 64, torch.float32, None),
    "fp16/gqa2/pointers": (*RAGGED, 4, 2, 64, torch.float16, small),
    "fp16/gqa4/split4-tma": (*RAGGED, 8, 2, 32, torch.float16, PrefillConfig(16, 32, 4, 2, num_splits=4, use_tma=True)),
}
print(json.dumps({name: run(*spec) for name, spec in cases.items()}))
"""


def test_interpreted_prefill_kernel_matches_reference():
    """fp32 within 1e-5 of the fp64 reference, fp16 within 2e-3, through pointer and TMA loads,
    unsplit and split (the merge), GQA groups 1, 2 and 4, head dims 32 and 64; the output finite,
    in q's dtype and shape."""
    done = run_interpreted(CHILD)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 7
    for name, (err, finite, dtype, same_shape) in errors.items():
        assert finite and same_shape, name
        fp16 = name.startswith("fp16")
        assert err < (2e-3 if fp16 else 1e-5), (name, err)
        assert dtype == ("torch.float16" if fp16 else "torch.float32"), name


def test_keys_split_only_while_the_grid_leaves_sms_idle():
    assert P.choose_num_splits(128, 16384, 64, 132) == 1           # Qwen3-8B, 512 rows: one wave already
    assert P.choose_num_splits(64, 16384, 64, 132) == 2            # 16 heads × 4 blocks: two ranges each
    assert P.choose_num_splits(4, 16384, 64, 132) == P.MAX_SPLITS
    assert P.choose_num_splits(8, 300, 64, 132) == 1               # too few keys for a range of 4 blocks


def test_default_tiles_are_a_function_of_shapes():
    import torch
    for head_dim in P.HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            config = P.default_config(head_dim, dtype)
            assert config == P.default_config(head_dim, dtype)
            assert config.block_m >= 16 and config.block_n >= 16 and config.num_splits == 0


def test_unsupported_heads_name_the_fallback():
    import torch
    q, keys = torch.zeros(4, 4, 48), torch.zeros(4, 2, 48)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="flash_prefill"):
        P.varlen_causal_triton(q, keys, keys, cu, cu, 4, 4, 1.0)
