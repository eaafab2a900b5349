"""The kernel warm-up: every variant of our Triton kernels that a step of this engine can choose,
compiled (and launched once) before the first request.

Triton compiles a kernel per value of its constexprs (and per divisibility / alignment of the
arguments it specialises on; the kernels list the batch-varying ones in do_not_specialize, so
their constexprs alone tell variants apart). Which variant a call runs is a pure function of
its shapes, defined once per kernel family and used by the kernel's own wrapper:
`kernels.attention.attention_variant` (BLOCK_M from the longest query, the split-K count from
the programs and the key bound), `kernels.gdn.step_variant` (fused norm, BLOCK_V). This module
names, for the engine's config, the calls each path can make — FULL graphs (the bucket's fixed
shapes), PIECEWISE / eager mixer cores (host lengths: any query length up to a chunk, any number
of sequences, any live length up to a sequence's pages), the draft — takes the set of variants
those give, and runs each once on padding (page 0, state slot 0: nobody's memory; a few rows of
scratch, far inside the pool sizing's headroom). Shape-stable kernels (the fused norms / RoPE,
MoE, FP8 linears, the logits stage) take only bucket shapes under graphs, and the graph warm-up
(engine/model_runner.py `warm_up`) runs every bucket; fla's chunk kernels (the prefill cores)
get one varlen batch whatever the prompts (models/gated_delta.py `make_fla_chunk`), and their
one row-keyed autotune (l2norm's row blocks) is swept by the PIECEWISE warm-up's buckets.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from blockspec.engine.memory import StageCost
from blockspec.layers.attention import Attention, uses_kernels
from blockspec.models.dflash import DraftAttention

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine
    from blockspec.engine.model_runner import ModelRunner
    from blockspec.kernels.attention import AttentionVariant, CallShapes
    from blockspec.kernels.gdn import StepVariant
    from blockspec.models.qwen3_5 import GatedDeltaNet

logger = logging.getLogger("blockspec.engine")


@dataclass(frozen=True)
class AttentionSite:
    """The attention layers of one kind (target, draft by causality) and every call they can make."""
    name: str
    layer: Attention                             # one of them (its pool, heads, dtype)
    is_causal: bool
    has_block: bool
    shapes: tuple[CallShapes, ...]


@dataclass
class KernelPlan:
    """What the warm-up runs: per attention site its variants, per GDN layer shape its variants."""
    attention: list[tuple[AttentionSite, set[AttentionVariant]]] = field(default_factory=list)
    gdn: list[tuple[GatedDeltaNet, set[StepVariant]]] = field(default_factory=list)
    # The target's layers whose long prefill chunks take kernels/prefill_attention.py (one stands
    # for all: its heads and dtype fix the variants).
    prefill: list[Attention] = field(default_factory=list)

    @property
    def num_variants(self) -> int:
        return (sum(len(v) for _, v in self.attention) + sum(len(v) for _, v in self.gdn)
                + PREFILL_VARIANTS * len(self.prefill))

    def describe(self) -> str:
        parts = [f"attention {site.name} {len(v)}" for site, v in self.attention]
        parts += [f"Gated DeltaNet step {len(v)}" for _, v in self.gdn]
        parts += [f"prefill attention {PREFILL_VARIANTS}" for _ in self.prefill]
        return ", ".join(parts) or "none"


PREFILL_VARIANTS = 8            # kernels/prefill_attention.py warm_up's launches


def key_bounds(runner: ModelRunner) -> tuple[tuple[int, int], tuple[int, int]]:
    """(keys of a FULL graph's calls, keys of an eager call): the pool's capacity per sequence
    (or the reference's key buckets up to it), and any live length up to it."""
    graphs, capacity = runner.graphs, runner.config.pages_per_seq * runner.page_size
    full = (graphs.keys(1), capacity) if graphs.bucket_keys else (capacity, capacity)
    return full, (1, capacity)


def target_calls(runner: ModelRunner) -> list[CallShapes]:
    """The target's attention calls: FULL graphs' decode / verify rows (max_rows = the block) in
    each bucket's sequence slots; PIECEWISE / eager mixer calls of any ragged step."""
    from blockspec.kernels.attention import CallShapes
    config, graphs = runner.config, runner.graphs
    full_keys, live_keys = key_bounds(runner)
    longest = max(runner.width, min(config.max_num_batched_tokens, config.max_prefill_tokens, config.max_model_len))
    calls = [CallShapes((1, longest), tuple(range(1, config.max_num_seqs + 1)), live_keys)]
    if graphs.padded:
        slots = tuple(sorted({graphs.seq_slots(tokens) for tokens in graphs.full_tokens}))
        calls.append(CallShapes((runner.width, runner.width), slots, full_keys))
    return calls


def draft_calls(runner: ModelRunner) -> list[CallShapes]:
    """The draft's: blocks of each of its widths (the full one; adaptive's narrower ones), per
    sequence bucket under a graph, else any count."""
    from blockspec.kernels.attention import CallShapes
    graphs = runner.graphs
    full_keys, live_keys = key_bounds(runner)
    if graphs.padded:
        return [CallShapes((w, w), tuple(graphs.draft_sizes), full_keys) for w in graphs.draft_widths]
    return [CallShapes((w, w), tuple(range(1, graphs.max_draft_seqs + 1)), (w, live_keys[1]))
            for w in graphs.draft_widths]


def attention_sites(runner: ModelRunner) -> list[AttentionSite]:
    """The target's layers (causal, keys from the pool), the draft's by causality (with their
    block's own keys); sliding-window layers run the reference."""
    target_layer = next((m for m in runner.target.modules() if isinstance(m, Attention)), None)
    sites = [AttentionSite("target", target_layer, True, False, tuple(target_calls(runner)))] if target_layer else []
    if runner.draft is not None:
        layers = [m for m in runner.draft.modules() if isinstance(m, DraftAttention) and m.window is None]
        for causal in sorted({layer.is_causal for layer in layers}):
            layer = next(m for m in layers if m.is_causal == causal)
            name = "draft (causal)" if causal else "draft"
            sites.append(AttentionSite(name, layer, causal, True, tuple(draft_calls(runner))))
    return sites


def decode_group_calls(runner: ModelRunner) -> list[tuple[int, int]]:
    """(rows, sequences) of every decode / verify group the GDN step kernel can take: a FULL
    graph's bucket, or B sequences of 1 … block rows each in a PIECEWISE / eager step. The
    variant depends on the rows only through the fused-norm threshold, so each B takes its
    range's ends and the rows either side of that threshold."""
    graphs = runner.graphs
    calls = [(tokens, graphs.seq_slots(tokens)) for tokens in graphs.full_tokens] if graphs.padded else []
    return calls + ragged_group_calls(runner, runner.width)


def ragged_group_calls(runner: ModelRunner, width: int) -> list[tuple[int, int]]:
    """(rows, sequences) of B sequences of 1 … width rows each, for every B a step can hold: a
    decode / verify group (width: the block) or a group of short prefill chunks (width:
    gated_delta.SHORT_PREFILL_ROWS)."""
    from blockspec.models.gated_delta import FUSE_NORM_MAX_ROWS
    config, calls = runner.config, []
    for seqs in range(1, config.max_num_seqs + 1):
        lo, hi = seqs, min(seqs * width, config.max_num_batched_tokens)
        if lo > hi:
            break
        for rows in {lo, hi, FUSE_NORM_MAX_ROWS, FUSE_NORM_MAX_ROWS + 1}:
            if lo <= rows <= hi:
                calls.append((rows, seqs))
    return calls


def gdn_layers(runner: ModelRunner) -> list[GatedDeltaNet]:
    """One Gated DeltaNet layer per distinct state shape (the kernels' constexprs)."""
    from blockspec.models.qwen3_5 import GatedDeltaNet
    seen, layers = set(), []
    for module in runner.target.modules():
        if isinstance(module, GatedDeltaNet) and module.state_shape not in seen:
            seen.add(module.state_shape)
            layers.append(module)
    return layers


def kernel_plan(runner: ModelRunner, kernels: bool | None = None) -> KernelPlan:
    """The variants this runner's steps can choose. kernels: whether the Triton kernels serve
    (default: whether they do on the runner's device; the interpreter tests force it on CPU)."""
    from blockspec.kernels.attention import attention_variants, heads_of, num_sms
    from blockspec.models.gated_delta import (SHORT_PREFILL_ROWS, prefill_kernel_serves, step_kernel_serves,
                                              step_variants)
    on_device = uses_kernels(runner.device) if kernels is None else kernels
    plan = KernelPlan()
    if not on_device:
        return plan
    sms = num_sms(runner.device)
    for site in attention_sites(runner):
        heads = heads_of(scratch_q(site, runner), site_pools(site, runner)[0])
        variants = set().union(*(attention_variants(heads, shapes, sms) for shapes in site.shapes))
        plan.attention.append((site, variants))
        if site.name == "target" and routes_long_prefills(scratch_q(site, runner)):
            plan.prefill.append(site.layer)
    if runner.is_hybrid:
        decode = step_kernel_serves(runner.dtype, runner.width)
        prefill = prefill_kernel_serves(runner.dtype, 1)
        calls = decode_group_calls(runner) if decode else []
        prefill_calls = ragged_group_calls(runner, SHORT_PREFILL_ROWS) if prefill else []
        keep = runner.draft is not None
        for layer in gdn_layers(runner):
            variants = step_variants(layer, calls, keep) | step_variants(layer, prefill_calls, False)
            if variants:
                plan.gdn.append((layer, variants))
    return plan


def routes_long_prefills(q: torch.Tensor) -> bool:
    """Whether the target's long prefill chunks take our Triton FlashAttention kernel
    (kernels/flash_prefill.py; FlashAttention-2, its fallback, compiles nothing at run time)."""
    from blockspec.kernels import flash_prefill
    return flash_prefill.enabled() and flash_prefill.supports(q) and flash_prefill.triton_fa_serves(q)


def site_pools(site: AttentionSite, runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    pools = runner.draft_kv if site.has_block else runner.target_kv
    return pools.layers[site.layer.cache_index]


def scratch_q(site: AttentionSite, runner: ModelRunner) -> torch.Tensor:
    layer = site.layer
    return torch.zeros(1, layer.num_heads, layer.head_dim, dtype=runner.dtype, device=runner.device)


@torch.inference_mode()
def run_plan(runner: ModelRunner, plan: KernelPlan) -> None:
    """Each planned variant once (see the module doc), with a progress bar on a terminal."""
    from tqdm import tqdm
    from blockspec.kernels import attention as attention_kernels
    from blockspec.models.gated_delta import warm_step
    if plan.prefill:
        from blockspec.kernels import prefill_attention
    bar = tqdm(total=plan.num_variants, desc="warming kernels", unit="variant", disable=not sys.stderr.isatty())
    for site, variants in plan.attention:
        k_pool, v_pool = site_pools(site, runner)
        q = scratch_q(site, runner)
        block_kv = None
        if site.has_block:
            block_kv = tuple(torch.zeros(1, k_pool.shape[1], k_pool.shape[2], dtype=runner.dtype, device=runner.device)
                             for _ in range(2))
        attention_kernels.warm_up(variants, q, k_pool, v_pool, site.is_causal, block_kv)
        bar.update(len(variants))
    for layer, variants in plan.gdn:
        warm_step(layer, runner.states, variants, runner.dtype)
        bar.update(len(variants))
    for layer in plan.prefill:
        k_pool = runner.target_kv.layers[layer.cache_index][0]
        bar.update(prefill_attention.warm_up(layer.num_heads, k_pool.shape[1], layer.head_dim, runner.dtype,
                                             runner.device))
    bar.close()
    if runner.is_hybrid:
        runner.states.clear([0])                 # the GDN variants ran on the padding slot


def warm_kernels(runner: ModelRunner) -> KernelPlan:
    """Plan and run the warm-up; its time and the memory it kept in the startup log."""
    cost = StageCost(runner.device)
    plan = kernel_plan(runner)
    if not plan.num_variants:
        return plan
    run_plan(runner, plan)
    logger.info(f"blockspec: warmed {plan.num_variants} kernel variants in {cost.done()} ({plan.describe()})")
    return plan


# -- the request path ------------------------------------------------------------------------------

WARM_PROMPTS = (5, 23)              # prompt lengths of the warm-up requests
# Sampling ones seeded: the warm-up draws nothing from the global generators.
WARM_SAMPLING = ({}, {"temperature": 1.0, "top_p": 0.9, "seed": 2}, {"temperature": 0.7, "top_k": 20, "seed": 1},
                 {"repetition_penalty": 1.1})                  # the last one also with logprobs


def warm_requests(engine: Engine, vocab_size: int) -> str:
    """A few requests through the whole engine before the first real one (the server's startup,
    on CUDA): prefill, first tokens, decode / verify steps and the host work around them, greedy
    and sampled, with penalties and logprobs, so what only runs there on first use (CUDA's lazy
    module loading of torch's own kernels, first-call caches) is paid now — a first burst of
    requests then meets a warm engine. Afterwards nothing of them remains: no K/V or prefix-cache
    entry, no counter, nothing the speculation policy learnt. Returns the stage's 'time, memory'."""
    from blockspec.engine.engine import EngineCounters, QueueFullError
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    cost = StageCost(engine.runner.device)
    gen = torch.Generator().manual_seed(0)
    limit = engine.config.max_model_len
    requests = []
    for i, params in enumerate(WARM_SAMPLING):
        length = min(WARM_PROMPTS[i % len(WARM_PROMPTS)], max(1, limit - engine.runner.width - 4))
        prompt = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
        requests.append(Request(f"warm-{i}", prompt, SamplingParams(max_tokens=2 * engine.runner.width + 2, **params),
                                frozenset(), limit))
    requests[-1].num_logprobs = 2
    errors: list[str] = []

    def on_event(event) -> None:
        if event.error is not None:
            errors.append(event.error)
    for request in requests:
        while True:
            try:
                engine.submit(request, on_event)
                break
            except QueueFullError:                     # a queue shorter than the warm-up: make room
                engine.step()
    while engine.has_work:
        engine.step()
    failed = [r for r in requests if r.finish_reason not in ("length", "stop")]
    if failed:                                         # the port must not open on an engine that fails
        raise RuntimeError(f"a warm-up request ended with {failed[0].finish_reason!r}"
                           + (f": {errors[0]}" if errors else ""))
    engine.runner.learn()                              # what the last steps deferred, then forgotten
    engine.runner.speculation.reset()
    engine.counters = EngineCounters()
    prefix = getattr(engine.cache, "prefix", None)
    if prefix is not None:
        prefix.clear()
        prefix.queries = prefix.hits = 0
    return cost.done()
