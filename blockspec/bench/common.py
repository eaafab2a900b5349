"""What every bench mode shares: the shapes, building random-weight models of them, timing on the
device, running a batch through the engine and forcing its acceptance length, writing the results."""
from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any, Callable

import torch

from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.layers.moe import SparseMoE
from blockspec.loader import build_empty
from blockspec.models.dflash import DFlashDraftModel, DraftConfig, default_target_layer_ids
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.models.registry import ARCHITECTURES
from blockspec.sampling import SamplingParams, device_longs


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=256,
                 intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, rope_theta=1e6, max_position_embeddings=40960, draft_layers=2),
    # Host costs (scripts/host_split.py on CPU): a model whose own compute is small next to the
    # engine's per-sequence host work at 64-256 sequences (vocabulary small: a verify's logits are
    # rows × vocab).
    "host": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, rope_theta=1e6, max_position_embeddings=40960, draft_layers=1, mask_token_id=511),
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


def device_time_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """Mean microseconds of fn() back to back on the CUDA stream, timed by events (one warm call
    first): the kernels' time where the host keeps ahead, its launch time where it does not."""
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / reps


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
    target_cfg = {k: v for k, v in shape.items() if k not in ("draft_layers", "draft", "mask_token_id")}
    layer_ids = default_target_layer_ids(target_cfg["num_hidden_layers"], shape["draft_layers"])
    same_as_target = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "rope_theta", "max_position_embeddings")
    draft_cfg = {**{k: target_cfg[k] for k in same_as_target if k in target_cfg}, **shape.get("draft", {}),
                 "model_type": "qwen3", "num_hidden_layers": shape["draft_layers"], "block_size": block_size,
                 "dflash_config": {"mask_token_id": shape.get("mask_token_id", 151669), "target_layer_ids": layer_ids}}
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


def forced_accept(accept_len: float):
    """A judge() that keeps accept_len tokens per verify on average (floor and ceil mixed), for
    random weights whose drafts are never right: the counts are set on the device, so what reads
    them there (an early draft's anchors, engine/model_runner.py) sees the forced verdict too.
    It patches model_runner.judge; a sampling sequence that verifies drafts keeps the rejection
    rule's own verdict."""
    credit = [0.0]

    def judge(seqs, proposal, logits, processed=None, num_drafts=None):
        verdict = real_judge(seqs, proposal, logits, processed, num_drafts)
        limits = num_drafts or [logits.shape[1] - 1] * len(seqs)
        accepted = []
        for b in range(len(seqs)):
            credit[0] += accept_len
            kept = max(1, min(int(credit[0]), limits[b] + 1))
            credit[0] -= kept
            accepted.append(kept - 1)
        verdict.accepted = device_longs(accepted, logits.device).view(-1, 1)
        return verdict
    real_judge = model_runner.judge
    return judge


# The engine options given to `bench` (--max-model-len, --gpu-memory-utilization, --num-gpu-blocks,
# --max-num-batched-tokens, --kv-cache-memory): main() sets them, every engine the bench builds uses them.
ENGINE_OPTIONS: dict[str, Any] = {}


MEMORY_OPTIONS = ("max_model_len", "gpu_memory_utilization", "num_gpu_blocks", "max_num_batched_tokens",
                  "kv_cache_memory")


def bench_engine(target, draft, block_size: int, max_seqs: int, prompt_len: int, max_tokens: int,
                 speculation: str = "fixed") -> Engine:
    """One engine for a sweep: seats for its largest concurrency, so every concurrency of the sweep
    runs on the graphs captured once (a capture costs seconds per bucket; an engine per point made a
    sweep of 256 sequences outlast its device call). speculation "fixed": the whole block
    (--compare-speculation measures adaptive). Prompt tokens per step: serve's default, or one
    whole prompt where that is longer (until round 46 one prompt a step: a closed loop's 256
    replacements then entered one per step, and nearly every step at 256 sequences was a mixed
    one, off the decode graphs, for plain and DFlash alike)."""
    prefill = max(prompt_len, EngineConfig.max_prefill_tokens)
    config = EngineConfig(**{"max_model_len": prompt_len + max_tokens + 8, "max_prefill_tokens": prefill,
                             **ENGINE_OPTIONS},
                          block_size=block_size if draft else 1, max_num_seqs=max_seqs, max_queue=max_seqs,
                          speculation=speculation)
    return Engine(target, draft, config)


def release() -> None:
    """Free a finished engine's pool and graphs before the next one sizes its pool from memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, int(-(-len(values) * q // 100)) - 1))] if values else float("nan")


class EngineFailed(RuntimeError):
    """A bench request ended with an error: the figures would be of a broken run."""


def run_batch(engine: Engine, concurrency: int, prompt_len: int, max_tokens: int, rounds: int = 1) -> dict[str, float]:
    """Output tok/s and ms per step of `concurrency` requests decoded together, measured after
    every one has its first token (decode alone). rounds > 1: closed loop, as a serving load of
    `concurrency` clients: each request that ends is replaced by a new one until rounds ×
    concurrency were sent, and the window closes at the first end that nobody replaces, so no
    drain is measured: a batch's tail (its slowest requests finishing alone) says nothing of the
    throughput at that load, and it is where a policy that narrows the slow requests' blocks
    would be judged on the wrong thing. The replacements' prefills run inside the window."""
    gen = torch.Generator().manual_seed(0)
    total = concurrency * max(1, rounds)
    high = min(100000, engine.runner.target.lm_head.out_features)      # a small vocabulary's ids
    requests = [Request(f"bench-{i}", torch.randint(min(1000, high // 2), high, (prompt_len,), generator=gen).tolist(),
                        SamplingParams(max_tokens=max_tokens), frozenset(), engine.config.max_model_len)
                for i in range(total)]
    errors: list[str] = []

    def on_event(event) -> None:
        if event.error is not None:
            errors.append(event.error)

    def step() -> None:
        engine.step()
        if errors:               # a failed request never gets its tokens: stop, do not spin
            raise EngineFailed(f"a bench request failed in the engine: {errors[0]}")

    sent = requests[:concurrency]
    for request in sent:
        engine.submit(request, on_event)
    while not all(r.output_ids or r.is_finished for r in sent):
        step()                                          # prefill everyone first: decode is measured alone
    synchronize()
    started = time.perf_counter()
    tokens_before = sum(len(r.output_ids) for r in sent)
    batch_cycles, closes = 0, (total - concurrency if rounds > 1 else total - 1)
    while True:
        step()
        batch_cycles += 1
        finished = sum(r.is_finished for r in sent)
        if finished > closes:
            break
        for request in requests[len(sent): len(sent) + finished - (len(sent) - concurrency)]:
            engine.submit(request, on_event)
            sent.append(request)
    synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in sent) - tokens_before
    if not any(len(r.output_ids) > 1 for r in sent):     # none decoded past its first token: nothing timed
        ends = sorted({f"{r.finish_reason} after {len(r.output_ids)} of {max_tokens} tokens" for r in sent
                       if r.is_finished})
        cut = any(r.finish_reason == "length" and len(r.output_ids) < max_tokens for r in sent)
        raise EngineFailed(f"the bench's requests decoded nothing after their prefill ({'; '.join(ends)}): " + (
            f"a {prompt_len}-token prompt and {max_tokens} new tokens do not fit this engine's "
            f"{engine.config.max_model_len}-token context (lower --prompt-len or --max-tokens, or give the pool "
            "more memory)" if cut else "a decode window needs --max-tokens of 2 or more"))
    while not all(r.is_finished for r in sent):
        step()                                          # the rest drains, unmeasured
    per_seq = [r.stats for r in sent]
    return {"tok_s": tokens / seconds, "ms_per_cycle": seconds * 1e3 / max(1, batch_cycles),
            "mean_acceptance_length": sum(s.mean_acceptance_length for s in per_seq) / len(per_seq)}


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
