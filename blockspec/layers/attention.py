"""Attention over paged K/V pools: the metadata of one batched forward, the torch reference
kernel, and the one Attention module every model uses.

A forward runs B sequences over a flat ragged batch of N tokens: sequence b feeds the query
rows query_start[b] … query_start[b + 1] − 1 (vLLM's cu_seqlens), its own number of tokens — a
prefill chunk, a plain decode row, or a verify block [x, d1 … dk] of its own width. Each
sequence's keys live in pages of a pool ([num_slots, Hkv, D] per layer, slot = page · page_size
+ offset) named by its block table. New K/V are written at `slot_mapping` first; queries then
see every key of their sequence at a position ≤ their own (targets) or the committed context
plus their own block (the draft).
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kernels.fused import qk_norm_rope
from blockspec.layers.common import FusedLinear, RMSNorm, join_fused_parts

if TYPE_CHECKING:
    from blockspec.kernels.flash_prefill import LongPrefills


@dataclass
class AttentionMetadata:
    """Everything a model needs to know about the sequences of one forward (nothing of requests).

    input_ids, positions, slot_mapping: [N]; query_start [B + 1]: sequence b's rows are
    query_start[b] … query_start[b + 1] − 1; block_tables [B, max_pages]; context_lens [B]: keys
    each sequence sees in the pool (for targets: its start + its query length, the new tokens
    included; for the draft: its committed context). width: every sequence's query length when
    they are all equal (the draft's blocks, a graph's decode batch), else 0 (query_lens holds
    them on the host, max_query_len their maximum). max_context_len: keys the reference gathers
    per sequence — the batch's longest eagerly, a fixed bucket under a CUDA graph; for the Triton
    kernels only a bound that sizes their split-K grid. The integer fields are views of one
    packed tensor (`packed`), so a batch crosses to the device in one copy.

    Recurrent layers: the first num_prefill_seqs sequences are prefill chunks (chunked form, final
    state written); the others are decode / verify rows (keep_steps: the state after every row
    is stashed for StatePool.select, else written).

    A graph's batch (engine/graphs.py) is padded to a bucket of N tokens and B sequences: padding
    sequences have no rows, padding tokens (past query_start[B]) belong to no sequence. Under a
    FULL graph the host knows no lengths (width 0, query_lens None): max_rows bounds them.
    Under a PIECEWISE graph `pieces` runs the calls that read the host's lengths (`mixer`)
    eagerly between the captured pieces.
    """
    num_seqs: int
    width: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int
    page_size: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]           # per attention layer (cache_index)
    states: Any = None                                    # StatePool of a hybrid target
    state_slots: torch.Tensor | None = None               # [B]
    keep_steps: bool = False                              # verify: recurrent layers keep every step
    # Per-forward values every layer shares (gather indices, masks): computed by the first layer
    # that needs them, cleared at the start of each forward (so a captured graph computes them once).
    shared: dict = field(default_factory=dict)
    packed: torch.Tensor | None = None
    query_start: torch.Tensor | None = None               # [B + 1]; None: uniform, from width
    query_lens: list[int] | None = None                   # host copy (ragged batches)
    num_prefill_seqs: int = 0
    max_rows: int = 0                                     # bound on each sequence's rows (lengths on the device only)
    # The target's rotary positions [N]: positions + the sequence's rope_offsets [B] (an image
    # sequence's M-RoPE shift, 0 for text); None where they are the positions themselves.
    rope_positions: torch.Tensor | None = None
    rope_offsets: torch.Tensor | None = None
    pieces: Any = None                                    # engine/graphs.py's Pieces under a piecewise graph
    # context_lens on the host, for steps with prefill chunks (their long chunks' attention takes
    # shapes from it: kernels/flash_prefill.py); None elsewhere.
    context_lens_host: list[int] | None = None
    # The most keys the routed long chunks may gather at once (what the pool's sizing left room
    # for: one sequence of the longest context); None: no cap (forwards built outside the runner).
    max_gather_keys: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.width if self.width else sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        if self.bounded:
            return self.max_rows
        return self.width or max(self.query_lens, default=0)

    @property
    def bounded(self) -> bool:
        """Whether the host knows only a bound on the lengths (a FULL graph's decode / verify rows)."""
        return not self.width and self.query_lens is None

    @property
    def lens(self) -> list[int]:
        """Query rows per sequence (host)."""
        if self.bounded:
            raise RuntimeError("a bounded batch's lengths live on the device only")
        return [self.width] * self.num_seqs if self.width else self.query_lens

    @property
    def starts(self) -> torch.Tensor:
        """query_start [B + 1] on the device (made from width for a uniform batch)."""
        if self.query_start is None:
            self.query_start = torch.arange(self.num_seqs + 1, device=self.positions.device) * self.width
        return self.query_start

    @property
    def query_positions(self) -> torch.Tensor:
        """[B, T] (uniform batches only)."""
        return self.positions.view(self.num_seqs, self.width)


# A packed batch's per-token rows, first in its layout (a PIECEWISE graph's static inputs).
TOKEN_ROWS = ("input_ids", "positions", "slot_mapping", "rope_positions")


def packed_size(num_seqs: int, num_tokens: int, num_pages: int) -> int:
    return len(TOKEN_ROWS) * num_tokens + (num_seqs + 1) + num_seqs * num_pages + 3 * num_seqs


def unpack(packed: torch.Tensor, num_seqs: int, num_tokens: int, num_pages: int) -> dict[str, torch.Tensor]:
    """Views of a packed batch: [input_ids | positions | slot_mapping | rope_positions (N each) |
    query_start (B + 1) | block_tables (B·pages) | context_lens | state_slots | rope_offsets (B each)]."""
    parts = packed.split([num_tokens] * len(TOKEN_ROWS)
                         + [num_seqs + 1, num_seqs * num_pages, num_seqs, num_seqs, num_seqs])
    names = TOKEN_ROWS + ("query_start", "block_tables", "context_lens", "state_slots", "rope_offsets")
    views = dict(zip(names, parts))
    views["block_tables"] = views["block_tables"].view(num_seqs, num_pages)
    return views


def token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row within it) of every token [N] each, from query_start on the device."""
    def make():
        starts = meta.starts
        tokens = torch.arange(meta.positions.shape[0], device=starts.device)
        seq = torch.searchsorted(starts[1:], tokens, right=True).clamp_max(meta.num_seqs - 1)
        return seq, tokens - starts[seq]
    return shared(meta, "token_rows", make)


def padded_rows(meta: AttentionMetadata, first: int = 0, last: int | None = None, rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences first … last − 1 as a rectangle [b, rows]: (flat token index, valid). Rows past a
    sequence's length repeat its first token (a visible key exists for every padded query)."""
    last = meta.num_seqs if last is None else last
    if rows is None:
        rows = meta.max_rows if meta.bounded else max(meta.lens[first:last], default=0)

    def make():
        starts = meta.starts
        begin, length = starts[first:last], starts[first + 1: last + 1] - starts[first:last]
        offsets = torch.arange(rows, device=starts.device)
        valid = offsets[None] < length[:, None]
        index = torch.where(valid, begin[:, None] + offsets[None], begin[:, None])
        return index.clamp(0, max(meta.positions.shape[0] - 1, 0)), valid
    return shared(meta, ("padded_rows", first, last, rows), make)


def to_padded(x: torch.Tensor, meta: AttentionMetadata, first: int = 0, last: int | None = None) -> torch.Tensor:
    """Flat rows [N, …] of sequences first … last − 1 → [b, T, …] (a view when they are uniform)."""
    last = meta.num_seqs if last is None else last
    if meta.width and first == 0 and last == meta.num_seqs:
        return x.view(meta.num_seqs, meta.width, *x.shape[1:])
    index, _ = padded_rows(meta, first, last)
    return x[index]


def from_padded(y: torch.Tensor, meta: AttentionMetadata, first: int = 0, last: int | None = None) -> torch.Tensor:
    """[b, T, …] of sequences first … last − 1 → their flat rows, in token order."""
    last = meta.num_seqs if last is None else last
    if meta.width and first == 0 and last == meta.num_seqs:
        return y.reshape(-1, *y.shape[2:])
    if meta.bounded:
        # Every token, padding ones included (they take some row of the last sequence: unread).
        seq, row = token_rows(meta)
        return y[seq, row.clamp(0, y.shape[1] - 1)]
    lens = meta.lens
    begin, end = sum(lens[:first]), sum(lens[:last])
    seq, row = token_rows(meta)
    return y[seq[begin:end] - first, row[begin:end]]


def key_slots(block_tables: torch.Tensor, num_keys: int, page_size: int) -> torch.Tensor:
    """Pool slots of the first num_keys positions of each sequence [B, num_keys]."""
    key_pos = torch.arange(num_keys, device=block_tables.device)
    return block_tables[:, key_pos // page_size] * page_size + key_pos % page_size


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor,
                 is_causal: bool, window: int | None) -> torch.Tensor:
    """Bool [B, T, L]: query_pos [B, T], key_pos [B or 1, L], key_valid [B, L].

    Causal layers see keys at or before the query; a window limits the distance (both ways
    for a non-causal layer)."""
    q, k = query_pos[:, :, None], key_pos[:, None, :]
    visible = key_valid[:, None, :].expand(-1, q.shape[1], -1)
    if is_causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not is_causal:
            visible = visible & (k - q < window)
    return visible


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import blockspec.kernels.attention  # noqa: F401  (Triton compiles lazily: importing is cheap)
    except ImportError:
        return False
    return True


def uses_kernels(device: torch.device) -> bool:
    """Whether paged attention on this device runs the Triton kernels: on CUDA when Triton
    imports, unless BLOCKSPEC_ATTENTION=reference. They read each sequence's live length only,
    so graphs need no key bucket (engine/graphs.py)."""
    return (device.type == "cuda" and os.environ.get("BLOCKSPEC_ATTENTION", "") != "reference"
            and _triton_available())


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                    context_lens: torch.Tensor, scale: float, is_causal: bool = True, window: int | None = None,
                    block_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B·T, H, D] → [B·T, H·D]: the Triton kernels on CUDA (see `uses_kernels`; a sliding
    window stays on the reference), else the reference below, which is the spec."""
    if window is None and uses_kernels(q.device):
        from blockspec.kernels.attention import paged_attention as kernel
        target_rows = is_causal and block_kv is None and context_lens is meta.context_lens
        routed = long_prefills(meta, q) if target_rows else None
        if routed is not None:
            return after_long_prefills(routed, q, k_pool, v_pool, meta, scale)
        return kernel(q, k_pool, v_pool, meta.block_tables, context_lens, meta.positions, meta.starts,
                      meta.max_query_len, meta.page_size, meta.max_context_len, scale, is_causal, block_kv)
    return reference_paged_attention(q, k_pool, v_pool, meta, context_lens, scale, is_causal, window, block_kv)


def long_prefills(meta: AttentionMetadata, q: torch.Tensor) -> LongPrefills | None:
    """The step's long prefill chunks for the FlashAttention form (kernels/flash_prefill.py),
    planned once per forward, or None: a FULL graph's rows, no long chunk, or the form off or
    unable. The routed sequences are a prefix of the step's, cut back while their keys exceed
    max_gather_keys (the gather's room)."""
    if meta.bounded or not meta.num_prefill_seqs or meta.context_lens_host is None:
        return None
    return shared(meta, "long_prefills", lambda: plan_long_prefills(meta, q))     # the same for every layer


def plan_long_prefills(meta: AttentionMetadata, q: torch.Tensor) -> LongPrefills | None:
    """long_prefills' plan, made by the forward's first attention layer."""
    from blockspec.kernels import flash_prefill
    if not flash_prefill.enabled() or not flash_prefill.supports(q):
        return None
    head = flash_prefill.long_prefill_head(meta.lens[: meta.num_prefill_seqs], q.shape[-1])
    if meta.max_gather_keys is not None:
        keys = itertools.accumulate(meta.context_lens_host[:head])
        head = sum(1 for _ in itertools.takewhile(lambda total: total <= meta.max_gather_keys, keys))
    if not head:
        return None
    return flash_prefill.plan(head, meta.lens, meta.context_lens_host, meta.starts, meta.context_lens,
                              meta.block_tables, meta.page_size)


def after_long_prefills(routed: LongPrefills, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        meta: AttentionMetadata, scale: float, kernel: Callable | None = None) -> torch.Tensor:
    """q [N, H, D] → [N, H·D]: the routed sequences 0 … head − 1 in the FlashAttention form, the
    others (their query_start's tail, as it is) on the paged kernel (`kernel`: kernels.attention's,
    or a stand-in with its contract), whose programs write only their rows."""
    from blockspec.kernels import flash_prefill
    if kernel is None:
        from blockspec.kernels.attention import paged_attention as kernel
    head = routed.head
    rest_rows = max(meta.lens[head:], default=0)
    if rest_rows:
        out = kernel(q, k_pool, v_pool, meta.block_tables[head:], meta.context_lens[head:], meta.positions,
                     meta.starts[head:], rest_rows, meta.page_size, meta.max_context_len, scale, True, None)
    else:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    out[: routed.num_rows] = flash_prefill.attend(routed, q, k_pool, v_pool, scale)
    return out


def reference_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                              context_lens: torch.Tensor, scale: float, is_causal: bool = True,
                              window: int | None = None, block_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> torch.Tensor:
    """The reference kernel: q [N, H, D] → [N, H·D].

    Each sequence's rows are gathered into a rectangle [B, T] (T its longest query length).
    Keys: the first context_lens[b] positions of each sequence in the pool, gathered from its
    pages (meta.max_context_len of them, masked past the live length), plus block_kv
    ([N, Hkv, D] each, at the query positions) when given (the draft's own block, never cached).
    """
    num_seqs = meta.num_seqs
    slots = shared(meta, "slots", lambda: key_slots(meta.block_tables, meta.max_context_len, meta.page_size))
    keys, values = k_pool[slots], v_pool[slots]                                       # [B, L, Hkv, D]
    if block_kv is not None:
        keys = torch.cat((keys, to_padded(block_kv[0], meta)), dim=1)
        values = torch.cat((values, to_padded(block_kv[1], meta)), dim=1)
    mask = shared(meta, ("mask", is_causal, window, block_kv is not None),
                  lambda: attention_mask(meta, context_lens, is_causal, window, block_kv is not None))
    q = to_padded(q, meta).transpose(1, 2)                                            # [B, H, T, D]
    dtype = q.dtype
    if q.device.type == "cpu" and dtype == torch.float32:
        # fp32 SDPA on CPU blocks its sums by the query count, so a verify row and the same row
        # decoded alone differ in the last bits; in float64 both round to the same fp32. The
        # quantized CPU path (layers/quant.py) rounds matmul inputs to bf16, where such last
        # bits would flip whole bf16 steps and DFlash would drift from plain decoding.
        q, keys, values = q.double(), keys.double(), values.double()
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != keys.shape[2]).to(dtype)
    return from_padded(out.transpose(1, 2).reshape(num_seqs, q.shape[2], -1), meta)


def mixer(meta: AttentionMetadata, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn(meta, *inputs) → [N, …]: a token mixer's core over the ragged sequences (attention,
    Gated DeltaNet), the part of a layer that reads the batch's lengths on the host. Under a
    piecewise graph it runs eagerly between the captured pieces (engine/graphs.py)."""
    if meta.pieces is not None:
        return meta.pieces.call(fn, meta, inputs)
    return padding_zeroed(fn(meta, *inputs), meta, inputs[0].shape[0])


def padding_zeroed(x: torch.Tensor, meta: AttentionMetadata, num_rows: int) -> torch.Tensor:
    """x [≤ num_rows, …] → [num_rows, …] with the rows past the sequences' own (a bucket's padding
    tokens, which no kernel program writes) zero: whatever memory they held never reaches the
    pages they store K/V in (page 0, which the reference gathers masked: 0 · NaN is NaN)."""
    if meta.bounded:
        if num_rows == 1:
            return x            # a bucket of one row holds a token: a one-sequence decode pads nothing (40 launches a step)
        # the padding rows' mask made once a forward, not a `~` a layer (40 launches of Qwen3.5-35B-A3B's step)
        padding = shared(meta, "padding_tokens", lambda: torch.arange(num_rows, device=x.device) >= meta.starts[-1])
        return x.masked_fill(padding.view(-1, *[1] * (x.dim() - 1)), 0)
    real = meta.num_tokens
    if x.shape[0] < num_rows:
        return torch.cat((x[:real], x.new_zeros(num_rows - real, *x.shape[1:])))
    if real < num_rows:
        x[real:] = 0
    return x


def shared(meta: AttentionMetadata, key: Any, make) -> torch.Tensor:
    if key not in meta.shared:
        meta.shared[key] = make()
    return meta.shared[key]


def attention_mask(meta: AttentionMetadata, context_lens: torch.Tensor, is_causal: bool, window: int | None,
                   with_block: bool) -> torch.Tensor:
    """Bool [B, 1, T, L (+ T with the block)]: which keys each query sees."""
    query_pos = to_padded(meta.positions, meta)                                      # [B, T]
    key_pos = torch.arange(meta.max_context_len, device=query_pos.device)[None].expand(meta.num_seqs, -1)
    key_valid = key_pos < context_lens[:, None]
    if with_block:
        block_valid = (torch.ones_like(query_pos, dtype=torch.bool) if meta.width
                       else padded_rows(meta)[1])
        key_pos = torch.cat((key_pos, query_pos), dim=1)
        key_valid = torch.cat((key_valid, block_valid), dim=1)
    return visible_keys(query_pos, key_pos, key_valid, is_causal, window)[:, None]


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k/v [N, Hkv, D] at their slots (graph-safe: no host integer decides a shape)."""
    k_pool.index_copy_(0, slot_mapping, k)
    v_pool.index_copy_(0, slot_mapping, v)


class Attention(nn.Module):
    """Multi-head attention with GQA for every model.

    qk_norm: None, "plain" (Qwen3) or "zero_centred" (Qwen3.5); output_gate: q_proj also yields
    a per-head gate, o_proj(attn · sigmoid(gate)) (Qwen3.5's gated attention). RoPE rotates the
    first rot_dim dims of each head (cos/sin carry that width). cache_index: this layer's K/V
    in the metadata's pool list. q, k and v are one GEMM (qkv_proj; q_proj / k_proj / v_proj on
    disk), then one fused op norms and rotates q and k and stores k, v (`qk_norm_rope`).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 qkv_bias: bool = False, out_bias: bool = False, qk_norm: str | None = None,
                 output_gate: bool = False, cache_index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.eps = eps
        self.has_output_gate = output_gate
        self.cache_index = cache_index
        self.q_head_stride = head_dim * (2 if output_gate else 1)        # per head: [q (D) | gate (D)]
        kv_width = num_kv_heads * head_dim
        self.qkv_proj = FusedLinear(hidden_size, {"q_proj": num_heads * self.q_head_stride, "k_proj": kv_width,
                                                  "v_proj": kv_width}, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        self.register_load_state_dict_pre_hook(join_fused_parts)
        self.zero_centred = qk_norm == "zero_centred"
        if qk_norm is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(head_dim, eps, self.zero_centred)
            self.k_norm = RMSNorm(head_dim, eps, self.zero_centred)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, with_q: bool = True):
        """x [N, hidden] → (q [N, H, D] normed and rotated, or None without with_q; k, v [N, Hkv, D],
        or None when kv_store = (k_pool, v_pool, slot_mapping) took them; the output gate [N, H, D]
        or None). One GEMM (only the k/v rows without with_q), one fused norm + RoPE (+ store)."""
        if with_q:
            qkv = self.qkv_proj(x)
        else:
            qkv = self.qkv_proj.project(x, "k_proj", "v_proj")
        num_q = self.num_heads if with_q else 0
        q, k, v = qk_norm_rope(qkv, num_q, self.num_kv_heads, self.head_dim, self.q_head_stride,
                               None if self.q_norm is None else self.q_norm.weight,
                               None if self.k_norm is None else self.k_norm.weight, self.eps, self.zero_centred,
                               *rope, kv_store)
        gate = None
        if self.has_output_gate and with_q:
            gate = qkv[:, : self.num_heads * self.q_head_stride].view(x.shape[0], self.num_heads, -1)[..., self.head_dim:]
        return q, k, v, gate

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] → k, v [N, Hkv, D] (k normed and rotated), from the k/v rows alone."""
        _, k, v, _ = self.project(x, rope, with_q=False)
        return k, v

    def store_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_pool: torch.Tensor,
                 v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v of x stored at slot_mapping (the draft's context K/V), without computing q."""
        self.project(x, rope, (k_pool, v_pool, slot_mapping), with_q=False)

    def output(self, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            attn = attn * torch.sigmoid(gate).reshape(attn.shape)
        return self.o_proj(attn)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Causal self-attention of a target layer: write the new K/V, attend over the pool."""
        k_pool, v_pool = meta.kv[self.cache_index]
        q, _, _, gate = self.project(x, rope, (k_pool, v_pool, meta.slot_mapping))
        return self.output(mixer(meta, self.attend, q), gate)

    def attend(self, meta: AttentionMetadata, q: torch.Tensor) -> torch.Tensor:
        """q [N, H, D] → [N, H·D] over this layer's pool (the new K/V already stored)."""
        k_pool, v_pool = meta.kv[self.cache_index]
        return paged_attention(q, k_pool, v_pool, meta, meta.context_lens, self.scale, is_causal=True)
