"""The graph dispatcher: which graph serves a step, chosen from its batch descriptor.

The host launches kernels far slower than an H200 runs them (an eager Qwen3-8B forward is ~400
launches, tens of milliseconds of Python), so every forward a step can make replays a CUDA graph
captured at startup. A step is described by its padded shape (`BatchDescriptor`: tokens,
sequences, whether it carries prefill chunks) and served by one of three modes:

- FULL: a step of decode and verify rows only, of any ragged mix of widths 1 … block. One graph
  per token bucket, with min(tokens, max_num_seqs) sequence slots. The attention and Gated
  DeltaNet step kernels read query_start on the device, so their grids are sized for the bucket
  (max_rows = the block) and programs past a sequence's rows exit; padding sequences have no
  rows, padding tokens belong to no sequence, store their K/V in page 0 (nobody's) and come out
  of every token mixer zero (layers/attention.py: padding_zeroed). The host knows no lengths
  under it (AttentionMetadata.bounded). The draft's propose over the drafting sequences' blocks
  is FULL too, one graph per sequence bucket.
- PIECEWISE: a step with prefill chunks, up to max_num_batched_tokens tokens. Everything between
  the token mixers' cores (attention, Gated DeltaNet: `layers.attention.mixer`) is captured per
  token bucket; those cores run eagerly between the pieces, on the step's own metadata (host
  lengths, chunked kernels), from and into the pieces' static tensors.
- EAGER: beyond the buckets (or graphs off): exact shapes, no padding.

Graphs read static buffers: a FULL graph one packed metadata tensor (one host→device copy per
forward fills it), a PIECEWISE graph the step's token rows (ids, positions, slots, rotary
positions). A sequence with images is no different once its rows meet no image (engine/
multimodal.py: its rotary positions are its positions + a per-sequence offset in the packed
metadata); a step with a prefill chunk reaching image rows runs eagerly (the model_runner's
forward). With capture=False the same padded shapes run eagerly: CPU tests hold that path to
the eager one, and a replay adds nothing to it but the replay. padded=False: every step eager,
exact shapes.

The torch reference attention (CPU, BLOCKSPEC_ATTENTION=reference, a sliding-window draft layer)
gathers a fixed number of keys per sequence, so with it FULL graphs are also keyed by a key
bucket (the live length rounded up to a power of two, at least MIN_KEYS) and captured on first
use; the Triton kernels read each live length on the device, and one graph serves every length.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from blockspec.engine.spec.dflash import DraftReadout
from blockspec.layers import AttentionMetadata
from blockspec.layers.attention import TOKEN_ROWS, padding_zeroed, unpack

MIN_KEYS = 256
FULL, PIECEWISE, EAGER = "full", "piecewise", "eager"
# A hybrid target's verify stashes the recurrent state after every row (2 MiB a row and layer at
# Qwen3.5's shapes) into one space all its FULL graphs share: its FULL graphs stop at this many
# tokens, with ⌈tokens / block⌉ sequence slots; larger decode steps take the PIECEWISE graphs.
STASHING_FULL_TOKENS = 256


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector off while a graph is captured: a collection there runs the
    destructors of whatever it frees (an earlier engine's graphs and streams, found in a cycle),
    and a CUDA call they make invalidates the capture (tests/gpu, round 56: a draft graph's
    capture failed in the second engine of a process, and every capture after it). Cyclic garbage
    made meanwhile waits for the next collection outside (what reference counting frees still goes
    at once: nothing the capture drops holds CUDA objects). Engine thread only: the switch is the
    process's."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def bucket(num: int, sizes: list[int]) -> int | None:
    """The smallest size ≥ num; None above the largest (the step runs eagerly)."""
    return next((size for size in sizes if size >= num), None)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Sequence buckets: 1, 2, 4, 8, multiples of 16, and max_num_seqs itself (the largest)."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(size, max_num_seqs) for size in sizes})


def token_buckets(max_tokens: int) -> list[int]:
    """Token buckets: 1, 2, 4, 8, multiples of 16 to 256 (where a forward's cost is flat), of 64
    to 1024, of 128 beyond, and max_tokens itself: past 256 tokens a padded step computes at most
    a quarter more rows than its own."""
    sizes = ([1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, 1024, 64))
             + list(range(1024, max_tokens + 128, 128)))
    return sorted({min(size, max_tokens) for size in sizes})


def narrower_widths(width: int) -> tuple[int, ...]:
    """Draft block widths below the full one that adaptive speculation may draft at: powers of
    two from 2 (an anchor and one draft). A step whose sequences verify at most k drafts denoises
    a block of the smallest such width ≥ k + 1 (policy.py), so the draft's rows shrink with k."""
    widths, w = [], 2
    while w < width:
        widths.append(w)
        w *= 2
    return tuple(widths)


@dataclass(frozen=True)
class BatchDescriptor:
    """A step's forward as a graph sees it: padded tokens and sequences, and whether it carries
    prefill chunks."""
    num_tokens: int
    num_seqs: int
    has_prefill: bool


@dataclass(frozen=True)
class Plan:
    """How one forward runs: its mode, its padded shape, and the shape of its metadata (block-table
    columns, the keys the reference gathers; bounded: lengths on the device only)."""
    mode: str
    desc: BatchDescriptor
    cols: int
    keys: int

    @property
    def bounded(self) -> bool:
        return self.mode == FULL


@dataclass
class FullGraph:
    """One FULL graph's static metadata (its packed buffer, filled by one copy per forward), the
    graph and its output. Every tensor a graph touches stays referenced here: a freed buffer
    would hand its memory to someone else while the graph still uses it."""
    meta: AttentionMetadata
    padding: torch.Tensor                    # the packed buffer of a batch with padding rows only
    graph: torch.cuda.CUDAGraph | None = None
    output: Any = None
    stashed: list | None = None              # recurrent per-step states the graph writes (verify)


class Pieces:
    """A PIECEWISE graph: graphs[i] runs the forward up to its i-th mixer call, calls[i] is that
    call (fn, its staged inputs, its static output), the last graph runs the rest. A call's
    inputs are copied (inside piece i) into scratch rows it alone reads, and its output goes to
    scratch rows the next piece alone reads, so every call of every piecewise graph shares them
    (one buffer per role and row shape): tensors of the graphs' own pool kept for the calls
    would be 36 layers × 40 buckets of them, gigabytes."""

    def __init__(self, pool, scratch: Callable[[tuple, torch.Tensor], torch.Tensor]) -> None:
        self.pool, self.scratch = pool, scratch
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[Callable, tuple[torch.Tensor, ...], torch.Tensor]] = []
        self.output: Any = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def call(self, fn: Callable, meta: AttentionMetadata, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """While capturing: the piece so far ends, fn runs eagerly (on inputs nothing has computed
        yet: its output only fixes a static tensor) and the next piece begins."""
        staged = tuple(self.scratch(("in", j), x).copy_(x) for j, x in enumerate(inputs))
        self.graphs[-1].capture_end()
        result = padding_zeroed(fn(dataclasses.replace(meta, pieces=None), *staged), meta, inputs[0].shape[0])
        out = self.scratch(("out",), result)
        out.copy_(result)
        self.calls.append((fn, staged, out))
        self.begin()
        return out

    def replay(self, meta: AttentionMetadata) -> Any:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.calls):
                fn, inputs, out = self.calls[i]
                out.copy_(padding_zeroed(fn(meta, *inputs), meta, inputs[0].shape[0]))
        return self.output


@dataclass
class PiecewiseGraph:
    tokens: torch.Tensor                     # [4 · N] static token rows (layers/attention.py: TOKEN_ROWS)
    pieces: Pieces | None = None


class GraphDispatcher:
    """Owns the buckets, the static buffers and the graphs of a runner's forwards; the runner
    builds metadata in the shape a Plan says and hands its forwards (fn(meta) → output) here."""

    def __init__(self, width: int, max_num_seqs: int, max_num_batched_tokens: int, pages_per_seq: int,
                 page_size: int, device: torch.device, capture: bool, padded: bool = True,
                 bucket_keys: bool = True, stashing: bool = False, draft_widths: tuple[int, ...] = ()) -> None:
        self.width, self.page_size, self.device = width, page_size, device
        # The draft's block widths: the full one, and the narrower ones adaptive drafts at.
        self.draft_widths = tuple(sorted({w for w in draft_widths if 1 < w < width} | {width}))
        self.pages_per_seq = pages_per_seq
        self.capture, self.padded, self.bucket_keys = capture, padded, bucket_keys
        self.max_num_seqs, self.stashing = max_num_seqs, stashing
        self.max_draft_seqs = max(1, min(max_num_seqs, max_num_batched_tokens // width))
        self.draft_sizes = capture_sizes(self.max_draft_seqs)
        max_full = min(max_num_seqs * width, max_num_batched_tokens)
        self.full_tokens = token_buckets(min(max_full, STASHING_FULL_TOKENS) if stashing else max_full)
        self.piecewise_tokens = token_buckets(max_num_batched_tokens)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.full: dict[tuple[str, BatchDescriptor, int], FullGraph] = {}
        self.piecewise: dict[int, PiecewiseGraph] = {}
        self.scratch: dict[tuple, torch.Tensor] = {}          # mixer calls' rows, by role and row shape
        self.costs: dict[str, dict[int, float]] | None = None
        # The runner's forward of one bucket on padding rows: probe(kind, size, width), kind
        # "verify" (size tokens, logits of every row) or "propose" (size blocks of width, the
        # full one when None); None without a draft.
        self.probe: Callable[[str, int, int | None], Any] | None = None
        self.has_draft = False

    # -- plans ------------------------------------------------------------------------------

    def plan(self, num_tokens: int, num_seqs: int, has_prefill: bool, live_keys: int, cols: int) -> Plan:
        """The target forward of a step: FULL for decode / verify rows within its token buckets,
        else PIECEWISE within the token budget (prefill chunks, or decode rows past the FULL
        buckets), else EAGER (exact shapes)."""
        if self.padded and not has_prefill:
            for tokens in self.full_tokens:
                if tokens >= num_tokens and self.seq_slots(tokens) >= num_seqs:
                    desc = BatchDescriptor(tokens, self.seq_slots(tokens), False)
                    return Plan(FULL, desc, self.pages_per_seq, self.keys(live_keys))
        if self.padded:
            tokens = bucket(num_tokens, self.piecewise_tokens)
            if tokens is not None:
                return Plan(PIECEWISE, BatchDescriptor(tokens, num_seqs, has_prefill), cols, live_keys)
        return Plan(EAGER, BatchDescriptor(num_tokens, num_seqs, has_prefill), cols, live_keys)

    def seq_slots(self, num_tokens: int) -> int:
        """Sequence slots of a FULL graph of num_tokens: one per token (any ragged mix of widths),
        or for a stashing target one per block (its stash space is slots × block rows)."""
        slots = -(-num_tokens // self.width) if self.stashing else num_tokens
        return min(slots, self.max_num_seqs)

    def plan_draft(self, num_seqs: int, live_keys: int, cols: int, width: int | None = None) -> Plan:
        """The draft's propose over num_seqs blocks of one width (the full one when not given):
        FULL per (sequence bucket, width); a descriptor's tokens ÷ sequences is its width."""
        width = self.width if width is None else width
        seqs = bucket(num_seqs, self.draft_sizes) if self.padded and width in self.draft_widths else None
        if seqs is None:
            return Plan(EAGER, BatchDescriptor(num_seqs * width, num_seqs, False), cols, live_keys)
        return Plan(FULL, BatchDescriptor(seqs * width, seqs, False), self.pages_per_seq, self.keys(live_keys))

    def keys(self, live_keys: int) -> int:
        """Keys per sequence the reference gathers under a graph: a power-of-two bucket of the live
        length, or the pool's capacity where the kernels read the live length themselves."""
        max_keys = self.pages_per_seq * self.page_size
        if not self.bucket_keys:
            return max_keys
        keys = MIN_KEYS
        while keys < live_keys:
            keys *= 2
        return min(keys, max_keys)

    # -- running ----------------------------------------------------------------------------

    def run(self, kind: str, plan: Plan, fn: Callable[[AttentionMetadata], Any], meta: AttentionMetadata,
            prepare: Callable[[AttentionMetadata], None]) -> Any:
        """fn(meta) as the plan says. kind names the forward ("verify", "propose"); prepare(m)
        fills what a graph derives on the device (positions, slots) from the copied metadata."""
        if plan.mode == FULL:
            return self.run_full(kind, plan, fn, meta, prepare)
        prepare(meta)
        if plan.mode == PIECEWISE:
            return self.run_piecewise(plan, fn, meta)
        return fn(meta)

    def run_full(self, kind: str, plan: Plan, fn: Callable, meta: AttentionMetadata,
                 prepare: Callable[[AttentionMetadata], None]) -> Any:
        key = (kind, plan.desc, plan.keys)
        static = self.full.get(key)
        if static is None:
            static = self.full[key] = self.make_full(meta)
        static.meta.packed.copy_(meta.packed)

        def graphed(m: AttentionMetadata) -> Any:
            # Everything a graph reads is made inside it: a tensor cached in m.shared by an
            # earlier warm-up or graph would be freed by the next forward while this graph
            # still reads it.
            m.shared.clear()
            prepare(m)
            return fn(m)
        if not self.capture:
            return graphed(static.meta)
        if static.graph is None:
            self.record_full(static, graphed)
        static.graph.replay()
        if static.stashed is not None:
            meta.states.stashed = list(static.stashed)
        return static.output

    def make_full(self, meta: AttentionMetadata) -> FullGraph:
        packed = torch.zeros_like(meta.packed)
        num_tokens, cols = meta.input_ids.shape[0], meta.block_tables.shape[1]
        views = unpack(packed, meta.num_seqs, num_tokens, cols)
        if meta.state_slots is None:
            views["state_slots"] = None
        static_meta = dataclasses.replace(meta, **views, packed=packed, shared={})
        # Padding only, every token at page 0 and state slot 0: no rows at all (a bounded batch),
        # or blocks of the width at positions 0 … T − 1 (the draft's uniform batch).
        padding = torch.zeros_like(packed)
        if meta.width:
            pad = unpack(padding, meta.num_seqs, num_tokens, cols)
            pad["positions"].copy_(torch.arange(meta.width, device=packed.device).repeat(meta.num_seqs))
            pad["slot_mapping"].copy_(pad["positions"] % meta.page_size)
            pad["query_start"].copy_(torch.arange(meta.num_seqs + 1, device=packed.device) * meta.width)
            pad["context_lens"].fill_(meta.width)
        return FullGraph(static_meta, padding)

    def record_full(self, static: FullGraph, fn: Callable) -> None:
        """Warm up and capture on padding-only inputs (touching nobody's pages or state), then put
        the batch back."""
        batch = static.meta.packed.clone()
        static.meta.packed.copy_(static.padding)
        states = static.meta.states
        earlier = list(states.stashed) if states is not None else None
        self.warm(lambda: fn(static.meta))
        if states is not None:                  # what this graph stashes, nothing of an earlier forward's
            states.stashed = [None] * len(states.stashed)
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool):
            static.output = fn(static.meta)
        static.graph = graph
        if states is not None and any(s is not None for s in states.stashed):
            static.stashed = list(states.stashed)
        elif states is not None:
            # A graph that stashes nothing (the draft's, captured on first use, possibly between a
            # verify and its rollback: an early draft) leaves the verify's stash as it found it.
            states.stashed = earlier
        static.meta.packed.copy_(batch)

    def run_piecewise(self, plan: Plan, fn: Callable, meta: AttentionMetadata) -> Any:
        num_tokens = plan.desc.num_tokens
        static = self.piecewise.get(num_tokens)
        if static is None or not self.capture:
            return fn(meta)                   # captured at startup only (capture_piecewise)
        static.tokens.copy_(meta.packed[: len(TOKEN_ROWS) * num_tokens])
        meta.shared.clear()
        return static.pieces.replay(meta)

    def capture_piecewise(self, num_tokens: int, fn: Callable, meta: AttentionMetadata) -> None:
        """Capture the pieces of fn on meta, a batch of num_tokens padding tokens of this bucket
        (its token rows become the graph's static inputs)."""
        static = PiecewiseGraph(meta.packed[: len(TOKEN_ROWS) * num_tokens])
        self.warm(lambda: fn(meta))
        pieces = Pieces(self.pool, self.scratch_rows)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        torch.cuda.synchronize(self.device)
        with collector_paused(), torch.cuda.stream(stream):
            pieces.begin()
            pieces.output = fn(dataclasses.replace(meta, pieces=pieces, shared={}))
            pieces.graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        static.pieces = pieces
        self.piecewise[num_tokens] = static

    def draft_output(self, out: Any) -> Any:
        """The draft's logits [B, W − 1, V] as a graph returns them: written into one buffer that
        every draft graph shares (a graph's output stays allocated for its lifetime, and one
        per (bucket, width) of a 150k vocabulary at 256 sequences summed to ~10 GiB on the
        H200). Safe because each step's proposal is read from it before the next draft forward
        runs. Eager forwards, and DFlash 2's small candidate walks, return their own."""
        if not (self.capture and torch.cuda.is_current_stream_capturing()
                and isinstance(out, (torch.Tensor, DraftReadout))):
            return out
        if isinstance(out, DraftReadout):          # its argmax and confidences beside the logits
            return DraftReadout(*(None if part is None else self.draft_output(part)
                                  for part in (out.logits, out.drafts, out.confidence)))
        key = ("draft", tuple(out.shape[2:]), out.dtype)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(self.max_draft_seqs, self.width - 1, *out.shape[2:], dtype=out.dtype,
                                            device=out.device)
        static = self.scratch[key][: out.shape[0], : out.shape[1]]
        static.copy_(out)
        return static

    def scratch_rows(self, role: tuple, like: torch.Tensor) -> torch.Tensor:
        """The shared rows of a piecewise graph's mixer calls for one role (an input's position,
        the output), shaped like `like` (contiguous)."""
        key = (role, tuple(like.shape[1:]), like.dtype)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(self.piecewise_tokens[-1], *like.shape[1:], dtype=like.dtype,
                                            device=like.device)
        return self.scratch[key][: like.shape[0]]

    def warm(self, once: Callable[[], Any]) -> None:
        """One eager run on a side stream (Triton compiles and autotunes, cuBLAS picks its
        kernels, the allocator grows) before a capture: a second, as vLLM also found, changes
        nothing but the startup's length (~80 graphs an engine)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            once()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    @torch.inference_mode()
    def measure_costs(self, repeat: int = 3) -> dict[str, dict[int, float]]:
        """Milliseconds of one verify forward per FULL token bucket and of one draft propose per
        draft sequence bucket, {"verify": {tokens: ms}, "draft": {seqs: ms}} (the full block),
        and "narrow": {width: {seqs: ms}} for each narrower draft width; each the median of
        `repeat` runs after a warm one, through the path a step of that shape takes (its graph's
        replay), on padding rows; monotone in the bucket (unpadded: the powers of two and the
        largest, `sparse`, each repeated past MIN_REPEAT runs only within EAGER_PROBE_BUDGET_S).
        The runs go round the buckets in turn (each repeat times every bucket once), so a stretch
        of load on a shared host lands on all of them rather than on one bucket's every sample.
        Measured once (cached in .costs)."""
        if self.costs is not None:
            return self.costs
        widths = self.draft_widths if self.has_draft else ()
        tokens, seqs = self.full_tokens, self.draft_sizes
        if not self.padded:
            tokens, seqs = sparse(tokens), sparse(seqs)
        probes = ([("verify", size, None) for size in tokens]
                  + [("propose", size, w) for w in widths for size in seqs])
        for probe in probes:
            self.probe(*probe)                           # warm
        times: dict[tuple, list[float]] = {probe: [] for probe in probes}
        for turn in range(repeat):
            for probe in probes:
                if turn >= MIN_REPEAT and not self.padded and sum(times[probe]) >= EAGER_PROBE_BUDGET_S * 1e3:
                    continue
                sync(self.device)
                start = time.perf_counter()
                self.probe(*probe)
                sync(self.device)
                times[probe].append((time.perf_counter() - start) * 1e3)

        def median_ms(kind: str, size: int, width: int | None = None) -> float:
            samples = sorted(times[(kind, size, width)])
            return samples[len(samples) // 2]
        verify = [median_ms("verify", size) for size in tokens]
        draft = {w: monotone([median_ms("propose", size, w) for size in seqs]) for w in widths}
        self.costs = {"verify": dict(zip(tokens, monotone(verify))),
                      "draft": dict(zip(seqs, draft.get(self.width, []))),
                      "narrow": {w: dict(zip(seqs, ms)) for w, ms in draft.items() if w != self.width}}
        return self.costs

    @property
    def num_graphs(self) -> int:
        return (sum(static.graph is not None for static in self.full.values())
                + sum(len(static.pieces.graphs) for static in self.piecewise.values() if static.pieces))

    def describe(self) -> str:
        """The startup log's line: which buckets each mode serves."""
        return (f"FULL {len(self.full_tokens)} token buckets ≤ {self.full_tokens[-1]} "
                f"({self.seq_slots(self.full_tokens[-1])} sequences), drafts {len(self.draft_sizes)} "
                f"sequence buckets ≤ {self.draft_sizes[-1]} at widths {'/'.join(map(str, self.draft_widths))}, PIECEWISE {len(self.piecewise_tokens)} token buckets "
                f"≤ {self.piecewise_tokens[-1]}, EAGER beyond")


# Unpadded (eager: CPU) cost tables: a step runs at its exact size and the table interpolates,
# so the buckets are measured at powers of two (and the largest), each at least MIN_REPEAT times
# and past that only while its runs stay within EAGER_PROBE_BUDGET_S. Every bucket at 10 runs
# made an adaptive engine of 64 sequences on the 2-core CPU start 18.6 s later (the test suite's
# pair: its 64-sequence draft forward alone 244 ms a run).
MIN_REPEAT = 3
EAGER_PROBE_BUDGET_S = 0.1


def sparse(sizes: list[int]) -> list[int]:
    """The powers of two among `sizes`, and the largest."""
    return [n for n in sizes if n & (n - 1) == 0 or n == sizes[-1]]


def monotone(values: list[float]) -> list[float]:
    """More rows never cost less: the least-squares non-decreasing fit of the measured times
    (pool adjacent violators), so measurement noise does not make a policy chase it. Unlike a
    running maximum, one slow sample does not lift every bucket after it: on a shared CPU a
    noisy 32-token verify made 32 … 64 tokens look free and the policy drop rows that paid."""
    pools: list[tuple[float, int]] = []            # (sum, count) of each run pooled to its mean
    for value in values:
        total, count = float(value), 1
        while pools and pools[-1][0] / pools[-1][1] > total / count:
            previous_total, previous_count = pools.pop()
            total, count = total + previous_total, count + previous_count
        pools.append((total, count))
    return [total / count for total, count in pools for _ in range(count)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
