"""FP8 linear kernels (Triton): the CUDA path of `layers.fp8.Fp8Linear`.

`linear(x, weight, scale, block, bias)` has the result of `reference_linear`, the spec:
x · (weight · scale)ᵀ + bias with the weight dequantized to fp32 and rounded to x's dtype. Two
kernels, chosen by the number of rows M (both fixed-shape, no host sync: inside CUDA graphs):

- M ≤ WEIGHT_ONLY_MAX_ROWS (decode rows, DFlash verify blocks): weight-only. Each program
  streams e4m3 weight tiles [BLOCK_K, BLOCK_N], widens them to x's dtype in registers (exact:
  e4m3 fits in bf16), multiplies with tl.dot in fp32 and scales each 128-column tile's partial
  product by its block scale. A step reads one byte per weight; the math stays bf16, so
  activations are never quantized where acceptance is decided.
- larger M (prefill chunks): FP8 × FP8. x is quantized per row and 128 columns (one scale each,
  largest magnitude → 448, `quantize_rows`) and the tensor cores multiply e4m3 by e4m3, each
  tile's partial product scaled by its row's and its weight block's scales: twice bf16's peak
  where a chunk is compute-bound. `reference_fp8_fp8` is its spec (x quantized the same way).

No split over K: a partial sum per split would need a reduction kernel after every linear (a
few µs each inside a graph, hundreds per step); programs split over N instead, narrow tiles at
small M so that every SM streams weights. Results are deterministic (no atomics).
torch._scaled_mm's block-wise scaling is not used: ours runs the same on every torch version.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from blockspec.kernels.fused import use_triton
from blockspec.layers.fp8 import BLOCK, FP8, FP8_MAX, ScaleBlock, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the reference path serves
    triton = None

WEIGHT_ONLY_MAX_ROWS = 256
MIN_CAPABILITY = (8, 9)      # e4m3 tensor-core and conversion instructions: Ada and Hopper on


def has_fp8(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether `device` runs FP8 weights: CUDA of compute capability ≥ 8.9, or the CPU (the
    dequantizing reference path)."""
    if device.type != "cuda":
        return device.type == "cpu"
    return (capability or torch.cuda.get_device_capability(device)) >= MIN_CAPABILITY


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] → [..., N]: the weight dequantized in fp32, rounded to x's dtype, one GEMM."""
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype), bias)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], scales [M, ⌈K/128⌉] fp32): per row and 128 columns."""
    from blockspec.layers.fp8 import quantize
    return quantize(x, ScaleBlock(rows=1, cols=BLOCK))


def reference_fp8_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 × FP8 kernel's spec: x quantized per row × 128 columns, both sides dequantized, fp32."""
    q, x_scale = quantize_rows_reference(x)
    x_deq = dequantize(q, x_scale, ScaleBlock(rows=1, cols=BLOCK))
    out = x_deq @ dequantize(weight, scale, block).T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] → [..., N] (see the module doc)."""
    if not use_triton(x, bias):
        return reference_linear(x, weight, scale, block, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= WEIGHT_ONLY_MAX_ROWS or x.dtype == torch.float32:
        out = weight_only_linear(flat, weight, scale, block, bias)
    else:
        out = fp8_fp8_linear(flat, weight, scale, block, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def scale_cols(block: ScaleBlock, in_features: int) -> int:
    """The kernels' SCALE_COLS: 128, or one scale over the whole row (per-channel) as a constant
    that no column offset reaches, so every row's scale index stays 0."""
    return block.cols if block.cols < in_features else 1 << 30


def weight_only_tiles(num_rows: int, out_features: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): rows rounded up to a tl.dot tile; the widest
    column tile that still gives every SM two programs."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    widths = (128, 64, 32, 16) if num_rows > 64 else (64, 32, 16)
    row_blocks = triton.cdiv(num_rows, block_m)
    block_n = next((w for w in widths if triton.cdiv(out_features, w) * row_blocks >= 2 * sms), 16)
    return block_m, block_n, 4, 4 if num_rows <= 64 else 3


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                       bias: torch.Tensor | None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) · e4m3 weight [N, K] → [M, N] in x's dtype."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m, block_n, warps, stages = tiles or weight_only_tiles(num_rows, out_features, num_sms(x.device.index or 0))
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _weight_only_kernel[grid](
        x, weight, scale, bias if bias is not None else x, out, num_rows, out_features, in_features,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features), HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, num_warps=warps, num_stages=stages)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one launch: x [M, K] → (e4m3 [M, K], scales [M, ⌈K/128⌉])."""
    num_rows, in_features = x.shape
    groups = triton.cdiv(in_features, BLOCK)
    q = torch.empty(num_rows, in_features, dtype=FP8, device=x.device)
    scales = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_rows_kernel[(num_rows, groups)](x, q, scales, in_features, x.stride(0), q.stride(0),
                                                  scales.stride(0), FP8_MAX=FP8_MAX, BLOCK_K=BLOCK, num_warps=1)
    return q, scales


def fp8_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] quantized per row × 128 columns, then e4m3 × e4m3 → [M, N] in x's dtype."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x.contiguous()
    q, x_scales = quantize_rows(x)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m = block_n = 128
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n),)
    _fp8_fp8_kernel[grid](
        q, x_scales, weight, scale, bias if bias is not None else x, out, num_rows, out_features, in_features,
        q.stride(0), x_scales.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, GROUP_M=8, num_warps=8, num_stages=3)
    return out


if triton is not None:

    @triton.jit
    def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                            stride_om, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, n] = Σ_kb scale[n // SCALE_ROWS, kb] · Σ_{k in kb} x[m, k] · w[n, k] (+ bias[n])."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]          # [BLOCK_K, BLOCK_N]
        s_ptrs = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            partial = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
            s = tl.load(s_ptrs + k // SCALE_COLS, mask=n_ok, other=0.0)
            acc += partial * s[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, FP8_MAX: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        offs = group * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * stride_sm + group, scale)

    @triton.jit
    def _fp8_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_asm, stride_wn,
                        stride_wsn, stride_om, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """out[m, n] = Σ_kb xs[m, kb] · ws[n // SCALE_ROWS, kb] · Σ_{k in kb} q[m, k] · w[n, k];
        programs walk GROUP_M row tiles per column tile, so weight tiles are reused from L2."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group_size = GROUP_M * tiles_n
        first_m = (pid // group_size) * GROUP_M
        rows_in_group = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group_size) % rows_in_group
        pid_n = (pid % group_size) // rows_in_group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
        ws_ptrs = ws_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            partial = tl.dot(a, w)
            a_s = tl.load(as_ptrs + k // BLOCK_K, mask=m_ok, other=0.0)
            w_s = tl.load(ws_ptrs + k // SCALE_COLS, mask=n_ok, other=0.0)
            acc += partial * a_s[:, None] * w_s[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
