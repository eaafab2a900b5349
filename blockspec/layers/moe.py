"""The sparse mixture-of-experts block of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE.

Router (as transformers computes it): logits = x Wᵀ [N, E]; p = softmax(logits) in fp32; the k
largest p per token; divided by their sum when `normalize`; cast back to x's dtype. Each token's
output is Σ_k p_k · expert_k(x), plus sigmoid(x · w_gate) · shared_expert(x) where the model has a
shared expert.

Experts are held stacked, in the fused checkpoint layout: gate_up_proj [E, 2I, H] (gate rows
first, then up rows) and down_proj [E, H, I]. Four kernels, one signature:
- `kernels.moe.fused_experts` (Triton): pairs aligned by expert on the device, a gather-GEMM for
  gate_up with silu·mul fused, one for down with the routing weights; fixed shapes, no host
  sync. The CUDA default wherever Triton is installed (it ships with PyTorch's CUDA builds).
- `reference_experts`: a loop over the experts some token chose (transformers' order of sums);
  data-dependent shapes and host syncs, so never under a CUDA graph. The CPU default.
- `grouped_experts`: rows sorted by expert, two `torch._grouped_mm` calls; fixed shapes, no host
  sync, so the decode cycle can be captured. CUDA bf16 without Triton.
- `gathered_experts`: every (token, expert) row multiplies its own gathered copy of the expert's
  weights (N·k copies: fine for tests and small batches); fixed shapes in any dtype. The CUDA
  fallback where `_grouped_mm` does not serve (fp32, older torch).
Tests hold the others to the reference (the Triton kernel on CPU through its interpreter, and
on the GPU).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import MoeConfig
from blockspec.kernels import moe as moe_kernels
from blockspec.layers.common import MLP

ExpertsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Experts(nn.Module):
    """E SwiGLU experts, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as the experts kernels take them (FP8 experts: dequantized)."""
        return self.gate_up_proj, self.down_proj

    scales = None                                  # block scales of FP8 experts (layers/fp8.py)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] → (weights [N, k] in the logits' dtype, expert ids [N, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def reference_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """x [N, H], weights / experts [N, k] → Σ_k weights · expert(x) [N, H]; experts in
    ascending id order, each over the tokens that chose it."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = torch.where(experts == expert)
        gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)     # [n, I] each
        y = F.linear(F.silu(gate) * up, down_proj[expert])                       # [n, H]
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Same result as reference_experts with fixed shapes: the N·k (token, expert) rows sorted
    by expert, one grouped GEMM per projection (group e = the rows of expert e), then each
    token's k rows weighted and summed."""
    num_tokens, top_k = experts.shape
    flat = experts.flatten()                                                    # [N·k]
    order = flat.argsort(stable=True)
    rows = x[order // top_k]                                                    # [N·k, H]
    counts = torch.zeros(gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)                              # group ends [E]
    # _grouped_mm takes mat2 as [E, K, N]; the transposes are views (column-major, as cuBLAS wants).
    gate_up = torch._grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offsets)   # [N·k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()                                   # [N·k, I]
    y = torch._grouped_mm(hidden, down_proj.transpose(1, 2), offs=offsets)     # [N·k, H]
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(num_tokens, top_k, -1)
    return (unsorted * weights[..., None]).sum(dim=1)


def gathered_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Same result as reference_experts, one batched matmul per projection over the N·k rows."""
    num_tokens, top_k = experts.shape
    flat = experts.flatten()                                                    # [N·k]
    rows = x.repeat_interleave(top_k, dim=0)[:, :, None]                        # [N·k, H, 1]
    gate, up = torch.bmm(gate_up_proj[flat], rows).squeeze(-1).chunk(2, dim=-1)     # [N·k, I] each
    y = torch.bmm(down_proj[flat], (F.silu(gate) * up)[:, :, None]).squeeze(-1)      # [N·k, H]
    return (y.view(num_tokens, top_k, -1) * weights[..., None]).sum(dim=1)


def select_experts_kernel(device: torch.device, dtype: torch.dtype) -> ExpertsKernel:
    """The reference on CPU (exact, fast enough for tiny models); on CUDA, where the decode cycle
    is graph-captured and the reference's host syncs cannot be, a fixed-shape kernel."""
    if device.type != "cuda":
        return reference_experts
    if moe_kernels.is_available():
        return moe_kernels.fused_experts
    if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return grouped_experts
    return gathered_experts


class SparseMoE(nn.Module):
    """Router + stacked experts (+ the sigmoid-gated shared expert); names as Hugging Face's."""

    def __init__(self, hidden_size: int, config: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.normalize
        self.gate = nn.Linear(hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden_size, config.moe_intermediate_size)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = MLP(hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.kernel: ExpertsKernel | None = None       # chosen on first use, by device and dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] → [N, H]."""
        if self.kernel is None:
            self.kernel = select_experts_kernel(x.device, x.dtype)
        logits = self.gate(x)                                                       # [N, E]
        if self.kernel is moe_kernels.fused_experts:
            return self.fused_forward(x, logits)
        weights, experts = route(logits, self.top_k, self.normalize)                # [N, k] each
        out = self.kernel(x, weights, experts, *self.experts.stacked(x.dtype))
        if self.has_shared_expert:
            out = out + self.gated_shared_expert(x)
        return out

    def gated_shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def fused_forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Triton: routing in one launch, the experts in two gather-GEMMs; a shared expert of the
        experts' intermediate size (Qwen3.5-MoE, Qwen3-Next) rides along as one more slot per token."""
        scales = self.experts.scales
        shared = self.shared_slot() if self.has_shared_expert else None
        out = moe_kernels.fused_moe(x, logits, self.top_k, self.normalize, self.experts.gate_up_proj,
                                    self.experts.down_proj, shared, scales)
        if self.has_shared_expert and shared is None:
            out = out + self.gated_shared_expert(x)
        return out

    def shared_slot(self) -> moe_kernels.SharedExpert | None:
        """The shared expert as the fused kernel's last slot, where it can ride along: the
        experts' intermediate size, a plain gate, and the experts' format (bf16 beside bf16
        experts; e4m3 beside FP8 ones with scales laid out as one expert's: round 66 on the H200,
        Qwen3.5-35B-A3B's FP8 plain step 5.07 → 4.63 ms, 1,109 → 749 kernels;
        BLOCKSPEC_FP8_SHARED_SLOT=0 turns it off). Else None: it runs on its own."""
        mlp, scales = self.shared_expert, self.experts.scales
        if (not isinstance(self.shared_expert_gate, nn.Linear)
                or mlp.down_proj.weight.shape[1] != self.experts.down_proj.shape[2]):
            return None
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if scales is None:
            if not (isinstance(gate_up, nn.Linear) and isinstance(down, nn.Linear)):
                return None
            gate, up = gate_up.weight.chunk(2, dim=0)                     # fused rows: gate, then up
            return moe_kernels.SharedExpert(gate, up, down.weight, self.shared_expert_gate.weight)
        if os.environ.get("BLOCKSPEC_FP8_SHARED_SLOT") == "0" or not all(
                getattr(m, "weight_scale_inv", None) is not None and getattr(m, "bias", None) is None
                for m in (gate_up, down)):
            return None
        if (gate_up.block != scales.gate_up_block or down.block != scales.down_block
                or gate_up.weight_scale_inv.shape != scales.gate_up.shape[1:]
                or down.weight_scale_inv.shape != scales.down.shape[1:]):
            return None
        gate, up = gate_up.weight.chunk(2, dim=0)
        return moe_kernels.SharedExpert(gate, up, down.weight, self.shared_expert_gate.weight,
                                        gate_up.weight_scale_inv, down.weight_scale_inv)


def make_mlp(hidden_size: int, intermediate_size: int, moe: MoeConfig | None, layer: int,
             bias: bool = False) -> nn.Module:
    """Layer `layer`'s feed-forward: the sparse block where the config says so, else the dense MLP."""
    if moe is not None and moe.is_sparse(layer):
        return SparseMoE(hidden_size, moe)
    return MLP(hidden_size, intermediate_size, bias)

