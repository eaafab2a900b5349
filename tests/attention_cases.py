"""Random paged-attention batches laid out as the runner lays them out, for holding the Triton
kernels (blockspec/kernels/attention.py) to the torch reference (layers/attention.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.layers.attention import AttentionMetadata, reference_paged_attention


@dataclass
class Case:
    q: torch.Tensor                                   # [B·T, H, D]
    k_pool: torch.Tensor                              # [slots, Hkv, D]
    v_pool: torch.Tensor
    meta: AttentionMetadata
    block_kv: tuple[torch.Tensor, torch.Tensor] | None
    is_causal: bool
    num_real: int                                     # sequences before the padding rows

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_case(context_lens: list[int], width: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str, draft: bool = False, is_causal: bool | None = None,
              num_padding: int = 0, page_size: int = 16, seed: int = 0, widths: list[int] | None = None) -> Case:
    """Targets: context_lens[b] = start + T (the block's K/V already in the pool), queries at
    start … start + T − 1. The draft (draft=True): context_lens[b] = start (committed context),
    queries at start …, plus its own block's K/V. Pages are shuffled over the pool; padding rows
    read page 0 with positions 0 … T − 1, as the runner pads a graph's batch. widths: each
    sequence's own query length (a ragged batch: prefill chunks and verify rows of any width;
    `width` is then their maximum)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = max(-(-(n + width) // page_size) for n in context_lens) + 1
    num_seqs = len(context_lens) + num_padding
    total_pages = 1 + len(context_lens) * pages_per_seq
    order = (torch.randperm(total_pages - 1, generator=gen) + 1).view(len(context_lens), pages_per_seq)
    tables = torch.cat((order, torch.zeros(num_padding, pages_per_seq, dtype=torch.long)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    query_lens = (widths or [width] * len(context_lens)) + [width] * num_padding
    lens = torch.tensor(context_lens + [0 if draft else width] * num_padding)
    starts = lens if draft else lens - torch.tensor(query_lens)
    positions = torch.cat([start + torch.arange(n) for start, n in zip(starts.tolist(), query_lens)])
    query_start = torch.tensor([0] + query_lens).cumsum(0)
    num_tokens = sum(query_lens)
    meta = AttentionMetadata(num_seqs=num_seqs, width=0 if widths else width, input_ids=None,
                             positions=positions.to(device), slot_mapping=None, block_tables=tables.to(device),
                             context_lens=lens.to(device), max_context_len=int(lens.max()), page_size=page_size,
                             kv=[], query_start=query_start.to(device), query_lens=query_lens)
    block_kv = (randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)) \
        if draft else None
    return Case(q=randn(num_tokens, num_heads, head_dim), k_pool=randn(total_pages * page_size, num_kv_heads, head_dim),
                v_pool=randn(total_pages * page_size, num_kv_heads, head_dim), meta=meta, block_kv=block_kv,
                is_causal=(not draft) if is_causal is None else is_causal, num_real=len(context_lens))


def reference(case: Case, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The torch reference on the case's inputs, computed in `dtype` → [B·T, H·D], one sequence at
    a time: the reference pads the batch to [B, T, L] scores, which for a ragged step (a 2048-row
    chunk beside 7000-key sequences) asks for tens of GiB in fp64."""
    m = case.meta
    k_pool, v_pool = case.k_pool.to(dtype), case.v_pool.to(dtype)
    starts = m.starts.tolist()
    outs = []
    for b, n in enumerate(m.lens):
        rows = slice(starts[b], starts[b] + n)
        one = AttentionMetadata(num_seqs=1, width=n, input_ids=None, positions=m.positions[rows], slot_mapping=None,
                                block_tables=m.block_tables[b:b + 1], context_lens=m.context_lens[b:b + 1],
                                max_context_len=max(int(m.context_lens[b]), 1), page_size=m.page_size, kv=[])
        block_kv = None if case.block_kv is None else tuple(x[rows].to(dtype) for x in case.block_kv)
        outs.append(reference_paged_attention(case.q[rows].to(dtype), k_pool, v_pool, one, one.context_lens,
                                              case.scale, case.is_causal, None, block_kv))
    return torch.cat(outs)


def kernel(case: Case, max_context_len: int | None = None) -> torch.Tensor:
    """The Triton kernels; max_context_len as a CUDA graph passes it (the pool's capacity)."""
    from blockspec.kernels.attention import paged_attention
    m = case.meta
    return paged_attention(case.q, case.k_pool, case.v_pool, m.block_tables, m.context_lens, m.positions,
                           m.starts, m.max_query_len, m.page_size, max_context_len or m.max_context_len, case.scale,
                           case.is_causal, case.block_kv)


def real_rows(case: Case, out: torch.Tensor) -> torch.Tensor:
    return out[: sum(case.meta.lens[: case.num_real])]
