"""Gated DeltaNet core: a chunked form (prefill) and a token-by-token form (decode, verify).

Per value head, with a state S [Dk, Dv] kept in fp32, for each token t:

    q, k ← l2-normalised; q ← q · Dk^-½
    S ← e^{g_t} · S                       # decay, g_t ≤ 0
    u ← β_t · (v_t − Sᵀ k_t)              # delta rule: write only what S does not predict
    S ← S + k_t u_tᵀ
    o_t = Sᵀ q_t

Value head j reads key head j // (Hv / Hk). Layout on both forms (and on fla's kernels):
q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] fp32;
output [B, T, Hv, Dv] in v's dtype. q and k come in raw: normalising is the kernel's job.
The torch forms compute in fp32, or in fp64 for an fp64 model (so tests can compare paths
without rounding noise).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

import torch

from blockspec.kernels.fused import gated_rms_norm_torch
from blockspec.sampling import device_longs

CHUNK_SIZE = 64


class GDNKernels(NamedTuple):
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 models, fp64 for fp64 ones."""
    return torch.promote_types(dtype, torch.float32)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
    """Head-major [B, Hv, T, ·] copies in the state dtype; q, k normalised and expanded to the
    value heads."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) if group > 1 else x for x in (q, k))
    dtype = state_dtype(v.dtype)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))
    q = l2_normalise(q) * q.shape[-1] ** -0.5
    return q, l2_normalise(k), v, g, beta


def initial_or_zeros(initial_state: torch.Tensor | None, v: torch.Tensor, k_dim: int) -> torch.Tensor:
    batch, num_heads, _, v_dim = v.shape
    if initial_state is None:
        return v.new_zeros(batch, num_heads, k_dim, v_dim)
    return initial_state.to(v.dtype)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               keep_steps: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token by token. keep_steps: also return the state after every position [B, T, Hv, Dk, Dv]."""
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta)            # [B, Hv, T, ·]
    state = initial_or_zeros(initial_state, v, k.shape[-1])  # [B, Hv, Dk, Dv]
    outputs, steps = [], []
    for t in range(v.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]                                                    # [B, Hv, Dk]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        update = beta[:, :, t, None] * (v[:, :, t] - predicted)            # [B, Hv, Dv]
        state = state + k_t[..., :, None] * update[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
        if keep_steps:
            steps.append(state)
    out = torch.stack(outputs, dim=1).to(out_dtype)                         # [B, T, Hv, Dv]
    return out, state, torch.stack(steps, dim=1) if keep_steps else None


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of CHUNK_SIZE positions in parallel, the state carried from chunk to chunk.
    lengths (each sequence's real rows; None: all T) only tell fla's form where rows end: here
    the rows past them are inert padding (β = 0, g = 0) and run with the rest.

    Inside a chunk, with γ_t = Σ_{s≤t} g_s and S₀ the state before it, unrolling the recurrence:
        S_t = e^{γ_t} S₀ + Σ_{s≤t} e^{γ_t−γ_s} k_s u_sᵀ
        u_t + Σ_{s<t} β_t e^{γ_t−γ_s} (k_t·k_s) u_s = β_t (v_t − e^{γ_t} S₀ᵀ k_t)
    a unit lower-triangular system (I + A) U = β(V − e^γ K S₀), solved once per chunk.
    """
    out_dtype, num_tokens = v.dtype, v.shape[1]
    q, k, v, g, beta = prepare(q, k, v, g, beta)            # [B, Hv, T, ·]
    state = initial_or_zeros(initial_state, v, k.shape[-1])
    # Zero padding is inert: k = v = β = 0 writes nothing, g = 0 decays nothing.
    pad = -num_tokens % CHUNK_SIZE
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    outputs = []
    for start in range(0, q.shape[2], CHUNK_SIZE):
        part = slice(start, start + CHUNK_SIZE)
        out, state = gated_delta_chunk(q[:, :, part], k[:, :, part], v[:, :, part],
                                       g[:, :, part], beta[:, :, part], state)
        outputs.append(out)
    out = torch.cat(outputs, dim=2)[:, :, :num_tokens]
    return out.transpose(1, 2).to(out_dtype), state


def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q, k [B, H, C, Dk], v [B, H, C, Dv], g, beta [B, H, C], state [B, H, Dk, Dv]."""
    size = q.shape[2]
    gamma = g.cumsum(-1)                                                    # [B, H, C]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # e^{γ_t − γ_s} for s ≤ t; masked before exp so that s > t cannot overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    diagonal = torch.eye(size, dtype=torch.bool, device=q.device)
    # I + A with A[t, s] = β_t e^{γ_t−γ_s} (k_t·k_s) for s < t; the solve reads only below the diagonal.
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(diagonal, 1.0)
    rhs = beta[..., None] * (v - (gamma.exp()[..., None] * k) @ state)     # β(V − e^γ K S₀)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (gamma.exp()[..., None] * q) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    to_end = (gamma[..., -1:] - gamma).exp()[..., None]                    # e^{γ_C − γ_s}
    state = gamma[..., -1, None, None].exp() * state + (k * to_end).transpose(-1, -2) @ u
    return out, state


def select_kernels(device: torch.device) -> GDNKernels:
    """fla's Triton kernels on CUDA when installed, else the torch forms above.

    Decided by device type: fla imports fine on a CPU-only machine and fails only when called.
    """
    if device.type != "cuda":
        return GDNKernels(chunk_gated_delta_rule, recurrent_gated_delta_rule)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError:
        return GDNKernels(chunk_gated_delta_rule, recurrent_gated_delta_rule)
    return GDNKernels(make_fla_chunk(fla_chunk), make_fla_recurrent(fla_recurrent, fla_step_kernel()))


def fla_step_kernel() -> Callable | None:
    """fla's KDA decode kernel, if this fla has the form that writes the state after every token
    into slots of a pool (`ssm_state_indices`, fla >= 0.5); None otherwise."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    parameters = inspect.signature(fused_recurrent_kda_fwd).parameters
    return fused_recurrent_kda_fwd if {"ssm_state_indices", "inplace_final_state"} <= set(parameters) else None


def expand_key_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    # fla versions differ on grouped value heads; repeating the key heads works on all of them.
    group = num_v_heads // k.shape[2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


def make_fla_chunk(fla_chunk: Callable) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """fla's chunk form over a padded group [B, T, ·] as one varlen batch of its real rows
    (cu_seqlens): fla's kernels then always see a batch of one, so those specialised on the batch
    size (chunk_local_cumsum's B, a constexpr of its autotune key) or on the rows (l2norm's NB)
    compile for the shapes the startup warm-up ran, not once more per number of prompts
    prefilling together, and no padding row is computed."""
    def chunk(q, k, v, g, beta, initial_state=None, lengths=None):
        q, k = expand_key_heads(q, k, v.shape[2])
        batch, num_tokens = v.shape[:2]
        index, cu_seqlens = varlen_rows(batch, num_tokens, None if lengths is None else tuple(lengths), v.device)

        def rows(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(batch * num_tokens, *x.shape[2:])
            return (flat if index is None else flat[index])[None]
        state = None if initial_state is None else initial_state.float()
        out, final = fla_chunk(q=rows(q), k=rows(k), v=rows(v), g=rows(g.float()), beta=rows(beta),
                               initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                               cu_seqlens=cu_seqlens)
        if index is None:
            return out.view(batch, num_tokens, *out.shape[2:]), final.float()
        padded = out.new_zeros(batch * num_tokens, *out.shape[2:])
        padded[index] = out[0]
        return padded.view(batch, num_tokens, *out.shape[2:]), final.float()
    return chunk


@functools.lru_cache(maxsize=64)
def varlen_rows(batch: int, num_tokens: int, lengths: tuple[int, ...] | None, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the real rows' indices in the flattened [B·T] group, None when every row is real;
    cu_seqlens [B + 1]) of a group whose sequence b has lengths[b] real rows (None: all T).
    Made on the device from the lengths alone (one non-blocking copy, no wait for the device),
    once per shape: every Gated DeltaNet layer of a prefill step asks for the same (read-only)."""
    if lengths is None or all(n == num_tokens for n in lengths):
        return None, torch.arange(0, (batch + 1) * num_tokens, num_tokens, device=device)
    lens = device_longs(lengths, device)
    cu_seqlens = torch.cat((lens.new_zeros(1), lens.cumsum(0)))
    total = sum(lengths)
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lens, output_size=total)
    index = seq * num_tokens + torch.arange(total, device=device) - cu_seqlens[seq]
    return index, cu_seqlens


def make_fla_recurrent(fla_recurrent: Callable, step_kernel: Callable | None) -> Callable[..., tuple]:
    def recurrent(q, k, v, g, beta, initial_state=None, keep_steps=False):
        if keep_steps:
            # fused_recurrent_gated_delta_rule returns only the final state; a verify block needs
            # the state after every position: KDA's kernel writes them, else the torch form.
            if step_kernel is None:
                return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, keep_steps=True)
            return recurrent_with_steps(step_kernel, q, k, v, g, beta, initial_state)
        q, k = expand_key_heads(q, k, v.shape[2])
        state = None if initial_state is None else initial_state.float()
        # Keywords throughout: fused_recurrent's positional order is q, k, v, g, gk, gv, beta.
        out, final = fla_recurrent(q=q, k=k, v=v, g=g.float(), beta=beta, initial_state=state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out, final.float(), None
    return recurrent


def recurrent_with_steps(step_kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDN through KDA's kernel: GDN is KDA with its decay broadcast over the key dim.

    With ssm_state_indices [B, T] and the pool as both initial and final state, the kernel reads
    sequence n's initial state from pool[indices[n, 0]] and stores the state after token t in
    pool[indices[n, t]]; indices n·T + t make the pool the per-step states [B, T, Hv, Dk, Dv].
    """
    batch, num_tokens, num_v_heads, v_dim = v.shape
    k_dim = k.shape[-1]
    steps = torch.zeros(batch, num_tokens, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    if initial_state is not None:
        steps[:, 0] = initial_state
    indices = torch.arange(batch * num_tokens, dtype=torch.int32, device=v.device).view(batch, num_tokens)
    decay = g.float()[..., None].expand(-1, -1, -1, k_dim).contiguous()         # [B, T, Hv, Dk]
    out, _ = step_kernel(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=decay, beta=beta.contiguous(),
                         initial_state=steps.view(batch * num_tokens, num_v_heads, k_dim, v_dim),
                         inplace_final_state=True, ssm_state_indices=indices,
                         use_qk_l2norm_in_kernel=True)
    return out, steps[:, -1], steps


# The Triton decode / verify step (kernels/gdn.py) on CUDA; False: the torch / fla path above
# (benches flip it to measure both in one process).
STEP_KERNEL = True
# The output's gated RMSNorm inside the recurrent kernel (one program per head row, the whole
# [Dk, Dv] state in registers) rather than after it in torch, for forwards of up to
# FUSE_NORM_MAX_ROWS rows. Measured on the H200 (graphed forwards, BENCHMARKS.md), fused vs not:
# Qwen3.5-4B 3.51 vs 3.95 ms at 1 row, 4.50 vs 4.57 at 8, 14.5 vs 11.6 at 256 (32 × 8), where
# the head-row programs writing every step's state lose to the column split; 35B shape 23.6 vs
# 23.4 at 64 rows (8 × 8). A verify of 16 rows (one sequence at block 16, round 42): the
# recurrent kernel 82 µs a layer fused against 29 µs split by columns, the DFlash cycle 9.41
# against 9.22 ms with the norm in torch. So fused up to 8 rows.
FUSE_NORM = True
FUSE_NORM_MAX_ROWS = 8


# A prefill chunk of at most this many rows per sequence runs on the step kernel too (its rows
# walked in order, the state in registers, the slots advanced in place: two launches a layer)
# rather than on fla's chunked form, whose host side costs ~1 ms a layer beside the torch ops
# around it (gather into a padded group, conv, gates, scatter back), all outside a PIECEWISE
# graph's pieces. Measured on the H200 (Qwen3.5-4B, a turn of N new tokens after a cached 16k
# prefix, one process, BENCHMARKS.md round 47), first token: N = 64: 20 ms on the step kernel
# against 53–71 ms chunked; 128: 16 against 50–60; 256: 25 against 50. The step kernel's device
# time grows with the rows where the chunked form's is flat, so longer chunks stay chunked.
SHORT_PREFILL_ROWS = 256


def step_kernel_fits(x: torch.Tensor, width: int) -> bool:
    """A forward of ≤ MAX_ROWS rows per sequence on CUDA in a float dtype the kernel handles."""
    return x.device.type == "cuda" and step_kernel_serves(x.dtype, width)


def step_kernel_serves(dtype: torch.dtype, width: int) -> bool:
    """Whether the step kernel takes decode / verify rows of this dtype, ≤ width per sequence
    (on CUDA): MAX_ROWS bounds a verify's stash of per-row states."""
    from blockspec.kernels import gdn
    return width <= gdn.MAX_ROWS and kernel_takes(dtype)


def prefill_kernel_fits(x: torch.Tensor, width: int) -> bool:
    """A prefill group of ≤ SHORT_PREFILL_ROWS rows per sequence on CUDA the step kernel takes."""
    return x.device.type == "cuda" and prefill_kernel_serves(x.dtype, width)


def prefill_kernel_serves(dtype: torch.dtype, width: int) -> bool:
    """Whether prefill chunks of this dtype, ≤ width rows per sequence, take the step kernel (a
    plain step's form: no stash, so any number of rows)."""
    return width <= SHORT_PREFILL_ROWS and kernel_takes(dtype)


def kernel_takes(dtype: torch.dtype) -> bool:
    from blockspec.kernels import gdn
    return STEP_KERNEL and gdn.is_available() and dtype in (torch.bfloat16, torch.float16, torch.float32)


def fuses_norm(num_rows: int) -> bool:
    """Whether a step of num_rows decode / verify rows fuses the output norm into the kernel."""
    return FUSE_NORM and num_rows <= FUSE_NORM_MAX_ROWS


def step_variants(layer, calls: list[tuple[int, int]], keep_steps: bool) -> set:
    """The step kernels' variants over calls [(rows, sequences)] of this layer."""
    from blockspec.kernels import gdn
    return {gdn.step_variant(seqs, layer.num_v_heads, layer.k_dim, layer.v_dim, keep_steps, fuses_norm(rows))
            for rows, seqs in calls}


def warm_layouts(layer, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """One row of (mixed, z, b, a) per distinct way a step can hand them to the kernels, which
    Triton tells apart by each pointer's 16-byte alignment and each stride's divisibility: a
    step's decode rows start after its P prefill rows, in views of the layer's own projection
    (FULL graphs, eager steps) or in contiguous copies (a PIECEWISE graph stages a mixer's inputs
    in scratch buffers); over P mod 16 every combination of alignments occurs."""
    rows = 16
    projected = [t[0] for t in layer.project(torch.zeros(1, rows + 1, layer.in_proj.in_features, dtype=dtype,
                                                          device=device))]
    layouts: dict[tuple, tuple[torch.Tensor, ...]] = {}
    for source in (projected, [t.contiguous() for t in projected]):
        for start in range(rows):
            layout = tuple(t[start:start + 1] for t in source)
            key = tuple((t.data_ptr() % 16 == 0, tuple(s % 16 == 0 or s == 1 for s in t.stride())) for t in layout)
            layouts.setdefault(key, layout)
    return list(layouts.values())


def warm_step(layer, states, variants: set, dtype: torch.dtype) -> None:
    """Each variant on one padding row (state slot 0, nobody's) of the model's dtype in every
    layout a step can pass (warm_layouts), so no step compiles one."""
    from blockspec.kernels import gdn
    device = states.ssm[layer.state_index].device
    slots = torch.zeros(1, dtype=torch.long, device=device)
    cu_seqlens = torch.tensor([0, 1], dtype=torch.int32, device=device)
    index = layer.state_index
    for mixed, z, b, a in warm_layouts(layer, dtype, device):
        for variant in sorted(variants, key=lambda v: (v.keep, v.norm, v.block_v)):
            norm = (layer.norm.weight, z, layer.norm.eps) if variant.norm else None
            gdn.gdn_step(mixed, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, states.conv[index],
                         states.ssm[index], slots, cu_seqlens, 1, layer.num_k_heads, layer.k_dim, variant.keep, norm,
                         variant=variant)


def gdn_rows_step(layer, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor, states,
                  slots: torch.Tensor, cu_seqlens: torch.Tensor, max_rows: int, keep_steps: bool) -> torch.Tensor:
    """One GatedDeltaNet layer's conv + delta rule + gated output norm through kernels/gdn.py on
    flat rows: sequence i owns rows cu_seqlens[i] … cu_seqlens[i+1] − 1 (any widths ≤ max_rows,
    0 included) and state slot slots[i]. mixed [R, conv_dim], b, a [R, Hv], z [R, Hv, Dv] →
    layer.norm(out, z) [R, Hv, Dv]. Reads and advances the slots of `states` in place, or
    (keep_steps) stashes every row's state [B, max_rows, Hv, Dk, Dv] and the conv inputs
    [B, C, K−1+max_rows] for StatePool.select, the slots untouched."""
    from blockspec.kernels import gdn
    index = layer.state_index
    fuse_norm = fuses_norm(mixed.shape[0])
    space = states.space_for(index, slots.shape[0], max_rows) if keep_steps else None
    out, steps, conv_inputs = gdn.gdn_step(
        mixed, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, states.conv[index], states.ssm[index],
        slots, cu_seqlens, max_rows, layer.num_k_heads, layer.k_dim, keep_steps,
        (layer.norm.weight, z, layer.norm.eps) if fuse_norm else None, space)
    if keep_steps:
        states.stash(index, steps, conv_inputs)
    return out if fuse_norm else layer.norm(out, z)


def reference_step(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                   slots: torch.Tensor, cu_seqlens: torch.Tensor, max_rows: int, num_k_heads: int, k_dim: int,
                   keep_steps: bool, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """kernels/gdn.py's `gdn_step` from the torch forms (F.conv1d + SiLU, `recurrent_gated_delta_rule`),
    one sequence at a time: the kernel's reference, same arguments and results."""
    num_rows, conv_dim = mixed.shape
    num_v_heads, v_dim = ssm_pool.shape[1], ssm_pool.shape[3]
    kernel = conv_weight.shape[-1]
    key_width = num_k_heads * k_dim
    out = torch.empty(num_rows, num_v_heads, v_dim, dtype=mixed.dtype, device=mixed.device)
    steps = torch.zeros(slots.shape[0], max_rows, num_v_heads, k_dim, v_dim, dtype=ssm_pool.dtype, device=mixed.device)
    stash = torch.zeros(slots.shape[0], conv_dim, kernel - 1 + max_rows, dtype=conv_pool.dtype, device=mixed.device)
    new_conv, new_ssm = conv_pool.clone(), ssm_pool.clone()
    for seq, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot, rows = int(slots[seq]), end - start
        inputs = torch.cat((conv_pool[slot], mixed[start:end].T), dim=-1)[None]     # [1, C, K−1+T]
        stash[seq, :, :inputs.shape[-1]] = inputs[0]
        new_conv[slot] = inputs[0, :, rows:]
        if rows == 0:
            continue
        conv = torch.nn.functional.silu(torch.nn.functional.conv1d(
            inputs, conv_weight.reshape(conv_dim, 1, kernel), groups=conv_dim)).transpose(1, 2)   # [1, T, C]
        q, k, v = conv.split((key_width, key_width, num_v_heads * v_dim), dim=-1)
        dtype = state_dtype(a.dtype)
        g = -a_log.to(dtype).exp() * torch.nn.functional.softplus(a[start:end].to(dtype) + dt_bias.to(dtype))
        o, final, kept = recurrent_gated_delta_rule(
            q.reshape(1, rows, num_k_heads, k_dim), k.reshape(1, rows, num_k_heads, k_dim),
            v.reshape(1, rows, num_v_heads, v_dim), g[None], b[start:end].sigmoid()[None],
            ssm_pool[slot][None], keep_steps=True)
        out[start:end] = o[0]
        steps[seq, :rows] = kept[0].to(steps.dtype)
        new_ssm[slot] = final[0].to(new_ssm.dtype)
    if norm is not None:
        out = gated_rms_norm_torch(out, *norm)
    if keep_steps:
        return out, steps, stash
    conv_pool.copy_(new_conv)
    ssm_pool.copy_(new_ssm)
    return out, None, None


