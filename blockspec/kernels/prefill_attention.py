"""Long prefill chunks' attention in Triton: FlashAttention's forward over contiguous varlen keys,
the contract of `flash_prefill.varlen_causal` (issue 30).

FlashAttention-2's varlen forward (torch's) reaches ~290–350 TFLOP/s on the H200 for a chunk
over 16k cached keys, and its time is flat below 4 × 128 query rows per head: its grid is
(query blocks × heads) and never splits the keys. This kernel is the same algorithm laid out
for Hopper:

- Grid (query block of BLOCK_M rows, query head, sequence × key split). A program holds its
  BLOCK_M rows of one head against the keys of their KV head (h // group); the programs of one
  group run side by side, so each K/V block is read from HBM about once and from L2 by the rest.
  Query blocks are taken last-first: under the causal mask a later block has more keys, and
  the longest programs should start in the first wave.
- Causal, bottom-right per sequence: row i of n sees keys 0 … L − n + i. Key blocks every row of
  the tile sees run without a mask; only the diagonal blocks (≈ (BLOCK_M + BLOCK_N) / BLOCK_N of
  them) build one; blocks past the tile's last row are never visited.
- Split-K (flash-decoding) when the grid alone leaves SMs idle (few rows, few heads): each
  program takes one of num_splits ranges of the tile's keys, writes an unnormalised partial
  (acc, running max, sum) and `_merge_splits_kernel` combines them.
- Loads through TMA tensor descriptors where the GPU has them (sm90+, 16-byte aligned rows):
  Triton pipelines them over num_stages; elsewhere (and optionally) plain pointer loads. A
  descriptor spans the whole packed tensor, so a tile's rows past its own sequence read the
  next sequence's (or zeros past the end): their scores are masked, their rows never stored.
- Online softmax in fp32 (base 2), fp32 accumulation; fp32 inputs multiply in IEEE fp32 (no
  TF32), fp16 / bf16 on the tensor cores with P rounded to the input dtype, as FlashAttention.

The tile is a pure function of the shapes (`default_config`): no autotuning, so a row's output
never depends on timing. `PrefillConfig` is exposed so scripts/prefill_attention_bench.py
--sweep can time a grid of them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blockspec.kernels.attention import num_sms

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                      # Triton builds before host-side descriptors
    TensorDescriptor = None

HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_SPLITS = 16


@triton.jit
def _load_tile(src, row0, col0, valid_rows, row_stride,
               ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """[ROWS, HEAD_DIM] from a packed [rows, heads · HEAD_DIM] tensor at (row0, col0): a TMA
    descriptor (out-of-tensor rows read as zeros) or a pointer (rows ≥ valid_rows read as zeros
    when MASKED; an unmasked tile must lie inside its sequence)."""
    if USE_TMA:
        tile = src.load([row0, col0])
    else:
        r = tl.arange(0, ROWS)
        ptrs = src + (row0 + r).to(tl.int64)[:, None] * row_stride + col0 + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            tile = tl.load(ptrs, mask=(r < valid_rows)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_block(q, k, v, m_i, l_i, acc, qk_scale, visible, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a block of keys: q [M, D], k / v [N, D], visible [M, N]
    (read only when MASKED)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if MASKED:
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with no visible key yet (a split that starts on the diagonal) keeps max −inf:
        # shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
    else:
        # Every key visible: the scale folds into the exponent's multiply-add (qk_scale > 0, so
        # the row max commutes with it).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)
        p = tl.exp2(scores * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


# Values that change from call to call are not specialised on (Triton would compile a variant per
# divisibility of each: kernels/attention.py says why); the variants are the constexprs alone,
# which the startup warm-up runs (engine/warm.py).
@triton.jit(do_not_specialize=["num_splits", "total_q_rows"])
def _prefill_attention_kernel(
        q_src, k_src, v_src, out_ptr, part_acc_ptr, part_ml_ptr, cu_q_ptr, cu_k_ptr,
        num_splits, total_q_rows, qk_scale,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)             # the longest (last) query blocks first
    h = tl.program_id(1)
    b, split = tl.program_id(2) // num_splits, tl.program_id(2) % num_splits
    q_start = tl.load(cu_q_ptr + b)
    n = tl.load(cu_q_ptr + b + 1) - q_start                       # this sequence's query rows
    k_start = tl.load(cu_k_ptr + b)
    length = tl.load(cu_k_ptr + b + 1) - k_start                  # its keys; its rows are the last n
    m_start = tile * BLOCK_M
    if m_start >= n:
        return
    offset = length - n                                           # row i sees keys ≤ offset + i
    hi = offset + tl.minimum(m_start + BLOCK_M, n)                # past the tile's last row's keys
    # Keys below full_hi are visible to every row of the tile: no mask there.
    full_hi = (offset + m_start + 1) // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N  # this split's range, whole blocks
    lo = split * chunk
    split_hi = tl.minimum(lo + chunk, hi)
    kv_col = (h // (NUM_HEADS // NUM_KV_HEADS)) * HEAD_DIM
    q_stride: tl.constexpr = NUM_HEADS * HEAD_DIM
    kv_stride: tl.constexpr = NUM_KV_HEADS * HEAD_DIM

    q = _load_tile(q_src, q_start + m_start, h * HEAD_DIM, n - m_start, q_stride,
                   BLOCK_M, HEAD_DIM, USE_TMA, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(lo, tl.minimum(split_hi, full_hi), BLOCK_N):
        k = _load_tile(k_src, k_start + start, kv_col, BLOCK_N, kv_stride, BLOCK_N, HEAD_DIM, USE_TMA, False)
        v = _load_tile(v_src, k_start + start, kv_col, BLOCK_N, kv_stride, BLOCK_N, HEAD_DIM, USE_TMA, False)
        m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, None, False, IEEE)
    rows = m_start + tl.arange(0, BLOCK_M)                        # 0-based within the chunk
    for start in range(tl.maximum(lo, full_hi), split_hi, BLOCK_N):
        k = _load_tile(k_src, k_start + start, kv_col, length - start, kv_stride, BLOCK_N, HEAD_DIM, USE_TMA, True)
        v = _load_tile(v_src, k_start + start, kv_col, length - start, kv_stride, BLOCK_N, HEAD_DIM, USE_TMA, True)
        visible = (start + tl.arange(0, BLOCK_N))[None, :] <= (offset + rows)[:, None]
        m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, visible, True, IEEE)

    row_ok = rows < n
    out_row = (q_start + rows).to(tl.int64) * NUM_HEADS + h       # [M] flat (token, head)
    d = tl.arange(0, HEAD_DIM)
    if num_splits == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]       # l_i = 0 only on rows past n
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        part_row = split * total_q_rows * NUM_HEADS + out_row
        tl.store(part_ml_ptr + 2 * part_row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part_row + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_rows, num_splits,
                         BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[r] = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s for BLOCK_R flat (token, head) rows;
    a split that saw none of a row's keys (l_s = 0) weighs nothing and its acc is not read."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for s in range(num_splits):
        part_row = s * num_rows + r.to(tl.int64)
        m_s = tl.load(part_ml_ptr + 2 * part_row, mask=r_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + 2 * part_row + 1, mask=r_ok, other=0.0)
        used = l_s > 0.0
        m_new = tl.where(used, tl.maximum(m_run, m_s), m_run)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - shift)
        weight = tl.where(used, tl.exp2(m_s - shift), 0.0)
        part = tl.load(part_acc_ptr + part_row[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
        acc = acc * alpha[:, None] + weight[:, None] * part
        total = total * alpha + weight * l_s
        m_run = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    """One compiled form and its launch. num_splits 0: the split count `choose_num_splits` gives
    for the call; use_tma None: TMA descriptors wherever the GPU and the tensors allow."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 0
    use_tma: bool | None = None


def default_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The tile for heads this wide, chosen by scripts/prefill_attention_bench.py --sweep on the
    H200 (round 48, BENCHMARKS.md): 128 query rows against 128 keys, 8 warps, 3 stages at
    128-wide heads (573-581 TFLOP/s over 16k keys); 256-wide heads 64 rows against 64 keys (a
    128 × 256 fp32 accumulator spills), 4 warps, 3 stages (577); ≤ 64-wide heads were not swept.
    fp32 tiles are twice the bytes, so narrower key blocks and fewer stages."""
    if dtype == torch.float32:
        return PrefillConfig(64, 32, 4, 2) if head_dim <= 128 else PrefillConfig(32, 32, 4, 1)
    if head_dim <= 64:
        return PrefillConfig(128, 64, 4, 3)
    if head_dim <= 128:
        return PrefillConfig(128, 128, 8, 3)      # the sweep's best at 512 and 2,048 rows over 16k keys
    return PrefillConfig(64, 64, 4, 3)            # the sweep's best at 512 rows over 16k keys


def choose_num_splits(num_programs: int, max_k: int, block_n: int, sms: int) -> int:
    """Split the keys only while the grid fills less than half the SMs (from there one wave
    holds it: a split would add a merge and no parallelism), into as many ranges as fill one
    wave, each ≥ 4 blocks of keys."""
    if 2 * num_programs > sms:
        return 1
    return max(1, min(sms // max(num_programs, 1), max_k // (4 * block_n), MAX_SPLITS))


def tma_usable(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Host-side TMA descriptors: sm90+, base addresses and rows 16-byte aligned."""
    if TensorDescriptor is None or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    return all(x.data_ptr() % 16 == 0 and x.shape[1] * x.shape[2] * x.element_size() % 16 == 0
               for x in (q, keys, values))


def varlen_causal_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor,
                         cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                         config: PrefillConfig | None = None) -> torch.Tensor:
    """q [Σ n_b, H, D], keys / values [Σ L_b, Hkv, D] → [Σ n_b, H, D] in q's dtype: each
    sequence's rows (the last n_b of its L_b positions) over its own keys, causal, bottom-right
    aligned; cu_q / cu_k [B + 1] int32. max_q bounds every n_b (it sizes the grid), max_k every L_b."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    if head_dim not in HEAD_DIMS or num_heads % num_kv_heads:
        raise ValueError(f"prefill attention: head dim {head_dim} (one of {HEAD_DIMS}) with {num_heads} query "
                         f"heads over {num_kv_heads} KV heads (a multiple) is not supported; use flash_prefill")
    config = config or default_config(head_dim, q.dtype)
    q, keys, values = (x.contiguous() for x in (q, keys, values))
    num_seqs = cu_q.shape[0] - 1
    num_tiles = triton.cdiv(max_q, config.block_m)
    splits = config.num_splits or choose_num_splits(num_tiles * num_heads * num_seqs, max_k, config.block_n,
                                                    num_sms(q.device))
    use_tma = tma_usable(q, keys, values) if config.use_tma is None else config.use_tma
    out = torch.empty_like(q)
    part_acc = part_ml = out                                      # unused unless split
    if splits > 1:
        part_acc = torch.empty(splits, num_rows * num_heads, head_dim, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(splits, num_rows * num_heads, 2, device=q.device, dtype=torch.float32)
    srcs = (q, keys, values)
    if use_tma:
        srcs = tuple(tma_descriptor(x, rows) for x, rows in
                     ((q, config.block_m), (keys, config.block_n), (values, config.block_n)))
    _prefill_attention_kernel[(num_tiles, num_heads, num_seqs * splits)](
        *srcs, out, part_acc, part_ml, cu_q, cu_k, splits, num_rows, scale * math.log2(math.e),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, USE_TMA=use_tma, IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        block_r = 16
        _merge_splits_kernel[(triton.cdiv(num_rows * num_heads, block_r),)](
            part_acc, part_ml, out, num_rows * num_heads, splits, BLOCK_R=block_r, HEAD_DIM=head_dim)
    return out


def tma_descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """x [rows, heads, D] as the 2-D [rows, heads · D] tensor it is, read in [block_rows, D] tiles."""
    rows, heads, head_dim = x.shape
    return TensorDescriptor(x, [rows, heads * head_dim], [heads * head_dim, 1], [block_rows, head_dim])


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Every variant a step of these heads can launch, once, on a few rows of scratch: the kernel
    unsplit and split (then the merge), over query and key row counts of either divisibility by 16
    each (a descriptor's shape may be specialised on). → the launches made."""
    config = default_config(head_dim, dtype)
    launches = 0
    m = config.block_m                                # a multiple of 16; a chunk's rows are the last of its keys
    for q_rows, k_rows in ((m, m), (m, m + 1), (m + 1, m + 16), (m + 1, m + 1)):
        q = torch.zeros(q_rows, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(k_rows, num_kv_heads, head_dim, dtype=dtype, device=device)
        cu_q = torch.tensor([0, q_rows], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, k_rows], dtype=torch.int32, device=device)
        for splits in (1, 2):
            varlen_causal_triton(q, kv, kv, cu_q, cu_k, q_rows, k_rows, 1.0,
                                 dataclasses.replace(config, num_splits=splits))
            launches += 1
    return launches
