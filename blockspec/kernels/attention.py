"""Paged attention in Triton: the fast path of `layers.attention.paged_attention` (the torch
reference there is the spec; tests/gpu/test_attention_kernels.py holds them together).

One kernel serves every forward of the flat ragged batch: a program takes one sequence b, one
KV head h and a tile of BLOCK_M query rows — the GROUP query heads that share h times
consecutive tokens of b's rows query_start[b] … query_start[b + 1] − 1, flattened
(row = t · GROUP + g) — so even a decode row or a verify block feeds tl.dot with a real matrix,
and each K/V page is read once per KV head instead of once per query head. The grid covers the
longest query of the batch; a tile past its own sequence's rows returns at once.
Keys are read from the pool through the block table up to the sequence's live length
(`context_lens`, on the device): a program past the end does no work, so the grid can be fixed
by the pool's capacity and a CUDA graph serves every length.

Split-K (flash-decoding): when the batch alone gives fewer programs than the GPU has SMs, the
keys of each sequence are cut into num_splits ranges (cut per sequence from its own length, so
every range has work), each program writes an unnormalised partial (acc, running max, sum) and
a second kernel merges them. Online softmax in fp32 (base 2), fp32 accumulation whatever the
input dtype; fp32 inputs multiply in IEEE fp32 (no TF32).

Masks as the reference: causal layers see keys at positions ≤ the query's; the draft (block_kv)
sees its committed context and its own block's K/V (never cached), both ways unless causal.
Sliding windows are not handled here (the caller keeps the reference for them).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_chunk(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One online-softmax step over a chunk of keys: q [M, D], k/v [N, D], visible [M, N]."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no visible key yet keeps max −inf: shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Values that change from batch to batch are not specialised on (Triton would compile a variant
# per divisibility / alignment of each: views of the packed metadata start anywhere, a block
# table's row is as long as the step's longest sequence): the kernel's variants are its
# constexprs alone (`attention_variant`), which the startup warm-up runs.
@triton.jit(do_not_specialize=["block_tables_ptr", "context_lens_ptr", "positions_ptr", "query_start_ptr",
                               "stride_bt", "page_size", "num_tokens", "num_splits", "split_keys"])
def _paged_attention_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, block_k_ptr, block_v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_tables_ptr, context_lens_ptr, positions_ptr, query_start_ptr,
        stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_bkn, stride_bkh, stride_bvn, stride_bvh, stride_bt,
        page_size, head_dim, num_tokens, num_splits, split_keys, qk_scale,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, IS_SPLIT: tl.constexpr, INVARIANT: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BLOCK: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, seq_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = seq_head // NUM_KV_HEADS, seq_head % NUM_KV_HEADS
    q_start = tl.load(query_start_ptr + b).to(tl.int32)
    width = tl.load(query_start_ptr + b + 1).to(tl.int32) - q_start       # this sequence's query rows
    live = tile * BLOCK_M < width * GROUP                                 # else: a tile past its rows, no work
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t, g = rows // GROUP, rows % GROUP
    row_ok = t < width
    tok = q_start + t                                                     # [M] flat token index
    q_head = h * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qn + q_head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(positions_ptr + tok, mask=row_ok, other=0).to(tl.int32)            # [M]

    context_len = tl.load(context_lens_ptr + b).to(tl.int32)
    if INVARIANT:
        # Ranges of split_keys keys from key 0, whatever the call: a row's keys are cut the same
        # way however many splits the grid has (the ones past its keys are empty), and its own
        # block goes with its last range (the unsplit kernel's order: context, then block).
        chunk = split_keys
        # (max_context_len bounds every context_len, so the last range is in the grid; the clamp
        # keeps the block in it should a caller ever pass less.)
        block_split = tl.minimum(tl.maximum(context_len - 1, 0) // chunk, num_splits - 1)
    else:
        # Split ranges cut from this sequence's own length (multiples of BLOCK_N), so none is idle
        # while another holds the whole context.
        chunk = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        block_split = 0
    lo = split * chunk
    hi = tl.minimum(lo + chunk, context_len)
    hi = tl.where(live, hi, lo)
    if IS_CAUSAL:
        # No row of this tile sees a key past its last query position.
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, q_pos, 0)) + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < hi
        page = tl.load(table + key_pos // page_size, mask=key_ok, other=0)
        slot = page.to(tl.int64) * page_size + key_pos % page_size
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_pool_ptr + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + slot[:, None] * stride_vs + h * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        visible = key_ok[None, :] & row_ok[:, None]
        if IS_CAUSAL:
            visible = visible & (key_pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_chunk(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE)

    if HAS_BLOCK:
        if split == block_split:
            # The draft's own block: keys and values of its T tokens, at their positions.
            for j0 in range(0, tl.where(live, width, 0), BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                j_ok = j < width
                key_tok = (q_start + j).to(tl.int64)
                key_pos = tl.load(positions_ptr + key_tok, mask=j_ok, other=0).to(tl.int32)
                kv_mask = j_ok[:, None] & d_ok[None, :]
                k = tl.load(block_k_ptr + key_tok[:, None] * stride_bkn + h * stride_bkh + d[None, :],
                            mask=kv_mask, other=0.0)
                v = tl.load(block_v_ptr + key_tok[:, None] * stride_bvn + h * stride_bvh + d[None, :],
                            mask=kv_mask, other=0.0)
                visible = j_ok[None, :] & row_ok[:, None]
                if IS_CAUSAL:
                    visible = visible & (key_pos[None, :] <= q_pos[:, None])
                m_i, l_i, acc = _attend_chunk(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE)

    out_row = tok.to(tl.int64) * (NUM_KV_HEADS * GROUP) + q_head           # [M] (token, query head)
    if not IS_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_row[:, None] * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part_row = split * num_tokens * (NUM_KV_HEADS * GROUP) + out_row
        tl.store(part_ml_ptr + 2 * part_row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part_row + 1, l_i, mask=row_ok)
        if (hi > lo) | (split == block_split):   # an idle split's acc is never read (block_split has the block)
            tl.store(part_acc_ptr + part_row[:, None] * head_dim + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_rows, head_dim,
                         NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[row] = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s over the splits of one (token, head),
    merged one split after another in split order (an online softmax over the partials): a split
    with no visible key changes nothing, bit for bit, so the result depends on the non-empty
    splits alone, never on how many empty ones the grid had (batch invariance), and one split
    gives acc / l exactly as the unsplit kernel does."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    m_run = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        part_row = s * num_rows + row + tl.zeros([1], tl.int64)
        m_s = tl.load(part_ml_ptr + 2 * part_row)
        l_s = tl.load(part_ml_ptr + 2 * part_row + 1)
        used = l_s > 0.0
        m_new = tl.where(used, tl.maximum(m_run, m_s), m_run)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - shift)
        weight = tl.where(used, tl.exp2(m_s - shift), 0.0)
        part = tl.load(part_acc_ptr + part_row[:, None] * head_dim + d[None, :],
                       mask=used[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + weight[:, None] * part
        total = total * alpha + weight * l_s
        m_run = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + row * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok[None, :])


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 64                    # the interpreter: as many as a small GPU, so its tests split keys
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_SPLITS = 16
# A split takes at least this many BLOCK_N chunks of keys.
MIN_CHUNKS_PER_SPLIT = 4
# BLOCKSPEC_BATCH_INVARIANT=1: each row's keys are cut into fixed ranges of INVARIANT_SPLIT_KEYS
# from key 0 and the partials merged in range order, so its softmax and weighted sum are the same
# operations in the same order however many rows, sequences or graph bound share the call. Split
# counts otherwise follow the batch (below), and a split merged is rounded otherwise than one
# pass: in bf16 a row verified among 8 of its sequence then differs from the same row decoded
# alone, and a greedy near-tie can flip (BENCHMARKS.md, rounds 44 and 45). Round 45 measured the
# unsplit form of this mode at 1.8 × a plain step's time over 4k-token contexts (too few
# programs for the SMs); fixed ranges keep flash-decoding's parallelism where contexts are long.
BATCH_INVARIANT = os.environ.get("BLOCKSPEC_BATCH_INVARIANT", "") == "1"
# Under BATCH_INVARIANT the keys are cut into ranges of this many from key 0 (a multiple of every
# BLOCK_N): long contexts still spread over the SMs, and a row's ranges never depend on the call.
INVARIANT_SPLIT_KEYS = 512


def choose_num_splits(num_programs: int, max_keys: int, block_n: int, sms: int) -> int:
    """Split the keys only while the batch leaves SMs idle; each split keeps ≥ 4 chunks of keys
    (max_keys is a bound: the batch's longest eagerly, the pool's capacity under a graph). A power
    of two ≤ MAX_SPLITS, so the merge kernel compiles at most four ways. Not so under
    BATCH_INVARIANT, where the count is the ranges of INVARIANT_SPLIT_KEYS max_keys needs, rounded up
    to a power of two (the ranges past a row's keys are empty and merge as nothing), whatever the
    programs and with no cap: prefill chunks split too, and the partials take splits × tokens ×
    heads × head_dim fp32 (an 8,192-token chunk of Qwen3-8B over 32k keys: 8.6 GB; SmolLM2's graphs,
    bound 8,208 keys: 32 splits, 151 MB at 2,048 tokens), one reason the mode is opt-in for large models."""
    if BATCH_INVARIANT:
        return triton.next_power_of_2(max(1, triton.cdiv(max_keys, INVARIANT_SPLIT_KEYS)))
    if num_programs >= sms:
        return 1
    wanted = max(1, min(triton.cdiv(2 * sms, num_programs), triton.cdiv(max_keys, MIN_CHUNKS_PER_SPLIT * block_n),
                        MAX_SPLITS))
    return 1 << (wanted.bit_length() - 1)


def tile_sizes(rows_per_head: int, head_dim: int, element_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages): tl.dot wants ≥ 16 rows; 256-wide
    heads take narrower key chunks to stay in registers, and K/V chunks of more than 16 KB two
    pipeline stages (fp32's, to fit in shared memory), as do the 16 KB chunks of heads up to 128
    wide (128-wide bf16, 64-wide fp32): two beat three at 7 of 8 decode and verify shapes of
    128-wide bf16 heads (Qwen3-8B heads, 512-16k keys, 1 and 32 sequences; H100, round 58,
    scripts/decode_attention_sweep.py: 1-9 % of the call), with the same bits. 256-wide heads'
    16 KB chunks (32 keys of bf16) keep three (not swept)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(64, max(16, triton.next_power_of_2(rows_per_head)))
    block_n = 64 if block_d <= 128 else 32
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    chunk_bytes, sixteen_kb = block_n * block_d * element_size, 16 * 1024
    num_stages = 2 if chunk_bytes > sixteen_kb or (chunk_bytes == sixteen_kb and block_d <= 128) else 3
    return block_m, block_n, block_d, num_warps, num_stages


@dataclass(frozen=True)
class Heads:
    """What a call site's layers fix for every call: the kernel's other constexprs and the dtype."""
    num_kv_heads: int
    group: int
    head_dim: int
    element_size: int


@dataclass(frozen=True)
class AttentionVariant:
    """One compiled form: the tile constexprs and launch options of the attention kernel, and its
    split count (> 1: the IS_SPLIT form, then the merge kernel of that many splits)."""
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    num_splits: int


def attention_variant(heads: Heads, max_query_len: int, num_seqs: int, max_keys: int, sms: int) -> AttentionVariant:
    """The variant a call of these shapes runs (the wrapper's choice, and the warm-up's)."""
    rows_per_head = max_query_len * heads.group
    block_m, block_n, block_d, num_warps, num_stages = tile_sizes(rows_per_head, heads.head_dim, heads.element_size)
    programs = triton.cdiv(rows_per_head, block_m) * num_seqs * heads.num_kv_heads
    return AttentionVariant(block_m, block_n, block_d, num_warps, num_stages,
                            choose_num_splits(programs, max_keys, block_n, sms))


@dataclass(frozen=True)
class CallShapes:
    """The calls a path can make: max_query_len in [query_lens[0], query_lens[1]], num_seqs one
    of seqs, max_keys in [keys[0], keys[1]]."""
    query_lens: tuple[int, int]
    seqs: tuple[int, ...]
    keys: tuple[int, int]


def attention_variants(heads: Heads, shapes: CallShapes, sms: int) -> set[AttentionVariant]:
    """Every variant `attention_variant` gives over shapes, without walking them all: the split
    count is a function of (programs, keys), falling in programs and rising in keys, and only
    programs below the SM count and keys up to MAX_SPLITS chunks of 4 · BLOCK_N tell apart."""
    (q_lo, q_hi), (k_lo, k_hi) = shapes.query_lens, shapes.keys
    variants = set()
    for block_m, tiles in tile_counts(heads, q_lo, q_hi):
        tile = tile_sizes(block_m, heads.head_dim, heads.element_size)     # rows_per_head = block_m: same tile
        chunk = INVARIANT_SPLIT_KEYS if BATCH_INVARIANT else MIN_CHUNKS_PER_SPLIT * tile[1]
        top = k_hi if BATCH_INVARIANT else min(k_hi, chunk * MAX_SPLITS)     # more keys split no further
        key_points = {k_lo, k_hi, *range(k_lo, top + 1, chunk)}           # every ⌈keys / chunk⌉ up to there
        for programs in program_counts(tiles, shapes.seqs, heads.num_kv_heads, sms):
            for max_keys in key_points:
                variants.add(AttentionVariant(*tile, choose_num_splits(programs, max_keys, tile[1], sms)))
    return variants


def tile_counts(heads: Heads, q_lo: int, q_hi: int) -> list[tuple[int, range]]:
    """(BLOCK_M, the range of tile counts a query length in [q_lo, q_hi] gives with it)."""
    out: dict[int, range] = {}
    q = q_lo
    while q <= q_hi:
        rows = q * heads.group
        block_m = tile_sizes(rows, heads.head_dim, heads.element_size)[0]
        last = q_hi if block_m == 64 else min(q_hi, max(q, block_m // heads.group))     # same BLOCK_M up to here
        seen = out.get(block_m, range(triton.cdiv(rows, block_m), 0))
        out[block_m] = range(min(seen.start, triton.cdiv(rows, block_m)),
                             max(seen.stop, triton.cdiv(last * heads.group, block_m) + 1))
        q = last + 1
    return sorted(out.items())


def program_counts(tiles: range, seqs: tuple[int, ...], num_kv_heads: int, sms: int) -> set[int]:
    """Distinct program counts below sms (and sms itself, standing for every count above)."""
    counts = set()
    for t in tiles:
        if t * num_kv_heads >= sms:
            counts.add(sms)
            break
        for s in seqs:
            counts.add(min(t * s * num_kv_heads, sms))
    return counts


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
                    max_query_len: int, page_size: int, max_context_len: int, scale: float, is_causal: bool,
                    block_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [N, H, D] → [N, H·D] in q's dtype; the reference's contract (no window). query_start
    [B + 1]: each sequence's rows; max_query_len bounds their lengths (it sizes the grid: a fixed
    bucket under a graph), max_context_len bounds the live key lengths (it sizes the split-K grid;
    under BATCH_INVARIANT keys past its ranges would be dropped, so it must bound every length)."""
    heads = heads_of(q, k_pool)
    variant = attention_variant(heads, max_query_len, query_start.shape[0] - 1, max_context_len, num_sms(q.device))
    return launch(variant, q, k_pool, v_pool, block_tables, context_lens, positions, query_start, max_query_len,
                  page_size, scale, is_causal, block_kv)


def heads_of(q: torch.Tensor, k_pool: torch.Tensor) -> Heads:
    return Heads(k_pool.shape[1], q.shape[1] // k_pool.shape[1], q.shape[2], q.element_size())


def launch(variant: AttentionVariant, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
           max_query_len: int, page_size: int, scale: float, is_causal: bool,
           block_kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The kernels of one variant over these tensors (what `paged_attention` chose, or the warm-up)."""
    num_seqs = query_start.shape[0] - 1
    q, k_pool, v_pool = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_pool, v_pool))
    if block_kv is not None:
        block_kv = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in block_kv)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    splits = variant.num_splits
    num_tiles = triton.cdiv(max_query_len * (num_heads // num_kv_heads), variant.block_m)
    out = torch.empty(num_tokens, num_heads * head_dim, device=q.device, dtype=q.dtype)
    part_acc = part_ml = out                                               # unused when splits == 1
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens * num_heads, head_dim, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(splits, num_tokens * num_heads, 2, device=q.device, dtype=torch.float32)
    block_k, block_v = block_kv if block_kv is not None else (k_pool, v_pool)
    _paged_attention_kernel[(num_tiles, num_seqs * num_kv_heads, splits)](
        q, k_pool, v_pool, block_k, block_v, out, part_acc, part_ml,
        block_tables, context_lens, positions, query_start,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_k.stride(0), block_k.stride(1), block_v.stride(0), block_v.stride(1), block_tables.stride(0),
        page_size, head_dim, num_tokens, splits, INVARIANT_SPLIT_KEYS, scale * math.log2(math.e),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, IS_SPLIT=splits > 1,
        INVARIANT=BATCH_INVARIANT and splits > 1, IS_CAUSAL=is_causal,
        HAS_BLOCK=block_kv is not None, IEEE=q.dtype == torch.float32,
        BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BLOCK_D=variant.block_d, num_warps=variant.num_warps,
        num_stages=variant.num_stages)
    if splits > 1:
        _merge_splits_kernel[(num_tokens * num_heads,)](
            part_acc, part_ml, out, num_tokens * num_heads, head_dim,
            NUM_SPLITS=splits, BLOCK_D=variant.block_d)
    return out


def warm_up(variants: set[AttentionVariant], q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            is_causal: bool, block_kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Each variant once, compiled (and launched) on one row of q at page 0 (nobody's): q [1, H, D]
    as a step's, the pools a step reads, block_kv [1, Hkv, D] for the draft's own block."""
    device = q.device
    zeros = torch.zeros(3, dtype=torch.long, device=device)
    block_tables, context_lens, positions = zeros[:1].view(1, 1), zeros[1:2] + 1, zeros[2:3]
    query_start = torch.tensor([0, 1], dtype=torch.long, device=device)
    for variant in sorted(variants, key=lambda v: (v.block_m, v.num_splits)):
        launch(variant, q, k_pool, v_pool, block_tables, context_lens, positions, query_start, 1, 1, 1.0,
               is_causal, block_kv)
