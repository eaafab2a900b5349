"""Gated DeltaNet decode / verify step (Triton): the CUDA path of `models.gated_delta.gdn_rows_step`.

A step is a few rows per sequence (1 for plain decode, the block for a verify, ≤ 16), so the
chunked kernels made for long prefills are the wrong shape: each sequence's rows are walked in
order with the state held in registers, and the state pools are read and written in place
instead of gathered into copies and scattered back. Two launches per layer:

1. conv: one program per (sequence, block of conv channels): the causal depthwise conv over the
   slot's cached window + the sequence's rows, SiLU, written in the model's dtype (as F.conv1d +
   F.silu round). Then either the slot's window moves on in place (plain step) or the window and
   the rows are stashed as conv inputs [B, C, K−1+T] for StatePool.select (verify).
2. recurrent: one program per (sequence, value head, block of Dv columns): q, k l2-normalised,
   g = −e^{A_log} · softplus(a + dt_bias), β = σ(b), then per row the delta rule of
   `models.gated_delta` on the fp32 state [Dk, BLOCK_V]; the output row [Hv, Dv] in the model's
   dtype. Plain step: the final state goes back into the slot; verify: the state after every
   row goes to `steps` [B, max_rows, Hv, Dk, Dv] (sequence b's row t at [b, t], the layout
   StatePool.select picks from, also for ragged widths; the rollback is a pick, no replay).

Rows are flat: sequence b owns rows cu_seqlens[b] … cu_seqlens[b+1] − 1 and state slot
slots[b], so a uniform batch (cu_seqlens = b·T) and a ragged one (each sequence its own width,
0 included) take the same kernels. Everything is sized on the host from shapes alone (no host
sync), so the step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                      # CPU-only installs: the torch path
    triton = None

MAX_ROWS = 16          # rows per sequence this step kernel is made for (decode, verify blocks)


def is_available() -> bool:
    return triton is not None


if triton is not None:

    # Values that change from step to step are not specialised on (Triton would compile a variant per
    # alignment of the slots' view of the packed metadata, per divisibility of a stash's row count):
    # the kernels' variants are their constexprs alone (`step_variant`), which the warm-up runs.
    @triton.jit(do_not_specialize=["slots_ptr", "cu_ptr", "stride_stash_b", "stride_stash_c"])
    def _conv1d_update_kernel(mixed_ptr, weight_ptr, pool_ptr, slots_ptr, cu_ptr, out_ptr, stash_ptr,
                              conv_dim, stride_mixed, stride_pool_slot, stride_pool_c, stride_out,
                              stride_stash_b, stride_stash_c, KERNEL: tl.constexpr, K_POW2: tl.constexpr,
                              KEEP: tl.constexpr, BLOCK_C: tl.constexpr):
        seq = tl.program_id(0)
        chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = chans < conv_dim
        start = tl.load(cu_ptr + seq)
        rows = tl.load(cu_ptr + seq + 1) - start
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        taps = tl.arange(0, K_POW2)
        window_ptrs = pool_ptr + slot * stride_pool_slot + chans[:, None] * stride_pool_c + taps[None, :]
        # window[:, j] = conv input j − (K−1) (before the first row); column K−1 is unused.
        window = tl.load(window_ptrs, mask=c_ok[:, None] & (taps[None, :] < KERNEL - 1), other=0.0)
        weight = tl.load(weight_ptr + chans[:, None] * KERNEL + taps[None, :],
                         mask=c_ok[:, None] & (taps[None, :] < KERNEL), other=0.0).to(tl.float32)
        for t in range(0, rows):
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KERNEL):
                i = t - (KERNEL - 1) + j                 # conv input index; < 0: the cached window
                i_ok = (tl.zeros([BLOCK_C], dtype=tl.int32) + i) >= 0     # a vector (the interpreter wants one)
                from_rows = tl.load(mixed_ptr + (start + i).to(tl.int64) * stride_mixed + chans,
                                    mask=c_ok & i_ok, other=0.0)
                from_window = tl.sum(tl.where(taps[None, :] == i + KERNEL - 1, window, 0.0), axis=1)
                x = tl.where(i_ok, from_rows, from_window.to(from_rows.dtype))
                w_j = tl.sum(tl.where(taps[None, :] == j, weight, 0.0), axis=1)
                acc += w_j * x.to(tl.float32)
            # F.conv1d rounds to the model's dtype, then F.silu computes on that.
            y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            y = y * tl.sigmoid(y)
            tl.store(out_ptr + (start + t).to(tl.int64) * stride_out + chans, y.to(out_ptr.dtype.element_ty),
                     mask=c_ok)
        if KEEP:
            # Conv inputs of the block, window first: stash[b, c, j] = input j − (K−1).
            stash = stash_ptr + seq.to(tl.int64) * stride_stash_b + chans * stride_stash_c
            tl.store(stash[:, None] + taps[None, :], window, mask=c_ok[:, None] & (taps[None, :] < KERNEL - 1))
            for t in range(0, rows):
                x = tl.load(mixed_ptr + (start + t).to(tl.int64) * stride_mixed + chans, mask=c_ok, other=0.0)
                tl.store(stash + KERNEL - 1 + t, x, mask=c_ok)
        else:
            # The window moves on by `rows`: new column j = input rows − (K−1) + j.
            new = tl.zeros([BLOCK_C, K_POW2], dtype=window.dtype)
            for j in tl.static_range(KERNEL - 1):
                i = rows - (KERNEL - 1) + j
                i_ok = (tl.zeros([BLOCK_C], dtype=tl.int32) + i) >= 0     # a vector (the interpreter wants one)
                from_rows = tl.load(mixed_ptr + (start + i).to(tl.int64) * stride_mixed + chans,
                                    mask=c_ok & i_ok, other=0.0)
                from_window = tl.sum(tl.where(taps[None, :] == i + KERNEL - 1, window, 0.0), axis=1)
                x = tl.where(i_ok, from_rows, from_window.to(from_rows.dtype))
                new = tl.where(taps[None, :] == j, x.to(window.dtype)[:, None], new)
            tl.debug_barrier()                           # every thread has read the old window
            tl.store(window_ptrs, new, mask=c_ok[:, None] & (taps[None, :] < KERNEL - 1))

    @triton.jit(do_not_specialize=["slots_ptr", "cu_ptr", "max_rows"])
    def _recurrent_kernel(conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr, cu_ptr,
                          out_ptr, steps_ptr, z_ptr, norm_w_ptr, eps, stride_conv, stride_a, stride_b,
                          stride_pool_slot, stride_out, stride_steps, stride_z_row, stride_z_head, max_rows,
                          NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr,
                          V_DIM: tl.constexpr, KEY_WIDTH: tl.constexpr, KEEP: tl.constexpr,
                          NORM: tl.constexpr, BLOCK_V: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, K_DIM)
        start = tl.load(cu_ptr + seq)
        rows = tl.load(cu_ptr + seq + 1) - start
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        state_offs = head * K_DIM * V_DIM + dk[:, None] * V_DIM + cols[None, :]
        state_ptrs = pool_ptr + slot * stride_pool_slot + state_offs
        state = tl.load(state_ptrs).to(tl.float32)                        # [Dk, BLOCK_V]
        key_head = head // GROUP
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        scale = 1.0 / tl.sqrt(K_DIM * 1.0)
        for t in range(0, rows):
            row = (start + t).to(tl.int64)
            base = conv_ptr + row * stride_conv
            q = tl.load(base + key_head * K_DIM + dk).to(tl.float32)
            k = tl.load(base + KEY_WIDTH + key_head * K_DIM + dk).to(tl.float32)
            v = tl.load(base + 2 * KEY_WIDTH + head * V_DIM + cols).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
            x = tl.load(a_ptr + row * stride_a + head).to(tl.float32) + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))   # torch's threshold
            g = -tl.exp(a_log) * softplus
            b = tl.load(b_ptr + row * stride_b + head)
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)      # σ rounds as torch's does
            state = state * tl.exp(g)
            predicted = tl.sum(state * k[:, None], axis=0)                   # Sᵀk [BLOCK_V]
            update = beta * (v - predicted)
            state = state + k[:, None] * update[None, :]
            o = tl.sum(state * q[:, None], axis=0)
            if NORM:
                # The output's gated RMSNorm (BLOCK_V = Dv: the whole head row is here), rounding
                # where GatedRMSNorm rounds: o, the normalised row, the weight product, the result.
                dtype = out_ptr.dtype.element_ty
                o = o.to(dtype).to(tl.float32)
                normed = (o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V_DIM + eps))).to(dtype)
                weighted = (tl.load(norm_w_ptr + cols) * normed).to(tl.float32)
                z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + cols).to(tl.float32)
                o = weighted * (z * tl.sigmoid(z))
            tl.store(out_ptr + row * stride_out + head * V_DIM + cols, o.to(out_ptr.dtype.element_ty))
            if KEEP:
                tl.store(steps_ptr + (seq * max_rows + t).to(tl.int64) * stride_steps + state_offs, state)
        if not KEEP:
            tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty))


def block_v(num_seqs: int, num_v_heads: int, v_dim: int) -> int:
    """Columns of the state per program: 32 (16 KB of fp32 state in registers) unless that leaves
    the chip's 132 SMs short of two programs each, as one decoding sequence does."""
    size = 32 if num_seqs * num_v_heads * (v_dim // 32) >= 264 else 16
    while v_dim % size:
        size //= 2
    return size


@dataclass(frozen=True)
class StepVariant:
    """One compiled form of the two step kernels: KEEP (stash every row's state), NORM (the gated
    norm fused), the recurrent kernel's BLOCK_V and warps."""
    keep: bool
    norm: bool
    block_v: int
    num_warps: int


def step_variant(num_seqs: int, num_v_heads: int, k_dim: int, v_dim: int, keep: bool, norm: bool) -> StepVariant:
    """The variant a step of num_seqs sequences runs (the wrapper's choice, and the warm-up's)."""
    bv = v_dim if norm else block_v(num_seqs, num_v_heads, v_dim)
    return StepVariant(keep, norm, bv, 8 if norm and k_dim * v_dim >= 8192 else 4)


def gdn_step(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
             a_log: torch.Tensor, dt_bias: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
             slots: torch.Tensor, cu_seqlens: torch.Tensor, max_rows: int, num_k_heads: int, k_dim: int,
             keep_steps: bool, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
             space: tuple[torch.Tensor, torch.Tensor] | None = None, variant: StepVariant | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """mixed [R, conv_dim] (q | k | v before the conv), a, b [R, Hv] (rows may be strided views
    of the projection), conv_weight [conv_dim, K], pools [slots, conv_dim, K−1] and
    [slots, Hv, Dk, Dv] → out [R, Hv, Dv]; with keep_steps also steps [B, max_rows, Hv, Dk, Dv] and the
    conv inputs [B, conv_dim, K−1+max_rows], the pools untouched; else the pools advanced.
    norm = (weight [Dv], z [R, Hv, Dv], eps): out is the gated RMSNorm of the rows,
    weight · rmsnorm(o) · silu(z), computed in the recurrent kernel (one program per head row).
    space: preallocated (steps, conv inputs) of that shape to stash into (a graph's, shared by all).
    variant: the warm-up's; else `step_variant` of these shapes."""
    num_v_heads, v_dim = ssm_pool.shape[1], ssm_pool.shape[3]
    variant = variant or step_variant(slots.shape[0], num_v_heads, k_dim, v_dim, keep_steps, norm is not None)
    return launch_step(variant, mixed, a, b, conv_weight, a_log, dt_bias, conv_pool, ssm_pool, slots, cu_seqlens,
                       max_rows, num_k_heads, k_dim, keep_steps, norm, space)


def launch_step(variant: StepVariant, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, conv_pool: torch.Tensor,
                ssm_pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, max_rows: int,
                num_k_heads: int, k_dim: int, keep_steps: bool, norm: tuple[torch.Tensor, torch.Tensor, float] | None,
                space: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`gdn_step`'s two kernels in this variant."""
    num_rows, conv_dim = mixed.shape
    num_seqs = slots.shape[0]
    num_v_heads, v_dim = ssm_pool.shape[1], ssm_pool.shape[3]
    kernel = conv_weight.shape[-1]
    conv_weight = conv_weight.reshape(conv_dim, kernel).contiguous()
    assert mixed.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert conv_pool.is_contiguous() and ssm_pool.is_contiguous() and ssm_pool.shape[2] == k_dim
    conv_out = torch.empty(num_rows, conv_dim, dtype=mixed.dtype, device=mixed.device)
    stash = None
    if keep_steps:
        stash = (space[1] if space is not None else
                 torch.empty(num_seqs, conv_dim, kernel - 1 + max_rows, dtype=conv_pool.dtype, device=mixed.device))
    block_c = 256
    _conv1d_update_kernel[(num_seqs, triton.cdiv(conv_dim, block_c))](
        mixed, conv_weight, conv_pool, slots, cu_seqlens, conv_out, stash if keep_steps else conv_out,
        conv_dim, mixed.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_out.stride(0),
        stash.stride(0) if keep_steps else 0, stash.stride(1) if keep_steps else 0,
        KERNEL=kernel, K_POW2=triton.next_power_of_2(kernel), KEEP=keep_steps, BLOCK_C=block_c, num_warps=4)
    out = torch.empty(num_rows, num_v_heads, v_dim, dtype=mixed.dtype, device=mixed.device)
    steps = None
    if keep_steps:
        steps = (space[0] if space is not None else
                 torch.empty(num_seqs, max_rows, num_v_heads, k_dim, v_dim, dtype=ssm_pool.dtype, device=mixed.device))
    assert variant.keep == keep_steps and variant.norm == (norm is not None)
    bv = variant.block_v
    norm_weight, z, eps = norm if norm is not None else (out, out, 0.0)
    if norm is not None:
        assert z.shape == out.shape and z.stride(2) == 1
    assert k_dim & (k_dim - 1) == 0 and bv & (bv - 1) == 0 and v_dim % bv == 0, \
        "head dims: Dk a power of two, Dv a multiple of a power of two ≤ 32"
    _recurrent_kernel[(num_seqs, num_v_heads, v_dim // bv)](
        conv_out, a, b, a_log, dt_bias, ssm_pool, slots, cu_seqlens, out, steps if keep_steps else out,
        z, norm_weight, eps, conv_out.stride(0), a.stride(0), b.stride(0), ssm_pool.stride(0), out.stride(0),
        steps.stride(1) if keep_steps else 0, z.stride(0), z.stride(1), max_rows,
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, K_DIM=k_dim, V_DIM=v_dim,
        KEY_WIDTH=num_k_heads * k_dim, KEEP=keep_steps, NORM=norm is not None, BLOCK_V=bv,
        num_warps=variant.num_warps)
    return out, steps, stash

