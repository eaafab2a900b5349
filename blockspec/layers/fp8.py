"""FP8 weights: block-scaled e4m3 linears and experts, and how a checkpoint becomes them.

The format is Qwen's (and DeepSeek's) FP8 checkpoints: `quantization_config` {"quant_method":
"fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}; each
quantized `X.weight` [N, K] is float8_e4m3fn with `X.weight_scale_inv` [⌈N/128⌉, ⌈K/128⌉], and
the real weight is weight · scale of its 128 × 128 block (the last blocks of a shape that is not
a multiple of 128 are partial: they cover what is left). Which modules are FP8 is what the
checkpoint says, tensor by tensor (a `weight_scale_inv` next to the weight): Qwen keeps lm_head,
embeddings, norms, routers and the Gated DeltaNet's a / b projections in bf16.

Fused projections stay one GEMM (qkv_proj, gate_up_proj, the stacked experts): their parts'
FP8 rows are concatenated and so are their scale rows. A part boundary inside a 128-row block
(k_proj starting at row 192) would give one block two scales, so such a module keeps one scale
row per weight row (`ScaleBlock.rows` = 1, the part's block scales repeated over its rows): the
kernels read scale[n // rows, k // cols] either way. A fused module whose parts are of mixed
formats (GDN in_proj: qkv and z in FP8, b and a in bf16) becomes a `SegmentedLinear`, one GEMM
per run of parts of one format; its `parts` hands each part over as a view of its own run's
output (no concatenation to split again).

`--quantization fp8` quantizes a bf16 checkpoint on load into the same format (128 × 128 blocks,
the parts quantized one by one as an FP8 checkpoint holds them): `fp8_stream` turns the
tensor stream into what an FP8 checkpoint would have given, so one load path serves both.

The forward is `kernels.fp8.linear`: Triton kernels on CUDA, and a dequantizing reference
elsewhere (CPU: weight · scale in fp32, then the model's dtype), which tests compare to
transformers running the same weights dequantized. The draft and the KV cache never see FP8.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.common import FusedLinear
from blockspec.layers.moe import Experts
from blockspec.models.registry import ParamSlice, Rename

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                           # the largest finite e4m3fn value
BLOCK = 128
SCALE = ".weight_scale_inv"
EXPERT_SCALES = ("gate_up_proj_scale_inv", "down_proj_scale_inv")   # fused-expert FP8 names (transformers')


class Fp8Error(ValueError):
    """An FP8 checkpoint or option we cannot serve; the message says which and why."""


@dataclass(frozen=True)
class ScaleBlock:
    """Weight rows × columns one scale covers (128 × 128; rows 1 where a fused part boundary
    falls inside a 128-row block)."""
    rows: int = BLOCK
    cols: int = BLOCK

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return -(-out_features // self.rows), -(-in_features // self.cols)


# ---------------------------------------------------------------------------------------------
# the format

def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock) -> torch.Tensor:
    """weight [..., N, K] e4m3, scale [..., ⌈N/rows⌉, ⌈K/cols⌉] → weight · scale [..., N, K] fp32."""
    rows, cols = weight.shape[-2:]
    expanded = scale.float().repeat_interleave(block.rows, dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block.cols, dim=-1)[..., :cols]
    return weight.float() * expanded


def quantize(weight: torch.Tensor, block: ScaleBlock = ScaleBlock()) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] → (e4m3 [..., N, K], scale [..., ⌈N/rows⌉, ⌈K/cols⌉] fp32): each block's
    scale maps its largest magnitude to 448 (an all-zero block gets scale 1)."""
    rows, cols = weight.shape[-2:]
    nb, kb = block.scale_shape(rows, cols)
    w = weight.float()
    padded = F.pad(w, (0, kb * block.cols - cols, 0, nb * block.rows - rows))
    blocks = padded.unflatten(-1, (kb, block.cols)).unflatten(-3, (nb, block.rows))    # [..., nb, r, kb, c]
    amax = blocks.abs().amax(dim=(-3, -1))                                              # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale.repeat_interleave(block.rows, dim=-2)[..., :rows, :].repeat_interleave(block.cols, dim=-1)
    q = (w / expanded[..., :cols]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fused_scale_block(part_sizes: Iterable[int]) -> ScaleBlock:
    """128-row blocks when every part but the last ends on a block boundary, else a scale per row."""
    sizes = list(part_sizes)
    return ScaleBlock() if all(size % BLOCK == 0 for size in sizes[:-1]) else ScaleBlock(rows=1)


def part_scale_rows(tensor: torch.Tensor, part_rows: int, block: ScaleBlock) -> torch.Tensor:
    """A part's checkpoint scale [⌈n/128⌉, Kb] as the fused module holds it: the same rows, or
    (rows 1) one row per weight row of the part [n, Kb]."""
    if block.rows == BLOCK:
        return tensor
    return tensor.repeat_interleave(BLOCK, dim=-2)[..., :part_rows, :]


# ---------------------------------------------------------------------------------------------
# modules

class KeepsFormat(nn.Module):
    """A module whose e4m3 weights and fp32 scales stay so when the model is cast to its compute
    dtype (`model.to(torch.bfloat16)`): device moves apply, dtype changes do not."""

    kept: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        def keep(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        kept = {name: self._parameters[name] for name in self.kept if self._parameters.get(name) is not None}
        for name in kept:
            del self._parameters[name]
        super()._apply(fn, recurse)
        for name, param in kept.items():
            self._parameters[name] = nn.Parameter(keep(param.data), requires_grad=False)
        return self


class Fp8Linear(KeepsFormat):
    """y = x · (weight · scale)ᵀ + bias, the weight e4m3 [N, K] with block scales; with `parts`,
    a fused projection (FusedLinear's split / project / part_rows)."""

    kept = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, bias: bool = False, block: ScaleBlock = ScaleBlock(),
                 parts: dict[str, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(block.scale_shape(out_features, in_features)),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.part_sizes = dict(parts or {})
        self.part_rows = rows_of(self.part_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from blockspec.kernels.fp8 import linear
        return linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def of_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_mul(gate_up)), the activation quantized where it is made when cuBLASLt takes
        the product (MLP.forward: the down projection)."""
        from blockspec.kernels.fp8 import silu_mul_linear
        return silu_mul_linear(gate_up, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block).to(dtype)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.part_sizes.values()), dim=-1)

    def project(self, x: torch.Tensor, first: str, last: str | None = None) -> torch.Tensor:
        """Only the parts first … last (the whole GEMM, then their columns: a draft-side call)."""
        start, stop = self.part_rows[first][0], self.part_rows[last or first][1]
        return self(x)[..., start:stop]


class SegmentedLinear(nn.Module):
    """A fused projection whose parts come in two formats: one GEMM per run of consecutive parts
    of one format (`segments`, each an Fp8Linear or a PartsLinear), outputs side by side; `parts`
    gives them without putting them side by side. An e4m3 run then a bf16 one, without biases
    (GDN's in_proj), can be one launch (`joined`)."""

    def __init__(self, segments: list[nn.Module]) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.in_features = segments[0].in_features          # every segment reads the same input
        self.part_sizes = {name: size for seg in segments for name, size in seg.part_sizes.items()}
        self.part_rows = rows_of(self.part_sizes)
        self.has_bf16_tail = (len(segments) == 2 and isinstance(segments[0], Fp8Linear)
                              and isinstance(segments[1], PartsLinear)
                              and all(segment.bias is None for segment in segments))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.joined(x)
        return joined if joined is not None else torch.cat([segment(x) for segment in self.segments], dim=-1)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One output per part, in order, each a view of its own segment's output (or of the one
        launch's, `joined`): the values of split(self(x)) without the concatenation, which a
        caller that splits at once would only undo (GDN's in_proj: a launch and a copy of the
        outputs a layer fewer)."""
        joined = self.joined(x)
        if joined is not None:
            return self.split(joined)
        return tuple(part for segment in self.segments
                     for part in segment(x).split(list(segment.part_sizes.values()), dim=-1))

    def joined(self, x: torch.Tensor) -> torch.Tensor | None:
        """Both runs' outputs side by side from the e4m3 run's weight-only launch, the bf16 rows
        its last column tiles (kernels/fp8.linear_with_tail: on unless BLOCKSPEC_FP8_BF16_TAIL=0;
        decode rows on CUDA); else None, and each run is a GEMM of its own."""
        if not self.has_bf16_tail:
            return None
        from blockspec.kernels.fp8 import linear_with_tail
        fp8_run, bf16_run = self.segments
        return linear_with_tail(x, fp8_run.weight, fp8_run.weight_scale_inv, fp8_run.block, bf16_run.weight)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.part_sizes.values()), dim=-1)

    def project(self, x: torch.Tensor, first: str, last: str | None = None) -> torch.Tensor:
        start, stop = self.part_rows[first][0], self.part_rows[last or first][1]
        return self(x)[..., start:stop]


class PartsLinear(nn.Linear):
    """The bf16 run of a SegmentedLinear: consecutive parts in one weight. Not a FusedLinear: its
    parts load through the plan (their names are siblings of the whole fused module)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.part_sizes = dict(parts)


class Fp8Experts(KeepsFormat):
    """Experts with e4m3 weights: gate_up_proj [E, 2I, H], down_proj [E, H, I] and their block
    scales [E, ·, ·] (rows 1 for gate_up when I is not a multiple of 128: per-expert
    checkpoints scale gate and up separately)."""

    kept = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, gate_up_block: ScaleBlock) -> None:
        super().__init__()
        self.gate_up_block, self.down_block = gate_up_block, ScaleBlock()
        shapes = {"gate_up_proj": (2 * intermediate_size, hidden_size), "down_proj": (hidden_size, intermediate_size)}
        for name, block in (("gate_up_proj", gate_up_block), ("down_proj", self.down_block)):
            rows, cols = shapes[name]
            setattr(self, name, nn.Parameter(torch.empty(num_experts, rows, cols, dtype=FP8), requires_grad=False))
            setattr(self, name + "_scale_inv", nn.Parameter(torch.empty(num_experts, *block.scale_shape(rows, cols)),
                                                            requires_grad=False))

    def stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized weights (the reference path's experts)."""
        return (dequantize(self.gate_up_proj, self.gate_up_proj_scale_inv, self.gate_up_block).to(dtype),
                dequantize(self.down_proj, self.down_proj_scale_inv, self.down_block).to(dtype))

    @property
    def scales(self):
        from blockspec.kernels.moe import ExpertScales
        return ExpertScales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.gate_up_block, self.down_block)


def rows_of(part_sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    rows, start = {}, 0
    for name, size in part_sizes.items():
        rows[name] = (start, start + size)
        start += size
    return rows


# ---------------------------------------------------------------------------------------------
# which modules a checkpoint makes FP8, and the conversion

def check_quantization_config(config: dict[str, Any]) -> bool:
    """True for an FP8 block-wise checkpoint we serve, False for an unquantized one; Fp8Error
    for anything else that says it is quantized."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "fp8":
        raise Fp8Error(f"quantization_config quant_method {method!r} is not supported (fp8 block-wise is)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise Fp8Error(f"FP8 format {quant.get('fmt')!r} is not supported (e4m3 is)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8Error(f"FP8 activation_scheme {quant.get('activation_scheme')!r} is not supported (dynamic is)")
    if list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise Fp8Error(f"FP8 weight_block_size {quant.get('weight_block_size')} is not supported "
                       f"([{BLOCK}, {BLOCK}] is)")
    return True


# Linears `--quantization fp8` leaves in bf16, as Qwen's FP8 checkpoints do: the router and the
# shared expert's gate (routing decisions), GDN's a / b (decay and write strength per head).
KEPT_BF16 = re.compile(r".*\.(mlp\.gate|shared_expert_gate|linear_attn\.in_proj_(a|b|ba))")


def quantizable(module_name: str) -> bool:
    """Whether --quantization fp8 quantizes the linear (or fused part) `module_name`: the decoder
    layers' projections and experts; never lm_head, embeddings or the KEPT_BF16 ones."""
    return module_name.startswith("model.layers.") and KEPT_BF16.fullmatch(module_name) is None


@dataclass
class Fp8Plan:
    """Our names of the FP8 tensors of one load: `X` for every `X.weight` stored as e4m3 (and,
    for fused experts, `…experts.gate_up_proj` / `…experts.down_proj`; `…experts.per_expert`:
    the experts' per-expert tensors). on_load: the checkpoint is bf16 and `fp8_stream` quantizes
    these as it reads them, on `device` (the model's: a GPU quantizes 8B weights in seconds)."""
    fp8: set[str]
    on_load: bool = False
    device: torch.device | None = None
    # filled by convert(): checkpoint names (ours) → where the tensor goes, and how a part's scale
    # is laid out in its fused module
    slices: dict[str, ParamSlice] = field(default_factory=dict)
    scale_rows: dict[str, tuple[int, ScaleBlock]] = field(default_factory=dict)
    expert_blocks: dict[str, ScaleBlock] = field(default_factory=dict)     # experts module → gate_up's block

    def is_fp8(self, name: str) -> bool:
        return name in self.fp8


def plan_from_names(names: Iterable[str], rename: Rename) -> Fp8Plan:
    """The plan of an FP8 checkpoint: every tensor with a `weight_scale_inv` beside it, by our name."""
    fp8 = set()
    for name in names:
        ours = rename(name) if name.endswith(SCALE) or name.endswith(EXPERT_SCALES) else None
        if isinstance(ours, str):
            fp8.add(ours[: -len(SCALE)] if ours.endswith(SCALE) else ours[: -len("_scale_inv")])
    if "lm_head" in fp8:
        raise Fp8Error("an FP8 lm_head is not supported (the draft reads the target's lm_head in bf16)")
    return Fp8Plan(fp8)


def plan_on_load(model: nn.Module) -> Fp8Plan:
    """The plan of --quantization fp8 over a bf16 checkpoint (quantizable linears, all experts)."""
    fp8 = set()
    for name, module in model.named_modules():
        if isinstance(module, FusedLinear):
            parent = FusedLinear._names(name + ".")
            fp8 |= {parent + part for part in module.part_sizes if quantizable(parent + part)}
        elif type(module) is nn.Linear and quantizable(name):
            fp8.add(name)
        elif isinstance(module, Experts):
            fp8 |= {f"{name}.gate_up_proj", f"{name}.down_proj", f"{name}.per_expert"}
    return Fp8Plan(fp8, on_load=True)


def convert(model: nn.Module, plan: Fp8Plan) -> nn.Module:
    """Replace the modules the plan names with their FP8 forms (on the meta device, before the
    loader allocates) and record in the plan where each FP8 checkpoint tensor goes."""
    if plan.on_load:
        plan.fp8 = plan_on_load(model).fp8
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedLinear):
            replacement = convert_fused(name, module, plan)
        elif type(module) is nn.Linear and plan.is_fp8(name):
            replacement = Fp8Linear(module.in_features, module.out_features, module.bias is not None)
        elif isinstance(module, Experts):
            replacement = convert_experts(name, module, plan)
        else:
            continue
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    return model


def convert_fused(name: str, module: FusedLinear, plan: Fp8Plan) -> nn.Module | None:
    """A FusedLinear → Fp8Linear (every part FP8), SegmentedLinear (some), or None (none)."""
    parent = FusedLinear._names(name + ".")
    runs: list[tuple[bool, dict[str, int]]] = []
    for part, size in module.part_sizes.items():
        is_fp8 = plan.is_fp8(parent + part)
        if runs and runs[-1][0] == is_fp8:
            runs[-1][1][part] = size
        else:
            runs.append((is_fp8, {part: size}))
    if not any(is_fp8 for is_fp8, _ in runs):
        return None
    has_bias = module.bias is not None
    segments = []
    for i, (is_fp8, parts) in enumerate(runs):
        prefix = name + (f".segments.{i}." if len(runs) > 1 else ".")
        if is_fp8:
            segment = Fp8Linear(module.in_features, sum(parts.values()), has_bias, fused_scale_block(parts.values()),
                                parts)
        else:
            segment = PartsLinear(module.in_features, parts, has_bias)
        record_parts(plan, parent, prefix, parts, segment)
        segments.append(segment)
    return segments[0] if len(segments) == 1 else SegmentedLinear(segments)


def record_parts(plan: Fp8Plan, parent: str, prefix: str, parts: dict[str, int], segment: nn.Module) -> None:
    """Each part's checkpoint tensors → rows of the segment's fused parameters."""
    block = getattr(segment, "block", None)
    start = 0
    for part, size in parts.items():
        rows = (start, start + size)
        plan.slices[f"{parent}{part}.weight"] = ParamSlice(prefix + "weight", None, rows=rows)
        plan.slices[f"{parent}{part}.bias"] = ParamSlice(prefix + "bias", None, rows=rows)
        if block is not None:
            scale_rows = rows if block.rows == 1 else (start // BLOCK, -(-(start + size) // BLOCK))
            plan.slices[f"{parent}{part}{SCALE}"] = ParamSlice(prefix + "weight_scale_inv", None, rows=scale_rows)
            plan.scale_rows[f"{parent}{part}{SCALE}"] = (size, block)
        start += size


def convert_experts(name: str, module: Experts, plan: Fp8Plan) -> nn.Module | None:
    fused = plan.is_fp8(f"{name}.gate_up_proj")
    per_expert = plan.is_fp8(f"{name}.0.gate_proj") or plan.is_fp8(f"{name}.per_expert")
    if not (fused or per_expert):
        return None
    num_experts, rows, hidden = module.gate_up_proj.shape
    inter = rows // 2
    # A fused FP8 checkpoint scales [2I, H] as one matrix; per-expert ones (and our quantization
    # on load, either layout) scale gate and up apart.
    block = ScaleBlock() if fused and not plan.on_load else fused_scale_block((inter, inter))
    plan.expert_blocks[name] = block
    for e in range(num_experts):
        for part, (param, index) in {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                                     "down_proj": ("down_proj", 0)}.items():
            pieces = 2 if param == "gate_up_proj" else 1
            key = f"{name}.{e}.{part}{SCALE}"
            plan.slices[key] = ParamSlice(f"{name}.{param}_scale_inv", e, index, pieces)
            if param == "gate_up_proj":
                plan.scale_rows[key] = (inter, block)
    return Fp8Experts(num_experts, hidden, inter, block)


def fp8_rename(rename: Rename, plan: Fp8Plan) -> Rename:
    """The architecture's rename, then the FP8 modules' own places for fused parts and scales."""
    def mapped(name: str):
        ours = rename(name)
        if isinstance(ours, str):
            return plan.slices.get(ours, ours)
        return ours
    return mapped


def fp8_stream(tensors: Iterator[tuple[str, Any, torch.Tensor]], rename: Rename, plan: Fp8Plan
               ) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """The checkpoint's tensors as the FP8 modules take them: (on load) bf16 weights of planned
    modules quantized, each followed by its scale; scales as fp32, repeated per row where a fused
    module keeps a scale per row."""
    for raw, file, tensor in tensors:
        ours = rename(raw)
        if plan.on_load and tensor.is_floating_point() and tensor.dtype != FP8:
            quantized = quantize_on_load(raw, ours, tensor, plan)
            if quantized is not None:
                yield raw, file, quantized[0]
                yield quantized[1], file, quantized[2]
                continue
        if isinstance(ours, str) and (ours.endswith(SCALE) or ours.endswith(EXPERT_SCALES)):
            tensor = tensor.float()
            if ours in plan.scale_rows:
                tensor = part_scale_rows(tensor, *plan.scale_rows[ours])
        yield raw, file, tensor


def quantize_on_load(raw: str, ours, tensor: torch.Tensor, plan: Fp8Plan
                     ) -> tuple[torch.Tensor, str, torch.Tensor] | None:
    """(e4m3 weight, the scale's checkpoint name, its scale) for a weight the plan quantizes."""
    if plan.device is not None:
        tensor = tensor.to(plan.device)
    if isinstance(ours, ParamSlice):                         # one expert's piece
        experts = ours.param.rsplit(".", 1)[0]
        if not plan.is_fp8(f"{experts}.per_expert") or not raw.endswith(".weight"):
            return None
        q, scale = quantize(tensor)
        name = raw[: -len(".weight")] + SCALE
        ours_scale = rename_scale(ours, experts, raw)
        if ours_scale in plan.scale_rows:
            scale = part_scale_rows(scale, *plan.scale_rows[ours_scale])
        return q, name, scale
    if not isinstance(ours, str):
        return None
    if ours.endswith(".weight") and plan.is_fp8(ours[: -len(".weight")]):
        q, scale = quantize(tensor)
        scale_name = ours[: -len(".weight")] + SCALE
        if scale_name in plan.scale_rows:
            scale = part_scale_rows(scale, *plan.scale_rows[scale_name])
        return q, raw[: -len(".weight")] + SCALE, scale
    if ours.endswith(".experts.down_proj") and plan.is_fp8(ours):
        q, scale = quantize(tensor)
        return q, raw + "_scale_inv", scale
    if ours.endswith(".experts.gate_up_proj") and plan.is_fp8(ours):
        block = plan.expert_blocks[ours.rsplit(".", 1)[0]]
        halves = [quantize(half) for half in tensor.chunk(2, dim=1)]            # gate, up: as per-expert files
        inter = tensor.shape[1] // 2
        return (torch.cat([q for q, _ in halves], dim=1), raw + "_scale_inv",
                torch.cat([part_scale_rows(s, inter, block) for _, s in halves], dim=1))
    return None


def rename_scale(piece: ParamSlice, experts: str, raw: str) -> str:
    """Our name of an expert piece's scale (`…experts.{e}.gate_proj.weight_scale_inv`)."""
    return f"{experts}.{piece.index}.{raw.rsplit('.', 2)[-2]}{SCALE}"


def quantize_model(model: nn.Module) -> nn.Module:
    """--quantization fp8 over a model already in memory (bench's random weights): its decoder
    linears and experts become FP8 in place, as loading its checkpoint with --quantization fp8
    would make them; each bf16 weight is freed once quantized (on CUDA they are staged in host
    memory first: the card holds the FP8 model and one bf16 tensor at a time)."""
    from pathlib import Path

    from blockspec.loader import load_weights
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    state = model.state_dict()                 # Hugging Face names (fused parts split), views
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    if device.type == "cuda":
        # The bf16 tensors wait in host memory and come back one at a time to be quantized, so
        # the card never holds both copies (Qwen3.5-35B-A3B: ~70 + 35 GB, past an H100's 80).
        state = {name: tensor.to("cpu") for name, tensor in state.items()}
    plan = Fp8Plan(set(), on_load=True)
    with torch.device("meta"):
        convert(model, plan)
    for module in model.modules():             # only the replacements need memory
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False).to(dtype)

    def drained() -> Iterator[tuple[str, Any, torch.Tensor]]:
        while state:
            name, tensor = state.popitem()
            yield name, Path("<memory>"), tensor.to(device)

    def same(name: str) -> str:
        return name
    load_weights(model, [], fp8_rename(same, plan), tensors=fp8_stream(drained(), same, plan))
    return model


def keep_column_scales(model: nn.Module, dtype: torch.dtype) -> int:
    """Make now the cuBLASLt GEMM's weight scales (kernels/fp8.column_scales: [K/128, N] fp32, 128 ×
    a 128 × 128-blocked weight's own) of every FP8 linear it will serve, so that they are counted
    once with the weights when the pool is sized (made at the profile's first forward, they were
    counted as its activations, then again as what the process holds and as the graphs' reserve:
    ~0.65 GB of KV cache on Qwen3-8B). Returns their bytes."""
    from blockspec.kernels import fp8 as kernels
    if kernels.FP8_GEMM != "cublas":
        return 0
    made = 0
    for module in model.modules():
        if not isinstance(module, Fp8Linear):
            continue
        # the shapes and device a call would bring (off CUDA, blockwise_scaled_mm_serves says no)
        probe = torch.empty(0, module.in_features, dtype=dtype, device=module.weight.device)
        if kernels.blockwise_scaled_mm_serves(probe, module.weight):
            made += kernels.cached_column_scales(module.weight_scale_inv, module.block, module.out_features,
                                                 module.in_features).nbytes
    return made


def weight_format(model: nn.Module) -> str:
    """`fp8_e4m3` when the target holds e4m3 weights, else its weights' dtype (`bfloat16`)."""
    if any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules()):
        return "fp8_e4m3"
    return str(model.lm_head.weight.dtype).removeprefix("torch.")


def step_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter (scales included) but the experts a
    token does not choose (top_k of E per sparse layer)."""
    from blockspec.layers.moe import SparseMoE

    def nbytes(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())
    unread = 0.0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            unread += nbytes(module.experts) * (1 - module.top_k / module.experts.gate_up_proj.shape[0])
    return int(nbytes(model) - unread)
