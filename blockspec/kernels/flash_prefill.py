"""Long prefill chunks' attention on FlashAttention-2 (torch's varlen forward): the part of a
ragged step the Triton paged kernel (kernels/attention.py) serves worst.

Round 47 on the H200: a 512-token chunk over 16k cached keys (Qwen3-8B) spent 68 % of its step
in the Triton kernel at ~215 TFLOP/s, about a quarter of the bf16 peak; the best of its tiles
gained 1.09-1.21 ×. Its programs are decode-shaped (a tile is the GQA group × a few tokens, each
K/V page reached through the block table, the causal mask evaluated on every chunk); a prefill
chunk wants FlashAttention's form instead: 128 query rows of one head against contiguous keys,
the mask only on the diagonal blocks.

FlashAttention's varlen forward takes every routed sequence in one launch (cu_seqlens), GQA as
it is, and aligns a causal mask bottom-right: a chunk of n rows ending at key L sees the keys ≤
its own position, as the reference does. Its paged form wants pages of ≥ 256 tokens where ours
hold 16, so the routed sequences' keys are gathered from the pool first: one index_select per
layer and pool (the slot index is built once per forward and shared by every layer).

Which sequences go here is `long_prefill_head`: the first sequences of a step are its prefill
chunks (the runner lays them out first); everything up to the last long chunk (LONG_PREFILL_ROWS
by head size) goes to FlashAttention, the rest (decode / verify rows, short chunks after it) to the
Triton kernel, which takes the tail of query_start as it is. Off where the kernel cannot run
(CPU, fp32, head dims it lacks), under BLOCKSPEC_BATCH_INVARIANT=1 (a row's bits must not
depend on how its prompt was chunked) and with BLOCKSPEC_PREFILL_ATTENTION=triton.

`varlen_causal_reference` is the same contract in torch (one SDPA per sequence), for CPU tests
of the routing.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger("blockspec.engine")

# Rows of a prefill chunk from which it takes FlashAttention, by head size (H200, round 48,
# scripts/prefill_attention_bench.py; BENCHMARKS.md). FlashAttention's time is flat below 4
# blocks of 128 rows per head (its grid is blocks × heads: 64 programs at 256 rows of 32 heads
# leave half the SMs idle), the Triton kernel's grows with the rows: at 128-wide heads over 16k
# keys 256 rows took 326 µs on Triton against 472 + 48 (gather) routed, 512 rows 612 against
# 471 + 48, so they cross near 430. Triton's 256-wide tiles are slower (590 µs at 256 rows
# against 492 + 48), so those heads route from 256. Shorter chunks (a prefix-cache hit's few
# new tokens, bursts of short prompts) stay on Triton.
LONG_PREFILL_ROWS = {128: 448, 256: 256}
MAX_HEAD_DIM = 256


def enabled() -> bool:
    """Whether long chunks may take FlashAttention (the environment, read at each call: tests
    and side-by-side benchmarks switch it)."""
    from blockspec.kernels.attention import BATCH_INVARIANT
    return os.environ.get("BLOCKSPEC_PREFILL_ATTENTION", "flash") != "triton" and not BATCH_INVARIANT


def supports(q: torch.Tensor) -> bool:
    """FlashAttention-2's own limits: CUDA (sm80+), fp16 / bf16, head dim a multiple of 8 ≤ 256."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= MAX_HEAD_DIM and flash_available(q.device))


@functools.lru_cache(maxsize=None)
def flash_available(device: torch.device) -> bool:
    """One tiny call: torch builds without FlashAttention (or a GPU below sm80) keep the Triton
    kernel, said once in the log."""
    try:
        q = torch.zeros(2, 1, 64, device=device, dtype=torch.bfloat16)
        cu = torch.tensor([0, 2], device=device, dtype=torch.int32)
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, True, False)
        return True
    except (RuntimeError, AttributeError) as exc:
        logger.info("blockspec: FlashAttention is not available here (%s); long prefill chunks keep "
                    "the Triton attention kernel", str(exc).splitlines()[0])
        return False


def long_prefill_rows(head_dim: int) -> int:
    """The rows from which a chunk of heads this wide takes FlashAttention."""
    return LONG_PREFILL_ROWS[128] if head_dim <= 128 else LONG_PREFILL_ROWS[256]


def long_prefill_head(prefill_lens: list[int], head_dim: int = 128) -> int:
    """How many of the step's first sequences (its prefill chunks, of these row counts) go to
    FlashAttention: up to and including the last long chunk, 0 if none."""
    rows, last = long_prefill_rows(head_dim), -1
    for i, n in enumerate(prefill_lens):
        if n >= rows:
            last = i
    return last + 1


@dataclass
class LongPrefills:
    """The routed sequences 0 … head − 1 of one forward, what every layer's call shares: their
    rows (the first num_rows of the step), cu_seqlens and maxima, their keys' pool slots."""
    head: int
    num_rows: int
    cu_q: torch.Tensor                  # [head + 1] int32
    cu_k: torch.Tensor                  # [head + 1] int32
    max_q: int
    max_k: int
    slots: torch.Tensor                 # [Σ context_lens] pool slots, sequence after sequence


def plan(head: int, query_lens: list[int], context_lens: list[int], query_start: torch.Tensor,
         context_lens_device: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> LongPrefills:
    """The routed sequences' shared part, from the host's lengths (shapes) and the device's copies
    of the same (values): no host→device copy, no sync, so the pieces around stay queued."""
    query_lens, context_lens = query_lens[:head], context_lens[:head]
    device = block_tables.device
    total = sum(context_lens)
    lens = context_lens_device[:head]
    ends = torch.cumsum(lens, 0)
    seq = torch.repeat_interleave(torch.arange(head, device=device), lens, output_size=total)
    pos = torch.arange(total, device=device) - (ends - lens)[seq]
    slots = block_tables[seq, pos // page_size] * page_size + pos % page_size
    cu_k = torch.cat((ends.new_zeros(1), ends)).to(torch.int32)
    return LongPrefills(head, sum(query_lens), query_start[: head + 1].to(torch.int32), cu_k,
                        max(query_lens), max(context_lens), slots)


def varlen_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """q [Σ n_b, H, D], keys / values [Σ L_b, Hkv, D] → [Σ n_b, H, D]: each sequence's rows (the
    last n_b of its L_b positions) over its own keys, causal, bottom-right aligned."""
    if q.is_cuda:
        return torch.ops.aten._flash_attention_forward(q, keys, values, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                       scale=scale)[0]
    return varlen_causal_reference(q, keys, values, cu_q, cu_k, scale)


def varlen_causal_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor,
                            cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """The same contract in torch: one SDPA per sequence, row i of n seeing keys ≤ L − n + i."""
    out = torch.empty_like(q)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for b in range(len(qs) - 1):
        n, length = qs[b + 1] - qs[b], ks[b + 1] - ks[b]
        rows, cols = slice(qs[b], qs[b + 1]), slice(ks[b], ks[b + 1])
        visible = (torch.arange(length, device=q.device)[None]
                   <= (length - n + torch.arange(n, device=q.device))[:, None])
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys[cols].transpose(0, 1),
                                           values[cols].transpose(0, 1), attn_mask=visible, scale=scale,
                                           enable_gqa=q.shape[1] != keys.shape[1])
        out[rows] = o.transpose(0, 1)
    return out


def attend(routed: LongPrefills, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float
           ) -> torch.Tensor:
    """The routed sequences' rows (the first num_rows of q [N, H, D]) → [num_rows, H·D]."""
    rows = routed.num_rows
    out = varlen_causal(q[:rows].contiguous(), k_pool.index_select(0, routed.slots),
                        v_pool.index_select(0, routed.slots), routed.cu_q, routed.cu_k, routed.max_q, routed.max_k,
                        scale)
    return out.reshape(rows, -1)
