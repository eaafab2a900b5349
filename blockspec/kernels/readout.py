"""The DFlash draft's readout in one pass over its logits: each row's argmax (the greedy draft)
and the draft's probability of it (its confidence, which adaptive speculation calibrates).

torch computes them as argmax, then a float copy of the logits and a logsumexp over it: at 8
sequences of the Qwen3-8B shape (15 slots × a 152k vocabulary, bf16) four passes and a 73 MB
copy, ~0.3 ms of the H100 every cycle (round 52's torch profile: the whole gap between adaptive
and fixed cycles at 8 sequences). Here each program streams one row once, keeping per lane a
running maximum, the first column that reached it and the sum of exp(x − max) rescaled as the
maximum moves (the online softmax), then reduces the lanes: the row's argmax is the first column
holding the maximum (torch.argmax's choice on ties), and its probability is 1 / Σ exp(x − max).
The argmax is exact; the confidence equals torch's up to fp32 summation order. CPU (and CUDA
without Triton) takes the torch form.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the torch form serves
    triton = None

BLOCK = 2048                 # columns a program loads per iteration (8 warps: 8 bf16 per thread)
FLOOR = -3.0e38              # a finite stand-in for −∞ (masked columns): no inf − inf in the rescale


# Columns a chunk of first_argmax's CPU form holds: the chunk maxima are the only pass over the
# whole row; the argmax itself runs over the chunk maxima and one chunk a row.
ARGMAX_CHUNK = 1024


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] → x.argmax(-1), the same indices (the first column holding the maximum; a NaN
    counts as the maximum). On CPU torch's argmax walks a row one element at a time: 25 ms for 64
    rows of a 152k vocabulary on this project's 2-core machine, as long as the tiny pair's verify
    forward itself, where `amax` (vectorised) takes 4 ms. So there: each chunk's maximum, the
    first chunk holding the row's, and the argmax inside that chunk alone. Elsewhere (CUDA, short
    rows, autograd) torch's own."""
    vocab = x.shape[-1]
    if x.device.type != "cpu" or vocab < 4 * ARGMAX_CHUNK or x.requires_grad or x.numel() == 0:
        return x.argmax(-1)
    rows = x.reshape(-1, vocab)
    full = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    chunk_max = rows[:, :full].reshape(rows.shape[0], -1, ARGMAX_CHUNK).amax(-1)             # [R, q]
    if full < vocab:
        chunk_max = torch.cat((chunk_max, rows[:, full:].amax(-1, keepdim=True)), dim=1)   # the tail's
    top = chunk_max.amax(-1, keepdim=True)
    if torch.isnan(top).any():
        return x.argmax(-1)                                  # NaN ≠ NaN: torch's walk decides
    chunk = (chunk_max == top).to(torch.uint8).argmax(-1)                                     # the first
    cols = chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK)[None]
    values = rows.gather(1, cols.clamp_max(vocab - 1)).masked_fill(cols >= vocab, float("-inf"))   # the tail's
    # a row whose maximum is -inf: its chunk is the first, and the first column there is torch's answer
    return (chunk * ARGMAX_CHUNK + values.argmax(-1)).view(x.shape[:-1])


def draft_confidence(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """DFlash 1: softmax(logits)[d_i] = exp(logit(d_i) − logsumexp), without a [B, L, V] softmax
    (any drafts: a processed or sampled row's too)."""
    chosen = logits.gather(-1, drafts.unsqueeze(-1)).squeeze(-1).float()
    return (chosen - torch.logsumexp(logits.float() if logits.dtype != torch.float32 else logits, dim=-1)).exp()


def argmax_confidence_torch(logits: torch.Tensor, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V] → (argmax [...] int64, softmax(logits) at it [...] fp32, or None)."""
    drafts = first_argmax(logits)
    return drafts, draft_confidence(logits, drafts) if confidence else None


def argmax_confidence(logits: torch.Tensor, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax_confidence_torch's results, by the one-pass kernel where it runs (CUDA, Triton)."""
    if triton is None or not logits.is_cuda or logits.requires_grad and torch.is_grad_enabled():
        return argmax_confidence_torch(logits, confidence)
    return argmax_confidence_triton(logits, confidence)


def argmax_confidence_triton(logits: torch.Tensor, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    drafts = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    probs = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if rows.shape[0]:
        _argmax_confidence_kernel[(rows.shape[0],)](rows, drafts, probs, rows.stride(0), vocab, BLOCK=BLOCK,
                                                    FLOOR=FLOOR, num_warps=8)
    return drafts.view(shape), probs.view(shape) if confidence else None


if triton is not None:
    @triton.jit
    def _argmax_confidence_kernel(x_ptr, ids_ptr, conf_ptr, stride, vocab, BLOCK: tl.constexpr,
                                  FLOOR: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], FLOOR, tl.float32)          # each lane's running maximum
        where = tl.zeros([BLOCK], tl.int32)                 # the first column that reached it
        total = tl.zeros([BLOCK], tl.float32)               # Σ exp(x − best) over the lane's columns
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=FLOOR).to(tl.float32)
            higher = tl.maximum(best, x)
            total = total * tl.exp(best - higher) + tl.where(inside, tl.exp(x - higher), 0.0)
            where = tl.where(x > best, cols, where)         # strictly: an earlier column keeps a tie
            best = higher
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, where, vocab), axis=0)
        mass = tl.sum(total * tl.exp(best - top), axis=0)
        tl.store(ids_ptr + row, first.to(tl.int64))
        tl.store(conf_ptr + row, 1.0 / mass)
