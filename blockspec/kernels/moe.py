"""Fused mixture-of-experts kernels (Triton): the CUDA path of `layers/moe.py`.

`fused_experts` has the signature and result of `layers.moe.reference_experts`: x [N, H],
routing weights and expert ids [N, k], stacked gate_up_proj [E, 2I, H] (gate rows, then up rows)
and down_proj [E, H, I] → Σ_k w_k · down_e(silu(gate_e x) · up_e x) [N, H]. `fused_moe` is the
whole sparse block from the router logits: `route_fused` (softmax, top-k, renormalisation in one
launch per token) and, where the model has a shared expert of the experts' intermediate size,
that expert as slot k + 1 of every token (id E, weight sigmoid(x · gate), its own weight tensors).

Three launches and one sum, all of fixed shape with no host sync, so a decode cycle can be
captured in a CUDA graph:
1. align: the N·k (token, slot) pairs, stably sorted by expert, each expert's run padded to a
   multiple of BLOCK_M (padding holds the sentinel N·k). `sorted_ids` is sized for the worst
   case; the real padded length lives on the device and programs past it exit at once.
2. gate_up: one program per (block of BLOCK_M pairs of one expert, block of BLOCK_N columns of
   I) gathers its pairs' token rows of x, multiplies by that expert's gate and up rows and writes
   silu(gate) · up (fp32 accumulation, rounded once) to hidden [N·k, I] at the pair's row.
3. down: the same grid over H; each pair's row of hidden times down_e, scaled by its routing
   weight, written to out [N·k, H] at the pair's row.
4. out.view(N, k, H).sum(1): a fixed-order sum over the k slots, so results are deterministic
   (no atomics) and equal from run to run, eager or graphed.

Every chosen expert's weights are read once per step whatever the batch: at decode widths the
kernel is weight-bandwidth-bound, so small BLOCK_M (16, the least tl.dot takes) and programs
split over the output columns keep every SM streaming weights.

FP8 experts (`scales`, layers/fp8.py): the same launches read e4m3 weights, widen each tile to
x's dtype in registers and scale each 128-column partial product by its block scale (the
weight-only scheme of kernels/fp8.py); an e4m3 shared expert whose scales are laid out as one
expert's rides along as its slot too (layers/moe.py decides; BLOCKSPEC_FP8_SHARED_SLOT=0 turns it
off), else it runs on its own, outside the slots: nine launches a layer more (the gate's dot and
sigmoid, two GEMVs, silu · up, the product and the sum), 0.43 ms of Qwen3.5-35B-A3B's 5.07 ms FP8
plain step on the H200 (round 66: 1,109 → 749 kernels a step).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from blockspec.kernels.fused import k_split

try:
    import triton
    import triton.language as tl
except ImportError:                                      # CPU-only installs: the reference path
    triton = None

# A single program aligns up to this many pairs (decode and small verify batches, one launch);
# larger batches use a few torch ops, still without host sync.
MAX_PAIRS_ONE_PROGRAM = 256
# ARRIVALS (on unless BLOCKSPEC_MOE_ARRIVALS=0): the routing launch's last program aligns the pairs,
# and the down GEMM's last pair of each token adds its slots (arrival counts, as kernels/fp8.py's
# in-kernel split sums): two launches a sparse layer fewer (80 of Qwen3.5-35B-A3B's ~750 a plain
# step). On since round 68's H100 run: tests/gpu bit for bit against the separate launches, eager
# and graphed, and the FP8 MoE's plain step 4.44 → 4.15 ms with the bf16 tail (kernels/fp8.py).
def arrivals_from_env() -> bool:
    """BLOCKSPEC_MOE_ARRIVALS: on unless "0"."""
    return os.environ.get("BLOCKSPEC_MOE_ARRIVALS", "1") != "0"


ARRIVALS = arrivals_from_env()
# Counters in the one arrival buffer of a device (tokens × column blocks for the slot sum).
MAX_COUNTED = 1 << 16
# BLOCKSPEC_MOE_SPLIT_K=<parts> (opt-in, round 68; 1: off): at decode widths (gate_up_tiles' small
# blocks) the gate/up GEMM's K is split into that many parts, each its own program, the last part of a
# tile to arrive adding the parts' fp32 sums in part order before silu · up. Why: round 68's H100
# sweep put one sparse layer at one token at 45 µs against a 10 µs bandwidth floor, and no tile set
# was faster: ~150 programs each walking all of K one tile after another leave the GPU waiting on
# latency, not bytes. Off until a GPU run measures it (scripts/moe_kernel_bench.py --split-k).
def split_k_from_env() -> int:
    """BLOCKSPEC_MOE_SPLIT_K: the parts (1, unsplit, unless a larger whole number is given)."""
    value = os.environ.get("BLOCKSPEC_MOE_SPLIT_K", "1")
    return max(1, int(value)) if value.strip().isdigit() else 1


SPLIT_K = split_k_from_env()


def is_available() -> bool:
    return triton is not None


@functools.lru_cache(maxsize=None)
def arrival_counters(device: torch.device) -> torch.Tensor:
    """[MAX_COUNTED] int32 zeros: the arrivals the routing and down launches count. Each launch's
    last arrivals put their counts back to 0, so the buffer is zero between launches and every
    CUDA-graph replay finds it so; the launches that use it run one after another (one stream)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the MoE arrival counters are allocated by the first eager call: run the layer "
                           "once before capturing a CUDA graph")
    return torch.zeros(MAX_COUNTED, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class ExpertScales:
    """Block scales of FP8 experts: gate_up [E, ⌈2I/rows⌉, ⌈H/128⌉], down [E, ⌈H/128⌉, ⌈I/128⌉],
    and the weight rows × columns each scale covers (layers.fp8.ScaleBlock)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_block: Any
    down_block: Any


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def decode_widths(num_pairs: int, num_experts: int) -> bool:
    """Decode and verify widths: at most two pairs per expert on average, so blocks hold a row or two."""
    return num_pairs <= 2 * num_experts


def gate_up_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """Decode and verify widths (decode_widths): weight-streaming GEMV-like tiles, split over the
    output columns (round 68's H100 sweep of eight sets kept them)."""
    if decode_widths(num_pairs, num_experts):
        return Tiles(16, 32, 128, 4, 4)
    return Tiles(64, 64, 64, 4, 3)


def down_tiles(num_pairs: int, num_experts: int) -> Tiles:
    if decode_widths(num_pairs, num_experts):
        return Tiles(16, 64, 128, 4, 4)
    return Tiles(64, 64, 64, 4, 3)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst case of Σ_e ceil(count_e / block_m) · block_m: every used expert (at most
    min(E, N·k)) pads by at most block_m − 1 rows; rounded up to whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


if triton is not None:

    @triton.jit
    def _align_pairs(experts_ptr, sorted_ids_ptr, ends_ptr, num_padded_ptr, num_pairs, sorted_len,
                     NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                     IDS_CACHE: tl.constexpr):
        """Pass 1 counts pairs per expert (one-hot rows summed), pass 2 gives each pair its slot:
        its expert's padded start + the number of earlier pairs of that expert (a cumulative sum
        down the one-hot columns, carried across chunks), so the order inside an expert is the
        pairs' own order, as a stable sort gives. IDS_CACHE: the ids' load cache modifier (".cg",
        from L2, in the route kernel, where other programs of the launch wrote them)."""
        bins = tl.arange(0, E_POW2)
        lanes = tl.arange(0, CHUNK)
        counts = tl.zeros([E_POW2], dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            idx = start + lanes
            expert = tl.load(experts_ptr + idx, mask=idx < num_pairs, other=E_POW2, cache_modifier=IDS_CACHE).to(tl.int32)
            counts += tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        tl.store(ends_ptr + bins, ends, mask=bins < NUM_EXPERTS)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        for start in range(0, sorted_len, CHUNK):
            idx = start + lanes
            tl.store(sorted_ids_ptr + idx, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=idx < sorted_len)
        tl.debug_barrier()                                 # sentinels first, then the pairs over them
        seen = ends - padded                               # next free slot of each expert
        for start in range(0, num_pairs, CHUNK):
            idx = start + lanes
            expert = tl.load(experts_ptr + idx, mask=idx < num_pairs, other=E_POW2, cache_modifier=IDS_CACHE).to(tl.int32)
            onehot = (expert[:, None] == bins[None, :]).to(tl.int32)
            before = tl.cumsum(onehot, axis=0) - onehot                  # same expert, earlier in chunk
            slot = tl.sum(onehot * (before + seen[None, :]), axis=1)
            tl.store(sorted_ids_ptr + slot, idx, mask=idx < num_pairs)
            seen += tl.sum(onehot, axis=0)

    @triton.jit
    def _align_kernel(experts_ptr, sorted_ids_ptr, ends_ptr, num_padded_ptr, num_pairs, sorted_len,
                      NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr):
        """One program: `_align_pairs` over the pairs' expert ids."""
        _align_pairs(experts_ptr, sorted_ids_ptr, ends_ptr, num_padded_ptr, num_pairs, sorted_len,
                     NUM_EXPERTS, E_POW2, BLOCK_M, CHUNK, "")

    @triton.jit
    def _expert_gemm_kernel(a_ptr, w_ptr, shared_ptr, shared_up_ptr, out_ptr, sorted_ids_ptr, ends_ptr,
                            num_padded_ptr, route_ptr, s_ptr, shared_s_ptr, sum_ptr, count_ptr, num_pairs, N, K,
                            stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn,
                            ROWS_PER_A: tl.constexpr, NUM_IDS: tl.constexpr, E_POW2: tl.constexpr,
                            HAS_SHARED: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                            SCALED: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SLOT_SUM: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1,
                            k_per_split=0):
        """out[pair, n] = Σ_k a[pair // ROWS_PER_A, k] · w[expert, n, k] for the pairs of one
        block (all of one expert); GATED: also the up rows w[expert, N + n, :] and the output is
        silu(gate) · up; WEIGHTED: times the pair's routing weight. HAS_SHARED: the last id is
        the shared expert, whose (gate, up) or down rows live in their own tensors (same row stride).
        SCALED: w is e4m3, each BLOCK_K-column partial product times s[expert, row // SCALE_ROWS,
        k // SCALE_COLS] (BLOCK_K divides SCALE_COLS); the shared expert's scales are then
        shared_s[row // SCALE_ROWS, k // SCALE_COLS] (its (gate, up) or down rows' own, same strides).
        SLOT_SUM = k > 0: pair p is slot p % k of token p // k; the last of a token's k pairs to
        store its columns (an arrival count per token and column block in count_ptr, put back to 0)
        adds the token's k rows in slot order, in fp32 as torch's sum over the slots, into
        sum_ptr [tokens, N]: no launch of its own for the sum.
        SPLIT_K > 1 (GATED, no SLOT_SUM): program (·, ·, s) walks K columns [s·k_per_split, (s+1)·k_per_split)
        and stores its fp32 gate and up sums in sum_ptr [SPLIT_K, pairs, 2N]; the last of a tile's
        parts to arrive (a count per tile in count_ptr, put back to 0) adds them in part order and
        goes on as an unsplit program would."""
        row0 = tl.program_id(0) * BLOCK_M
        if row0 >= tl.load(num_padded_ptr):
            return                                        # past the real pairs: the grid is the worst case
        bins = tl.arange(0, E_POW2)
        ends = tl.load(ends_ptr + bins, mask=bins < NUM_IDS, other=2**30)
        expert = tl.sum((ends <= row0).to(tl.int32), axis=0)          # the run this block lies in
        pairs = tl.load(sorted_ids_ptr + row0 + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = (pairs // ROWS_PER_A).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        k_start = tl.program_id(2) * k_per_split if SPLIT_K > 1 else 0
        k_end = tl.minimum(k_start + k_per_split, K) if SPLIT_K > 1 else K
        a_ptrs = a_ptr + rows[:, None] * stride_am + k_start + offs_k[None, :]
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        up_base = w_base + N * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        if HAS_SHARED:
            if expert == NUM_IDS - 1:
                w_base = shared_ptr
                up_base = shared_up_ptr
                if SCALED:
                    s_base = shared_s_ptr
        w_offs = offs_n[None, :].to(tl.int64) * stride_wn + k_start + offs_k[:, None]
        w_ptrs = w_base + w_offs
        up_ptrs = up_base + w_offs
        s_ptrs = s_base + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
        s_up_ptrs = s_base + ((N + offs_n) // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            k_ok = offs_k < k_end - k
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if SCALED:
                s = tl.load(s_ptrs + k // SCALE_COLS, mask=n_ok, other=0.0)
                acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * s[None, :]
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if SCALED:
                    s_up = tl.load(s_up_ptrs + k // SCALE_COLS, mask=n_ok, other=0.0)
                    acc_up += tl.dot(a, w_up.to(a.dtype), input_precision=PRECISION) * s_up[None, :]
                else:
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        written = valid[:, None] & n_ok[None, :]
        if SPLIT_K > 1:
            # Every thread's partial sums stored before the tile's arrival (as SLOT_SUM below);
            # the last part reads them from L2 in part order, so the sum has one order.
            tile = (pairs[:, None].to(tl.int64) * (2 * N) + offs_n[None, :])
            stored = written
            part = sum_ptr + tl.program_id(2).to(tl.int64) * num_pairs * (2 * N)
            tl.store(part + tile, acc, mask=stored)
            tl.store(part + tile + N, acc_up, mask=stored)
            tl.debug_barrier()
            counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            # the count broadcast to the tile first: Triton's interpreter refuses a scalar in a tile's mask
            last_part = (tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32) + arrived) == SPLIT_K - 1
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for p in tl.static_range(SPLIT_K):
                part = sum_ptr + p * num_pairs * (2 * N)
                acc += tl.load(part + tile, mask=stored & last_part, other=0.0, cache_modifier=".cg")
                acc_up += tl.load(part + tile + N, mask=stored & last_part, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0, mask=arrived == SPLIT_K - 1)    # zero again for the next launch or replay
            written = stored & last_part
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if WEIGHTED:
            acc = acc * tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=written)
        if SLOT_SUM > 0:
            # Every thread's stores precede the arrivals (the barrier orders them within the
            # program; each atomic's release, cumulative, publishes them at GPU scope). A block
            # is one expert's, so it holds at most one pair of a token.
            tl.debug_barrier()
            tokens = (pairs // SLOT_SUM).to(tl.int64)
            counters = count_ptr + tokens * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(counters, 1, mask=valid, sem="acq_rel", scope="gpu")
            last = valid & (arrived == SLOT_SUM - 1)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            rows = out_ptr + (tokens * SLOT_SUM)[:, None] * stride_om + offs_n[None, :]
            for slot in tl.static_range(SLOT_SUM):        # in slot order; L2, never a stale L1 line
                total += tl.load(rows + slot * stride_om, mask=last[:, None] & n_ok[None, :], other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
            tl.store(sum_ptr + tokens[:, None] * N + offs_n[None, :], total.to(sum_ptr.dtype.element_ty),
                     mask=last[:, None] & n_ok[None, :])
            tl.store(counters, 0, mask=last)              # zero again for the next launch or graph replay


    @triton.jit
    def _route_kernel(logits_ptr, x_ptr, shared_gate_ptr, weights_ptr, experts_ptr, num_experts, hidden,
                      stride_logits, stride_x, count_ptr, sorted_ids_ptr, ends_ptr, num_padded_ptr, sorted_len,
                      TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                      SLOTS_POW2: tl.constexpr, E_POW2: tl.constexpr, NORMALIZE: tl.constexpr,
                      SHARED: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr = False,
                      NUM_IDS: tl.constexpr = 1, IDS_POW2: tl.constexpr = 1, ALIGN_M: tl.constexpr = 16,
                      CHUNK: tl.constexpr = 1):
        """One program per token: softmax over the experts in fp32, the TOP_K largest (the first
        index among equals), renormalised when NORMALIZE; SHARED: one more slot, the shared
        expert (id num_experts) weighted sigmoid(x · shared_gate). ALIGN: the last program to
        store its token's ids (an arrival count at count_ptr, put back to 0) aligns all of them
        for the expert GEMMs as `_align_kernel` does: no launch of its own."""
        token = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, E_POW2)
        logits = tl.load(logits_ptr + token * stride_logits + offs, mask=offs < num_experts,
                         other=float("-inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=0))
        probs = exps / tl.sum(exps, axis=0)
        remaining = tl.where(offs < num_experts, probs, -1.0)
        slots = tl.arange(0, SLOTS_POW2)
        top_w = tl.zeros([SLOTS_POW2], dtype=tl.float32)
        top_e = tl.zeros([SLOTS_POW2], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=0)
            choice = tl.min(tl.where(remaining == best, offs, E_POW2), axis=0)
            top_w = tl.where(slots == i, best, top_w)
            top_e = tl.where(slots == i, choice, top_e)
            remaining = tl.where(offs == choice, -1.0, remaining)
        if NORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)
        if SHARED:
            lanes = tl.arange(0, BLOCK_H)
            dot = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h in range(0, hidden, BLOCK_H):
                ok = lanes < hidden - h
                x = tl.load(x_ptr + token * stride_x + h + lanes, mask=ok, other=0.0).to(tl.float32)
                g = tl.load(shared_gate_ptr + h + lanes, mask=ok, other=0.0).to(tl.float32)
                dot += x * g
            top_w = tl.where(slots == TOP_K, tl.sigmoid(tl.sum(dot, axis=0)), top_w)
            top_e = tl.where(slots == TOP_K, num_experts, top_e)
        tl.store(weights_ptr + token * SLOTS + slots, top_w.to(weights_ptr.dtype.element_ty), mask=slots < SLOTS)
        tl.store(experts_ptr + token * SLOTS + slots, top_e, mask=slots < SLOTS)
        if ALIGN:
            tl.debug_barrier()                            # this program's ids stored before its arrival
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(0) - 1:         # the last: its acquire sees every token's ids
                _align_pairs(experts_ptr, sorted_ids_ptr, ends_ptr, num_padded_ptr, tl.num_programs(0) * SLOTS,
                             sorted_len, NUM_IDS, IDS_POW2, ALIGN_M, CHUNK, ".cg")
                tl.store(count_ptr, 0)                    # zero again for the next launch or graph replay


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert's weights as the checkpoint has them: gate/up [I, H], down [H, I],
    its gate [1, H] (output = sigmoid(x · gateᵀ) · down(silu(gate x) · up x)). Beside FP8
    experts its weights are e4m3 too, with their block scales as the experts' are laid out
    (gate_up_scale [⌈2I/rows⌉, ⌈H/128⌉] for the fused gate | up rows, down_scale [⌈H/128⌉, ⌈I/128⌉])."""
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]      # align's sorted_ids, padded run ends, padded length


def route_fused(logits: torch.Tensor, x: torch.Tensor, top_k: int, normalize: bool,
                shared: SharedExpert | None, aligned: AlignPlan | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, Routing | None]:
    """`layers.moe.route` in one launch (→ weights [N, k], ids [N, k] int32), plus a last slot
    for the shared expert (id E, weight sigmoid(x · gate)) when there is one. The top k of the
    probabilities are those of the logits, so the choice equals torch.topk's except between
    exactly equal probabilities. `aligned`: the same launch also aligns the pairs for the
    expert GEMMs (`align`'s result, third; else None)."""
    num_tokens, num_experts = logits.shape
    slots = top_k + (shared is not None)
    weights = torch.empty(num_tokens, slots, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(num_tokens, slots, dtype=torch.int32, device=logits.device)
    routing, extra = None, {}
    if aligned is not None:
        routing = aligned.buffers(logits.device)
        extra = dict(ALIGN=True, NUM_IDS=aligned.num_ids, IDS_POW2=aligned.ids_pow2, ALIGN_M=aligned.block_m,
                     CHUNK=aligned.chunk)
    _route_kernel[(num_tokens,)](
        logits, x, shared.gate_logit if shared is not None else x, weights, experts, num_experts, x.shape[1],
        logits.stride(0), x.stride(0), arrival_counters(logits.device) if aligned is not None else experts,
        *(routing if routing is not None else (experts, experts, experts)),
        aligned.sorted_len if aligned is not None else 0,
        TOP_K=top_k, SLOTS=slots, SLOTS_POW2=triton.next_power_of_2(slots),
        E_POW2=triton.next_power_of_2(num_experts), NORMALIZE=normalize, SHARED=shared is not None,
        BLOCK_H=min(1024, triton.next_power_of_2(x.shape[1])), num_warps=4, **extra)
    return weights, experts, routing


def fused_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, shared: SharedExpert | None = None,
              scales: ExpertScales | None = None) -> torch.Tensor:
    """The whole sparse block from the router logits [N, E]: route, the experts and (when given,
    of the experts' intermediate size) the shared expert as one more slot of every token. With
    ARRIVALS, routing and alignment are one launch and the slot sum rides in the down GEMM."""
    num_pairs = x.shape[0] * (top_k + (shared is not None))
    plan = align_plan(num_pairs, gate_up_proj.shape[0], shared is not None)
    aligned = plan if ARRIVALS and num_pairs <= MAX_PAIRS_ONE_PROGRAM else None
    weights, experts, routing = route_fused(logits, x, top_k, normalize, shared, aligned)
    return fused_experts(x, weights, experts, gate_up_proj, down_proj, shared, scales, routing=routing,
                         slot_sum=ARRIVALS)


def align_torch(flat: torch.Tensor, num_experts: int, block_m: int,
                sorted_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The align kernel's result from torch ops (no host sync): sorted_ids [sorted_len],
    padded run ends [E], padded length [1]. Large batches, and the test reference."""
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    sorted_ids = torch.full((sorted_len,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    return sorted_ids, ends.to(torch.int32), ends[-1:].to(torch.int32)


@dataclass(frozen=True)
class AlignPlan:
    """How the N·k pairs of a step are aligned for the expert GEMMs: num_ids expert ids (the
    shared expert's included), runs padded to block_m, sorted_len the worst case's length."""
    num_pairs: int
    num_ids: int
    block_m: int
    sorted_len: int

    @property
    def ids_pow2(self) -> int:
        return triton.next_power_of_2(self.num_ids)

    @property
    def chunk(self) -> int:
        """Pairs a loop step of `_align_pairs`: one-hot chunks of chunk × ids_pow2 stay ≤ 8192."""
        return min(triton.next_power_of_2(self.num_pairs), max(1, 8192 // self.ids_pow2), 64)

    def buffers(self, device: torch.device) -> Routing:
        return (torch.empty(self.sorted_len, dtype=torch.int32, device=device),
                torch.empty(self.num_ids, dtype=torch.int32, device=device),
                torch.empty(1, dtype=torch.int32, device=device))


def align_plan(num_pairs: int, num_experts: int, has_shared: bool) -> AlignPlan:
    """The plan both expert GEMMs walk (their tiles' block_m, which gate_up_tiles sets)."""
    num_ids = num_experts + has_shared
    block_m = gate_up_tiles(num_pairs, num_experts).block_m
    return AlignPlan(num_pairs, num_ids, block_m, max_padded_pairs(num_pairs, num_ids, block_m))


def align(flat: torch.Tensor, num_experts: int, block_m: int,
          sorted_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_pairs = flat.numel()
    if num_pairs > MAX_PAIRS_ONE_PROGRAM:
        return align_torch(flat, num_experts, block_m, sorted_len)
    plan = AlignPlan(num_pairs, num_experts, block_m, sorted_len)
    routing = plan.buffers(flat.device)
    _align_kernel[(1,)](flat, *routing, num_pairs, sorted_len, NUM_EXPERTS=num_experts, E_POW2=plan.ids_pow2,
                        BLOCK_M=block_m, CHUNK=plan.chunk, num_warps=4)
    return routing


def expert_gemm(a: torch.Tensor, w: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None,
                out: torch.Tensor, routing: tuple[torch.Tensor, ...], tiles: Tiles, rows_per_a: int, gated: bool,
                route_weights: torch.Tensor | None, scale: tuple[torch.Tensor, Any] | None = None,
                shared_scale: torch.Tensor | None = None, slot_sum: tuple[torch.Tensor, int] | None = None,
                split_k: int = 1) -> None:
    """One gather-GEMM launch over the aligned pairs (see _expert_gemm_kernel); `shared`: the
    shared expert's (gate, up) or (down, down) rows, id E; `scale`: (block scales [E, ·, ·], their
    ScaleBlock) of e4m3 weights; `shared_scale`: the e4m3 shared expert's own (strides as one
    expert's scales); `slot_sum`: (sums [tokens, N], k): each token's k rows of `out` also added
    into sums by the launch (the kernel's SLOT_SUM); `split_k`: K in that many parts (gated only,
    see SPLIT_K; fewer where K has fewer tiles or the counters too little room)."""
    sorted_ids, ends, num_padded = routing
    s, block = scale if scale is not None else (out, None)
    if scale is not None and shared is not None:
        assert (shared_scale is not None and shared_scale.shape == s.shape[1:]
                and shared_scale.stride() == s.stride()[1:]), "an e4m3 shared expert's scales are laid out as one expert's"
    scale_cols = 1 if block is None else (block.cols if block.cols < w.shape[2] else 1 << 30)
    num_ids, n_out, k_in = w.shape[0] + (shared is not None), (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    grid = (sorted_ids.numel() // tiles.block_m, triton.cdiv(n_out, tiles.block_n))
    sums, per_token = slot_sum if slot_sum is not None else (out, 0)
    parts, k_per_split = k_split(k_in, tiles.block_k, split_k if gated and slot_sum is None else 1)
    if parts > 1 and grid[0] * grid[1] > MAX_COUNTED:
        parts, k_per_split = 1, 0
    counts = arrival_counters(out.device) if slot_sum is not None or parts > 1 else sorted_ids
    if parts > 1:
        sums = torch.empty(parts, out.shape[0], 2 * n_out, dtype=torch.float32, device=out.device)
    _expert_gemm_kernel[grid + (parts,)](
        a, w, shared[0] if shared is not None else w, shared[1] if shared is not None else w, out, sorted_ids,
        ends, num_padded, route_weights if route_weights is not None else out, s,
        shared_scale if shared_scale is not None else s, sums,
        counts, out.shape[0], n_out, k_in,
        a.stride(0), w.stride(0),
        w.stride(1), out.stride(0),
        s.stride(0) if scale is not None else 0, s.stride(1) if scale is not None else 0,
        ROWS_PER_A=rows_per_a, NUM_IDS=num_ids, E_POW2=triton.next_power_of_2(num_ids),
        HAS_SHARED=shared is not None, GATED=gated, WEIGHTED=route_weights is not None,
        SCALED=scale is not None, SCALE_ROWS=1 if block is None else block.rows, SCALE_COLS=scale_cols,
        PRECISION="ieee" if a.dtype == torch.float32 else None,       # fp32 stays fp32 (no TF32)
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SLOT_SUM=per_token,
        SPLIT_K=parts, k_per_split=k_per_split, num_warps=tiles.num_warps, num_stages=tiles.num_stages)





def fused_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  shared: SharedExpert | None = None, scales: ExpertScales | None = None,
                  routing: Routing | None = None, slot_sum: bool = False) -> torch.Tensor:
    """x [N, H], weights / experts [N, k] → Σ_k weights · expert(x) [N, H] (see the module doc).
    With `shared`, id E in `experts` is the shared expert (route_fused puts it in the last slot).
    With `scales`, the expert weights are e4m3, and a shared slot's too (with its own scales).
    `routing`: the pairs already aligned (route_fused's); `slot_sum`: the sum over the slots
    taken by the down GEMM's launch (where the arrival counters have room for the tokens)."""
    assert scales is None or shared is None or shared.gate_up_scale is not None, "e4m3 experts, e4m3 shared expert"
    num_tokens, top_k = experts.shape
    num_experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    num_ids = num_experts + (shared is not None)
    num_pairs = num_tokens * top_k
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    if shared is not None:
        shared = SharedExpert(*(t.contiguous() if t is not None else None
                                for t in (shared.gate, shared.up, shared.down, shared.gate_logit,
                                          shared.gate_up_scale, shared.down_scale)))
        assert shared.gate.shape == shared.up.shape == (inter, x.shape[1]) and shared.down.shape == (x.shape[1], inter), \
            "the fused shared expert must have the experts' intermediate size"
    up_tiles, dn_tiles = gate_up_tiles(num_pairs, num_experts), down_tiles(num_pairs, num_experts)
    assert up_tiles.block_m == dn_tiles.block_m, "both GEMMs walk the same aligned blocks"
    if routing is None:
        plan = align_plan(num_pairs, num_experts, shared is not None)
        routing = align(experts.flatten().contiguous(), num_ids, plan.block_m, plan.sorted_len)
    hidden = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)                # [N·k, I]
    expert_gemm(x, gate_up_proj, (shared.gate, shared.up) if shared is not None else None, hidden, routing,
                up_tiles, top_k, gated=True, route_weights=None,
                scale=(scales.gate_up, scales.gate_up_block) if scales is not None else None,
                shared_scale=shared.gate_up_scale if shared is not None else None,
                split_k=SPLIT_K if decode_widths(num_pairs, num_experts) else 1)
    out = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)              # [N·k, H]
    summed = None
    if slot_sum and num_tokens * triton.cdiv(x.shape[1], dn_tiles.block_n) <= MAX_COUNTED:
        summed = torch.empty_like(x)
    expert_gemm(hidden, down_proj, (shared.down, shared.down) if shared is not None else None, out, routing,
                dn_tiles, 1, gated=False, route_weights=weights.flatten().contiguous(),
                scale=(scales.down, scales.down_block) if scales is not None else None,
                shared_scale=shared.down_scale if shared is not None else None,
                slot_sum=(summed, top_k) if summed is not None else None)
    return summed if summed is not None else out.view(num_tokens, top_k, -1).sum(dim=1)
