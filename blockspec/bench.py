"""`blockspec bench`: speed on random weights of real shapes, side by side with peers in one run.

Everything is a ratio to something measured in the same process: the bandwidth floor (weight
bytes a plain step reads, for MoE targets only the chosen experts, / measured copy bandwidth),
plain decoding, transformers' forward, z-lab's reference loop.
Throughput is measured through the real engine (scheduler, batched cycle, pools) at each
concurrency. Random weights accept no drafts, so `--accept-len` forces the acceptance length
(the forwards are the same; only the bookkeeping of what is kept changes).

DFlash 1 and DFlash 2 drafts of the same shape run side by side: the DFlash 2 cycle (its convs
and the selector's walk inside the propose graph) against the DFlash 1 cycle, and the readout
alone (DFlash 1: logits; DFlash 2: logits, top-k, edge scores, greedy walk) replayed as a graph.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from unittest import mock
from typing import Any, Callable

import torch

from blockspec.cache import KVPool
from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.layers import AttentionMetadata
from blockspec.loader import build_empty, resolve_device
from blockspec.models.dflash import DFlashDraftModel, DraftConfig, default_target_layer_ids
from blockspec.layers.moe import SparseMoE, grouped_experts, select_experts_kernel
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.models.registry import ARCHITECTURES
from blockspec.sampling import SamplingParams
from blockspec.progress import track

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=256,
                 intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, rope_theta=1e6, max_position_embeddings=40960, draft_layers=2),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960, draft_layers=5),
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, draft_layers=5),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, rope_theta=5e5, max_position_embeddings=131072, draft_layers=5),
    "tiny-moe": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", vocab_size=151936,
                     hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=40960,
                     full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=16,
                     num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                     draft_layers=1, draft=dict(intermediate_size=256)),
    # Hybrid (Gated DeltaNet + gated attention, dense MLP): Qwen3.5-4B's config.json values; its
    # draft's layer sizes are assumed (z-lab's Qwen3.5-4B draft: same hidden size, Qwen3-4B-like layers).
    "qwen3.5-4b": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320,
                       hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, rope_theta=1e7, partial_rotary_factor=0.25,
                       max_position_embeddings=262144, full_attention_interval=4, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, tie_word_embeddings=True, draft_layers=5,
                       draft=dict(intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=128, partial_rotary_factor=1.0)),
    # MoE shapes (config.json values of the released checkpoints); their drafts are dense, of the
    # sizes given under "draft" (z-lab's drafts for these targets: same hidden size).
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          draft_layers=5, draft=dict(intermediate_size=6144)),
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                            vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, rope_theta=1e7, partial_rotary_factor=0.25,
                            max_position_embeddings=262144, full_attention_interval=4, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, draft_layers=5,
                            draft=dict(intermediate_size=6144, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=128, partial_rotary_factor=1.0)),
}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() with the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), repeat=10)
    return 2 * src.numel() * 2 / (ms / 1e3)


def random_init(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model


def build_models(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, block_size: int = 16):
    target_cfg = {k: v for k, v in shape.items() if k not in ("draft_layers", "draft")}
    arch = target_cfg["architectures"][0]
    target = random_init(build_empty(lambda: ARCHITECTURES[arch]().build(target_cfg, arch), device, dtype))
    layer_ids = default_target_layer_ids(target.num_layers, shape["draft_layers"])
    same_as_target = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "rope_theta", "max_position_embeddings")
    draft_cfg = {**{k: target_cfg[k] for k in same_as_target if k in target_cfg}, **shape.get("draft", {}),
                 "model_type": "qwen3", "num_hidden_layers": shape["draft_layers"], "block_size": block_size,
                 "dflash_config": {"mask_token_id": 151669, "target_layer_ids": layer_ids}}
    draft = random_init(build_empty(lambda: DFlashDraftModel(DraftConfig.from_hf(draft_cfg)), device, dtype))
    return target_cfg, draft_cfg, target, draft


def build_dflash2(draft_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A DFlash 2 draft of the DFlash 1 draft's shape, with the selector and convolution sizes of
    z-lab's released DFlash 2 config (kernel 2, groups of 16, rank 256, top-16)."""
    extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                 output_multiplier=0.196, final_logit_softcapping=20.0)
    cfg = dict(draft_cfg, architectures=["DFlash2DraftModel"], is_causal=False,
               dflash_config=dict(draft_cfg["dflash_config"], **extra))
    return random_init(build_empty(lambda: DFlash2DraftModel(DraftConfig.from_hf(cfg)), device, dtype))


def graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """fn as one CUDA graph replay (how the propose graph runs it); fn itself off CUDA."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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


def kernel_breakdown(target: torch.nn.Module, device: torch.device, width: int, context: int = 512,
                     page_size: int = 16) -> dict[str, Any]:
    """One eager target forward (+ the LM head over the rows read) under torch.profiler: device
    milliseconds per kernel class and kernels per layer (on CPU: top-level ops and their CPU
    time, a smoke test of the same code). Dense targets: the metadata has no state pool."""
    config = target.config
    kv = KVPool(target.num_attention_layers, (-(-(context + width) // page_size) + 2) * page_size,
                config.num_key_value_heads, config.head_dim, target.lm_head.weight.dtype, device)
    meta = forward_metadata(width, context, page_size, kv, device)

    def forward() -> torch.Tensor:
        out = target(meta.input_ids, meta.positions, meta)
        return target.compute_logits(out.hidden[-1:] if width == 1 else out.hidden)

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


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one token's forward reads: everything but the experts it does not choose
    (top_k of E per sparse layer)."""
    unread = 0.0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            num_experts = module.experts.gate_up_proj.shape[0]
            unread += weight_bytes(module.experts) * (1 - module.top_k / num_experts)
    return int(weight_bytes(model) - unread)


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


def forced_accept(accept_len: float):
    """An accept() that keeps accept_len tokens per verify on average (floor and ceil mixed),
    for random weights whose drafts are never right."""
    credit = [0.0]

    def accept(seqs, proposal, logits, processed=None):
        num_accepted, new_tokens = real_accept(seqs, proposal, logits, processed)
        target_ids = logits.argmax(-1).tolist()
        for b in range(len(seqs)):
            credit[0] += accept_len
            kept = max(1, min(int(credit[0]), logits.shape[1]))
            credit[0] -= kept
            num_accepted[b], new_tokens[b] = kept - 1, target_ids[b][:kept]
        return num_accepted, new_tokens
    real_accept = model_runner.accept
    return accept


def throughput(target, draft, block_size: int, concurrency: int, prompt_len: int, max_tokens: int,
               accept_len: float | None) -> dict[str, float]:
    """Output tok/s of `concurrency` requests decoded together through the engine (a warm-up
    batch first), and the decode milliseconds per cycle of the batch."""
    config = EngineConfig(max_model_len=prompt_len + max_tokens + 8, block_size=block_size if draft else 1,
                          max_num_seqs=concurrency, max_queue=concurrency, max_prefill_tokens=prompt_len)
    engine = Engine(target, draft, config)
    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "accept", forced_accept(accept_len) if forcing else model_runner.accept):
        run_batch(engine, concurrency, prompt_len, 8)                                   # warm-up
        result = run_batch(engine, concurrency, prompt_len, max_tokens)
    return {**result, **graph_replay_ms(engine, concurrency)}


def graph_replay_ms(engine: Engine, concurrency: int) -> dict[str, float]:
    """Milliseconds of one replay of each captured forward (propose, verify) of the batch's size,
    at the longest key bucket the run used: the forwards alone, without the engine's host work.
    Replays rewrite the finished batch's pages and state slots, which nobody reads any more."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs.capture:
        return {}
    rows = graphs.shape(concurrency, 0)[0]
    batches = [b for b in graphs.batches.values() if b.meta.num_seqs == rows]
    if not batches:
        return {}
    static = max(batches, key=lambda b: b.meta.max_context_len)
    return {f"{kind}_graph_ms": timed(graph.replay, repeat=10) for kind, graph in static.graphs.items()}


class EngineFailed(RuntimeError):
    """A bench request ended with an error: the figures would be of a broken run."""


def run_batch(engine: Engine, concurrency: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    requests = [Request(f"bench-{i}", torch.randint(1000, 100000, (prompt_len,), generator=gen).tolist(),
                        SamplingParams(max_tokens=max_tokens), frozenset(), engine.config.max_model_len)
                for i in range(concurrency)]
    errors: list[str] = []

    def on_event(event) -> None:
        if event.error is not None:
            errors.append(event.error)

    def step() -> None:
        engine.step()
        if errors:               # a failed request never gets its tokens: stop, do not spin
            raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")

    for request in requests:
        engine.submit(request, on_event)
    while not all(r.output_ids or r.is_finished for r in requests):
        step()                                          # prefill everyone first: decode is measured alone
    synchronize()
    started = time.perf_counter()
    tokens_before = sum(len(r.output_ids) for r in requests)
    batch_cycles = 0
    while not all(r.is_finished for r in requests):
        step()
        batch_cycles += 1
    synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in requests) - tokens_before
    per_seq = [r.stats for r in requests]
    return {"tok_s": tokens / seconds, "ms_per_cycle": seconds * 1e3 / max(1, batch_cycles),
            "mean_acceptance_length": sum(s.mean_acceptance_length for s in per_seq) / len(per_seq)}


def main(args) -> int:
    device = resolve_device(args.device)
    if args.shape not in SHAPES:
        raise ValueError(f"unknown --shape {args.shape!r} ({', '.join(SHAPES)})")
    concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if not concurrency or min(concurrency) < 1:
        raise ValueError("--concurrency must be a comma-separated list of positive integers")
    try:
        block_sizes = [int(b) for b in str(args.block_size).split(",") if b.strip()]
    except ValueError:
        block_sizes = []
    if not block_sizes or min(block_sizes) < 2:
        raise ValueError(f"--block-size must be a comma-separated list of integers ≥ 2, not {args.block_size!r}")
    if getattr(args, "layers", None) is not None and args.layers < 1:
        raise ValueError("--layers must be at least 1")
    try:
        results = run(args.shape, device, args.vs, concurrency, args.accept_len, args.prompt_len, args.max_tokens,
                      block_sizes, dflash2=not getattr(args, "no_dflash2", False), layers=getattr(args, "layers", None),
                      breakdown=getattr(args, "breakdown", False))
    except EngineFailed as exc:
        print(f"blockspec bench: error: {exc}", file=sys.stderr)
        return 1
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def run(shape_name: str, device: torch.device, vs: list[str], concurrency: list[int], accept_len: float | None,
        prompt_len: int, max_tokens: int, block_sizes: list[int], dflash2: bool = True,
        layers: int | None = None, breakdown: bool = False) -> dict[str, Any]:
    """layers: the shape's first `layers` layers only (a per-layer comparison where the whole
    model and a peer's copy do not both fit)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_size = block_sizes[0]
    shape = dict(SHAPES[shape_name], **({"num_hidden_layers": layers} if layers else {}))
    target_cfg, draft_cfg, target, draft = build_models(shape, device, dtype, max(block_sizes))
    r: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                         "block_size": block_size, "forced_acceptance_length": accept_len,
                         "prompt_len": prompt_len, "max_tokens": max_tokens,
                         "num_hidden_layers": shape["num_hidden_layers"]}
    r["target_weight_GB"] = weight_bytes(target) / 1e9
    r["step_weight_GB"] = step_weight_bytes(target) / 1e9          # = target_weight_GB for dense targets
    r["draft_weight_GB"] = weight_bytes(draft) / 1e9
    moe_layers = [m for m in target.modules() if isinstance(m, SparseMoE)]
    if moe_layers:
        r["moe_kernel"] = kernel_name(select_experts_kernel(device, dtype))
    draft2 = build_dflash2(draft_cfg, device, dtype) if dflash2 else None
    if draft2 is not None:
        r["draft2_weight_GB"] = weight_bytes(draft2) / 1e9
    if device.type == "cuda":
        r["copy_bandwidth_TBps"] = copy_bandwidth(device) / 1e12
        r["floor_ms_per_token"] = r["step_weight_GB"] / r["copy_bandwidth_TBps"]
    if breakdown:
        if target.recurrent_shapes or moe_layers:
            r["breakdown"] = "dense targets only"
        else:
            for width in sorted({1, *block_sizes}):
                r[f"breakdown_w{width}"] = kernel_breakdown(target, device, width, prompt_len)
    for c in track(concurrency, f"bench {shape_name}", len(concurrency), "concurrency"):
        plain = throughput(target, None, 1, c, prompt_len, max_tokens, None)
        spec = throughput(target, draft, block_size, c, prompt_len, max_tokens, accept_len)
        r[f"c{c}"] = {"plain_tok_s": plain["tok_s"], "plain_ms_per_step": plain["ms_per_cycle"],
                      "dflash_tok_s": spec["tok_s"], "dflash_ms_per_cycle": spec["ms_per_cycle"],
                      "dflash_acceptance_length": spec["mean_acceptance_length"],
                      "dflash_over_plain": spec["tok_s"] / plain["tok_s"],
                      "dflash_cycle_over_plain_step": spec["ms_per_cycle"] / plain["ms_per_cycle"]}
        r[f"c{c}"].update(forward_figures(plain, spec, block_size))
        if c == concurrency[0]:
            for other in block_sizes[1:]:
                extra = throughput(target, draft, other, c, prompt_len, max_tokens, accept_len)
                r[f"c{c}"].update({f"dflash_b{other}_tok_s": extra["tok_s"],
                                   f"dflash_b{other}_ms_per_cycle": extra["ms_per_cycle"],
                                   f"dflash_b{other}_cycle_over_plain_step": extra["ms_per_cycle"] / plain["ms_per_cycle"],
                                   **forward_figures(plain, extra, other)})
            if moe_layers and "grouped-moe" in vs:
                with experts_kernel(moe_layers, grouped_experts):
                    grouped = throughput(target, None, 1, c, prompt_len, max_tokens, None)
                r[f"c{c}"].update({"grouped_moe_plain_ms_per_step": grouped["ms_per_cycle"],
                                   "grouped_moe_step_over_ours": grouped["ms_per_cycle"] / plain["ms_per_cycle"]})
        if draft2 is not None:
            spec2 = throughput(target, draft2, block_size, c, prompt_len, max_tokens, accept_len)
            r[f"c{c}"].update({"dflash2_tok_s": spec2["tok_s"], "dflash2_ms_per_cycle": spec2["ms_per_cycle"],
                               "dflash2_cycle_over_dflash1": spec2["ms_per_cycle"] / spec["ms_per_cycle"]})
        readers = {"dflash1": draft, **({"dflash2": draft2} if draft2 is not None else {})}
        r[f"c{c}"].update(readout_ms(readers, target.lm_head, c, block_size, device))
    first, last = f"c{concurrency[0]}", f"c{concurrency[-1]}"
    r["plain_throughput_ratio_last_over_first"] = r[last]["plain_tok_s"] / r[first]["plain_tok_s"]
    r["dflash_throughput_ratio_last_over_first"] = r[last]["dflash_tok_s"] / r[first]["dflash_tok_s"]
    if "floor_ms_per_token" in r:
        r["ratio_floor_over_plain_step_c1"] = r["floor_ms_per_token"] / r[first]["plain_ms_per_step"]
        r["ratio_plain_step_over_floor_c1"] = r[first]["plain_ms_per_step"] / r["floor_ms_per_token"]
    if device.type == "cuda" and "transformers" in vs:
        try:
            r["transformers"] = bench_transformers(target_cfg, target, device)
        except Exception as error:                   # a peer failing must not lose our own figures
            r["transformers"] = {"error": repr(error)[:500]}
        if "forward_ms_w1_ctx512" in r["transformers"]:
            r["ratio_transformers_step_over_ours"] = (r["transformers"]["forward_ms_w1_ctx512"]
                                                      / r[first]["plain_ms_per_step"])
    if device.type == "cuda" and "zlab" in vs:
        r["zlab"] = bench_zlab(target_cfg, draft_cfg, target, draft, device)
        r["ratio_zlab_plain_over_ours"] = r["zlab"]["plain_ms_per_token"] / r[first]["plain_ms_per_step"]
        r["ratio_zlab_cycle_over_ours"] = r["zlab"]["cycle_ms_b16"] / r[first]["dflash_ms_per_cycle"]
    return r


def hf_config(target_cfg: dict[str, Any]):
    from transformers import AutoConfig
    cfg = {k: v for k, v in target_cfg.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(target_cfg["model_type"], **cfg)


def transformers_layers(target_cfg: dict[str, Any], target: torch.nn.Module, device: torch.device) -> int:
    """All the target's layers if a second copy of its weights fits the device (with 10 % to
    spare), else the fewest whole cycles of the layer pattern (full_attention_interval) that do,
    at least 8 layers: forward times are then scaled by layers to a whole model's."""
    num_layers = target_cfg["num_hidden_layers"]
    free, _ = torch.cuda.mem_get_info(device)
    if weight_bytes(target) * 1.1 < free:
        return num_layers
    cycle = target_cfg.get("full_attention_interval", 1)
    return min(num_layers, max(8, cycle) // cycle * cycle)


def bench_transformers(target_cfg, target, device) -> dict[str, Any]:
    """transformers' forward of 1 and 16 tokens over a 512-token context, on our weights. Where two
    copies of the model do not fit (Qwen3.5-35B-A3B: 2 × 69 GB), the first layers only, and the
    times scaled by num_hidden_layers / layers (`scaled_to_all_layers`: embedding and head are
    then counted more than once, so the scaled figure overstates transformers' time slightly)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    layers = transformers_layers(target_cfg, target, device)
    cfg = dict(target_cfg, num_hidden_layers=layers)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.bfloat16).eval()
    hf.load_state_dict(target.state_dict(), strict=False)
    out: dict[str, Any] = {"layers": layers}
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (1, 512), device=device)
        for width in (1, 16):
            def step(width=width):
                cache = DynamicCache(config=hf.config)
                hf(ids, past_key_values=cache, use_cache=True)
            prefill = timed(step, repeat=3, warmup=1)
            cache = DynamicCache(config=hf.config)
            hf(ids, past_key_values=cache, use_cache=True)
            new = torch.randint(0, 1000, (1, width), device=device)
            can_crop = crop(cache, 512)
            out["cache_cropped"] = can_crop          # False (hybrids): the context grows by width per call

            def fwd(width=width, can_crop=can_crop):
                hf(new, past_key_values=cache, use_cache=True)
                if can_crop:
                    cache.crop(512)
            out[f"forward_ms_w{width}_ctx512"] = timed(fwd, repeat=10)
            out["prefill_ms_512"] = prefill
    if layers < target_cfg["num_hidden_layers"]:
        scale = target_cfg["num_hidden_layers"] / layers
        out["measured"] = {k: v for k, v in out.items() if k.endswith("ms_512") or "_ms_" in k}
        out.update({k: v * scale for k, v in out["measured"].items()}, scaled_to_all_layers=scale)
    del hf
    torch.cuda.empty_cache()
    return out


def crop(cache, length: int) -> bool:
    """Whether transformers' cache can be cut back to `length` (its recurrent layers cannot)."""
    try:
        cache.crop(length)
        return True
    except RuntimeError:
        return False


def bench_zlab(target_cfg, draft_cfg, target, draft, device) -> dict[str, Any]:
    """z-lab's reference loop (`dflash` wheel) on the same weights."""
    from dflash.model import DFlashDraftModel as ZDraft, dflash_generate
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(target_cfg), dtype=torch.bfloat16).eval()
        zcfg = hf_config(dict(draft_cfg, model_type="qwen3"))
        zcfg.dflash_config = draft_cfg["dflash_config"]
        zcfg.block_size = 16
        zcfg.num_target_layers = target_cfg["num_hidden_layers"]
        zdraft = ZDraft(zcfg).to(torch.bfloat16).eval()
    hf.load_state_dict(target.state_dict(), strict=False)
    zdraft.load_state_dict(draft.state_dict(), strict=False)
    ids = torch.randint(0, 1000, (1, 512), device=device)
    out = {}
    for block, key in ((1, "plain_ms_per_token"), (16, "cycle_ms_b16")):
        dflash_generate(zdraft, hf, ids, 8, None, block_size=block)  # warm-up
        stats = dflash_generate(zdraft, hf, ids, 48, None, block_size=block, return_stats=True)
        total_ms = stats.time_per_output_token * stats.num_output_tokens * 1e3
        out[key] = total_ms / (stats.num_output_tokens if block == 1 else max(1, len(stats.acceptance_lengths)))
    del hf, zdraft
    torch.cuda.empty_cache()
    return out


def print_table(r: dict[str, Any]) -> None:
    width = max(len(k) for k in r)
    for key, value in r.items():
        text = json.dumps(value) if isinstance(value, (dict, list)) else (f"{value:.4g}" if isinstance(value, float) else str(value))
        print(f"{key:<{width}}  {text}")
