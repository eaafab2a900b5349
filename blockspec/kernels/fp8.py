"""FP8 linear kernels (Triton): the CUDA path of `layers.fp8.Fp8Linear`.

`linear(x, weight, scale, block, bias)` has the result of `reference_linear`, the spec:
x · (weight · scale)ᵀ + bias with the weight dequantized to fp32 and rounded to x's dtype. Two
kernels, chosen by the number of rows M (both fixed-shape, no host sync: inside CUDA graphs):

- M ≤ WEIGHT_ONLY_MAX_ROWS (decode rows, a few sequences' DFlash verify blocks): weight-only.
  Each program streams e4m3 weight tiles [BLOCK_K, BLOCK_N], widens them to x's dtype in
  registers (exact: e4m3 fits in bf16), multiplies with tl.dot in fp32 and scales each
  128-column tile's partial product by its block scale. A step reads one byte per weight and
  the math stays bf16. Where N gives too few programs to keep every SM streaming, K is split
  too: each split writes its fp32 partial sums and one small kernel adds them in split order
  (deterministic, no atomics) with the bias.
- larger M (prefill chunks, verify of many sequences): FP8 × FP8. x is quantized per row and
  128 columns (one scale each, largest magnitude → 448, `quantize_rows`) and the tensor cores
  multiply e4m3 by e4m3, each tile's partial product scaled by its row's and its weight
  block's scales. `reference_fp8_fp8` is its spec (x quantized the same way).

Measured on the H200 at the Qwen3-8B shapes (scripts/fp8_kernel_bench.py, BENCHMARKS.md): at
256 rows the FP8 × FP8 kernel took 0.39-0.52 × the weight-only kernel's time, hence the
threshold of 64 rows (not 256); at 16 rows 32-column tiles with 4 stages were the best of the
swept ones, within 3 % or better (swapping the dot's operands, weight tile first, was no
better: BENCHMARKS.md, round 42); at one row a GEMV without tl.dot (`gemv_tiles`) is 1.2-1.35 ×
faster than the best tl.dot tiles.
torch._scaled_mm's block-wise scaling is not used: ours runs the same on every torch version.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.kernels.fused import use_triton
from blockspec.layers.fp8 import BLOCK, FP8, FP8_MAX, ScaleBlock, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the reference path serves
    triton = None

WEIGHT_ONLY_MAX_ROWS = 64
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
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def scale_cols(block: ScaleBlock, in_features: int) -> int:
    """The kernels' SCALE_COLS: 128, or one scale over the whole row (per-channel) as a constant
    that no column offset reaches, so every row's scale index stays 0."""
    return block.cols if block.cols < in_features else 1 << 30


@dataclass(frozen=True)
class WeightOnlyTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    # GEMV (one row): no tl.dot, whose 16-row tile would be 15/16 padding; each program reduces
    # its [BLOCK_N, k_blocks · 128] weight tile against x with fp32 FMAs.
    gemv: bool = False
    k_blocks: int = 1


# K splits give each program at least this many 128-column tiles; at most MAX_SPLITS of them.
MIN_TILES_PER_SPLIT, MAX_SPLITS = 4, 8


# The one-row GEMV: 32 columns × 4 scale blocks (512 K columns, 16 KB of e4m3) a program and
# iteration, 4 warps. Measured on the H200 (scripts/fp8_kernel_bench.py, BENCHMARKS.md) at the
# Qwen3-8B shapes: 12.6 / 9.9 / 30.7 / 18.5 µs for qkv / o / gate_up / down against the tl.dot
# kernel's best 15.6 / 12.3 / 40.9 / 24.4 (bf16 cuBLAS: 18.2 / 14.8 / 51.3 / 31.2).
GEMV_COLUMNS, GEMV_K_BLOCKS = 32, 4


def gemv_tiles(out_features: int, in_features: int, sms: int) -> WeightOnlyTiles:
    """One row: K split into the fewest equal parts (a divisor of the 512-column steps, so every
    load is mask-free) that give about four programs per SM, each part at least two steps long."""
    programs = triton.cdiv(out_features, GEMV_COLUMNS)
    steps = triton.cdiv(in_features, GEMV_K_BLOCKS * BLOCK)
    divisors = [d for d in range(1, MAX_SPLITS + 1) if steps % d == 0 and (steps // d >= 2 or d == 1)]
    split = next((d for d in divisors if programs * d >= 4 * sms), divisors[-1])
    return WeightOnlyTiles(1, GEMV_COLUMNS, 4, 2, split, gemv=True, k_blocks=GEMV_K_BLOCKS)


@functools.lru_cache(maxsize=None)       # a pure function of ints, asked once per linear per eager step
def weight_only_tiles(num_rows: int, out_features: int, in_features: int, sms: int) -> WeightOnlyTiles:
    """One row: the GEMV. More: rows rounded up to a tl.dot tile; 32 columns per program (the
    sweep's best at 16 rows); K split until there are about four programs per SM."""
    if num_rows == 1:
        return gemv_tiles(out_features, in_features, sms)
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    programs = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, 32)
    k_tiles = triton.cdiv(in_features, BLOCK)
    split = max(1, min(triton.cdiv(4 * sms, programs), k_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    return WeightOnlyTiles(block_m, 32, 4, 4, split)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                       bias: torch.Tensor | None, tiles: WeightOnlyTiles | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) · e4m3 weight [N, K] → [M, N] in x's dtype."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = tiles or weight_only_tiles(num_rows, out_features, in_features, num_sms(x.device))
    if tiles.gemv and num_rows != 1:
        raise ValueError(f"the GEMV tiles take one row, not {num_rows}")
    step = BLOCK * (tiles.k_blocks if tiles.gemv else 1)      # columns one loop iteration reads
    k_tiles = triton.cdiv(in_features, step)
    split = min(tiles.split_k, k_tiles)
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)              # no empty split
    partial = (torch.empty(split, num_rows, out_features, dtype=torch.float32, device=x.device)
               if split > 1 else out)                                                    # [S, M, N]
    k_per_split = tiles_per_split * step
    # Loads without masks where the shape allows (every real checkpoint's K and N): the masks'
    # runtime bounds keep Triton from issuing the widest vector loads.
    even_k = in_features % k_per_split == 0
    even_n = out_features % tiles.block_n == 0
    common = dict(SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features),
                  HAS_BIAS=bias is not None and split == 1, EVEN_K=even_k, EVEN_N=even_n,
                  BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.gemv:
        _gemv_kernel[(triton.cdiv(out_features, tiles.block_n), split)](
            x, weight, scale, bias if bias is not None else x, partial, out_features, in_features, k_per_split,
            weight.stride(0), scale.stride(0), out_features, KB=tiles.k_blocks, BLOCK_K=BLOCK, **common)
    else:
        grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), split)
        _weight_only_kernel[grid](
            x, weight, scale, bias if bias is not None else x, partial, num_rows, out_features, in_features,
            k_per_split, x.stride(0), weight.stride(0), scale.stride(0), partial.stride(-2),
            num_rows * out_features, PRECISION="ieee" if x.dtype == torch.float32 else None,
            BLOCK_M=tiles.block_m, BLOCK_K=BLOCK, **common)
    if split > 1:
        size = num_rows * out_features
        _split_sum_kernel[(triton.cdiv(size, 1024),)](partial, bias if bias is not None else x, out, size,
                                                      out_features, SPLITS=split, HAS_BIAS=bias is not None,
                                                      BLOCK=1024, num_warps=4)
    return out


def fp8_fp8_tiles(num_rows: int, out_features: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 128 × 128 where that fills every SM, else smaller tiles
    (256 rows × 4096 columns are 64 tiles of 128 × 128 for 132 SMs)."""
    for block_m, block_n, warps in ((128, 128, 8), (128, 64, 4)):
        if triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n) >= sms:
            return block_m, block_n, warps
    return 64, 64, 4


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
    block_m, block_n, warps = fp8_fp8_tiles(num_rows, out_features, num_sms(x.device))
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n),)
    _fp8_fp8_kernel[grid](
        q, x_scales, weight, scale, bias if bias is not None else x, out, num_rows, out_features, in_features,
        q.stride(0), x_scales.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, GROUP_M=8, num_warps=warps, num_stages=3)
    return out


if triton is not None:

    @triton.jit
    def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                            stride_sn, stride_om, stride_split, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """out[split, m, n] = Σ_kb scale[n // SCALE_ROWS, kb] · Σ_{k in kb} x[m, k] · w[n, k] over
        the split's columns K_PER_SPLIT · split … (+ bias[n]); one split: out[m, n] in out's dtype.
        EVEN_K: K is a multiple of K_PER_SPLIT; EVEN_N: N of BLOCK_N (no masks on the weight)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(2) * K_PER_SPLIT
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k_start + offs_k[:, None]   # [BLOCK_K, BLOCK_N]
        s_ptrs = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < K - k
                a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            partial = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
            s = tl.load(s_ptrs + k // SCALE_COLS) if EVEN_N else tl.load(s_ptrs + k // SCALE_COLS, mask=n_ok, other=0.0)
            acc += partial * s[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = (out_ptr + tl.program_id(2).to(tl.int64) * stride_split + offs_m[:, None].to(tl.int64) * stride_om
                    + offs_n[None, :])
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, K_PER_SPLIT, stride_wn, stride_sn, stride_split,
                     SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     EVEN_N: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row: out[split, 0, n] = Σ_kb scale[n // SCALE_ROWS, kb] · Σ_{k in kb} x[k] · w[n, k]
        (+ bias[n]) over the split's columns, KB blocks of BLOCK_K (one scale each) an iteration;
        products and sums in fp32 (an e4m3 times a bf16 value is exact in fp32)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(1) * K_PER_SPLIT
        offs_k = tl.arange(0, KB * BLOCK_K)
        n_ok = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_start + offs_k[None, :]   # [BLOCK_N, KB·BLOCK_K]
        s_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), KB * BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptr + k + offs_k).to(tl.float32)
                w = tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < K - k
                x = tl.load(x_ptr + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            products = tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, KB, BLOCK_K])
            block_sums = tl.sum(products, axis=2)                                             # [BLOCK_N, KB]
            columns = (k + tl.arange(0, KB) * BLOCK_K) // SCALE_COLS
            s_mask = n_ok[:, None] & ((k + tl.arange(0, KB) * BLOCK_K) < K)[None, :]
            s = tl.load(s_rows[:, None] + columns[None, :], mask=s_mask, other=0.0)
            acc += tl.sum(block_sums * s, axis=1)
            w_ptrs += KB * BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_split + offs_n, acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok)

    @triton.jit
    def _split_sum_kernel(partial_ptr, b_ptr, out_ptr, size, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """out = Σ_split partial[split] (+ bias) over the flat [M·N] outputs, splits in order."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < size
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            acc += tl.load(partial_ptr + split * size + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

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
