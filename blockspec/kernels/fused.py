"""Fused elementwise kernels of a decoder layer: residual-add + RMSNorm, q/k RMSNorm + RoPE +
K/V store, SiLU·mul, and the Gated DeltaNet output's gated RMSNorm.

Each op is one function the layers call; it runs one Triton kernel on CUDA and plain torch
elsewhere (CPU, tests), and both compute the same math the unfused modules did. The Triton
kernels round to the model dtype wherever the torch ops round (after the norm, after each
product and sum of RoPE, after SiLU), so in bf16 they differ from torch only by fp32
reduction order and libm ulps, and in fp32 by those alone. Why fuse at all: inside a CUDA
graph every small kernel still costs a few microseconds, and a dense layer had ~25 of them.

`set_enabled(False)` sends CUDA tensors down the torch path too (the unfused reference that
tests/gpu compares against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the torch path serves
    triton = None

_ENABLED = True


def set_enabled(enabled: bool) -> bool:
    """Turn the Triton path on or off for CUDA tensors; returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, enabled
    return previous


def use_triton(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """CUDA, Triton present, fusion on, and no gradient wanted: the kernels have no backward, so
    training (autograd through x or the weights) takes the torch path."""
    if not (_ENABLED and triton is not None and x.is_cuda):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params)))


# ---------------------------------------------------------------------------------------------
# torch forms: the reference math (what the modules computed before fusion)

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """w · x / rms(x) over the last dim in fp32; zero_centred: the scale is (1 + w) (Qwen3.5)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return rms_norm_torch(x, weight, eps, zero_centred), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x[..., :rot_dim] (rot_dim = cos.shape[-1]) and passes the rest through."""
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's GatedDeltaNet output norm: w · rmsnorm(x) · silu(gate) over the last dim (a plain
    weight, not zero-centred), the norm in fp32 and rounded to x's dtype before the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


# ---------------------------------------------------------------------------------------------
# the ops the layers call

def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for x [N, H]; residual None: (norm(x), x). The sum is
    a new tensor (callers keep earlier residuals as captured features)."""
    if not use_triton(x, residual, weight) or x.shape[-1] > 65536:
        return add_rms_norm_torch(x, residual, weight, eps, zero_centred)
    return add_rms_norm_triton(x, residual, weight, eps, zero_centred)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    if not use_triton(x, weight) or x.shape[-1] > 65536:
        return rms_norm_torch(x, weight, eps, zero_centred)
    flat = x.reshape(-1, x.shape[-1])
    return add_rms_norm_triton(flat, None, weight, eps, zero_centred)[0].view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) → silu(gate) · up [N, I]."""
    if not use_triton(gate_up):
        return silu_mul_torch(gate_up)
    return silu_mul_triton(gate_up)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm_torch` for x, gate [..., D] (the same shape) in one kernel: in torch it is
    twelve elementwise launches, once per Gated DeltaNet layer of every forward whose output norm
    is not fused into the recurrent kernel (a verify of more than 8 rows: 288 launches a cycle of
    Qwen3.5-4B, round 49's H200 trace)."""
    if (not use_triton(x, weight, gate) or x.shape[-1] > 65536 or x.shape != gate.shape
            or weight.dtype != x.dtype):       # the kernel rounds the weight's product to x's dtype
        return gated_rms_norm_torch(x, weight, gate, eps)
    return gated_rms_norm_triton(x, weight, gate, eps)


def qk_norm_rope(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, q_head_stride: int,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, zero_centred: bool,
                 cos: torch.Tensor, sin: torch.Tensor,
                 kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The attention input of one forward in one kernel.

    qkv [N, Hq·q_head_stride + 2·Hkv·D]: per token, Hq query heads (the first D of each
    q_head_stride: Qwen3.5's output gate is the rest), then Hkv key heads, then Hkv value
    heads (num_q_heads may be 0: context K/V only). q and k are RMS-normed per head (when the
    norms are given) and rotated over the first cos.shape[-1] dims; cos, sin [N, rot] (any
    leading shape that flattens to it). kv_store = (k_pool, v_pool, slot_mapping [N]): k and v
    go to the pools ([slots, Hkv, D]) at their slots and (q, None, None) comes back; without
    it, (q, k, v) with k, v [N, Hkv, D]. q is [N, Hq, D] (None when Hq = 0).
    """
    cos, sin = cos.reshape(qkv.shape[0], -1), sin.reshape(qkv.shape[0], -1)
    if not use_triton(qkv, q_norm, k_norm):
        return qk_norm_rope_torch(qkv, num_q_heads, num_kv_heads, head_dim, q_head_stride, q_norm, k_norm, eps,
                                  zero_centred, cos, sin, kv_store)
    return qk_norm_rope_triton(qkv, num_q_heads, num_kv_heads, head_dim, q_head_stride, q_norm, k_norm, eps,
                               zero_centred, cos, sin, kv_store)


def qk_norm_rope_torch(qkv, num_q_heads, num_kv_heads, head_dim, q_head_stride, q_norm, k_norm, eps, zero_centred,
                       cos, sin, kv_store):
    num_tokens = qkv.shape[0]
    q_width, kv_width = num_q_heads * q_head_stride, num_kv_heads * head_dim
    cos, sin = cos[:, None], sin[:, None]                               # broadcast over heads
    q = None
    if num_q_heads:
        q = qkv[:, :q_width].view(num_tokens, num_q_heads, q_head_stride)[..., :head_dim]
        if q_norm is not None:
            q = rms_norm_torch(q, q_norm, eps, zero_centred)
        q = apply_rope(q, cos, sin)
    k = qkv[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width:q_width + 2 * kv_width].view(num_tokens, num_kv_heads, head_dim)
    if k_norm is not None:
        k = rms_norm_torch(k, k_norm, eps, zero_centred)
    k = apply_rope(k, cos, sin)
    if kv_store is None:
        return q, k, v
    k_pool, v_pool, slot_mapping = kv_store
    k_pool.index_copy_(0, slot_mapping, k)
    v_pool.index_copy_(0, slot_mapping, v)
    return q, None, None


# ---------------------------------------------------------------------------------------------
# Triton kernels

def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def k_split(in_features: int, step: int, split_k: int) -> tuple[int, int]:
    """(parts, columns a part) of K for loop steps of `step` columns: at most split_k parts of
    whole steps, none empty."""
    steps = triton.cdiv(in_features, step)
    per_split = triton.cdiv(steps, min(split_k, steps))
    return triton.cdiv(steps, per_split), per_split * step


if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """fp32 x rounded to dtype (nearest even), kept in fp32: where a torch op would store.
        bf16 by integer arithmetic, which the compiler cannot fold away as it may fold a
        truncate-extend pair (and Triton's interpreter truncates instead of rounding)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, num_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round(x + r, dtype)                           # the residual stream is stored in dtype
            tl.store(res_out_ptr + row * num_cols + cols, x.to(dtype), mask=mask)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            out = _round(x * rstd * (1.0 + w), dtype)
        else:
            out = _round(_round(x * rstd, dtype) * w, dtype)
        tl.store(out_ptr + row * num_cols + cols, out.to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, num_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < num_cols
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
        tl.store(out_ptr + row * num_cols + cols, _round(silu * up, dtype).to(dtype), mask=mask)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, num_cols, eps, BLOCK: tl.constexpr):
        """One row of contiguous rows: rounded where gated_rms_norm_torch stores (the normed row,
        then the weight's product, in dtype; silu(gate) stays fp32 as the torch op's is)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(g_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        weighted = _round(_round(x * rstd, dtype) * w, dtype)
        out = _round(weighted * (gate / (1.0 + tl.exp(-gate))), dtype)
        tl.store(out_ptr + row * num_cols + cols, out.to(dtype), mask=mask)

    @triton.jit
    def _norm_rope_head(src, w_ptr, cos_ptr, sin_ptr, dst, eps, head_dim,
                        HAS_NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, ROT: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        """One head: load D values at src, norm (rounded as the torch op), rotate, store at dst."""
        dtype = dst.dtype.element_ty
        d = tl.arange(0, BLOCK_D)
        in_head = d < head_dim
        half: tl.constexpr = ROT // 2
        is_rot = d < ROT
        partner = tl.where(d < half, d + half, d - half)
        x = tl.load(src + d, mask=in_head, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=is_rot, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
            w = tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
            if ZERO_CENTRED:
                x = _round(x * rstd * (1.0 + w), dtype)
                xp = _round(xp * rstd * (1.0 + wp), dtype)
            else:
                x = _round(_round(x * rstd, dtype) * w, dtype)
                xp = _round(_round(xp * rstd, dtype) * wp, dtype)
        c = tl.load(cos_ptr + d, mask=is_rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + d, mask=is_rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        rotated = _round(_round(x * c, dtype) + _round(sign * xp * s, dtype), dtype)
        out = tl.where(is_rot, rotated, x)
        tl.store(dst + d, out.to(dtype), mask=in_head)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                             slot_ptr, stride_qkv, stride_rope, stride_kv_row, stride_kv_head,
                             q_head_stride, k_offset, v_offset, num_q_heads, head_dim, eps,
                             HAS_NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, HAS_SLOTS: tl.constexpr,
                             ROT: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        row = qkv_ptr + token * stride_qkv
        cos_row, sin_row = cos_ptr + token * stride_rope, sin_ptr + token * stride_rope
        if head < num_q_heads:
            _norm_rope_head(row + head * q_head_stride, q_w_ptr, cos_row, sin_row,
                            q_out_ptr + (token * num_q_heads + head) * head_dim, eps, head_dim,
                            HAS_NORM, ZERO_CENTRED, ROT, BLOCK_D)
        else:
            kv_head = head - num_q_heads
            if HAS_SLOTS:
                dst_row = tl.load(slot_ptr + token).to(tl.int64)
            else:
                dst_row = token
            dst = dst_row * stride_kv_row + kv_head * stride_kv_head
            _norm_rope_head(row + k_offset + kv_head * head_dim, k_w_ptr, cos_row, sin_row, k_out_ptr + dst,
                            eps, head_dim, HAS_NORM, ZERO_CENTRED, ROT, BLOCK_D)
            d = tl.arange(0, BLOCK_D)
            v = tl.load(row + v_offset + kv_head * head_dim + d, mask=d < head_dim)
            tl.store(v_out_ptr + dst + d, v, mask=d < head_dim)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, num_cols = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    if num_rows:
        block = _block(num_cols)
        _add_rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
            residual.stride(0) if residual is not None else 0, num_cols, eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred, BLOCK=block,
            num_warps=min(16, max(1, block // 256)))
    return out, res_out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    num_rows, width = gate_up.shape
    assert gate_up.stride(-1) == 1
    num_cols = width // 2
    out = torch.empty((num_rows, num_cols), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(1024, _block(num_cols))
        _silu_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](gate_up, out, gate_up.stride(0), num_cols,
                                                                  BLOCK=block, num_warps=4)
    return out


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous rows starting on a 16-byte boundary: a view (a verify's rows sliced after a
    step's prefill rows) becomes a copy. Triton compiles a kernel per pointer alignment and
    stride divisibility, so one layout means one variant, warmed by any call."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def gated_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    shape, num_cols = x.shape, x.shape[-1]
    x, gate = aligned_rows(x).view(-1, num_cols), aligned_rows(gate).view(-1, num_cols)
    out = torch.empty_like(x)
    if x.shape[0]:
        block = _block(num_cols)
        _gated_rms_norm_kernel[(x.shape[0],)](x, weight, gate, out, num_cols, eps, BLOCK=block,
                                              num_warps=min(16, max(1, block // 256)))
    return out.view(shape)


def qk_norm_rope_triton(qkv, num_q_heads, num_kv_heads, head_dim, q_head_stride, q_norm, k_norm, eps, zero_centred,
                        cos, sin, kv_store):
    num_tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    device, dtype = qkv.device, qkv.dtype
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=dtype, device=device) if num_q_heads else None
    if kv_store is None:
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=dtype, device=device)
        v_out, slots = torch.empty_like(k_out), None
    else:
        k_out, v_out, slots = kv_store
        assert k_out.stride() == v_out.stride() and k_out.stride(-1) == 1 and k_out.dtype == dtype
    k_offset = num_q_heads * q_head_stride
    if num_tokens:
        has_norm = k_norm is not None
        _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
            qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin,
            q if q is not None else qkv, k_out, v_out, slots if slots is not None else qkv,
            qkv.stride(0), cos.stride(0), k_out.stride(0), k_out.stride(1),
            q_head_stride, k_offset, k_offset + num_kv_heads * head_dim, num_q_heads, head_dim, eps,
            HAS_NORM=has_norm, ZERO_CENTRED=zero_centred, HAS_SLOTS=slots is not None, ROT=cos.shape[-1],
            BLOCK_D=_block(head_dim), num_warps=1 if head_dim <= 128 else 2)
    if kv_store is None:
        return q, k_out, v_out
    return q, None, None
