"""Our CPU kernels (kernels/cpu_kernels.cpp, kernels/native.py) against their torch references:
each op within fp32 rounding of the reference (the kernels sum in their own fixed order; bounds
stated per op), every row the same bits whether it comes alone or in a batch (DFlash == plain
rests on it), the whole decoder stack in one call against the modules' forward on the same
quantized weights, and the fallback when the library cannot be built."""
from __future__ import annotations

import pytest
import torch

from attention_cases import make_case
from blockspec.kernels import fused, native
from blockspec.layers.attention import reference_paged_attention
from blockspec.loader import load_draft, load_model
from gguf_fixtures import write_gguf
from helpers import make_engine, make_request, run_batch

# Relative to the values' own size: a handful of fp32 roundings.
CLOSE = 1e-5


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float = CLOSE) -> bool:
    return bool((a - b).abs().max() <= tolerance * max(float(b.abs().max()), 1e-30))


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_torch(with_residual):
    x, residual = torch.randn(9, 64, generator=gen(0)), torch.randn(9, 64, generator=gen(1))
    weight = torch.randn(64, generator=gen(2))
    out, total = native.add_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    ref_out, ref_total = fused.add_rms_norm_torch(x, residual if with_residual else None, weight, 1e-6, False)
    assert torch.equal(total, ref_total)                        # the sum is one fp32 add either way
    assert close(out, ref_out)
    assert torch.equal(native.add_rms_norm(x[4:5], residual[4:5] if with_residual else None, weight, 1e-6)[0], out[4:5])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_store_equals_torch(qk_norm):
    n, hq, hkv, d, rot = 7, 4, 2, 32, 16                          # partial rotary: half the head
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen(0))
    angles = torch.rand(n, rot // 2, generator=gen(1)) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    norms = (torch.randn(d, generator=gen(2)), torch.randn(d, generator=gen(3))) if qk_norm else (None, None)
    slots = torch.tensor([5, 0, 9, 3, 12, 7, 1])
    pools = [torch.zeros(16, hkv, d) for _ in range(4)]
    q = native.qk_norm_rope_store(qkv, hq, hkv, d, *norms, 1e-6, cos, sin, pools[0], pools[1], slots)
    ref_q, _, _ = fused.qk_norm_rope_torch(qkv, hq, hkv, d, d, *norms, 1e-6, False, cos, sin,
                                           (pools[2], pools[3], slots))
    assert close(q, ref_q) and close(pools[0], pools[2])
    assert torch.equal(pools[1], pools[3])                      # v is stored as it is
    again = native.qk_norm_rope_store(qkv[2:3], hq, hkv, d, *norms, 1e-6, cos[2:3], sin[2:3], pools[0], pools[1],
                                      slots[2:3])
    assert torch.equal(again, q[2:3])


def test_paged_attention_equals_the_reference_and_a_verify_row_equals_it_alone():
    # A ragged batch as the runner lays it out: a prefill chunk, a verify block of 8, a plain row.
    case = make_case([40, 21, 9], 8, 6, 2, 32, torch.float32, "cpu", widths=[8, 8, 1], page_size=16)
    out = native.paged_attention(case.q, case.k_pool, case.v_pool, case.meta, case.scale)
    ref = reference_paged_attention(case.q, case.k_pool, case.v_pool, case.meta, case.meta.context_lens, case.scale)
    assert close(out, ref)
    # Row 3 of the verify block, as the same sequence decoding that position alone.
    alone = make_case([40, 21, 9], 8, 6, 2, 32, torch.float32, "cpu", widths=[8, 8, 1], page_size=16)
    meta = alone.meta
    row = 8 + 3
    meta.num_seqs, meta.query_lens = 1, [1]
    meta.query_start = torch.tensor([0, 1])
    meta.positions = case.meta.positions[row:row + 1]
    meta.block_tables = case.meta.block_tables[1:2]
    meta.context_lens = case.meta.positions[row:row + 1] + 1
    single = native.paged_attention(case.q[row:row + 1], case.k_pool, case.v_pool, meta, case.scale)
    assert torch.equal(single, out[row:row + 1])


def test_silu_mul_equals_torch():
    gate_up = torch.randn(5, 96, generator=gen(0)) * 4
    assert close(native.silu_mul(gate_up), fused.silu_mul_torch(gate_up))


# ---- the whole stack on a quantized tiny target --------------------------------------------------

@pytest.fixture(scope="module")
def quantized_target(qwen3_dir, tmp_path_factory):
    """A tiny Qwen3 (qk-norm) GGUF with Q4_1 / Q4_0 / Q8_0 projections, loaded kept quantized with
    fp32 activations (BLOCKSPEC_CPU_KERNELS=fp32, the native kernel): the stack's op-for-op check
    needs continuous arithmetic, and int8 activations (the default q8 kernel) round two values a
    few ulps apart to different steps. The q8 stack: tests/test_quant.py."""
    kinds = {f"model.layers.{i}.{name}.weight": kind for i in range(4)
             for name, kind in {"self_attn.q_proj": "Q4_1", "self_attn.k_proj": "Q4_1", "self_attn.v_proj": "Q4_0",
                                "self_attn.o_proj": "Q8_0", "mlp.gate_proj": "Q4_1", "mlp.up_proj": "Q4_1",
                                "mlp.down_proj": "Q4_0"}.items()}
    kinds |= {"model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q8_0"}
    path = write_gguf(qwen3_dir, tmp_path_factory.mktemp("stack") / "tiny-q.gguf", quantize=kinds, with_tokenizer=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKSPEC_CPU_KERNELS", "fp32")
        return load_model(str(path), device="cpu").model


PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 19]


def outputs(model, draft=None, block_size=1, max_tokens=16) -> list[list[int]]:
    requests = [make_request(f"r{i}", ids, max_tokens=max_tokens) for i, ids in enumerate(PROMPTS)]
    engine = lambda: make_engine(model, draft, block_size=block_size, max_num_seqs=len(PROMPTS))  # noqa: E731
    return [run.output_ids for run in run_batch(engine, requests)[1]]


def test_the_stack_forward_equals_the_modules_forward(quantized_target, qwen3_draft_dir):
    """One engine step's forward through dense_forward vs the modules (torch ops around the same
    native matmuls): hidden states and the draft's features within fp32 rounding, the same greedy
    tokens, and DFlash on the stack equals plain on it."""
    target = quantized_target
    assert isinstance(target.native_stack, native.DenseStack)
    stack = target.native_stack
    plain = outputs(target)
    captured: dict[str, list] = {"stack": [], "modules": []}
    forward = target.forward

    def both(input_ids, positions, meta, capture_layers=(), multimodal=None):
        # The modules first, on a copy of the pools (they store K/V too), then the stack for real.
        pools = [(k.clone(), v.clone()) for k, v in meta.kv]
        saved, meta.kv = meta.kv, pools
        target.native_stack = None
        captured["modules"].append(forward(input_ids, positions, meta, capture_layers, multimodal))
        target.native_stack, meta.kv = stack, saved
        out = forward(input_ids, positions, meta, capture_layers, multimodal)
        captured["stack"].append(out)
        for (k, v), (k_ref, v_ref) in zip(meta.kv, pools):
            assert close(k, k_ref) and close(v, v_ref)
        return out

    target.forward = both
    try:
        checked = outputs(target, load_draft(str(qwen3_draft_dir), target), block_size=4, max_tokens=10)
    finally:
        del target.forward
    assert len(captured["stack"]) == len(captured["modules"]) > 3
    for ours, ref in zip(captured["stack"], captured["modules"]):
        assert close(ours.hidden, ref.hidden, 1e-4)
        assert ours.features is not None and close(ours.features, ref.features, 1e-4)
    assert checked == [ids[:10] for ids in plain]
    target.native_stack = None
    try:
        assert outputs(target) == plain                        # the modules' greedy tokens: the same
    finally:
        target.native_stack = stack


def test_without_a_compiler_the_torch_kernels_serve(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    (tmp_path / "edited.cpp").write_text("int x;\n")                   # a source no cache holds yet
    monkeypatch.setattr(native, "SOURCE", tmp_path / "edited.cpp")
    with caplog.at_level("WARNING", logger="blockspec.kernels"):
        assert native.library.__wrapped__() is None
    assert "CPU kernels not built" in caplog.text
    monkeypatch.setenv("BLOCKSPEC_CPU_KERNELS", "torch")
    assert native.library.__wrapped__() is None


def build_variant(flags: tuple[str, ...], path) -> "ctypes.CDLL":
    import ctypes
    import subprocess
    subprocess.run(["c++", *flags, "-shared", "-fPIC", "-fno-math-errno", str(native.SOURCE), "-o", str(path)],
                   check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(path))
    for name, args in native.SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    return lib


@pytest.mark.skipif("avx2" not in native.cpu_fingerprint().split() or "fma" not in native.cpu_fingerprint().split(),
                    reason="the AVX2 build runs only on a CPU with AVX2 and FMA")
def test_the_avx2_build_gives_the_portable_builds_bits(tmp_path):
    """A CPU without AVX-512 runs the kernels' AVX2 path, one with it the AVX-512 path (this
    machine's own build, where it has it): the portable path's float operations lane for lane and
    its lane sums' order, so the same bits (and a row the same alone or batched).
    The int8-activation kernel (quant_linear_q8) gives the same bits on every path: AVX2's int16
    pair sums, AVX-VNNI's and AVX-512 VNNI's dot products (where this CPU has them: this machine's
    own build), and the portable loops."""
    avx2 = build_variant(("-O3", "-mavx2", "-mfma", "-mf16c", "-mno-avx512f"), tmp_path / "avx2.so")
    # The portable side at -O1: GCC takes ~40 s to vectorise its 16-lane loops at -O3 for the
    # baseline ISA, and the optimisation level changes none of its float operations (explicit
    # fmaf in a fixed order, no -ffast-math, nothing to contract without -mfma).
    portable = build_variant(("-O1",), tmp_path / "portable.so")

    def linear(lib, x, bits, values, scale, shift, n):
        y = torch.empty(x.shape[0], n)
        lib.quant_linear(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(), bits, scale.data_ptr(),
                         None if shift is None else shift.data_ptr(), None, n, y.data_ptr())
        return y
    for bits in (4, 8):
        n, k = 37, 576
        values = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), dtype=torch.uint8, generator=gen(bits))
        scale = (torch.rand(n, k // 32, generator=gen(1)) * 0.01).half().view(torch.int16)
        shift = (torch.rand(n, k // 32, generator=gen(2)) * -0.01).half().view(torch.int16) if bits == 4 else None
        x = torch.randn(13, k, generator=gen(3))
        fast = linear(avx2, x, bits, values, scale, shift, n)
        assert torch.equal(fast, linear(portable, x, bits, values, scale, shift, n))
        if native.available():                                 # this CPU's build (AVX-512 here) too
            assert torch.equal(fast, linear(native.library(), x, bits, values, scale, shift, n))
        assert torch.equal(torch.cat([linear(avx2, x[i: i + 1], bits, values, scale, shift, n) for i in range(13)]), fast)
        for m in (2, 3, 5, 8):
            assert torch.equal(linear(avx2, x[:m], bits, values, scale, shift, n), fast[:m])
    q8_builds = {"avx2": avx2, "portable": portable}
    flags = native.cpu_fingerprint().split()
    if "avx_vnni" in flags:                                    # (GCC 11 on: -mavxvnni; an older one builds it not)
        import subprocess
        try:
            q8_builds["avx-vnni"] = build_variant(("-O3", "-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mno-avx512f"),
                                                  tmp_path / "avxvnni.so")
        except subprocess.CalledProcessError:
            pass
    if native.available():
        q8_builds["this CPU's"] = native.library()

    def q8(lib, x, bits, values, scale, shift, n):
        y = torch.full((x.shape[0], n), float("nan"))
        lib.quant_linear_q8(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(), bits, scale.data_ptr(),
                            None if shift is None else shift.data_ptr(), None, n, y.data_ptr())
        return y
    for bits, k in ((4, 576), (8, 576), (4, 160), (8, 160)):           # 160: an odd count of blocks
        n = 37
        values = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), dtype=torch.uint8, generator=gen(bits))
        scale = (torch.rand(n, k // 32, generator=gen(1)) * 0.01).half().view(torch.int16)
        shift = (torch.rand(n, k // 32, generator=gen(2)) * -0.01).half().view(torch.int16) if bits == 4 else None
        x = torch.randn(13, k, generator=gen(3))
        x[2, :32] = 0.0
        outs = {name: q8(lib, x, bits, values, scale, shift, n) for name, lib in q8_builds.items()}
        first = outs["portable"]
        assert not first.isnan().any()
        for name, out in outs.items():
            assert torch.equal(out, first), name
        for lib in q8_builds.values():
            for rows in (slice(0, 1), slice(4, 5), slice(0, 8), slice(3, 12)):
                assert torch.equal(q8(lib, x[rows], bits, values, scale, shift, n), first[rows])
    x, weight = torch.randn(5, 64, generator=gen(4)), torch.randn(64, generator=gen(5))
    outs = []
    for lib in (avx2, portable) + ((native.library(),) if native.available() else ()):
        out, total = torch.empty(5, 64), torch.empty(5, 64)
        lib.add_rms_norm(x.data_ptr(), None, weight.data_ptr(), 1e-6, 5, 64, out.data_ptr(), total.data_ptr())
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
