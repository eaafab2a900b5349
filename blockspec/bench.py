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

import gc
import json
import sys
import time
import zlib
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
    "qwen3-32b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, rope_theta=1e6, max_position_embeddings=40960, draft_layers=5),
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
    "qwen3-235b-a22b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                            hidden_size=4096, intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
                            draft_layers=5, draft=dict(intermediate_size=12288, num_attention_heads=32)),
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


def shape_configs(shape: dict[str, Any], block_size: int = 16) -> tuple[dict[str, Any], dict[str, Any]]:
    """A bench shape → the target's config.json dict and its DFlash draft's."""
    target_cfg = {k: v for k, v in shape.items() if k not in ("draft_layers", "draft")}
    layer_ids = default_target_layer_ids(target_cfg["num_hidden_layers"], shape["draft_layers"])
    same_as_target = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "rope_theta", "max_position_embeddings")
    draft_cfg = {**{k: target_cfg[k] for k in same_as_target if k in target_cfg}, **shape.get("draft", {}),
                 "model_type": "qwen3", "num_hidden_layers": shape["draft_layers"], "block_size": block_size,
                 "dflash_config": {"mask_token_id": 151669, "target_layer_ids": layer_ids}}
    return target_cfg, draft_cfg


def build_models(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, block_size: int = 16):
    target_cfg, draft_cfg = shape_configs(shape, block_size)
    arch = target_cfg["architectures"][0]
    target = random_init(build_empty(lambda: ARCHITECTURES[arch]().build(target_cfg, arch), device, dtype))
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

    def accept(seqs, proposal, logits, processed=None, num_drafts=None):
        num_accepted, new_tokens = real_accept(seqs, proposal, logits, processed, num_drafts)
        target_ids = logits.argmax(-1).tolist()
        limits = num_drafts or [logits.shape[1] - 1] * len(seqs)
        for b in range(len(seqs)):
            credit[0] += accept_len
            kept = max(1, min(int(credit[0]), limits[b] + 1))
            credit[0] -= kept
            num_accepted[b], new_tokens[b] = kept - 1, target_ids[b][:kept]
        return num_accepted, new_tokens
    real_accept = model_runner.accept
    return accept


# The engine options given to `bench` (--max-model-len, --gpu-memory-utilization, --num-gpu-blocks,
# --max-num-batched-tokens, --kv-cache-memory): main() sets them, every engine the bench builds uses them.
ENGINE_OPTIONS: dict[str, Any] = {}
MEMORY_OPTIONS = ("max_model_len", "gpu_memory_utilization", "num_gpu_blocks", "max_num_batched_tokens",
                  "kv_cache_memory")


def throughput(target, draft, block_size: int, concurrency: int, prompt_len: int, max_tokens: int,
               accept_len: float | None) -> dict[str, float]:
    """Output tok/s of `concurrency` requests decoded together through the engine (a warm-up
    batch first), and the decode milliseconds per cycle of the batch."""
    config = EngineConfig(**{"max_model_len": prompt_len + max_tokens + 8, **ENGINE_OPTIONS},
                          block_size=block_size if draft else 1, max_num_seqs=concurrency, max_queue=concurrency,
                          max_prefill_tokens=prompt_len,
                          speculation="fixed")      # the whole block: --compare-speculation measures adaptive
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


def burst(target, draft, block_size: int, arrivals: int, decoding: int, prompt_len: int, max_tokens: int,
          accept_len: float | None, max_num_batched_tokens: int = 2048) -> dict[str, float]:
    """`arrivals` requests of prompt_len tokens submitted at once, while `decoding` others are
    already decoding: the arrivals' time to first token (p50, p99) and the gaps between the
    decoding requests' streamed events during the burst (p50, p99), in milliseconds. With the
    ragged step their prefill chunks ride along with the decode rows instead of stalling them."""
    width = block_size if draft is not None else 1
    # The decoding ones (64-token prompts) keep going past the burst: room for prompt_len + max_tokens more.
    config = EngineConfig(**{"max_model_len": 64 + prompt_len + max_tokens + width, **ENGINE_OPTIONS,
                             "max_num_batched_tokens": max_num_batched_tokens},
                          block_size=width, max_num_seqs=arrivals + decoding, max_queue=arrivals + decoding)
    engine = Engine(target, draft, config)
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {}
    errors: list[str] = []

    def on_event(event) -> None:
        times.setdefault(event.request_id, []).append(time.perf_counter())
        if event.error is not None:
            errors.append(event.error)

    def request(name: str, length: int, tokens: int) -> Request:
        ids = torch.randint(1000, 100000, (length,), generator=gen).tolist()
        return Request(name, ids, SamplingParams(max_tokens=tokens, ignore_eos=True), frozenset(), config.max_model_len)

    def step() -> None:
        engine.step()
        if errors:
            raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")

    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "accept", forced_accept(accept_len) if forcing else model_runner.accept):
        run_batch(engine, min(4, arrivals), min(prompt_len, 64), 4)                    # warm-up
        background = [request(f"decoding-{i}", 64, prompt_len + max_tokens) for i in range(decoding)]
        for r in background:
            engine.submit(r, on_event)
        while not all(r.output_ids for r in background):
            step()
        synchronize()
        burst_requests = [request(f"arrival-{i}", prompt_len, max_tokens) for i in range(arrivals)]
        started = time.perf_counter()
        for r in burst_requests:
            engine.submit(r, on_event)
        while not all(r.output_ids or r.is_finished for r in burst_requests):
            step()
        ended = time.perf_counter()
        for r in [*background, *burst_requests]:
            r.abort()
        while engine.has_work:
            step()
    ttft = sorted((times[r.request_id][0] - started) * 1e3 for r in burst_requests)
    gaps = sorted((b - a) * 1e3 for r in background for a, b in zip(times[r.request_id], times[r.request_id][1:])
                  if started <= b <= ended)
    result = {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99)}
    if gaps:
        result.update(gap_p50_ms=percentile(gaps, 50), gap_p99_ms=percentile(gaps, 99))
    return result


def burst_main(args, device: torch.device, block_size: int) -> int:
    """`bench --burst N [--burst-decoding M]`: the burst figures, plain and DFlash, as one JSON object."""
    if args.burst < 1 or args.burst_decoding < 0:
        raise ValueError("--burst must be at least 1 and --burst-decoding at least 0")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if getattr(args, "layers", None) else {}))
    _, _, target, draft = build_models(shape, device, dtype, block_size)
    budget = getattr(args, "max_num_batched_tokens", None) or 2048
    results: dict[str, Any] = {"shape": args.shape, "arrivals": args.burst, "decoding": args.burst_decoding,
                               "prompt_len": args.prompt_len, "max_num_batched_tokens": budget}
    try:
        for name, drafter in (("plain", None), ("dflash", draft)):
            results[name] = burst(target, drafter, block_size, args.burst, args.burst_decoding, args.prompt_len,
                                  args.max_tokens, args.accept_len, budget)
    except EngineFailed as exc:
        print(f"blockspec bench: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, int(-(-len(values) * q // 100)) - 1))] if values else float("nan")


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
    if getattr(args, "multi_turn", None):
        return report(multi_turn_main, args)
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
    ENGINE_OPTIONS.clear()
    ENGINE_OPTIONS.update({name: getattr(args, name) for name in MEMORY_OPTIONS if getattr(args, name, None) is not None})
    if getattr(args, "tensor_parallel_size", 1) > 1:   # plain / DFlash / DFlash 2 over N ranks (distributed/bench.py)
        from blockspec.distributed import bench as tp_bench
        return report(lambda args: tp_bench.run(args, args.tensor_parallel_size), args)
    if getattr(args, "burst", None):
        return burst_main(args, device, block_sizes[0])
    if getattr(args, "compare_speculation", False):
        try:
            return main_compare_speculation(args, device, concurrency, block_sizes[0])
        except EngineFailed as exc:
            print(f"blockspec bench: error: {exc}", file=sys.stderr)
            return 1
    return report(lambda args: run(args.shape, device, args.vs, concurrency, args.accept_len, args.prompt_len,
                                   args.max_tokens, block_sizes, dflash2=not getattr(args, "no_dflash2", False),
                                   layers=getattr(args, "layers", None), breakdown=getattr(args, "breakdown", False)),
                  args)


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


def report(measure: Callable[[Any], dict[str, Any]], args) -> int:
    """Run one bench mode, print its table, write --out."""
    try:
        results = measure(args)
    except EngineFailed as exc:
        print(f"blockspec bench: error: {exc}", file=sys.stderr)
        return 1
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(r: dict[str, Any]) -> None:
    width = max(len(k) for k in r)
    for key, value in r.items():
        text = json.dumps(value) if isinstance(value, (dict, list)) else (f"{value:.4g}" if isinstance(value, float) else str(value))
        print(f"{key:<{width}}  {text}")


# ---- adaptive speculation (issue 21): plain / fixed block / adaptive, side by side ---------------

LATENT_CHUNK = 1024


class LatentProfile:
    """`--accept-profile latent:MEAN[:CONCENTRATION]`: an acceptance model for random weights in
    which the draft's reported confidence is informative, seeded and the same for every mode.

    Each output position j of request r has a latent acceptance probability π_{r,j} ~
    Beta(m·κ, (1 − m)·κ) and a uniform u_{r,j} (both drawn from a generator seeded by
    (seed, r)). The draft reports confidence π for the token it drafts at position j, and that
    draft is accepted iff u < π (so P(accept | confidence c) = c exactly; the engine still
    calibrates it online). A verify of d_1 … d_k at positions j+1 … j+k accepts the prefix up
    to the first failure, capped at k. m is solved so that verifying the whole block of T gives
    mean acceptance length MEAN: 1 + Σ_{i<T} m^i = MEAN (the positions are independent). κ
    (default 1) sets how spread the difficulties are: small κ, most positions near-certain
    and a few near-hopeless (what confidence can find); large κ, every position ≈ m (nothing
    to find: adaptive can then only choose between the whole block and none).
    The same position has the same π and u whichever cycle drafts it, so plain, fixed and
    adaptive runs see the same text difficulty."""

    def __init__(self, mean_length: float, block_size: int, concentration: float = 1.0, seed: int = 0) -> None:
        if not 1.0 <= mean_length <= block_size:
            raise ValueError(f"the latent profile's mean acceptance length must be in [1, {block_size}]")
        if concentration <= 0:
            raise ValueError("the latent profile's concentration must be positive")
        self.mean_length, self.block_size, self.concentration, self.seed = mean_length, block_size, concentration, seed
        self.m = solve_mean_probability(mean_length, block_size)
        self._latents: dict[str, tuple[list[float], list[float]]] = {}

    def latents(self, request, length: int) -> tuple[list[float], list[float]]:
        """(π, u) of the request's output positions 0 … length − 1 (at least), drawn in chunks of
        LATENT_CHUNK positions, each from its own seeded generator: any length gives the same
        values at the same positions."""
        key = request.request_id
        pi, u = self._latents.setdefault(key, ([], []))
        a, b = max(self.m * self.concentration, 1e-3), max((1 - self.m) * self.concentration, 1e-3)
        while len(pi) < length:
            chunk = len(pi) // LATENT_CHUNK
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}:{chunk}".encode()))   # stable
            gamma_a = torch._standard_gamma(torch.full((LATENT_CHUNK,), a, dtype=torch.float64), generator=gen)
            gamma_b = torch._standard_gamma(torch.full((LATENT_CHUNK,), b, dtype=torch.float64), generator=gen)
            pi += (gamma_a / (gamma_a + gamma_b).clamp_min(1e-300)).tolist()
            u += torch.rand(LATENT_CHUNK, generator=gen, dtype=torch.float64).tolist()
        return pi, u

    def positions(self, seq, num_slots: int) -> list[int]:
        """Output positions of draft slots 1 … L of this cycle (the anchor is output position
        num_cached − prompt_len; drafts follow it)."""
        start = seq.num_cached - len(seq.request.prompt_ids) + 1
        return list(range(start, start + num_slots))

    def propose(self, real: Callable):
        def propose(out, seqs, confidence: bool = False):
            proposal = real(out, seqs, confidence)
            num_slots = proposal.drafts.shape[1]
            rows = []
            for seq in seqs:
                pi, _ = self.latents(seq.request, seq.request.max_model_len + self.block_size + 1)
                rows.append([pi[j] for j in self.positions(seq, num_slots)])
            proposal.confidence = torch.tensor(rows, dtype=torch.float64)
            return proposal
        return propose

    def accept(self, real: Callable):
        def accept(seqs, proposal, logits, processed=None, widths=None):
            num_accepted, new_tokens = real(seqs, proposal, logits, processed, widths)   # the same host work
            if proposal is None:
                return num_accepted, new_tokens
            target_ids = logits.argmax(-1).tolist()
            num_slots = proposal.drafts.shape[1]
            for b, seq in enumerate(seqs):
                k = num_slots if widths is None else widths[b]
                pi, u = self.latents(seq.request, seq.request.max_model_len + self.block_size + 1)
                a = 0
                for j in self.positions(seq, k):
                    if u[j] >= pi[j]:
                        break
                    a += 1
                num_accepted[b], new_tokens[b] = a, target_ids[b][: a + 1]
            return num_accepted, new_tokens
        return accept


def solve_mean_probability(mean_length: float, block_size: int) -> float:
    """m with 1 + Σ_{i=1}^{T−1} m^i = mean_length (bisection; the sum grows with m)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        if 1 + sum(mid ** i for i in range(1, block_size)) < mean_length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def parse_accept_profile(text: str | None, block_size: int) -> LatentProfile | None:
    """`latent:MEAN[:CONCENTRATION]` → a LatentProfile; None → none."""
    if text is None:
        return None
    parts = text.split(":")
    if parts[0] != "latent" or len(parts) not in (2, 3):
        raise ValueError(f"--accept-profile must be latent:MEAN[:CONCENTRATION], not {text!r}")
    try:
        values = [float(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"--accept-profile must be latent:MEAN[:CONCENTRATION], not {text!r}") from None
    return LatentProfile(values[0], block_size, *values[1:])


def speculation_throughput(target, draft, block_size: int, concurrency: int, prompt_len: int, max_tokens: int,
                           speculation: str, accept_len: float | None = None,
                           profile: LatentProfile | None = None) -> dict[str, Any]:
    """throughput() for one speculation mode (fixed | adaptive; plain is draft=None), the
    acceptance forced (--accept-len) or following the latent profile; plus the mean width chosen."""
    config = EngineConfig(**{"max_model_len": prompt_len + max_tokens + 8, **ENGINE_OPTIONS},
                          block_size=block_size if draft else 1, max_num_seqs=concurrency, max_queue=concurrency,
                          max_prefill_tokens=prompt_len, speculation=speculation)
    engine = Engine(target, draft, config)
    patches = []
    if draft is not None and profile is not None:
        patches = [mock.patch.object(model_runner, "propose", profile.propose(model_runner.propose)),
                   mock.patch.object(model_runner, "accept", profile.accept(model_runner.accept))]
    elif draft is not None and accept_len is not None:
        patches = [mock.patch.object(model_runner, "accept", forced_accept(accept_len))]
    for patch in patches:
        patch.start()
    try:
        run_batch(engine, concurrency, prompt_len, 8)                                   # warm-up (+ cost table)
        engine.counters.spec_widths.clear()
        result = run_batch(engine, concurrency, prompt_len, max_tokens)
    finally:
        for patch in reversed(patches):
            patch.stop()
    widths = engine.counters.spec_widths
    cycles = sum(widths.values())
    result["mean_width"] = sum(k * n for k, n in widths.items()) / cycles if cycles else 0.0
    return result


def compare_speculation(shape_name: str, device: torch.device, concurrency: list[int], block_size: int,
                        prompt_len: int, max_tokens: int, accept_len: float | None,
                        profile: LatentProfile | None) -> dict[str, Any]:
    """`bench --compare-speculation`: plain, fixed block and adaptive tok/s at each concurrency,
    one process, one set of random weights (DFlash 1 draft)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, _, target, draft = build_models(SHAPES[shape_name], device, dtype, block_size)
    r: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                         "block_size": block_size, "prompt_len": prompt_len, "max_tokens": max_tokens,
                         "acceptance": f"latent m={profile.m:.4f} mean={profile.mean_length} "
                                       f"kappa={profile.concentration}" if profile else f"forced {accept_len}"}
    for c in concurrency:
        row = {"plain": speculation_throughput(target, None, 1, c, prompt_len, max_tokens, "fixed"),
               "fixed": speculation_throughput(target, draft, block_size, c, prompt_len, max_tokens, "fixed",
                                               accept_len, profile),
               "adaptive": speculation_throughput(target, draft, block_size, c, prompt_len, max_tokens, "adaptive",
                                                  accept_len, profile)}
        r[f"c{c}"] = speculation_row(row)
    return r


def speculation_row(row: dict[str, dict[str, Any]]) -> dict[str, float]:
    plain, fixed, adaptive = (row[k]["tok_s"] for k in ("plain", "fixed", "adaptive"))
    return {"plain_tok_s": round(plain, 1), "fixed_tok_s": round(fixed, 1), "adaptive_tok_s": round(adaptive, 1),
            "fixed_acceptance_length": round(row["fixed"]["mean_acceptance_length"], 3),
            "adaptive_acceptance_length": round(row["adaptive"]["mean_acceptance_length"], 3),
            "adaptive_mean_width": round(row["adaptive"].get("mean_width", 0.0), 2),
            "adaptive_over_plain": round(adaptive / plain, 3), "adaptive_over_fixed": round(adaptive / fixed, 3),
            "adaptive_over_best": round(adaptive / max(plain, fixed), 3)}


def print_speculation_table(r: dict[str, Any]) -> None:
    print(f"{r['shape']} on {r['device']}, block {r['block_size']}, acceptance {r['acceptance']}, "
          f"{r['max_tokens']} new tokens")
    print(f"{'conc':>5} {'plain':>9} {'fixed':>9} {'adaptive':>9} {'a/plain':>8} {'a/fixed':>8} {'a/best':>7} "
          f"{'width':>6}")
    for key, row in r.items():
        if key.startswith("c") and isinstance(row, dict):
            print(f"{key[1:]:>5} {row['plain_tok_s']:>9} {row['fixed_tok_s']:>9} {row['adaptive_tok_s']:>9} "
                  f"{row['adaptive_over_plain']:>8} {row['adaptive_over_fixed']:>8} {row['adaptive_over_best']:>7} "
                  f"{row['adaptive_mean_width']:>6}")


def main_compare_speculation(args, device: torch.device, concurrency: list[int], block_size: int) -> int:
    profile = parse_accept_profile(getattr(args, "accept_profile", None), block_size)
    if profile is None and args.accept_len is None:
        raise ValueError("--compare-speculation on random weights needs --accept-profile or --accept-len")
    result = compare_speculation(args.shape, device, concurrency, block_size, args.prompt_len, args.max_tokens,
                                 args.accept_len, profile)
    print_speculation_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0

# -- multi-turn: the prefix cache (`--multi-turn CxT`) ------------------------------------------

def parse_multi_turn(text: str) -> tuple[int, int]:
    """'32x6' → (32 conversations, 6 turns each)."""
    try:
        conversations, turns = (int(part) for part in text.lower().split("x"))
    except ValueError:
        conversations = turns = 0
    if conversations < 1 or turns < 1:
        raise ValueError(f"--multi-turn takes CONVERSATIONSxTURNS, e.g. 32x6, not {text!r}")
    return conversations, turns


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def multi_turn_run(target, draft, block_size: int, conversations: int, turns: int, system_tokens: int,
                   user_tokens: int, answer_tokens: int, accept_len: float | None, prefix_cache: bool,
                   state_slots: int, page_size: int = 16) -> dict[str, Any]:
    """`conversations` chats over one shared system prompt, all at once; each submits its next
    turn (history + answer + a new user message) as soon as its last one ends. Per turn: mean time
    to first token, prompt tokens, tokens served from the cache, and the reusable ones (the
    longest prefix, in whole pages short of the last position, that an answer finished before
    this turn was submitted had in common with it)."""
    max_len = system_tokens + turns * (user_tokens + answer_tokens) + 16
    # A pool of every conversation at full length (sized, not measured: several engines in a row).
    num_pages = conversations * -(-(max_len + block_size) // page_size) + 1
    config = EngineConfig(max_model_len=max_len, block_size=block_size if draft is not None else 1,
                          max_num_seqs=conversations, max_queue=conversations, page_size=page_size,
                          prefix_cache=prefix_cache, prefix_state_slots=state_slots, num_gpu_blocks=num_pages,
                          max_prefill_tokens=min(max_len, 8192), max_num_batched_tokens=min(max_len, 8192))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()                 # the last run's engine and its pools are gone
    engine = Engine(target, draft, config)
    gen = torch.Generator().manual_seed(1)
    words = lambda n: torch.randint(1000, 100000, (n,), generator=gen).tolist()     # noqa: E731
    system = words(system_tokens)
    histories: list[list[int]] = []                      # prompt + answer of every finished turn
    turn_of = [0] * conversations
    prompts = [system + words(user_tokens) for _ in range(conversations)]
    submitted: dict[str, tuple[int, int, float, int]] = {}     # request id → (conversation, turn, time, reusable)
    rows: dict[int, list[dict[str, float]]] = {t: [] for t in range(turns)}
    finished: list[tuple[int, Request]] = []
    errors: list[str] = []

    def submit(c: int) -> None:
        prompt = prompts[c]
        reusable = max((common_prefix(prompt, h) for h in histories), default=0)
        reusable = min(reusable, len(prompt) - 1) // page_size * page_size
        request = Request(f"mt-{c}-{turn_of[c]}", prompt, SamplingParams(max_tokens=answer_tokens, ignore_eos=True),
                          frozenset(), max_len)
        submitted[request.request_id] = (c, turn_of[c], time.perf_counter(), reusable)

        def on_event(event, request=request) -> None:
            if event.error is not None:
                errors.append(event.error)
            if event.finish_reason is not None:
                finished.append((c, request))
        engine.submit(request, on_event)

    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "accept", forced_accept(accept_len) if forcing else model_runner.accept):
        for c in range(conversations):
            submit(c)
        first_token: dict[str, float] = {}
        started = time.perf_counter()
        while submitted.keys() - {r.request_id for _, r in finished} or finished:
            engine.step()
            synchronize()
            now = time.perf_counter()
            if errors:
                raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")
            for seq in engine.scheduler.running:
                if seq.request.output_ids and seq.request_id not in first_token:
                    first_token[seq.request_id] = now
            while finished:
                c, request = finished.pop()
                _, turn, at, reusable = submitted.pop(request.request_id)
                rows[turn].append({"ttft_s": first_token.get(request.request_id, now) - at,
                                   "prompt_tokens": len(request.prompt_ids), "cached": request.stats.cached_tokens,
                                   "reusable": reusable, "output": len(request.output_ids)})
                histories.append(request.prompt_ids + request.output_ids)
                turn_of[c] += 1
                if turn_of[c] < turns:
                    prompts[c] = request.prompt_ids + request.output_ids + words(user_tokens)
                    submit(c)
        seconds = time.perf_counter() - started
    per_turn = [{"turn": t + 1, "ttft_ms": 1e3 * sum(r["ttft_s"] for r in rs) / len(rs),
                 "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                 "cached_tokens": sum(r["cached"] for r in rs) / len(rs),
                 "reusable_tokens": sum(r["reusable"] for r in rs) / len(rs)} for t, rs in rows.items()]
    cached = sum(r["cached"] for rs in rows.values() for r in rs)
    reusable = sum(r["reusable"] for rs in rows.values() for r in rs)
    prompt = sum(r["prompt_tokens"] for rs in rows.values() for r in rs)
    return {"per_turn": per_turn, "hit_rate_of_reusable": cached / reusable if reusable else None,
            "cached_of_prompt": cached / prompt, "seconds": seconds,
            "output_tok_s": sum(r["output"] for rs in rows.values() for r in rs) / seconds}


def multi_turn_main(args) -> dict[str, Any]:
    """The multi-turn figures with the prefix cache and with --no-prefix-cache side by side, and a
    workload with no reuse at all (distinct prompts) through both."""
    device = resolve_device(args.device)
    conversations, turns = parse_multi_turn(args.multi_turn)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_size = int(str(args.block_size).split(",")[0])
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    _, _, target, draft = build_models(shape, device, dtype, block_size)
    spec = draft if block_size > 1 else None
    slots = max(args.prefix_state_slots, 3 * conversations)
    common = dict(block_size=block_size, conversations=conversations, turns=turns,
                  system_tokens=args.system_prompt_tokens, user_tokens=args.user_tokens,
                  answer_tokens=args.max_tokens, accept_len=args.accept_len, state_slots=slots)
    r: dict[str, Any] = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "multi_turn": f"{conversations}x{turns}",
                         "system_prompt_tokens": args.system_prompt_tokens, "user_tokens": args.user_tokens,
                         "answer_tokens": args.max_tokens, "block_size": block_size, "prefix_state_slots": slots,
                         "forced_acceptance_length": args.accept_len}
    multi_turn_run(target, spec, **{**common, "conversations": 1, "turns": 1, "system_tokens": 64}, prefix_cache=True)
    on = multi_turn_run(target, spec, **common, prefix_cache=True)
    off = multi_turn_run(target, spec, **common, prefix_cache=False)
    r["prefix_cache"], r["no_prefix_cache"] = on, off
    r["ttft_ratio_per_turn"] = [a["ttft_ms"] / b["ttft_ms"] for a, b in zip(on["per_turn"], off["per_turn"])]
    distinct = dict(common, turns=1, system_tokens=0, user_tokens=args.system_prompt_tokens)
    no_reuse_on = multi_turn_run(target, spec, **distinct, prefix_cache=True)
    no_reuse_off = multi_turn_run(target, spec, **distinct, prefix_cache=False)
    r["no_reuse_tok_s"] = {"prefix_cache": no_reuse_on["output_tok_s"], "no_prefix_cache": no_reuse_off["output_tok_s"],
                           "ratio": no_reuse_on["output_tok_s"] / no_reuse_off["output_tok_s"]}
    r["snapshot_copy_ms"] = snapshot_copy_ms(target, device, dtype)
    return r


def snapshot_copy_ms(target, device: torch.device, dtype: torch.dtype) -> dict[str, float] | None:
    """Milliseconds to copy one recurrent-state slot (every GDN layer's conv window and SSM
    state): what a hybrid snapshot costs to take or restore."""
    from blockspec.cache import StatePool
    if not target.recurrent_shapes:
        return None
    pool = StatePool(3, target.recurrent_shapes, dtype, device)
    return {"ms": timed(lambda: pool.copy(1, 2)), "bytes": pool.slot_bytes}
