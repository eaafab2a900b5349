"""The layers where tensor-parallel ranks meet. Everything else in a sharded model is the
model's own module with fewer heads or a narrower intermediate size (shard.py): column-parallel
projections need no module of their own, since each rank's q/k/v and gate/up rows are a plain
FusedLinear of its own heads.

- RowParallelLinear: o_proj, down_proj, a GDN layer's out_proj: this rank's input columns, one
  all-reduce of the partial sums, the bias added once after it.
- A sparse MoE block (router replicated; each expert's intermediate rows split, or with
  expert_parallel each rank's 1/N of the experts whole, `LocalExperts`): its experts' and shared
  expert's partial sums meet in one all-reduce of the block's output (`reduce_output`).
- VocabParallelEmbedding: this rank's vocabulary rows; other ranks' ids look up zeros, one all-reduce.
- VocabParallelLMHead: this rank's vocabulary rows of the logits, one all-gather: every rank then
  holds the whole logits, so sampling, grammars and acceptance run exactly as on one device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed.group import TPGroup
from blockspec.layers.moe import select_experts_kernel


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r W_rᵀ) + b: x_r, W_r this rank's columns of the input (its heads, its
    intermediate rows); the parameter names are nn.Linear's (the checkpoint's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank · n, (rank + 1) · n) of the vocabulary; the sum over ranks is the lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_size // tp.size, hidden_size)
        self.tp = tp
        self.first = tp.rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)                 # [N, H]
        return self.tp.all_reduce(rows * mine[..., None].to(rows.dtype))


class VocabParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered once: [N, H] → [N, V] on every rank.
    out_features is the whole vocabulary (what the engine reads as the logits' width)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__(hidden_size, vocab_size // tp.size, bias=False)
        self.tp = tp
        self.out_features = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight))


class LocalExperts:
    """Expert parallel: an experts kernel over this rank's experts [first, first + count) of the
    router's E. Pairs routed to another rank's expert weigh 0 here (their id mapped to a local
    expert, so the kernel's shapes stay fixed); the block's all-reduce adds the ranks' sums."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.inner = None

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            self.inner = select_experts_kernel(x.device, x.dtype)
        local = experts - self.first                                                   # [N, k]
        mine = (local >= 0) & (local < self.count)
        return self.inner(x, weights * mine, torch.where(mine, local, 0), gate_up_proj, down_proj)


def reduce_output(tp: TPGroup):
    """A forward hook summing a block's output over ranks (a sparse MoE block: its experts' and
    shared expert's partial sums are linear in their intermediate rows, so one all-reduce does)."""
    def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(out)
    return hook
