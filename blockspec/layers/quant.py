"""GGUF weights kept quantized on CPU.

llama.cpp's Q4_0 / Q4_1 / Q8_0 tensors are blocks of 32 weights along a row, each block one
scale (and Q4_1 a minimum): w = scale·q + shift (Q4_1: shift = m; Q4_0: q − 8, shift = −8·scale;
Q8_0: q int8, shift 0). `Blocks` holds them as the file does.

QuantLinear runs them through one of three kernels:
- "q8" (kernels/cpu_kernels.cpp, where it builds; the default there): the blocks as stored (4-bit
  codes packed two to a byte, int8 values) times the activations quantized to int8 per block of
  32, as llama.cpp's CPU matmuls do: x ≈ d_x · q_x with d_x = max|x| / 127 and q_x rounded to
  nearest even; each block's integer products summed exactly, scaled by d_w · d_x in fp32; a
  4-bit block's shift times the block's fp32 sum of x. `reference_linear(kernel="q8")` is
  its spec (tests/test_quant.py holds it within fp32 rounding of that). Its matmuls run
  1.3–1.5 × the fp32 kernel's at one row, SmolLM2's decoding 1.1 × (BENCHMARKS.md, round 57), at
  the error of 8-bit activations.
- "native" (the same library; BLOCKSPEC_CPU_KERNELS=fp32): each weight rebuilt in fp32 exactly as
  dequantizing the file does and multiplied by the fp32 activations: the dequantized weight's
  matmul summed in another order (`reference_linear`, within fp32 rounding of it).
- "int4pack", torch's packed int4 CPU matmul (`_weight_int4pack_mm_for_cpu`), where our kernels
  cannot be built: 4-bit codes in groups of 32 with a (scale, zero) pair per group, w = (q − 8)·
  scale + zero, so a 4-bit block is one plane (scale, zero shift + 8·scale) and an 8-bit block two
  (q8 = 16·hi + lo, hi + 8 and lo in 0 … 15). It reads bf16 activations and bf16 scales (fp32
  inputs run a scalar fallback 50× slower, scripts/cpu_qmatmul_bench.py) and computes exactly
  `reference_weight(planes)` applied to the bf16-rounded activations.
Both compute each row the same way however many rows come together (a verify's row equals the
same row alone).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kernels import native

GROUP = 32                     # weights per GGUF block, and the int4 kernel's group size
MATMUL_DTYPE = torch.bfloat16  # the int4 kernel's activations and scales


@dataclass
class Plane:
    """One 4-bit plane of the int4 kernel: codes q [N, K] in 0 … 15, per-block scale and zero [N, K / 32]."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass
class Blocks:
    """A GGUF tensor's blocks, rows in PyTorch order: values [N, K] (4-bit codes 0 … 15 as uint8,
    or Q8_0's int8), scale [N, K / 32] fp32, shift [N, K / 32] fp32 (None for Q8_0)."""
    values: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor | None

    @property
    def bits(self) -> int:
        return 4 if self.shift is not None else 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def rows(self, index: torch.Tensor) -> "Blocks":
        return Blocks(self.values[index], self.scale[index], None if self.shift is None else self.shift[index])

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        """Blocks stacked by rows (a fused projection); all parts must have as many bits."""
        shift = None if parts[0].shift is None else torch.cat([b.shift for b in parts])
        return Blocks(torch.cat([b.values for b in parts]), torch.cat([b.scale for b in parts]), shift)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K], as the gguf package dequantizes it (scale·q exact, + shift rounds once)."""
        expand = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        w = self.values.float() * expand(self.scale)
        return w if self.shift is None else w + expand(self.shift)

    def planes(self) -> list[Plane]:
        """The int4 kernel's planes: one for 4-bit blocks, two (hi, lo) for Q8_0."""
        if self.shift is not None:
            return [Plane(self.values, self.scale, self.shift + 8 * self.scale)]
        q = self.values.to(torch.int32)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)
        return [Plane(hi + 8, 16 * self.scale, torch.zeros_like(self.scale)), Plane(lo, self.scale, 8 * self.scale)]


def q4_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Blocks:
    """Q4_1 (w = d·q + m) or Q4_0 (m None: w = d·(q − 8))."""
    return Blocks(codes.to(torch.uint8), d, m if m is not None else -8 * d)


def q8_blocks(values: torch.Tensor, d: torch.Tensor) -> Blocks:
    """Q8_0 (w = d·q, q int8)."""
    return Blocks(values.to(torch.int8), d, None)


def reference_weight(planes: list[Plane]) -> torch.Tensor:
    """The fp32 weight [N, K] the int4 kernel multiplies by: Σ planes (q − 8)·scale + zero, scales
    and zeros rounded to bf16 as the kernel stores them."""
    out = None
    for p in planes:
        scale = p.scale.to(MATMUL_DTYPE).float().repeat_interleave(GROUP, dim=1)
        zero = p.zero.to(MATMUL_DTYPE).float().repeat_interleave(GROUP, dim=1)
        w = (p.codes.float() - 8) * scale + zero
        out = w if out is None else out + w
    return out


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] → [N, K / 2] bytes in GGUF's block layout (byte j of a block: weight j
    in the low nibble, weight j + 16 in the high one)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def as_half_bits(t: torch.Tensor) -> torch.Tensor:
    return t.half().contiguous().view(torch.int16)


def native_fits(blocks: Blocks) -> bool:
    """Whether the native kernel holds these blocks as the file does: scales and shifts exact in
    fp16 (a file's are; Q4_0's −8·scale is unless it overflows), rows of at most 1024 blocks."""
    parts = [blocks.scale] + ([blocks.shift] if blocks.shift is not None else [])
    return blocks.shape[1] <= 1024 * GROUP and all(torch.equal(t.half().float(), t) for t in parts)


def default_kernel(blocks: Blocks) -> str:
    """q8 (or native, native.activations()) where our kernels build and hold these blocks, else int4pack."""
    if not native.available() or not native_fits(blocks):
        return "int4pack"
    return "q8" if native.activations() == "int8" else "native"


class QuantLinear(nn.Module):
    """y = x Wᵀ (+ b) with W held as GGUF blocks; x and y fp32.

    kernel: "q8", "native" or "int4pack" (the module docstring); None picks q8 where our kernels
    build (native with BLOCKSPEC_CPU_KERNELS=fp32), else int4pack.
    `weight` is the shape, dtype and device of the weight it stands for (what the engine reads of
    a head: rows, device, activation dtype), a zero-stride view holding no values: the math is
    `forward`."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None,
                 kernel: str | None = None) -> None:
        """parts: the projections stacked by rows, as FusedLinear's (q/k/v, gate/up), for split()."""
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.part_sizes = dict(parts or {})
        if self.in_features % GROUP:
            raise ValueError(f"a quantized row has {self.in_features} weights, not a multiple of {GROUP}")
        self.kernel = kernel or default_kernel(blocks)
        self.bits = blocks.bits
        if self.kernel in ("q8", "native"):
            if not native_fits(blocks):
                raise ValueError("these blocks' scales do not fit the native kernel (fp16, rows ≤ 32768 weights)")
            values = pack_nibbles(blocks.values) if blocks.bits == 4 else blocks.values.contiguous()
            self.register_buffer("values", values, persistent=False)                      # [N, K / 2] or [N, K]
            self.register_buffer("scale", as_half_bits(blocks.scale), persistent=False)  # [N, K / 32] fp16 bits
            self.register_buffer("shift", None if blocks.shift is None else as_half_bits(blocks.shift),
                                 persistent=False)
            self.num_planes = 0
        else:
            planes = blocks.planes()
            for i, plane in enumerate(planes):
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(plane.codes.to(torch.int32).contiguous(), 1)
                scale_zero = torch.stack((plane.scale.t(), plane.zero.t()), dim=-1).to(MATMUL_DTYPE).contiguous()
                self.register_buffer(f"packed{i}", packed, persistent=False)             # [N, K / 2] uint8
                self.register_buffer(f"scale_zero{i}", scale_zero, persistent=False)     # [K / 32, N, 2]
            self.num_planes = len(planes)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        device = (self.packed0 if self.kernel == "int4pack" else self.values).device
        return torch.zeros((), dtype=torch.float32, device=device).expand(self.out_features, self.in_features)

    def blocks(self) -> Blocks:
        """The blocks a q8 or native layer holds, unpacked (what `reference_linear` takes)."""
        if self.kernel == "int4pack":
            raise ValueError("an int4pack layer holds its kernel's planes, not the file's blocks")
        scale = self.scale.view(torch.float16).float()
        if self.bits == 8:
            return Blocks(self.values, scale, None)
        n, half = self.values.shape
        packed = self.values.view(n, half // (GROUP // 2), GROUP // 2)
        codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(n, 2 * half)
        return Blocks(codes, scale, self.shift.view(torch.float16).float())

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused output [..., sum(parts)] → one view per part, in order (FusedLinear.split)."""
        return out.split(list(self.part_sizes.values()), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)                                        # [M, K]
        if self.kernel in ("q8", "native"):
            matmul = native.quant_linear_q8 if self.kernel == "q8" else native.quant_linear
            out = matmul(flat.float(), self.bits, self.values, self.scale, self.shift, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        flat = flat.to(MATMUL_DTYPE)
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


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q8 kernel's activations: x [M, K] fp32 → (q [M, K / 32, 32] int8 values as float64,
    d [M, K / 32] = max|x| / 127 in fp32, the blocks' sums Σx [M, K / 32] in float64)."""
    blocks = x.float().unflatten(-1, (-1, GROUP))
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)          # round half to even, as the kernel
    q = q.nan_to_num(0.0)           # 0 · inf (a block whose max is below ~4e-37) and NaN inputs: 0, as the kernel
    return q.double(), amax / 127.0, blocks.double().sum(-1)


def reference_linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None,
                     kernel: str = "native") -> torch.Tensor:
    """What QuantLinear's kernel computes, written plainly (fp32 out; float64 inside, so only the
    kernel's own fp32 rounding is left to compare): native, the dequantized weight's matmul; q8,
    Σ_blocks (d_w · d_x, rounded to fp32) · Σ q_w · q_x + shift · Σx; int4pack, bf16-rounded x
    times reference_weight."""
    if kernel == "q8":
        q, dx, sums = quantize_activations(x)                                 # [M, B, 32], [M, B], [M, B]
        codes = blocks.values.double().unflatten(-1, (-1, GROUP))            # [N, B, 32]
        products = torch.einsum("mbj,nbj->mnb", q, codes)                    # exact integers
        scales = (blocks.scale[None] * dx[:, None]).double()                  # fp32 products, as the kernel's
        out = (products * scales).sum(-1)
        if blocks.shift is not None:
            out = out + (blocks.shift.double()[None] * sums[:, None]).sum(-1)
        return (out if bias is None else out + bias.double()).float()
    if kernel == "native":
        out = F.linear(x.double(), blocks.dequantized().double(), None if bias is None else bias.double())
        return out.float()
    return F.linear(x.to(MATMUL_DTYPE).float(), reference_weight(blocks.planes()), bias)
