"""The Gated DeltaNet step kernels (blockspec/kernels/gdn.py) under Triton's CPU interpreter,
against their torch reference (the model's own conv and recurrent forms, sequence by sequence).

Runs only where Triton is installed; the interpreter's flag is read when triton.language is
imported, so the cases run in a child process (~5 s). fp32 and small heads here; bf16 and the
real head sizes are tests/gpu/test_gdn_kernel.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_interpreted

pytest.importorskip("triton")

HERE = Path(__file__).parent

CHILD = """
import json
from gdn_cases import make_case, compare
from blockspec.kernels.gdn import gdn_step
from blockspec.models.gated_delta import reference_step
cases = {"ragged": [1, 3, 0, 5], "decode": [1, 1], "verify16": [16], "grouped-8": [2, 8], "norm": [1, 3, 0, 5]}
errors = {name: compare(make_case(rows, num_v_heads=8 if name == "grouped-8" else 4, seed=i, with_norm=name == "norm"),
                        gdn_step, reference_step)
          for i, (name, rows) in enumerate(cases.items())}
print(json.dumps(errors))
"""


def test_interpreted_step_matches_reference():
    """Per sequence (ragged widths, a sequence of 0 rows, grouped value heads; the gated output
    norm fused or not): the output rows,
    the state after every row and the stashed conv inputs (verify, pools untouched), and the
    advanced conv window and state in each sequence's own slot (plain step), within fp32 rounding."""
    done = run_interpreted(CHILD, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 5
    for name, case in errors.items():
        assert set(case) == {"out/True", "steps", "stash", "pools untouched", "out/False", "conv_pool", "ssm_pool"}
        assert case["pools untouched"] == 0.0, name
        for what, err in case.items():
            assert err < 1e-5, (name, what, err)


MODEL_CHILD = """
import sys, pytest, torch
import blockspec.models.qwen3_5 as qwen3_5
calls = []
def fits(x, width):
    calls.append(width)
    return width <= 16 and x.dtype == torch.float32     # as on CUDA: no fp64 kernel
qwen3_5.step_kernel_fits = fits             # the CUDA path, here on the CPU through the interpreter
prefills = []
def prefill_fits(x, width):
    prefills.append(width)
    return width <= 64 and x.dtype == torch.float32
qwen3_5.prefill_kernel_fits = prefill_fits
code = pytest.main(["-q", "-x", "-p", "no:cacheprovider",     # fp32 (fp64 stays on torch), both layouts
                    "tests/test_hybrid.py::test_rollback_selects_the_committed_state[qwen3_5-dtype2-1e-05]",
                    "tests/test_hybrid.py::test_graph_shaped_metadata_equals_eager_on_hybrids",
                    "tests/test_prefix_engine.py::test_greedy_turns_with_hits_equal_the_cache_off[hybrid-plain]",
                    "tests/test_audit64_core.py::test_a_prefill_chunk_beside_decoding_rows_keeps_both_states_exact"])
assert calls, "the step kernel was never used"
assert [w for w in prefills if w <= 64] and [w for w in prefills if w > 64], prefills     # chunks of both kinds
sys.exit(int(code))
"""


def test_hybrid_model_through_interpreted_step_kernel():
    """The model's call site (layers read and write their slots in place, a verify stashes the
    kernel's per-step states and conv inputs, StatePool.select rolls back): the exact-rollback
    and graph-padding tests of tests/test_hybrid.py pass with every decode / verify forward of
    ≤ 16 rows on the kernel, a hybrid's turns with prefix-cache hits (their short chunks on
    the kernel, as on CUDA) equal the same turns with the cache off (longer chunks on the torch
    chunked form), and a step of a prefill chunk beside a decode row keeps both states exact
    (each group on the kernel with its own row offsets)."""
    done = run_interpreted(MODEL_CHILD, timeout=300, cwd=HERE.parent)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    assert "5 passed" in done.stdout, done.stdout[-2000:]


NORM_CHILD = """
import torch
from blockspec.kernels import fused
gen = torch.Generator().manual_seed(0)
worst = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for rows, heads, dim in ((1, 4, 128), (16, 4, 128), (5, 3, 100)):
        x = torch.randn(rows, heads, dim, generator=gen).to(dtype)
        weight = (torch.randn(dim, generator=gen) * 0.1 + 1).to(dtype)
        wide = torch.randn(rows + 2, heads, 2 * dim, generator=gen).to(dtype) * 3
        gates = {"contiguous": wide[:rows, :, :dim].contiguous(), "strided view": wide[:rows, :, dim:],
                 "offset rows": wide[2:, :, :dim].contiguous()[:rows] if rows > 0 else wide[:0, :, :dim]}
        gates["offset rows"] = torch.cat((torch.zeros(1, heads, dim, dtype=dtype), gates["contiguous"]))[1:]
        for layout, gate in gates.items():
            ref = fused.gated_rms_norm_torch(x, weight, gate, 1e-6)
            got = fused.gated_rms_norm_triton(x, weight, gate, 1e-6)
            assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
            scale = ref.float().abs().max().item()
            err = (got.float() - ref.float()).abs().max().item() / scale
            unequal = (got != ref).float().mean().item()
            key = str(dtype)
            worst[key] = max(worst.get(key, (0, 0)), (err, unequal))
print(worst)
assert worst["torch.float32"][0] < 1e-6, worst
for key in ("torch.float16", "torch.bfloat16"):
    assert worst[key][0] < 2 ** -6 and worst[key][1] < 0.02, worst   # rounded where torch rounds
print("ok")
"""


def test_interpreted_gated_rms_norm_matches_torch():
    """The GDN output norm's one kernel (kernels/fused.py) against the twelve torch ops it
    replaces, for contiguous gates, a strided view and rows after an offset (copied to one
    aligned layout first): fp32 to rounding order, fp16 / bf16 rounded where torch rounds."""
    done = run_interpreted(NORM_CHILD, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout[-1500:], done.stderr[-2000:])
