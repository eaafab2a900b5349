"""The forwards alone: kernel classes of a profiled forward (`--breakdown`), the drafts' readout,
graph replays of the captured forwards, the MoE experts kernel switched for a run."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch

from blockspec.bench.common import graphed, synchronize, timed
from blockspec.cache import KVPool
from blockspec.engine.engine import Engine
from blockspec.layers import AttentionMetadata
from blockspec.layers.moe import SparseMoE


# Kernel classes of a forward, by kernel (CUDA) or top-level op (CPU) name: where a step's time
# goes, so a missed goal says which class to work on. First match wins.
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "attn", "sdpa", "flash", "softmax", "merge_splits")),
    ("moe", ("moe", "expert", "topk", "route", "_align_kernel")),
    ("recurrent", ("gated_delta", "delta_rule", "chunk_", "recurrent", "conv1d", "kda")),
    ("gemm", ("gemm", "matmul", "sm90", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::linear", "splitk",
              "aten::bmm", "nvjet")),
    ("norm_rope_act", ("norm", "rope", "rotary", "silu", "swiglu", "qk_", "add_rms")),
    ("copy_index", ("copy", "index", "gather", "scatter", "cat", "fill", "slice", "select", "view", "reshape")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, needles in KERNEL_CLASSES:
        if any(needle in lowered for needle in needles):
            return label
    return "other_elementwise"


def forward_metadata(width: int, context: int, page_size: int, kv: KVPool, device: torch.device) -> AttentionMetadata:
    """One sequence feeding `width` tokens after `context` cached ones (pages 1 …; 0 is padding)."""
    num_pages = -(-(context + width) // page_size)
    table = torch.arange(1, num_pages + 1, device=device)[None]
    positions = torch.arange(context, context + width, device=device)
    slots = table[0, positions // page_size] * page_size + positions % page_size
    return AttentionMetadata(num_seqs=1, width=width, input_ids=torch.zeros(width, dtype=torch.long, device=device),
                             positions=positions, slot_mapping=slots, block_tables=table,
                             context_lens=torch.tensor([context + width], device=device),
                             max_context_len=num_pages * page_size, page_size=page_size, kv=kv.layers)


def sequence_forward(target: torch.nn.Module, device: torch.device, width: int, context: int = 0,
                     page_size: int = 16, input_ids: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """A target forward of one sequence feeding `width` tokens (input_ids, else zeros) after
    `context` cached ones, in a pool of its own, and its logits (every row's; one row's when
    width is 1). Dense targets: the metadata has no state pool."""
    config = target.config
    kv = KVPool(target.num_attention_layers, (-(-(context + width) // page_size) + 2) * page_size,
                config.num_key_value_heads, config.head_dim, target.lm_head.weight.dtype, device)
    meta = forward_metadata(width, context, page_size, kv, device)
    ids = meta.input_ids if input_ids is None else input_ids.to(device)

    def forward() -> torch.Tensor:
        out = target(ids, meta.positions, meta)
        return target.compute_logits(out.hidden[-1:] if width == 1 else out.hidden)
    return forward


def kernel_breakdown(target: torch.nn.Module, device: torch.device, width: int, context: int = 512,
                     page_size: int = 16) -> dict[str, Any]:
    """One eager target forward (+ the LM head over the rows read) under torch.profiler: device
    milliseconds per kernel class and kernels per layer (on CPU: top-level ops and their CPU
    time, a smoke test of the same code)."""
    forward = sequence_forward(target, device, width, context, page_size)

    is_cuda = device.type == "cuda"
    with torch.inference_mode():
        forward()
        synchronize()
        activity = torch.profiler.ProfilerActivity.CUDA if is_cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            forward()
            synchronize()
    if is_cuda:
        events = [(e.name, e.device_time) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    else:
        events = [(e.name, e.cpu_time_total) for e in prof.events() if e.cpu_parent is None]
    by_class: dict[str, float] = {}
    for name, micros in events:
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + micros / 1e3
    ordered = sorted(by_class.items(), key=lambda item: -item[1])
    return {"ms_by_class": {label: round(ms, 4) for label, ms in ordered}, "ms_total": round(sum(by_class.values()), 4),
            "kernels_per_layer": len(events) / target.num_layers}


@torch.inference_mode()
def readout_ms(drafts: dict[str, torch.nn.Module], lm_head: torch.nn.Module, num_seqs: int, block_size: int,
               device: torch.device) -> dict[str, float]:
    """Milliseconds of each draft's `propose` on random hidden states [num_seqs, T, H]."""
    weight = lm_head.weight
    hidden = torch.randn(num_seqs, block_size, weight.shape[1], device=device, dtype=weight.dtype)
    anchors = torch.randint(0, weight.shape[0], (num_seqs,), device=device)
    return {f"{name}_readout_ms": timed(graphed(lambda d=draft: d.propose(hidden, anchors, lm_head), device))
            for name, draft in drafts.items()}


def forward_figures(plain: dict[str, float], spec: dict[str, float], block_size: int) -> dict[str, float]:
    """The graphed forwards alone: target of 1 token, verify of block_size, the draft's propose."""
    out = {}
    if "verify_graph_ms" in plain and "verify_graph_ms" in spec:
        out = {"target_forward_w1_ms": plain["verify_graph_ms"],
               f"target_forward_w{block_size}_ms": spec["verify_graph_ms"],
               f"verify{block_size}_over_step": spec["verify_graph_ms"] / plain["verify_graph_ms"]}
    if "propose_graph_ms" in spec:
        out[f"draft_propose_b{block_size}_ms"] = spec["propose_graph_ms"]
    return out


def kernel_name(kernel: Callable) -> str:
    return f"{kernel.__module__}.{kernel.__name__}"


@contextmanager
def experts_kernel(layers: list[SparseMoE], kernel: Callable):
    """Every MoE layer on `kernel` for the duration (graphs are captured per engine, so an engine
    built inside sees only this kernel)."""
    before = [layer.kernel for layer in layers]
    for layer in layers:
        layer.kernel = kernel
    try:
        yield
    finally:
        for layer, old in zip(layers, before):
            layer.kernel = old


def graph_replay_ms(engine: Engine, concurrency: int) -> dict[str, float]:
    """Milliseconds of one replay of each FULL graph (propose, verify) a decode step of the batch's
    size takes: the forwards alone, without the engine's host work. A batch larger than one step
    decodes (seats, token budget) ran in the graphs of the largest step. Replays rewrite page 0 and
    state slot 0, which nobody reads."""
    graphs, width = engine.runner.graphs, engine.runner.width
    if not graphs.capture:
        return {}
    seqs = min(concurrency, graphs.max_draft_seqs)
    plans = {"propose": graphs.plan_draft(seqs, 0, 1), "verify": graphs.plan(seqs * width, seqs, False, 0, 1)}
    statics = {kind: graphs.full.get((kind, plan.desc, plan.keys)) for kind, plan in plans.items()}
    return {f"{kind}_graph_ms": timed(static.graph.replay, repeat=10)
            for kind, static in statics.items() if static is not None and static.graph is not None}


