"""How a target splits over tensor-parallel ranks: its config, its modules, its checkpoint.

A rank's model is the model file's own module tree built from a *local* config (shard_config):
num_attention_heads / tp, num_key_value_heads / tp (or one head, replicated, when tp exceeds
them), intermediate sizes / tp, GDN key and value heads / tp. So q/k/v and gate/up are
column-parallel without a module of their own, every rank's K/V pool holds its own heads and its
recurrent-state pool its own GDN heads. shard_modules then puts in the layers where the ranks
meet (layers.py). The router, the norms and the residual stream are replicated: after each
all-reduce every rank holds the same stream, which is why the draft's features need no gather.

The checkpoint: `rank_slice` says which rows or columns of each tensor this rank reads, so each
rank reads only its slices of the safetensors (loading.py).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.distributed.group import TPGroup
from blockspec.distributed.layers import (LocalExperts, RowParallelLinear, VocabParallelEmbedding,
                                          VocabParallelLMHead, reduce_output)
from blockspec.layers.attention import Attention
from blockspec.layers.common import MLP
from blockspec.layers.moe import Experts, SparseMoE
from blockspec.models.qwen3_5 import GatedDeltaNet


def shard_config(config: dict[str, Any], full: ModelConfig, tp: int, expert_parallel: bool = False) -> dict[str, Any]:
    """The config.json dict of one rank's share of a model whose parsed config is `full`
    (expert_parallel: the experts keep their rows; shard_modules gives each rank E/N of them)."""
    check_divisible(full, tp, expert_parallel)
    local = copy.deepcopy(config)
    text = local.get("text_config") or local          # the multimodal layout nests the text config
    text.update(num_attention_heads=full.num_attention_heads // tp,
                num_key_value_heads=max(1, full.num_key_value_heads // tp),
                head_dim=full.head_dim, intermediate_size=full.intermediate_size // tp)
    if full.moe is not None:
        text.update(moe_intermediate_size=full.moe.moe_intermediate_size // (1 if expert_parallel else tp),
                    shared_expert_intermediate_size=full.moe.shared_expert_intermediate_size // tp)
    if hasattr(full, "linear_num_key_heads"):
        text.update(linear_num_key_heads=full.linear_num_key_heads // tp,
                    linear_num_value_heads=full.linear_num_value_heads // tp)
    return local


def check_divisible(full: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Every split dimension must divide by tp (K/V heads may instead be replicated)."""
    sizes = {"num_attention_heads": full.num_attention_heads, "intermediate_size": full.intermediate_size,
             "vocab_size": full.vocab_size}
    if full.moe is not None:
        sizes.update(shared_expert_intermediate_size=full.moe.shared_expert_intermediate_size,
                     **({"num_experts": full.moe.num_experts} if expert_parallel
                        else {"moe_intermediate_size": full.moe.moe_intermediate_size}))
    if hasattr(full, "linear_num_key_heads"):
        sizes.update(linear_num_key_heads=full.linear_num_key_heads,
                     linear_num_value_heads=full.linear_num_value_heads)
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"--tensor-parallel-size {tp}: the model's {name} {size} is not a multiple of {tp}")
    kv = full.num_key_value_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"--tensor-parallel-size {tp}: the model's num_key_value_heads {kv} neither divides "
                          f"by {tp} nor divides it")


def shard_modules(model: nn.Module, tp: TPGroup, expert_parallel: bool = False) -> None:
    """Put the meeting layers into a model built from a local config (on the meta device)."""
    in_moe = {id(m.shared_expert) for m in model.modules() if isinstance(m, SparseMoE) and m.has_shared_expert}
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.o_proj = row_parallel(module.o_proj, tp)
        elif isinstance(module, MLP) and id(module) not in in_moe:
            module.down_proj = row_parallel(module.down_proj, tp)
        elif isinstance(module, SparseMoE):
            module.register_forward_hook(reduce_output(tp))
            if expert_parallel:
                num_experts, inter, hidden = (module.experts.gate_up_proj.shape[0],
                                              module.experts.down_proj.shape[2], module.experts.down_proj.shape[1])
                module.experts = Experts(num_experts // tp.size, hidden, inter)
                module.kernel = LocalExperts(tp.rank * (num_experts // tp.size), num_experts // tp.size)
        elif isinstance(module, GatedDeltaNet):
            module.out_proj = row_parallel(module.out_proj, tp)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
    model.lm_head = VocabParallelLMHead(hidden, vocab, tp)


def row_parallel(linear: nn.Linear, tp: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, tp)


@dataclass(frozen=True)
class Slice:
    """Along `dim`, the concatenation of these [start, stop) ranges of the checkpoint tensor."""
    dim: int
    ranges: tuple[tuple[int, int], ...]


def chunk(size: int, tp: int, rank: int, num_chunks: int | None = None) -> tuple[int, int]:
    """Rank `rank`'s piece of `size` split into num_chunks (default tp) equal pieces; with fewer
    pieces than ranks (replicated K/V heads) consecutive ranks share one."""
    num_chunks = num_chunks or tp
    index = rank * num_chunks // tp
    step = size // num_chunks
    return index * step, (index + 1) * step


def pieces(sizes: list[int], tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """A dimension made of consecutive parts (q | k | v of a GDN projection), each split."""
    out, start = [], 0
    for size in sizes:
        lo, hi = chunk(size, tp, rank)
        out.append((start + lo, start + hi))
        start += size
    return tuple(out)


SPLIT_ROWS = re.compile(r"(self_attn\.q_proj|\.gate_proj|\.up_proj|in_proj_z|in_proj_b|in_proj_a|in_proj_qkvz|"
                        r"in_proj_ba|embed_tokens|lm_head)\.(weight|bias)$|linear_attn\.(dt_bias|A_log)$")
SPLIT_KV = re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$")
SPLIT_COLUMNS = re.compile(r"(self_attn\.o_proj|\.down_proj|linear_attn\.out_proj)\.weight$")
SPLIT_QKV = re.compile(r"linear_attn\.(in_proj_qkv|conv1d)\.weight$")
FUSED_GATE_UP = re.compile(r"experts\.gate_up_proj$")
FUSED_DOWN = re.compile(r"experts\.down_proj$")
EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.(\d+)\.")


def local_expert(name: str, num_experts: int, tp: int, rank: int) -> str | None:
    """Expert parallel: a per-expert checkpoint name under this rank's numbering of its experts,
    or None for another rank's expert (never read)."""
    match = EXPERT_TENSOR.search(name)
    if match is None:
        return name
    per_rank = num_experts // tp
    local = int(match[1]) - rank * per_rank
    if not 0 <= local < per_rank:
        return None
    return f"{name[:match.start(1)]}{local}{name[match.end(1):]}"


def rank_slice(name: str, shape: tuple[int, ...], full: ModelConfig, tp: int, rank: int,
               expert_parallel: bool = False) -> Slice | None:
    """The part of checkpoint tensor `name` (of `shape`) that rank `rank` reads; None: all of it
    (norms, the router, biases added after a reduce, the shared expert's gate). Expert parallel:
    the fused experts' first dim; a per-expert tensor is read whole or not at all (local_expert)."""
    if expert_parallel and (FUSED_GATE_UP.search(name) or FUSED_DOWN.search(name)):
        return Slice(0, (chunk(shape[0], tp, rank),))
    if expert_parallel and EXPERT_TENSOR.search(name):
        return None
    if SPLIT_KV.search(name):
        kv = full.num_key_value_heads
        return Slice(0, (chunk(shape[0], tp, rank, min(tp, kv)),))
    if SPLIT_ROWS.search(name):
        return Slice(0, (chunk(shape[0], tp, rank),))
    if FUSED_GATE_UP.search(name):                                  # [E, 2I, H]: gate rows, then up rows
        return Slice(1, pieces([shape[1] // 2, shape[1] // 2], tp, rank))
    if FUSED_DOWN.search(name):                                     # [E, H, I]
        return Slice(2, (chunk(shape[2], tp, rank),))
    if SPLIT_COLUMNS.search(name):
        return Slice(1, (chunk(shape[1], tp, rank),))
    if SPLIT_QKV.search(name):                                      # [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]
        key_width = full.linear_num_key_heads * full.linear_key_head_dim
        return Slice(0, pieces([key_width, key_width, shape[0] - 2 * key_width], tp, rank))
    return None
