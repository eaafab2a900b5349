"""Our CPU kernels (cpu_kernels.cpp) for quantized GGUF targets: the library, one Python entry
per op (what QuantLinear calls, and what tests/test_cpu_kernels.py holds to each op's torch
form), and DenseStack, a dense target's decoder layers in one call.

The C++ file is compiled at first use with the system's C++ compiler (`$CXX`, else `c++`; `-O3
-march=native`, no torch headers: a few seconds) into blockspec's cache, keyed by the source and
this CPU's flags, and called through ctypes. Without a compiler, or with
BLOCKSPEC_CPU_KERNELS=torch, nothing here is used: QuantLinear takes torch's packed int4 kernel
and the layers their torch ops (one log line says so).

Why: SmolLM2-135M at one token is 30 small layers. torch's int4 CPU matmul ran them at ~2 GB/s
and a layer was ~60 torch ops of microseconds each; here the weights stream at the memory's pace
and the whole stack is one call (BENCHMARKS.md, issue 32).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger("blockspec.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-fno-math-errno")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "quant_linear": [_P, _I, _I, _P, ctypes.c_int, _P, _P, _P, _I, _P],
    "quant_linear_q8": [_P, _I, _I, _P, ctypes.c_int, _P, _P, _P, _I, _P],
    "add_rms_norm": [_P, _P, _P, _F, _I, _I, _P, _P],
    "qk_norm_rope_store": [_P, _I, _I, _I, _I, _P, _P, _F, _P, _P, _I, _P, _P, _P, _P],
    "paged_attention": [_P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _P, _I, _F, _P, _P],
    "silu_mul": [_P, _I, _I, _P],
    "dense_forward": [_P, _I, _P, _P, _P, _I, _P, _I, _P, _P, _P],
}


def cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's flags (a cache shared by other machines must
    not hand them this machine's instructions)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(out_dir: Path) -> Path:
    """The compiled library in out_dir (built once per source and CPU)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + cpu_fingerprint().encode()).hexdigest()[:16]
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True, capture_output=True,
                   timeout=300)
    os.replace(partial, target)                  # atomic: a concurrent build finds a whole file
    return target


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The kernels, or None where they cannot be built (or BLOCKSPEC_CPU_KERNELS=torch)."""
    if os.environ.get("BLOCKSPEC_CPU_KERNELS", "") == "torch":
        return None
    from blockspec.named import cache_dir
    try:
        lib = ctypes.CDLL(str(build(cache_dir() / "kernels")))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning(f"blockspec: CPU kernels not built ({exc}{': ' + detail.decode()[-300:] if detail else ''}); "
                       "quantized GGUF layers run torch's int4 kernel")
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.dense_forward.restype = lib.quant_linear_q8.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def activations() -> str:
    """What the quantized layers multiply their blocks by where these kernels serve: "int8", x
    quantized per block of 32 (kernel "q8", llama.cpp's way, the default), or "fp32" with
    BLOCKSPEC_CPU_KERNELS=fp32 (kernel "native": the dequantized weight's matmul, summed in
    another order)."""
    return "fp32" if os.environ.get("BLOCKSPEC_CPU_KERNELS", "") == "fp32" else "int8"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_linear(x: torch.Tensor, bits: int, values: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                 bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [M, K] fp32 → [M, N]: the GGUF blocks' dot products (cpu_kernels.cpp: quant_linear)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features)
    library().quant_linear(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(), bits, scale.data_ptr(),
                           _ptr(shift), _ptr(bias), out_features, y.data_ptr())
    return y


def quant_linear_q8(x: torch.Tensor, bits: int, values: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor | None, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """quant_linear with x quantized to int8 per block of 32 (cpu_kernels.cpp: quant_linear_q8)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features)
    if library().quant_linear_q8(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(), bits, scale.data_ptr(),
                                 _ptr(shift), _ptr(bias), out_features, y.data_ptr()):
        raise MemoryError("the CPU kernels' scratch memory could not be allocated")
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for x [M, H] (kernels/fused.py's add_rms_norm)."""
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out, total = torch.empty_like(x), torch.empty_like(x)
    library().add_rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), eps, x.shape[0], x.shape[1],
                           out.data_ptr(), total.data_ptr())
    return out, total


def qk_norm_rope_store(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor
                       ) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) · D] → q [N, Hq, D] normed and rotated; k, v stored at slots
    (kernels/fused.py's qk_norm_rope with kv_store)."""
    n = qkv.shape[0]
    cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
    q = torch.empty(n, num_q_heads, head_dim)
    library().qk_norm_rope_store(qkv.contiguous().data_ptr(), n, num_q_heads, num_kv_heads, head_dim, _ptr(q_norm),
                                 _ptr(k_norm), eps, cos.data_ptr(), sin.data_ptr(), cos.shape[1], k_pool.data_ptr(),
                                 v_pool.data_ptr(), slots.contiguous().data_ptr(), q.data_ptr())
    return q


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Causal attention of target rows over the pool (layers/attention.py's reference with
    is_causal, no window, no block K/V): q [N, H, D] → [N, H·D]."""
    n, heads, dim = q.shape
    q = q.contiguous()
    tables = meta.block_tables.contiguous()
    scratch = torch.empty(3 * (int(meta.context_lens.max()) + 1) if meta.num_seqs else 3)
    out = torch.empty(n, heads * dim)
    library().paged_attention(q.data_ptr(), n, heads, k_pool.shape[1], dim, k_pool.data_ptr(), v_pool.data_ptr(),
                              tables.data_ptr(), tables.shape[1], meta.page_size, meta.starts.contiguous().data_ptr(),
                              meta.context_lens.contiguous().data_ptr(), meta.positions.contiguous().data_ptr(),
                              meta.num_seqs, scale, scratch.data_ptr(), out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate | up) → silu(gate) · up [M, I]."""
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    library().silu_mul(gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr())
    return out


class Weight(ctypes.Structure):
    _fields_ = [("values", _P), ("scale", _P), ("shift", _P), ("bias", _P), ("bits", _I), ("n", _I), ("k", _I),
                ("int8_activations", _I)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", Weight), ("o", Weight),
                ("gate_up", Weight), ("down", Weight), ("k_pool", _P), ("v_pool", _P)]


class Shape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("eps", _F), ("scale", _F)]


class Batch(ctypes.Structure):
    _fields_ = [("slots", _P), ("block_tables", _P), ("query_start", _P), ("context_lens", _P), ("positions", _P),
                ("pages", _I), ("page_size", _I), ("num_seqs", _I), ("cos", _P), ("sin", _P),
                ("rot", _I)]


def _weight(linear) -> Weight:
    return Weight(linear.values.data_ptr(), linear.scale.data_ptr(), _ptr(linear.shift), _ptr(linear.bias),
                  linear.bits, linear.out_features, linear.in_features, int(linear.kernel == "q8"))


class DenseStack:
    """A dense quantized target's decoder layers as one kernel call (cpu_kernels.cpp:
    dense_forward), op for op what the modules compute with these kernels in their place.

    The layers' pointers are taken once, at the first forward (after the weights are loaded),
    with the K/V pools of that forward; a forward over other pools (another engine on the same
    model) takes them again."""

    def __init__(self, model: nn.Module) -> None:
        self.layers: ctypes.Array | None = None
        self.pools: list[int] = []
        config = model.config
        attn = model.model.layers[0].self_attn
        self.shape = Shape(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                           config.intermediate_size, config.rms_norm_eps, attn.scale)

    def bind(self, model: nn.Module, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pools = [t.data_ptr() for pair in kv for t in pair]
        if self.layers is not None and pools == self.pools:
            return
        layers = []
        for layer, (k_pool, v_pool) in zip(model.model.layers, kv):
            attn = layer.self_attn
            layers.append(Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                                None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
                                None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
                                _weight(attn.qkv_proj), _weight(attn.o_proj), _weight(layer.mlp.gate_up_proj),
                                _weight(layer.mlp.down_proj), k_pool.data_ptr(), v_pool.data_ptr()))
        self.layers, self.pools = (Layer * len(layers))(*layers), pools

    def forward(self, model: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta,
                capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, hidden] embeddings → (final-normed hidden [N, hidden], features [N, C · hidden] or None)."""
        self.bind(model, meta.kv)
        n, hidden = x.shape
        cos, sin = (t.reshape(n, -1).contiguous() for t in rope)
        tables, starts = meta.block_tables.contiguous(), meta.starts.contiguous()
        keep = (meta.slot_mapping, tables, starts, meta.context_lens, meta.positions, cos, sin)
        batch = Batch(*(t.data_ptr() for t in keep[:5]), tables.shape[1], meta.page_size, meta.num_seqs,
                      cos.data_ptr(), sin.data_ptr(), cos.shape[1])
        slot = {layer: c for c, layer in enumerate(capture_layers)}
        capture = torch.tensor([slot.get(i, -1) for i in range(len(self.layers))], dtype=torch.int64)
        features = torch.empty(n, len(capture_layers) * hidden) if capture_layers else None
        out = torch.empty(n, hidden)
        x = x.contiguous()
        failed = library().dense_forward(self.layers, len(self.layers), ctypes.byref(self.shape), ctypes.byref(batch),
                                         x.data_ptr(), n, capture.data_ptr(), len(capture_layers), _ptr(features),
                                         model.model.norm.weight.data_ptr(), out.data_ptr())
        if failed:
            raise MemoryError("the CPU kernels' scratch memory could not be allocated")
        return out, features


def supports(model: nn.Module) -> bool:
    """Whether a target fits the stack: dense layers whose four projections are native
    QuantLinears, fp32, widths in whole 16-lane vectors, no Qwen3.5 norms or output gates, every
    contiguous layout the kernels assume."""
    from blockspec.layers.attention import Attention
    from blockspec.layers.common import MLP, RMSNorm
    from blockspec.layers.quant import QuantLinear
    from blockspec.models.base import PreNormLayer
    config = getattr(model, "config", None)
    if config is None or getattr(config, "moe", None) or model.recurrent_shapes or not hasattr(model.model, "layers"):
        return False
    if config.hidden_size % 16 or config.head_dim % 16 or model.model.norm.zero_centred:
        return False
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return False
    for layer in model.model.layers:
        if type(layer).forward_residual is not PreNormLayer.forward_residual or type(layer).mix is not PreNormLayer.mix:
            return False
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP) or attn.has_output_gate or attn.zero_centred:
            return False
        if not all(isinstance(p, QuantLinear) and p.kernel in ("q8", "native")
                   for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if any(not isinstance(norm, RMSNorm) or norm.zero_centred for norm in norms):
            return False
    return True


def enable(model: nn.Module) -> bool:
    """Give a quantized target its DenseStack (CausalLM.forward takes it) where the library is
    built and the model fits; returns whether it did."""
    if not available() or not supports(model):
        return False
    model.native_stack = DenseStack(model)
    return True
