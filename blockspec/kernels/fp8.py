"""FP8 linear kernels (Triton): the CUDA path of `layers.fp8.Fp8Linear`.

`linear(x, weight, scale, block, bias)` has the result of `reference_linear`, the spec:
x · (weight · scale)ᵀ + bias with the weight dequantized to fp32 and rounded to x's dtype. Two
paths, chosen by the number of rows M (all fixed-shape, no host sync: inside CUDA graphs):

- M ≤ WEIGHT_ONLY_MAX_ROWS (decode rows, a few sequences' DFlash verify blocks): weight-only,
  one byte read per weight. Two kernels, chosen per row count by `weight_only_tiles`
  (TILES_BY_ROWS): a GEMV (no tl.dot: each program widens its e4m3 tile to fp32 once and reduces
  it against each of its 1-16 rows with fp32 FMAs) and a tl.dot kernel (e4m3 tiles widened to
  x's dtype in registers, exact: e4m3 fits in bf16; fp32 accumulation). Both scale each
  128-column block's partial sums by its block scale. Where N gives too few programs to keep
  every SM streaming, K is split too: each split writes its fp32 partial sums, which are added
  in split order (deterministic, no float atomics) with the bias, either by one small second
  kernel or inside the kernel by the last of a tile's programs to finish (an int32 arrival
  count per output tile, put back to 0 by that program: `split_counters`).
- larger M (prefill chunks, verify of many sequences): FP8 × FP8. x is quantized per row and
  128 columns (one scale each, largest magnitude → 448, `quantize_rows`) and the tensor cores
  multiply e4m3 by e4m3, each tile's partial product scaled by its row's and its weight
  block's scales. `reference_fp8_fp8` is its spec (x quantized the same way).

Measured on the H200 at the Qwen3-8B shapes (scripts/fp8_kernel_bench.py, BENCHMARKS.md): at
256 rows the FP8 × FP8 kernel took 0.39-0.52 × the weight-only kernel's time, hence the
threshold of 64 rows (not 256); swapping the dot's operands, weight tile first, was no better
(round 42; round 58 on the H100: 5-14 % slower at 4 and 16 rows); at one row the GEMV is
1.2-1.35 × faster than the best tl.dot tiles. Round 49's sweep (`fp8_kernel_bench.py
--sweep-only`) chose the GEMV at two rows too, x broadcast in the weight tile's layout, and K
split in 4 parts summed inside the kernel at every row count (TILES_BY_ROWS). Round 58 on the
H100: at 256 rows the FP8 × FP8 kernel took 1.1-1.6 × cuBLAS's bf16 time (`--fp8-fp8-sweep`
weighs its tiles).
Above 64 rows the product runs on torch._scaled_mm's 1 × 128 block scaling (cuBLASLt) where this
torch and GPU run it (bf16 activations, K in whole blocks, N % 16), else on ours, which runs the
same on every torch version; BLOCKSPEC_FP8_GEMM=triton keeps ours (side-by-side runs).
Unless BLOCKSPEC_FP8_BF16_TAIL=0: `linear_with_tail`, a mixed-format projection's bf16 rows
made by its e4m3 rows' weight-only launch (the column tiles past the e4m3 rows, unscaled).
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from blockspec.kernels.fused import k_split, silu_mul, use_triton
from blockspec.layers.fp8 import BLOCK, FP8, FP8_MAX, ScaleBlock, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the reference path serves
    triton = None

WEIGHT_ONLY_MAX_ROWS = 64
QUANT_GROUPS = 8             # quantize_rows: scale groups of 128 columns a program
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


# Above WEIGHT_ONLY_MAX_ROWS the FP8 × FP8 product runs on cuBLASLt (torch._scaled_mm with 1 × 128
# block scales on both sides) where this torch and device run it, else on our Triton kernel: the
# same product (x quantized per row × 128 columns, the weight's scales repeated over their rows).
# H100, round 58: 1.6-2.1 × faster than ours and 1.3-1.5 × faster than bf16 at 256-512 rows of the
# Qwen3-8B linears, where ours is 1.1-1.6 × slower than bf16; round 59, the engine: DFlash with FP8
# at 32 sequences 1.01 × bf16 (ours: 0.82 ×), the plain step 6.12 ms (ours 6.69). The default since
# round 59 (its GPU tests passed at 256-2,048 rows, with a bias and in a graph; 65 rows was refused,
# hence the padding to SCALED_MM_ROWS, whose GPU run passed in round 63 at 65-2,048 rows);
# BLOCKSPEC_FP8_GEMM=triton keeps our kernel (side-by-side runs).
FP8_GEMMS = ("triton", "cublas")


def fp8_gemm_from_env() -> str:
    """BLOCKSPEC_FP8_GEMM, or "cublas" (a value that is neither named in a warning)."""
    value = os.environ.get("BLOCKSPEC_FP8_GEMM", "cublas")
    if value not in FP8_GEMMS:
        logging.getLogger("blockspec.engine").warning(
            "BLOCKSPEC_FP8_GEMM=%r is not one of %s: the FP8 x FP8 product runs on cuBLASLt where it can",
            value, FP8_GEMMS)
        return "cublas"
    return value


FP8_GEMM = fp8_gemm_from_env()


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] → [..., N] (see the module doc)."""
    if not use_triton(x, bias):
        return reference_linear(x, weight, scale, block, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= WEIGHT_ONLY_MAX_ROWS or x.dtype == torch.float32:
        out = weight_only_linear(flat, weight, scale, block, bias)
    elif FP8_GEMM == "cublas" and blockwise_scaled_mm_serves(flat, weight):
        out = scaled_mm_linear(flat, weight, scale, block, bias)
    else:
        out = fp8_fp8_linear(flat, weight, scale, block, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def bf16_tail_from_env() -> bool:
    """BLOCKSPEC_FP8_BF16_TAIL: on unless "0"."""
    return os.environ.get("BLOCKSPEC_FP8_BF16_TAIL", "1") != "0"


# linear_with_tail: the bf16 rows of a mixed-format fused projection (Qwen3.5's GDN in_proj: b | a
# after the e4m3 qkv | z) made by the e4m3 rows' weight-only launch, which writes both into one
# output: at decode, a launch (a bf16 GEMM of 64 rows: 30 a step, 152 µs of Qwen3.5-35B-A3B's FP8
# plain step on the H200, issue 33) and the concatenation fewer. On since round 68's H100 run (the
# e4m3 columns bit for bit `linear`'s at 1–64 rows; with the MoE's arrivals, the FP8 MoE's plain
# step 4.44 → 4.15 ms); BLOCKSPEC_FP8_BF16_TAIL=0 keeps two GEMMs.
FP8_BF16_TAIL = bf16_tail_from_env()


def linear_with_tail(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                     tail: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] → [..., N + Nt]: `linear(x, weight, scale, block)` and x · tailᵀ (tail [Nt, K]
    in x's dtype) side by side from one weight-only launch, where one serves: FP8_BF16_TAIL, the
    Triton path, at most WEIGHT_ONLY_MAX_ROWS rows, and N in whole column tiles of the launch the
    e4m3 rows get alone (its e4m3 columns are then that launch's, bit for bit). Else None."""
    if not (FP8_BF16_TAIL and use_triton(x, tail)) or tail.dtype != x.dtype:
        return None
    flat = x.reshape(-1, x.shape[-1])
    num_rows, in_features = flat.shape
    if not 0 < num_rows <= WEIGHT_ONLY_MAX_ROWS:
        return None
    tiles = weight_only_tiles(num_rows, weight.shape[0], in_features, num_sms(x.device))
    if weight.shape[0] % tiles.block_n:
        return None
    out = weight_only_linear(flat, weight, scale, block, None, tiles, tail=tail)
    return out.view(*x.shape[:-1], out.shape[-1])


def column_scales(scale: torch.Tensor, block: ScaleBlock, out_features: int, in_features: int) -> torch.Tensor:
    """The weight's scales as torch._scaled_mm's 1 × 128 scales of its right operand (weightᵀ):
    [⌈K/128⌉, N], row-major, each 128-column block's scale repeated over the rows it covers
    (a per-channel scale over every block of its row). The same dequantized weight."""
    if block.cols < in_features and block.cols % BLOCK:
        raise ValueError(f"scale blocks {block.cols} columns wide are not whole 128-column blocks")
    per_row = scale.float().repeat_interleave(block.rows, dim=0)[:out_features]          # [N, ⌈K/cols⌉]
    k_blocks = -(-in_features // BLOCK)
    if block.cols >= in_features:
        per_row = per_row.expand(out_features, k_blocks)
    elif block.cols != BLOCK:
        per_row = per_row.repeat_interleave(block.cols // BLOCK, dim=1)[:, :k_blocks]
    return per_row.t().contiguous()


# column_scales per weight (its scale tensor): made by the first eager call, read by every later
# call and graph replay. A call inside a CUDA graph's capture that finds none makes its own (a
# tensor made during capture holds nothing until the graph replays, so it is never kept).
# Keyed by the scale tensor's id, the entry dropped when that tensor is (a weak-keyed dict would
# compare tensors with ==).
_column_scales: dict[int, torch.Tensor] = {}


def cached_column_scales(scale: torch.Tensor, block: ScaleBlock, out_features: int, in_features: int) -> torch.Tensor:
    kept = _column_scales.get(id(scale))
    if kept is not None:
        return kept
    made = column_scales(scale, block, out_features, in_features)
    if not (scale.is_cuda and torch.cuda.is_current_stream_capturing()):
        _column_scales[id(scale)] = made
        weakref.finalize(scale, _column_scales.pop, id(scale), None)
    return made


def refuse_a_captured_probe() -> None:
    """A probe inside a CUDA graph's capture would be captured, not run: raise instead."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the FP8 GEMM probe runs at the first eager call: run the linear once before "
                           "capturing a CUDA graph")


@functools.lru_cache(maxsize=None)
def has_blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes 1 × 128 block scales on this device (one tiny call)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    refuse_a_captured_probe()
    try:        # K of two blocks: scales of (16, 1) would pass as row-wise scaling
        q = torch.zeros(16, 2 * BLOCK, dtype=FP8, device=device)
        ones = torch.ones(16, 2, device=device)
        torch._scaled_mm(q, q.t(), scale_a=ones.t().contiguous().t(), scale_b=ones.t().contiguous(),
                         out_dtype=torch.bfloat16)
    except Exception:         # noqa: BLE001 - whatever this torch raises for a layout it lacks
        return False
    return True


@functools.lru_cache(maxsize=None)
def has_block128_scaled_mm(device: torch.device) -> bool:
    """Whether torch._scaled_mm also takes a weight's own 128 × 128 block scales (x's still 1 × 128)
    and reads them as laid out (one tiny call, eager, as `has_blockwise_scaled_mm`, its answer
    checked: distinct scales over 2 × 4 blocks, every sum exact in bf16)."""
    if not has_blockwise_scaled_mm(device):
        return False
    refuse_a_captured_probe()
    k_blocks, n_blocks = BLOCK_SCALES_K_GROUP, 2
    own = torch.arange(1, n_blocks * k_blocks + 1, dtype=torch.float32, device=device).view(n_blocks, k_blocks)
    try:
        a = torch.ones(16, k_blocks * BLOCK, device=device).to(FP8)
        b = torch.ones(n_blocks * BLOCK, k_blocks * BLOCK, device=device).to(FP8)
        out = torch._scaled_mm(a, b.t(), scale_a=torch.ones(k_blocks, 16, device=device).t(), scale_b=own.t(),
                               out_dtype=torch.bfloat16)
    except Exception:         # noqa: BLE001 - whatever this torch raises for the 128 x 128 form
        return False
    # column n: 128 · Σ_kb own[n // 128, kb]; scales read in another layout give other sums
    return torch.equal(out.float(), (BLOCK * own.sum(dim=1)).repeat_interleave(BLOCK).expand(16, -1))


# Above WEIGHT_BLOCK_SCALES_ROWS rows a 128 × 128-blocked weight's own scales go to cuBLASLt as they
# are: the same product as with `column_scales`, and faster there (H100, round 63,
# scripts/scaled_mm_layouts.py over the Qwen3-8B linears: 14 % less time at 512 and at 2,048 rows,
# even at 256, while at 80 rows the 1 × 128 form is 1.2-1.6 × faster for qkv_proj and down_proj).
WEIGHT_BLOCK_SCALES_ROWS = 256
# cuBLASLt reads 128 × 128 scales with their K axis padded to a whole number of 4 blocks (its
# scaling-factor layouts; pytorch #166752: silent wrong answers where K/128 is not a multiple of 4,
# which torch._scaled_mm does not check): the weight's own scales serve K in whole 512 columns only.
BLOCK_SCALES_K_GROUP = 4

# The (device, padded rows, N, K) whose 128 × 128 weight scales cuBLASLt refused: their 1 × 128
# column scales serve them from then on (`scaled_mm_quantized`).
_block_scales_refused: set[tuple[torch.device, int, int, int]] = set()


def weight_block_scales(scale: torch.Tensor, block: ScaleBlock, weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The weight's own scales [N/128, K/128] as torch._scaled_mm takes 128 × 128 ones ([K/128, N/128],
    strides (1, K/128): their transpose, no copy), where that form serves these rows; else None."""
    out_features, in_features = weight.shape
    if (rows <= WEIGHT_BLOCK_SCALES_ROWS or block != ScaleBlock() or out_features % BLOCK
            or in_features % (BLOCK * BLOCK_SCALES_K_GROUP) or scale.dtype != torch.float32
            or not scale.is_contiguous() or gemm_shape(weight.device, rows, weight) in _block_scales_refused
            or not has_block128_scaled_mm(weight.device)):
        return None
    return scale.t()


# cuBLASLt refused 1 × 128 block scales at 65 rows (H100, torch 2.11 + CUDA 13, round 59:
# CUBLAS_STATUS_NOT_SUPPORTED) and served 16 (the probe), 256, 512 and 2,048 (likely the scales'
# column of M fp32 values must be 16-byte aligned): x is padded with zero rows to a multiple of
# this (at most 15 rows beside the > 64 this path takes).
SCALED_MM_ROWS = 16


def blockwise_scaled_mm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLASLt's 1 × 128 block-scaled GEMM takes these shapes (K in whole blocks, N aligned; bf16,
    the dtype its GPU test covers)."""
    return (x.dtype == torch.bfloat16 and x.shape[1] % BLOCK == 0 and weight.shape[0] % 16 == 0
            and has_blockwise_scaled_mm(x.device))


# The (device, padded rows, N, K) that cuBLASLt refused at an eager call. Its block-scaled GEMM
# refuses some shapes with an error (65 rows, round 59) rather than wrong numbers; the padding
# above served every shape the H100 tried (round 63), and other GPUs, torch builds or shapes may
# differ: a shape it refuses is served by our kernel from then on,
# with one warning, instead of failing the step. Every graph is warmed eagerly before its capture
# (`GraphDispatcher.warm`), so a capture never meets a refusal for the first time.
_refused_by_cublas: set[tuple[torch.device, int, int, int]] = set()


def capturing(x: torch.Tensor) -> bool:
    """Whether x's device is capturing a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def gemm_shape(device: torch.device, rows: int, weight: torch.Tensor) -> tuple[torch.device, int, int, int]:
    """(device, padded rows, N, K): how the refusals below are keyed."""
    return (device, rows, *weight.shape)


def padded_rows(rows: int) -> int:
    """rows rounded up to a multiple of SCALED_MM_ROWS (what cuBLASLt is handed)."""
    return -(-rows // SCALED_MM_ROWS) * SCALED_MM_ROWS


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_fp8_linear`'s product through torch._scaled_mm: x [M, K] quantized per row × 128
    columns (`quantize_rows`), then `scaled_mm_quantized`. A shape cuBLASLt refuses runs on
    `fp8_fp8_linear` (the same product)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if gemm_shape(x.device, padded, weight) in _refused_by_cublas:
        return fp8_fp8_linear(x, weight, scale, block, bias)
    unpadded = x
    if padded != rows:            # zero rows: their outputs are computed and dropped, nothing else reads them
        x = F.pad(x, (0, 0, 0, padded - rows))
    # x's scales column-major, strides (1, M): the only layout torch takes for 1 × 128 scales
    q, x_scales = quantize_rows(x.contiguous(), column_major=True)
    return scaled_mm_quantized(q, x_scales, rows, weight, scale, block, bias, x.dtype,
                               lambda: fp8_fp8_linear(unpadded, weight, scale, block, bias))


def scaled_mm_quantized(q: torch.Tensor, x_scales: torch.Tensor, rows: int, weight: torch.Tensor,
                        scale: torch.Tensor, block: ScaleBlock, bias: torch.Tensor | None, dtype: torch.dtype,
                        refused: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The first `rows` rows of q (e4m3 [padded rows, K], its scales column-major) times the e4m3
    weight through torch._scaled_mm, with the weight's own 128 × 128 scales above
    WEIGHT_BLOCK_SCALES_ROWS rows, else its `column_scales` (made once per weight); a bias is
    added in fp32, as `reference_fp8_fp8` adds it. A shape cuBLASLt refuses is recorded and
    `refused()` (our kernel's same product) answers instead; a refusal of the weight's own
    scales is recorded apart, and its column scales are tried at once."""
    padded = q.shape[0]
    shape = gemm_shape(q.device, padded, weight)
    scale_b = own = weight_block_scales(scale, block, weight, padded)
    if scale_b is None:
        scale_b = cached_column_scales(scale, block, weight.shape[0], q.shape[1])
    try:
        out = torch._scaled_mm(q, weight.t(), scale_a=x_scales, scale_b=scale_b,
                               out_dtype=dtype if bias is None else torch.float32)[:rows]
    except RuntimeError as error:
        if capturing(q) or isinstance(error, torch.OutOfMemoryError):
            raise                 # a capture cannot fall back (and never meets a refusal first: see above); out of
                                  # memory is no refusal of the shape
        if own is not None:
            _block_scales_refused.add(shape)
            logging.getLogger("blockspec.engine").warning(
                "cuBLASLt refused a weight's own 128 x 128 scales at %d rows (N %d, K %d): its 1 x 128 scales "
                "serve that shape", padded, shape[2], shape[3])
            return scaled_mm_quantized(q, x_scales, rows, weight, scale, block, bias, dtype, refused)
        first_at_rows = not any(kept[:2] == shape[:2] for kept in _refused_by_cublas)
        _refused_by_cublas.add(shape)
        logging.getLogger("blockspec.engine").log(
            logging.WARNING if first_at_rows else logging.DEBUG,
            "cuBLASLt refused the block-scaled FP8 GEMM at %d rows (N %d, K %d): our Triton kernel serves "
            "that shape (%s)", padded, shape[2], shape[3], str(error).splitlines()[0] if str(error) else "no message")
        return refused()
    return out if bias is None else (out + bias.float()).to(dtype)


def fused_silu_from_env() -> bool:
    """BLOCKSPEC_FP8_FUSED_SILU: on unless "0"."""
    return os.environ.get("BLOCKSPEC_FP8_FUSED_SILU", "1") != "0"


# silu_mul_linear's fused quantization: on by default since its GPU run (round 64, H100: tests/gpu/test_fp8.py
# passed with it, the 512-row FP8 verify 10.97 -> 10.68 ms); BLOCKSPEC_FP8_FUSED_SILU=0 keeps silu_mul and
# quantize_rows as two launches (what to compare against, or a way around a kernel bug on new hardware).
FUSED_SILU_QUANTIZE = fused_silu_from_env()


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(silu_mul(gate_up), …)` (an MLP's down_proj): where cuBLASLt takes the product,
    silu(gate) · up is quantized by the kernel that makes it (`silu_mul_quantize`: the same codes
    and scales, one launch instead of two and no bf16 activation stored and read back)."""
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    rows, in_features = flat.shape[0], flat.shape[1] // 2
    padded = padded_rows(rows)
    if (not FUSED_SILU_QUANTIZE or not use_triton(flat, bias) or rows <= WEIGHT_ONLY_MAX_ROWS or FP8_GEMM != "cublas"
            or not blockwise_scaled_mm_serves(flat[:, :in_features], weight)
            or gemm_shape(flat.device, padded, weight) in _refused_by_cublas):
        return linear(silu_mul(gate_up), weight, scale, block, bias)
    q, x_scales = silu_mul_quantize(flat, padded)
    out = scaled_mm_quantized(q, x_scales, rows, weight, scale, block, bias, flat.dtype,
                              lambda: fp8_fp8_linear(silu_mul(flat), weight, scale, block, bias))
    return out.view(*gate_up.shape[:-1], weight.shape[0])


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
    """One launch's tiles. tl.dot kernel: BLOCK_M rows (≥ 16, tl.dot's smallest tile) ×
    BLOCK_N columns a program. GEMV (`gemv`): no tl.dot, whose 16-row tile is mostly padding at
    a few rows; each program reduces its [BLOCK_N, k_blocks · 128] weight tile, widened to fp32
    once, against each of its block_m rows (1, 2, 4, 8 or 16) with fp32 FMAs. Both: k_blocks
    128-column scale blocks an iteration (each scaled on its own), split_k the most parts K is
    split into; reduce_in_kernel: the split's last program to finish adds the parts (in split
    order, so bit for bit what the separate sum kernel gives) instead of a second launch.
    GEMV only: broadcast_x, x loaded in the weight tile's layout, no shared memory (`_load_row`);
    prefetch, the next step's weight tile loaded before this step's math (its num_stages does
    nothing: Triton pipelines only loads that feed tl.dot). tl.dot only: dot_f16, both operands
    widened to fp16 rather than x's bf16 (e4m3 → fp16 is one conversion, → bf16 two; a bf16 x is
    exact in fp16 within its range): an experiment (scripts/fp8_dot_f16_probe.py), not chosen
    by `weight_only_tiles`."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    gemv: bool = False
    k_blocks: int = 1
    reduce_in_kernel: bool = False
    broadcast_x: bool = False
    prefetch: bool = False
    dot_f16: bool = False

    def __post_init__(self) -> None:
        smallest = 1 if self.gemv else 16
        if self.block_m not in (1, 2, 4, 8, 16, 32, 64) or not smallest <= self.block_m <= (16 if self.gemv else 64):
            raise ValueError(f"block_m {self.block_m}: the GEMV takes 1-16 rows a program, tl.dot 16-64 "
                             "(a power of two)")


# K splits give each program at least this many 128-column tiles; at most MAX_SPLITS of them.
MIN_TILES_PER_SPLIT, MAX_SPLITS = 4, 8
# In-kernel split sums count arrivals per output tile in one int32 buffer per device; a launch
# with more tiles than this sums in the separate kernel instead.
MAX_COUNTED_TILES = 1 << 16

# The tiles each row count gets: the first entry whose row count is ≥ the rows (the K split is
# not here: it follows N, K and the SMs, at most `split_k` parts). Chosen by the H200 sweep of
# round 49 (`scripts/fp8_kernel_bench.py --sweep-only`, BENCHMARKS.md; one Qwen3-8B layer's four
# linears, µs): one row, the GEMV of 32 columns × 4 scale blocks, x broadcast in the weight's
# layout, K in 4 parts summed in the kernel: 69.4 (round 42's tiles 73.7 in the same run); two
# rows, the GEMV of 2 rows × 32 columns × 2 scale blocks: 80.5 (tl.dot 95.6); 3-64 rows, tl.dot
# on 16-row × 64-column tiles, 4 stages, K in up to 4 parts summed in the kernel: 92.5 at 16
# rows (96.6). Four parts were the best or within 6 % at every shape and row count swept.
ONE_ROW_TILES = WeightOnlyTiles(1, 32, 4, 2, 4, gemv=True, k_blocks=4, reduce_in_kernel=True, broadcast_x=True)
TWO_ROW_TILES = WeightOnlyTiles(2, 32, 4, 2, 4, gemv=True, k_blocks=2, reduce_in_kernel=True, broadcast_x=True)
FEW_ROW_TILES = WeightOnlyTiles(16, 64, 4, 4, 4, reduce_in_kernel=True)
TILES_BY_ROWS: tuple[tuple[int, WeightOnlyTiles], ...] = (
    (1, ONE_ROW_TILES), (2, TWO_ROW_TILES), (WEIGHT_ONLY_MAX_ROWS, FEW_ROW_TILES))


def gemv_split(tiles: WeightOnlyTiles, in_features: int) -> int:
    """K split into the most equal parts up to tiles.split_k (a divisor of the loop's steps, so
    every load is mask-free), each part at least two steps long: with the parts summed in the
    kernel, more parts never lost at the Qwen3-8B shapes up to 4 (round 49's sweep: gate_up at
    one row 30.7 µs in 4 parts, 32.5 whole, though 768 programs already fill the SMs)."""
    steps = triton.cdiv(in_features, tiles.k_blocks * BLOCK)
    divisors = [d for d in range(1, tiles.split_k + 1) if steps % d == 0 and (steps // d >= 2 or d == 1)]
    return divisors[-1]


def dot_split(tiles: WeightOnlyTiles, num_rows: int, out_features: int, in_features: int, sms: int) -> int:
    """K split until there are about four programs per SM, each part ≥ MIN_TILES_PER_SPLIT tiles."""
    programs = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(out_features, tiles.block_n)
    k_tiles = triton.cdiv(in_features, BLOCK)
    return max(1, min(triton.cdiv(4 * sms, programs), k_tiles // MIN_TILES_PER_SPLIT, tiles.split_k))


@functools.lru_cache(maxsize=None)       # a pure function of ints, asked once per linear per eager step
def weight_only_tiles(num_rows: int, out_features: int, in_features: int, sms: int) -> WeightOnlyTiles:
    """TILES_BY_ROWS's entry for the rows, its rows a program fitted to them (GEMV: ≤ the rows,
    rounded up to a power of two; tl.dot: ≥ them, ≤ 64) and its K split to the shape."""
    chosen = next((tiles for rows, tiles in TILES_BY_ROWS if num_rows <= rows), TILES_BY_ROWS[-1][1])
    rows_up = triton.next_power_of_2(num_rows)
    if chosen.gemv:
        chosen = replace(chosen, block_m=min(chosen.block_m, rows_up))
        split = gemv_split(chosen, in_features)
    else:
        chosen = replace(chosen, block_m=min(64, max(chosen.block_m, rows_up)))
        split = dot_split(chosen, num_rows, out_features, in_features, sms)
    return replace(chosen, split_k=split)


@functools.lru_cache(maxsize=None)
def split_counters(device: torch.device) -> torch.Tensor:
    """[MAX_COUNTED_TILES] int32 zeros: per output tile, how many of a K split's programs have
    added their part. Each launch's last program puts its tile's count back to 0, so the buffer
    is zero between launches and every CUDA-graph replay finds it so. Kernels that share it run
    one after another (one stream; the engine's side streams wait on each other)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the FP8 split counters are allocated by the first eager call: run the linear "
                           "once before capturing a CUDA graph")
    return torch.zeros(MAX_COUNTED_TILES, dtype=torch.int32, device=device)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                       bias: torch.Tensor | None, tiles: WeightOnlyTiles | None = None,
                       tail: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) · e4m3 weight [N, K] → [M, N] in x's dtype. With `tail`
    [Nt, K] (unscaled, x's dtype, no bias; N a multiple of the tiles' block_n): [M, N + Nt], the
    tail's products in the columns after N, made by the launch's last column tiles (`linear_with_tail`)."""
    num_rows, in_features = x.shape
    fp8_rows = weight.shape[0]
    out_features = fp8_rows + (0 if tail is None else tail.shape[0])
    x = x.contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    # The e4m3 rows' tiles (and so K split) whatever the tail: their sums are those of the launch without it.
    tiles = tiles or weight_only_tiles(num_rows, fp8_rows, in_features, num_sms(x.device))
    tail_args = {}
    if tail is not None:
        if fp8_rows % tiles.block_n or bias is not None or tail.dtype != x.dtype or tail.shape[1] != in_features:
            raise ValueError(f"a tail [{tail.shape[0]}, {tail.shape[1]}] {tail.dtype} takes x's dtype and K, no "
                             f"bias, and e4m3 rows ({fp8_rows}) in whole column tiles of {tiles.block_n}")
        tail = tail.contiguous()
        tail_args = dict(t_ptr=tail, stride_tn=tail.stride(0), N_FP8=fp8_rows, HAS_TAIL=True)
    split, k_per_split = k_split(in_features, BLOCK * tiles.k_blocks, tiles.split_k)
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), split)
    in_kernel = split > 1 and tiles.reduce_in_kernel and grid[0] * grid[1] <= MAX_COUNTED_TILES
    partial = (torch.empty(split, num_rows, out_features, dtype=torch.float32, device=x.device)
               if split > 1 else out)                                                    # [S, M, N]
    # Loads without masks where the shape allows (every real checkpoint's K and N): the masks'
    # runtime bounds keep Triton from issuing the widest vector loads.
    common = dict(SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features),
                  HAS_BIAS=bias is not None and (split == 1 or in_kernel), EVEN_K=in_features % k_per_split == 0,
                  EVEN_N=fp8_rows % tiles.block_n == 0, EVEN_M=num_rows % tiles.block_m == 0,
                  SPLIT_SUM=in_kernel, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, KB=tiles.k_blocks,
                  BLOCK_K=BLOCK, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    args = (x, weight, scale, bias if bias is not None else x, partial, out,
            split_counters(x.device) if in_kernel else partial, num_rows, out_features, in_features, k_per_split,
            x.stride(0), weight.stride(0), scale.stride(0))
    if tiles.gemv:
        _gemv_kernel[grid](*args, BROADCAST_X=tiles.broadcast_x, PREFETCH=tiles.prefetch, **common, **tail_args)
    else:
        _weight_only_kernel[grid](*args, PRECISION="ieee" if x.dtype == torch.float32 else None,
                                  DOT_F16=tiles.dot_f16 and x.dtype == torch.bfloat16, **common, **tail_args)
    if split > 1 and not in_kernel:
        size = num_rows * out_features
        _split_sum_kernel[(triton.cdiv(size, 1024),)](partial, bias if bias is not None else x, out, size,
                                                      out_features, SPLITS=split, HAS_BIAS=bias is not None,
                                                      BLOCK=1024, num_warps=4)
    return out


@dataclass(frozen=True)
class Fp8Fp8Tiles:
    """One FP8 × FP8 launch's tiles: BLOCK_M × BLOCK_N outputs a program (BLOCK_K is the scale
    block, 128), its warps and pipeline stages, and GROUP_M row tiles walked per column tile."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 3
    group_m: int = 8


def fp8_fp8_tiles(num_rows: int, out_features: int, sms: int) -> Fp8Fp8Tiles:
    """128 × 128 where that fills every SM, else smaller tiles (256 rows × 4096 columns are 64
    tiles of 128 × 128 for 132 SMs)."""
    for block_m, block_n, warps in ((128, 128, 8), (128, 64, 4)):
        if triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n) >= sms:
            return Fp8Fp8Tiles(block_m, block_n, warps)
    return Fp8Fp8Tiles(64, 64, 4)


def quantize_rows(x: torch.Tensor, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one launch: x [M, K] → (e4m3 [M, K], scales [M, ⌈K/128⌉]);
    column_major: the scales laid out with strides (1, M), as torch._scaled_mm takes them."""
    num_rows, in_features = x.shape
    groups = triton.cdiv(in_features, BLOCK)
    q = torch.empty(num_rows, in_features, dtype=FP8, device=x.device)
    if column_major:
        scales = torch.empty(groups, num_rows, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows:
        # QUANT_GROUPS scale groups a program (1,024 columns, 4 warps): one group a program made
        # 49k programs of 128 elements for 512 × 12,288 and ran at a quarter of the copy bandwidth
        # (2.3 of a 14 ms FP8 verify of 512 rows on the H100, round 63).
        per_program = min(QUANT_GROUPS, triton.next_power_of_2(groups))
        _quantize_rows_kernel[(num_rows, triton.cdiv(groups, per_program))](
            x, q, scales, in_features, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            FP8_MAX=FP8_MAX, BLOCK_K=BLOCK, GROUPS=per_program, num_warps=max(1, per_program // 2))
    return q, scales


def silu_mul_quantize(gate_up: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] → `quantize_rows(F.pad(silu_mul(gate_up), rows to padded), column_major=True)`
    in one launch: silu(gate) · up rounded to gate_up's dtype as `silu_mul` stores it, quantized per
    row and 128 columns; rows M … padded - 1 zero (codes 0, scales 1), as padded zero rows quantize."""
    num_rows, in_features = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1 and padded >= num_rows
    groups = triton.cdiv(in_features, BLOCK)
    q = torch.empty(padded, in_features, dtype=FP8, device=gate_up.device)
    scales = torch.empty(groups, padded, dtype=torch.float32, device=gate_up.device).t()
    if padded:
        per_program = min(QUANT_GROUPS, triton.next_power_of_2(groups))
        _silu_mul_quantize_kernel[(padded, triton.cdiv(groups, per_program))](
            gate_up, q, scales, num_rows, in_features, gate_up.stride(0), q.stride(0), scales.stride(0),
            scales.stride(1), FP8_MAX=FP8_MAX, BLOCK_K=BLOCK, GROUPS=per_program,
            num_warps=max(1, per_program // 2))
    return q, scales


def fp8_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   bias: torch.Tensor | None, tiles: Fp8Fp8Tiles | None = None) -> torch.Tensor:
    """x [M, K] quantized per row × 128 columns, then e4m3 × e4m3 → [M, N] in x's dtype (tiles:
    `fp8_fp8_tiles`' unless given, as scripts/fp8_kernel_bench.py --fp8-fp8-sweep does)."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x.contiguous()
    q, x_scales = quantize_rows(x)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = tiles or fp8_fp8_tiles(num_rows, out_features, num_sms(x.device))
    grid = (triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(out_features, tiles.block_n),)
    _fp8_fp8_kernel[grid](
        q, x_scales, weight, scale, bias if bias is not None else x, out, num_rows, out_features, in_features,
        q.stride(0), x_scales.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=block.rows, SCALE_COLS=scale_cols(block, in_features), HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK, GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


if triton is not None:
    from blockspec.kernels.fused import _round     # rounding where a torch op stores (silu_mul's)

    @triton.jit
    def _store_tile(acc, b_ptr, part_ptr, out_ptr, count_ptr, offs, ok, M, N, HAS_BIAS: tl.constexpr,
                    SPLIT_SUM: tl.constexpr):
        """acc: this program's fp32 sums for out.flat[offs] (offs = m · N + n) over its part of K.
        Not SPLIT_SUM: (+ bias) stored at part_ptr[split] in part_ptr's dtype (the output itself
        when K is not split; else fp32 parts that `_split_sum_kernel` adds). SPLIT_SUM: the part
        stored, and the tile's last program to arrive adds all parts as `_split_sum_kernel` does."""
        split = tl.program_id(2)
        size = M * N
        if SPLIT_SUM:
            tl.store(part_ptr + split.to(tl.int64) * size + offs, acc, mask=ok)
            # Every thread's stores precede the one atomic below (the barrier orders them within
            # the program; its release, cumulative, publishes them at GPU scope).
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:       # the last: its acquire sees every part
                total = tl.zeros_like(acc)
                parts = part_ptr + offs
                for _ in range(tl.num_programs(2)):      # in split order, as _split_sum_kernel adds
                    total += tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg")   # L2, never a stale L1 line
                    parts += size
                if HAS_BIAS:
                    total += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)
                tl.store(count_ptr + tile, 0)            # zero again for the next launch or graph replay
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
            tl.store(part_ptr + split.to(tl.int64) * size + offs, acc.to(part_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT,
                            stride_xm, stride_wn, stride_sn, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                            EVEN_M: tl.constexpr, SPLIT_SUM: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_F16: tl.constexpr = False, t_ptr=None, stride_tn=0, N_FP8=0,
                            HAS_TAIL: tl.constexpr = False):
        """Σ_kb scale[n // SCALE_ROWS, kb] · Σ_{k in kb} x[m, k] · w[n, k] over the split's columns
        K_PER_SPLIT · split …, KB blocks of BLOCK_K (one scale and one tl.dot each) an iteration;
        stored by `_store_tile`. EVEN_K: K is a multiple of K_PER_SPLIT; EVEN_N: N of BLOCK_N;
        EVEN_M: M of BLOCK_M (loads without masks). HAS_TAIL: the weight holds rows [0, N_FP8) (EVEN_N
        then says N_FP8 is a multiple of BLOCK_N) and the column tiles from N_FP8 on are the bf16
        tail's (`_tail_dot_tile`)."""
        if HAS_TAIL:
            if tl.program_id(1) * BLOCK_N >= N_FP8:
                _tail_dot_tile(x_ptr, t_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT, N_FP8,
                               stride_xm, stride_tn, HAS_BIAS, SPLIT_SUM, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
                return
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(2) * K_PER_SPLIT
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k_start + offs_k[:, None]   # [BLOCK_K, BLOCK_N]
        s_ptrs = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), KB * BLOCK_K):
            for kb in tl.static_range(KB):
                col = k + kb * BLOCK_K
                if EVEN_K:
                    a = (tl.load(x_ptrs + kb * BLOCK_K) if EVEN_M
                         else tl.load(x_ptrs + kb * BLOCK_K, mask=m_ok[:, None], other=0.0))
                    w = tl.load(w_ptrs + kb * BLOCK_K) if EVEN_N else tl.load(w_ptrs + kb * BLOCK_K,
                                                                               mask=n_ok[None, :], other=0.0)
                    s = tl.load(s_ptrs + col // SCALE_COLS) if EVEN_N else tl.load(s_ptrs + col // SCALE_COLS,
                                                                                  mask=n_ok, other=0.0)
                else:           # a block past K reads nothing, its scale included (partial · NaN is NaN)
                    k_ok = offs_k < K - col
                    a = tl.load(x_ptrs + kb * BLOCK_K, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    w = tl.load(w_ptrs + kb * BLOCK_K, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    s = tl.load(s_ptrs + col // SCALE_COLS, mask=offs_n < tl.where(col < K, N, 0), other=0.0)
                if DOT_F16:
                    partial = tl.dot(a.to(tl.float16), w.to(tl.float16))
                else:
                    partial = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
                acc += partial * s[None, :]
            x_ptrs += KB * BLOCK_K
            w_ptrs += KB * BLOCK_K
        offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        _store_tile(acc, b_ptr, part_ptr, out_ptr, count_ptr, offs, m_ok[:, None] & n_ok[None, :], M, N,
                    HAS_BIAS, SPLIT_SUM)

    @triton.jit
    def _tail_dot_tile(x_ptr, t_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT, N_FP8, stride_xm,
                       stride_tn, HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`_weight_only_kernel`'s program for a column tile from N_FP8 on: Σ_k x[m, k] · t[n − N_FP8, k]
        over the split's columns, the bf16 tail t unscaled, every load masked (a tail is a few
        rows, of any K); stored by `_store_tile` as the e4m3 columns are (split parts included)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(2) * K_PER_SPLIT
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
        t_ptrs = t_ptr + (offs_n - N_FP8)[None, :].to(tl.int64) * stride_tn + k_start + offs_k[:, None]   # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
            k_ok = offs_k < K - k
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            t = tl.load(t_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(a, t, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            t_ptrs += BLOCK_K
        offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        _store_tile(acc, b_ptr, part_ptr, out_ptr, count_ptr, offs, m_ok[:, None] & n_ok[None, :], M, N,
                    HAS_BIAS, SPLIT_SUM)

    @triton.jit
    def _tail_gemv_tile(x_ptr, t_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT, N_FP8, stride_xm,
                        stride_tn, HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BROADCAST_X: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, BLOCK_K: tl.constexpr):
        """`_gemv_kernel`'s program for a column tile from N_FP8 on: `_tail_dot_tile`'s sums, the
        bf16 tile widened to fp32 and reduced against each row with fp32 FMAs as the GEMV's are."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(2) * K_PER_SPLIT
        offs_k = tl.arange(0, KB * BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        t_ptrs = t_ptr + (offs_n - N_FP8)[:, None].to(tl.int64) * stride_tn + k_start + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), KB * BLOCK_K):
            t = tl.load(t_ptrs, mask=n_ok[:, None] & (offs_k < K - k)[None, :], other=0.0).to(tl.float32)
            for r in tl.static_range(BLOCK_M):
                row = tl.program_id(0) * BLOCK_M + r
                x = _load_row(x_ptr + row.to(tl.int64) * stride_xm + k, offs_n, offs_k,
                              tl.where(row < M, K - k, 0), False, BROADCAST_X)
                acc = _add_row_sums(acc, tl.sum(t * x, axis=1), r, BLOCK_M)
            t_ptrs += KB * BLOCK_K
        offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        _store_tile(acc, b_ptr, part_ptr, out_ptr, count_ptr, offs, n_ok[:, None] & m_ok[None, :], M, N,
                    HAS_BIAS, SPLIT_SUM)

    @triton.jit
    def _add_row_sums(acc, row_sums, r, BLOCK_M: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] (transposed: a row's sums along N) plus row r's sums [BLOCK_N]."""
        if BLOCK_M == 1:
            return acc + row_sums[:, None]
        return tl.where((tl.arange(0, BLOCK_M) == r)[None, :], acc + row_sums[:, None], acc)

    @triton.jit
    def _load_weights(w_ptrs, n_ok, offs_k, bound, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """The e4m3 tile at w_ptrs [BLOCK_N, KB·BLOCK_K], 0 past N and from column `bound` on."""
        if EVEN_K:
            return tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        return tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k < bound)[None, :], other=0.0)

    @triton.jit
    def _load_row(x_row_ptr, offs_n, offs_k, bound, EVEN: tl.constexpr, BROADCAST_X: tl.constexpr):
        """x_row[offs_k] (0 from `bound` on unless EVEN) in fp32, shaped to multiply a
        [BLOCK_N, len(offs_k)] weight tile. BROADCAST_X: each thread loads the values its weight
        columns meet (L1 hits after the first warp), already in the weight's layout; else one load
        a program, then redistributed through shared memory (a barrier a row and iteration)."""
        if BROADCAST_X:
            cols = offs_k[None, :] + 0 * offs_n[:, None]                                     # [BLOCK_N, KB·BLOCK_K]
            x = tl.load(x_row_ptr + cols) if EVEN else tl.load(x_row_ptr + cols, mask=cols < bound, other=0.0)
        else:
            x = (tl.load(x_row_ptr + offs_k) if EVEN
                 else tl.load(x_row_ptr + offs_k, mask=offs_k < bound, other=0.0))[None, :]   # [1, KB·BLOCK_K]
        return x.to(tl.float32)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT, stride_xm,
                     stride_wn, stride_sn, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, SPLIT_SUM: tl.constexpr,
                     BROADCAST_X: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, KB: tl.constexpr, BLOCK_K: tl.constexpr, t_ptr=None, stride_tn=0,
                     N_FP8=0, HAS_TAIL: tl.constexpr = False):
        """BLOCK_M rows a program, the weight tile read once for all of them: out[m, n] =
        Σ_kb scale[n // SCALE_ROWS, kb] · Σ_{k in kb} x[m, k] · w[n, k] over the split's columns,
        KB blocks of BLOCK_K (one scale each) an iteration; products and sums in fp32 (an e4m3
        times a bf16 value is exact in fp32). Stored by `_store_tile`. HAS_TAIL: as
        `_weight_only_kernel`'s, the tail's column tiles by `_tail_gemv_tile`."""
        if HAS_TAIL:
            if tl.program_id(1) * BLOCK_N >= N_FP8:
                _tail_gemv_tile(x_ptr, t_ptr, b_ptr, part_ptr, out_ptr, count_ptr, M, N, K, K_PER_SPLIT, N_FP8,
                                stride_xm, stride_tn, HAS_BIAS, SPLIT_SUM, BROADCAST_X, BLOCK_M, BLOCK_N, KB, BLOCK_K)
                return
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(2) * K_PER_SPLIT
        offs_k = tl.arange(0, KB * BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_start + offs_k[None, :]   # [BLOCK_N, KB·BLOCK_K]
        s_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        # Transposed, [BLOCK_N, BLOCK_M]: a row's sums come out along N and go in without a layout change.
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if PREFETCH:
            w_next = _load_weights(w_ptrs, n_ok, offs_k, K - k_start, EVEN_K, EVEN_N)
        for k in range(k_start, k_end, KB * BLOCK_K):
            if PREFETCH:
                w = w_next
                # The next step's tile in flight during this step's math (Triton pipelines only
                # loads that feed tl.dot); the last step loads its own again, so no mask is needed.
                ahead = tl.where(k + KB * BLOCK_K < k_end, KB * BLOCK_K, 0)
                w_next = _load_weights(w_ptrs + ahead, n_ok, offs_k, K - k - ahead, EVEN_K, EVEN_N)
            else:
                w = _load_weights(w_ptrs, n_ok, offs_k, K - k, EVEN_K, EVEN_N)
            w = w.to(tl.float32)
            columns = k + tl.arange(0, KB) * BLOCK_K
            s = tl.load(s_rows[:, None] + (columns // SCALE_COLS)[None, :], mask=n_ok[:, None] & (columns < K)[None, :],
                        other=0.0)                                                            # [BLOCK_N, KB]
            for r in tl.static_range(BLOCK_M):
                row = tl.program_id(0) * BLOCK_M + r
                x = _load_row(x_ptr + row.to(tl.int64) * stride_xm + k, offs_n, offs_k,
                              tl.where(row < M, K - k, 0), EVEN_K and EVEN_M, BROADCAST_X)
                products = tl.reshape(w * x, [BLOCK_N, KB, BLOCK_K])
                acc = _add_row_sums(acc, tl.sum(tl.sum(products, axis=2) * s, axis=1), r, BLOCK_M)
            w_ptrs += KB * BLOCK_K
        offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        _store_tile(acc, b_ptr, part_ptr, out_ptr, count_ptr, offs, n_ok[:, None] & m_ok[None, :], M, N,
                    HAS_BIAS, SPLIT_SUM)

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
    def _store_quantized(x, q_row_ptr, s_row_ptr, offs, groups, K, stride_sg, FP8_MAX: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """x [GROUPS, BLOCK_K] fp32 (one scale group a tile row, columns offs) quantized: its
        largest magnitude → FP8_MAX (scale 1 for an all-zero group), the e4m3 codes at
        q_row_ptr + offs and the scales at s_row_ptr + groups · stride_sg."""
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
        q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=offs < K)
        tl.store(s_row_ptr + groups * stride_sg, scale, mask=groups * BLOCK_K < K)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg,
                              FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
        """Row program_id(0), scale groups GROUPS · program_id(1) … + GROUPS - 1 (as a
        [GROUPS, BLOCK_K] tile: one largest magnitude per tile row)."""
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = groups[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        _store_quantized(x, q_ptr + row * stride_qm, s_ptr + row * stride_sm, offs, groups, K, stride_sg,
                         FP8_MAX, BLOCK_K)

    @triton.jit
    def _silu_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                                  FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
        """`_quantize_rows_kernel` over silu(gate) · up of x = [gate | up] (K columns each),
        rounded where `_silu_mul_kernel` stores; rows from M on (cuBLASLt's padding) read nothing."""
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = groups[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        ok = offs < tl.where(row < M, K, 0)            # a padding row reads nothing
        dtype = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_xm + K + offs, mask=ok, other=0.0).to(tl.float32)
        x = _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
        _store_quantized(x, q_ptr + row * stride_qm, s_ptr + row * stride_sm, offs, groups, K, stride_sg,
                         FP8_MAX, BLOCK_K)

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
