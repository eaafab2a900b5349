"""GGUF weights kept quantized on CPU: torch's packed int4 matmul serves 4- and 8-bit blocks.

llama.cpp's Q4_0 / Q4_1 / Q8_0 tensors are blocks of 32 weights along a row, each block one
scale (and Q4_1 a minimum): w = d·q + m. torch's CPU kernel `_weight_int4pack_mm_for_cpu` takes
4-bit codes in groups of 32 with a (scale, zero) pair per group and computes w = (q − 8)·scale +
zero, so a 4-bit block is one "plane" (scale d, zero m + 8d) and an 8-bit block is two: q8 =
16·hi + lo with hi + 8, lo ∈ [0, 16), i.e. (scale 16d, zero 0) and (scale d, zero 8d). The kernel
reads bf16 activations and bf16 scales (its fast path on AVX-512; fp32 inputs run a scalar
fallback 50× slower, scripts/cpu_qmatmul_bench.py), accumulates in fp32, and its rows do not
depend on how many rows come together (a verify's row equals the same row alone).

What it computes is exactly `reference_weight`: the blocks with their scales and zeros rounded to
bf16, applied to the activations rounded to bf16 (tests/test_quant.py holds the kernel to it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32                     # weights per GGUF block, and the kernel's group size
MATMUL_DTYPE = torch.bfloat16


@dataclass
class Plane:
    """One 4-bit plane: codes q [N, K] in 0 … 15, per-block scale and zero [N, K / 32] (fp32)."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass
class Blocks:
    """A GGUF tensor's blocks as 4-bit planes (their sum is the weight), rows in PyTorch order."""
    planes: list[Plane]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.planes[0].codes.shape)

    def rows(self, index: torch.Tensor) -> "Blocks":
        return Blocks([Plane(p.codes[index], p.scale[index], p.zero[index]) for p in self.planes])

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        """Blocks stacked by rows (a fused projection); all parts must have as many planes."""
        return Blocks([Plane(torch.cat([b.planes[i].codes for b in parts]), torch.cat([b.planes[i].scale for b in parts]),
                             torch.cat([b.planes[i].zero for b in parts])) for i in range(len(parts[0].planes))])


def q4_planes(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Blocks:
    """Q4_1 (w = d·q + m) or Q4_0 (m None: w = d·(q − 8)) as one plane."""
    zero = m + 8 * d if m is not None else torch.zeros_like(d)
    return Blocks([Plane(codes, d, zero)])


def q8_planes(values: torch.Tensor, d: torch.Tensor) -> Blocks:
    """Q8_0 (w = d·q, q int8) as two planes: q = 16·hi + lo."""
    q = values.to(torch.int32)
    hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)
    return Blocks([Plane(hi + 8, 16 * d, torch.zeros_like(d)), Plane(lo, d, 8 * d)])


def reference_weight(blocks: Blocks) -> torch.Tensor:
    """The fp32 weight [N, K] the kernel multiplies by: Σ planes (q − 8)·scale + zero, scales and
    zeros rounded to bf16 as the kernel stores them."""
    out = None
    for p in blocks.planes:
        scale = p.scale.to(MATMUL_DTYPE).float().repeat_interleave(GROUP, dim=1)
        zero = p.zero.to(MATMUL_DTYPE).float().repeat_interleave(GROUP, dim=1)
        w = (p.codes.float() - 8) * scale + zero
        out = w if out is None else out + w
    return out


class QuantLinear(nn.Module):
    """y = x Wᵀ (+ b) with W held as packed 4-bit planes (GGUF blocks); x and y fp32.

    `weight` is the shape, dtype and device of the weight it stands for (what the engine reads of
    a head: rows, device, activation dtype), a zero-stride view holding no values: the math is
    `forward`."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None) -> None:
        """parts: the projections stacked by rows, as FusedLinear's (q/k/v, gate/up), for split()."""
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.part_sizes = dict(parts or {})
        if self.in_features % GROUP:
            raise ValueError(f"a quantized row has {self.in_features} weights, not a multiple of {GROUP}")
        for i, plane in enumerate(blocks.planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(plane.codes.to(torch.int32).contiguous(), 1)
            scale_zero = torch.stack((plane.scale.t(), plane.zero.t()), dim=-1).to(MATMUL_DTYPE).contiguous()
            self.register_buffer(f"packed{i}", packed, persistent=False)             # [N, K / 2] uint8
            self.register_buffer(f"scale_zero{i}", scale_zero, persistent=False)     # [K / 32, N, 2]
        self.num_planes = len(blocks.planes)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self.packed0.device).expand(self.out_features, self.in_features)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused output [..., sum(parts)] → one view per part, in order (FusedLinear.split)."""
        return out.split(list(self.part_sizes.values()), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(MATMUL_DTYPE)                       # [M, K]
        out = None
        for i in range(self.num_planes):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, getattr(self, f"packed{i}"), GROUP,
                                                           getattr(self, f"scale_zero{i}")).float()
            out = y if out is None else out + y
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """Rows of a Q8_0 table, dequantized as they are looked up: d·q in fp32, exactly what
    dequantizing the whole table gives (an fp16 scale times an int8 fits fp32's mantissa)."""

    def __init__(self, values: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("values", values.to(torch.int8).contiguous(), persistent=False)   # [V, K]
        self.register_buffer("scales", d.float().contiguous(), persistent=False)                # [V, K / 32]

    @property
    def weight(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self.values.device).expand(*self.values.shape)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.values[ids].float().unflatten(-1, (-1, GROUP))                     # [..., K / 32, 32]
        return (rows * self.scales[ids][..., None]).flatten(-2)


def reference_linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What QuantLinear computes, written plainly: bf16-rounded x times reference_weight, fp32."""
    return F.linear(x.to(MATMUL_DTYPE).float(), reference_weight(blocks), bias)
