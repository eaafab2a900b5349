"""Long prefill chunks' attention in FlashAttention's form: the part of a ragged step the
Triton paged kernel (kernels/attention.py) serves worst.

Round 47 on the H200: a 512-token chunk over 16k cached keys (Qwen3-8B) spent 68 % of its step
in the Triton kernel at ~215 TFLOP/s, about a quarter of the bf16 peak; the best of its tiles
gained 1.09-1.21 ×. Its programs are decode-shaped (a tile is the GQA group × a few tokens, each
K/V page reached through the block table, the causal mask evaluated on every chunk); a prefill
chunk wants FlashAttention's form instead: 128 query rows of one head against contiguous keys,
the mask only on the diagonal blocks.

Two kernels of that form take every routed sequence in one launch (cu_seqlens), GQA as it is,
with a causal mask aligned bottom-right (a chunk of n rows ending at key L sees the keys ≤ its
own position, as the reference does): our Triton kernel (kernels/prefill_attention.py, TMA loads
on Hopper: 500-580 TFLOP/s on the H200 where torch's FlashAttention-2 reaches 290-350, round 48),
the default; and FlashAttention-2's varlen forward (`BLOCKSPEC_PREFILL_ATTENTION=flash`, and for
head sizes the Triton kernel lacks). Both want contiguous keys (FlashAttention's paged form
wants pages of ≥ 256 tokens where ours hold 16), so the routed sequences' keys are gathered from
the pool first: one index_select per layer and pool (the slot index is built once per forward
and shared by every layer).

Which sequences go here is `long_prefill_head`: the first sequences of a step are its prefill
chunks (the runner lays them out first); everything up to the last long chunk goes to the
FlashAttention form, the rest (decode / verify rows, short chunks after it) to the paged kernel,
which takes the tail of query_start as it is. Off where neither kernel runs (CPU, fp32, head
dims they lack), under BLOCKSPEC_BATCH_INVARIANT=1 (a row's bits must not depend on how its
prompt was chunked) and with BLOCKSPEC_PREFILL_ATTENTION=triton.

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

# Rows of a prefill chunk from which it leaves the paged kernel (H200, round 48,
# scripts/prefill_attention_bench.py; BENCHMARKS.md). Our Triton kernel splits the keys when its
# grid is small, so from 256 rows it beats the paged kernel wherever the context is long (512
# rows over 16k keys: 236-273 µs + 48 of gather against 627) and ties where it is short (512 over
# 2,048: 92 against 87). FlashAttention-2 never splits: its time is flat below 4 blocks of 128
# rows per head (256 rows of 32 heads: 472 µs + 48 against the paged kernel's 326), so with it
# 128-wide heads route from 448 rows, 256-wide ones (whose paged tiles are slower) from 256.
LONG_PREFILL_ROWS = {"triton-fa": {128: 256, 256: 256}, "flash": {128: 448, 256: 256}}
MAX_HEAD_DIM = 256
BACKENDS = ("triton-fa", "flash", "triton")


def backend() -> str:
    """BLOCKSPEC_PREFILL_ATTENTION: "triton-fa" (ours, the default), "flash" (FlashAttention-2) or
    "triton" (the paged kernel for every row: no routing). Read at each call, so tests and
    side-by-side benchmarks switch it."""
    name = os.environ.get("BLOCKSPEC_PREFILL_ATTENTION", "triton-fa")
    return name if name in BACKENDS else "triton-fa"


def batch_invariant() -> bool:
    """kernels.attention's BATCH_INVARIANT, without importing Triton where it is absent (there the
    paged kernels do not run, so nothing is routed either)."""
    try:
        from blockspec.kernels import attention
    except ImportError:
        return False
    return attention.BATCH_INVARIANT


def enabled() -> bool:
    """Whether long chunks may leave the paged kernel."""
    return backend() != "triton" and not batch_invariant()


def triton_fa_serves(q: torch.Tensor) -> bool:
    """Our kernel's limits: a CUDA half-precision q of a head size it compiles for."""
    from blockspec.kernels.prefill_attention import HEAD_DIMS
    return backend() == "triton-fa" and q.shape[-1] in HEAD_DIMS


def supports(q: torch.Tensor) -> bool:
    """CUDA, fp16 / bf16 (fp32 steps keep the paged kernel's IEEE rounding), and a head size one of
    the two kernels takes (FlashAttention-2: a multiple of 8 ≤ 256, sm80+)."""
    head_dim = q.shape[-1]
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return triton_fa_serves(q) or (head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM and flash_available(q.device))


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
    """The rows from which a chunk of heads this wide leaves the paged kernel (for the backend set)."""
    rows = LONG_PREFILL_ROWS["flash" if backend() == "flash" else "triton-fa"]
    return rows[128] if head_dim <= 128 else rows[256]


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
    if q.is_cuda and triton_fa_serves(q):
        from blockspec.kernels.prefill_attention import varlen_causal_triton
        return varlen_causal_triton(q, keys, values, cu_q, cu_k, max_q, max_k, scale)
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
