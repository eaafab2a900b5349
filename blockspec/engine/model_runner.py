"""The model runner: owns the target, the draft, their pools and the CUDA graphs, and runs one
step at a time for the scheduler. Only the engine thread calls it (invariant 2). It allocates
nothing: pages and state slots come from the scheduler's cache manager (cache/manager.py).

step(batch) is one flat ragged target forward (layers/attention.py) over every prefill chunk
of the step and the verify rows [x, d1 … dk_i] of every decoding sequence (k_i = 0: a plain
decode row), preceded by one draft forward over the decoding sequences' blocks
[x, MASK × (T − 1)] (spec/dflash.py: propose). The prefill rows' features go into the draft's
context K/V with the verify rows'; a prompt that ends in this step samples its first token from
its last row; each decoding sequence accepts at most its k_i drafts, and a hybrid target's
recurrent state is set to its own accepted position. Both forwards go through the graph
dispatcher (engine/graphs.py), which picks their graph (FULL, PIECEWISE) or runs them eagerly;
the runner builds their metadata in the shape it plans.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from blockspec.cache import KVPool, StatePool
from blockspec.config import EngineConfig
from blockspec.engine.graphs import EAGER, PIECEWISE, BatchDescriptor, GraphDispatcher, Plan, narrower_widths
from blockspec.engine.logits import LogitsProcessor
from blockspec.engine.memory import PoolSize, StageCost, dummy_sequence, size_pool, startup_line
from blockspec.engine.multimodal import rope_offset, step_rows
from blockspec.engine.warm import warm_kernels
from blockspec.engine.logprobs import TokenLogprob, log_softmax_rows, token_logprobs
from blockspec.engine.scheduler import Batch, FirstToken
from blockspec.engine.sequence import Sequence, completes_prefill
from blockspec.engine.spec.dflash import DraftReadout, Proposal, Verdict, accept, judge, process_verify, propose
from blockspec.engine.spec import policy
from blockspec.engine.spec.policy import Speculation
from blockspec.layers import AttentionMetadata
from blockspec.models.base import MultimodalRows
from blockspec.models.dflash2 import CandidateWalk
from blockspec.layers.attention import token_rows, unpack, uses_kernels
from blockspec.layers.fp8 import keep_column_scales
from blockspec.kernels.readout import first_argmax
from blockspec.sampling import Staged, device_longs, sample


# Startup lines (the KV pool, the graphs): INFO, shown where the server or CLI configures logging
# (stderr stays one line for a CLI error).
logger = logging.getLogger("blockspec.engine")


@dataclass
class DecodeResult:
    num_accepted: list[int]          # drafts each sequence's verify accepted (≤ its k_i)
    new_tokens: list[list[int]]      # a_b + 1 tokens per sequence (before stop / length cuts)
    logprobs: list[list[TokenLogprob] | None] | None = None   # per sequence, for those that asked
    num_drafts: list[int] | None = None   # k_i each sequence verified


@dataclass
class StepResult:
    first_tokens: list[FirstToken | None]     # per prefill chunk: its first token when the prompt ended
    decode: DecodeResult | None
    waited: float = 0.0                       # seconds the host waited on the device for the verdict


@dataclass
class FirstDraws:
    """The first tokens of the prompts a step ends, chosen on the device when it is launched."""
    ending: list[int]                        # the prefill chunks (indices) that end their prompt
    raw: list[torch.Tensor | None]           # their raw log-softmax rows, for those that asked
    tokens: Staged | None                    # [len(ending)], on its way to the host
    chosen: torch.Tensor | None = None       # the same on the device (an early draft's anchors)


@dataclass
class Launched:
    """A step whose forwards are launched: what `collect` needs to finish it."""
    batch: Batch
    logits: torch.Tensor | None              # verify logits [B, max k + 1, V] of the decoding sequences
    proposal: Proposal | None
    first_logits: torch.Tensor | None        # [P, V]: the P prefill chunks that end their prompt
    verdict: Verdict | None = None           # the verify judged on the device (stage_readback)
    draws: FirstDraws | None = None


@dataclass
class EarlyDraft:
    """Step N + 1's draft, launched right after step N's verify, before step N's results reach the
    host (`draft_ahead`): each row's anchor and context length were set on the device — a
    decoding sequence's from step N's verdict (the bonus token, + a + 1), an arriving one's from
    its first token (drawn on the device; its prompt's end). It stands in for step N + 1's draft
    of a sequence only where that sequence is where the device put it (`settle`, then
    `row_of`) and the step drafts blocks of the same width; its rows are read (`proposal_of`)
    before any other draft forward overwrites the graphs' shared readout."""
    seqs: list[Sequence]
    origins: list[tuple[str, int]]           # ("verify", its row of step N's decode batch) or ("first", its chunk)
    width: int
    out: Any                                 # the draft's output: rows 0 … len(seqs) − 1, then padding
    base: list[int]                          # each row's length before step N's tokens: num_cached, or its prompt's
    expected: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    def settle(self, first: list["FirstToken | None"], result: "DecodeResult | None") -> None:
        """Step N's results on the host: where each row's sequence must stand at step N + 1 (row,
        num_cached, anchor) for its row to be its draft: base + a + 1 and the bonus token, or
        the prompt's length and the first token."""
        for row, (seq, (kind, i), base) in enumerate(zip(self.seqs, self.origins, self.base)):
            if kind == "verify" and result is not None:
                self.expected[id(seq)] = (row, base + result.num_accepted[i] + 1, result.new_tokens[i][-1])
            elif kind == "first" and first[i] is not None:
                self.expected[id(seq)] = (row, base, first[i].token_id)

    def row_of(self, seq: Sequence, width: int) -> int | None:
        entry = self.expected.get(id(seq))
        if entry is None or width != self.width:
            return None
        row, num_cached, anchor = entry
        if self.seqs[row] is not seq or seq.num_cached != num_cached or seq.anchor != anchor:
            return None                       # preempted, cut, or another step between
        return row


@dataclass
class Entry:
    """One sequence's rows of a forward: tokens fed from position start."""
    seq: Sequence
    start: int
    tokens: list[int]


class ModelRunner:
    supports_early_drafts = True            # a tensor-parallel runner's plans drive every draft: off there

    def __init__(self, target: nn.Module, draft: nn.Module | None, config: EngineConfig) -> None:
        self.target, self.config = target, config
        self.draft = draft if draft is not None and config.block_size > 1 and config.speculation != "off" else None
        self.width = config.block_size if self.draft is not None else 1
        weight = target.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        # Target layers whose outputs feed the draft (none without a draft).
        self.capture_layers = tuple(self.draft.target_layer_ids) if self.draft is not None else ()
        self.page_size = config.page_size
        shapes = target.recurrent_shapes
        num_snapshots = config.prefix_state_slots if config.prefix_cache else 0     # [prefix] slots after the seqs'
        self.states = (StatePool(config.max_num_seqs + 1 + num_snapshots, shapes, self.dtype, self.device)
                       if shapes else None)
        self.num_forwards = 0                            # target + draft forwards, for tests and stats
        self.deferred: list[Callable[[], None]] = []     # see defer
        self.pending_select: tuple[list[int], list[int]] | None = None    # (slots, kept): see flush_states
        self.early: EarlyDraft | None = None             # the next step's draft, launched ahead (draft_ahead)
        self.early_rows = [0, 0, 0]       # rows drafted early, those a step took, and of those an arrival's
        self.drafts_early = False
        graphed = config.cuda_graphs and self.device.type == "cuda"
        # Which drafts each step verifies (engine/spec/policy.py): the scheduler asks before the
        # step (verify_widths). Made before any forward: a draft forward (the pool's profile, the
        # graphs' capture) reads out the confidences when the policy reads them.
        self.speculation = Speculation(config.speculation if self.draft is not None else "fixed", self.width - 1,
                                       measure=self.measure_costs, max_rows=config.max_num_batched_tokens,
                                       plain_arm=policy.PLAIN_ARM)
        self.speculation.late = self.device.type == "cpu"     # the draft's confidences read at no sync
        self.graphs = self.make_graphs(capture=False, padded=False)     # the profile runs eagerly
        # The pool: measured after the weights and one full-budget forward (engine/memory.py).
        self.pool_size = self.size_pool(graphed)
        self.target_kv, self.draft_kv = self.make_pools(self.pool_size.num_pages)
        logger.info(startup_line(config, self.pool_size))
        if graphed:
            self.graphs = self.make_graphs(capture=True)
            if self.stashes_verify_states:
                self.states.reserve_space(self.graphs.seq_slots(self.graphs.full_tokens[-1]), self.width)
        warm_kernels(self)                        # every variant a step can choose (engine/warm.py)
        if graphed:
            self.warm_up()
        # Adaptive's cost table is measured now, on the forwards the steps will run
        # (engine/spec/costs.py), and logged.
        if self.speculation.mode == "adaptive":
            self.speculation.costs = self.measure_costs()
            if self.device.type == "cuda":
                # Probes that run eagerly (no graph holds their size, or graphs are off) leave the
                # caching allocator holding what the largest needed, beyond the one full-budget
                # forward the pool was sized to leave room for (tests/gpu: the pool test was 1.3 GiB
                # over its 6 GiB budget once adaptive was the default on CUDA).
                torch.cuda.empty_cache()
        # Early drafts (draft_ahead): where the device runs while the host finishes a step (CUDA);
        # BLOCKSPEC_EARLY_DRAFT=0 turns them off, for side-by-side measurements, =1 on anywhere
        # (the same drafts, launched earlier: profiling their host work on the CPU; tests).
        early = os.environ.get("BLOCKSPEC_EARLY_DRAFT", "")
        self.drafts_early = (self.supports_early_drafts and self.draft is not None
                             and (early == "1" or self.device.type == "cuda" and early != "0"))

    def size_pool(self, graphed: bool) -> PoolSize:
        """The pool's size (engine/memory.py), with the graphs' verify stash of a hybrid target."""
        stash_bytes = 0
        keep_column_scales(self.target, self.dtype)          # with the weights, not as activations
        if graphed and self.stashes_verify_states:
            stash = self.make_graphs(capture=False)
            stash_bytes = StatePool.space_bytes(self.target.recurrent_shapes, stash.seq_slots(stash.full_tokens[-1]),
                                                self.width, self.dtype)
        return size_pool(self.config, self.target, self.draft, self.device, self.dtype,
                         self.profile if self.device.type == "cuda" else None, stash_bytes)

    def measure_costs(self):
        """The table, once per process for these models and sizes (the cache keeps the models, so
        their ids are not reused while it holds them)."""
        from blockspec.engine.spec.costs import measure_costs
        key = (self.graphs.draft_widths, self.max_decode_seqs, str(self.device), self.graphs.capture, self.graphs.padded)
        return measure_costs(self.graphs, padded=self.graphs.padded, key=key, owners=(self.target, self.draft))

    def make_pools(self, num_pages: int) -> tuple[KVPool, KVPool | None]:
        num_slots = num_pages * self.page_size
        tc = self.target.config
        target_kv = KVPool(self.target.num_attention_layers, num_slots, tc.num_key_value_heads, tc.head_dim,
                           self.dtype, self.device)
        draft_kv = None
        if self.draft is not None:
            dc = self.draft.config
            draft_kv = KVPool(dc.num_hidden_layers, num_slots, dc.num_key_value_heads, dc.head_dim,
                              self.dtype, self.device)
        return target_kv, draft_kv

    @property
    def max_gather_keys(self) -> int:
        """Keys a step's long prefill chunks may gather at once (kernels/flash_prefill.py): one
        sequence of the longest context; the pool's profile holds room for them."""
        return self.config.max_model_len + self.width

    def gather_room(self) -> torch.Tensor | None:
        """What one layer's gather of max_gather_keys keys and values takes, allocated (the profile
        holds it through its forward, so the pool leaves room for it), where long chunks may be
        routed at all: CUDA with the Triton kernels, fp16 / bf16, the form not switched off."""
        from blockspec.kernels import flash_prefill
        routes = uses_kernels(self.device) and self.dtype in (torch.float16, torch.bfloat16)
        if not (routes and flash_prefill.enabled()):
            return None
        tc = self.target.config
        return torch.empty(2 * self.max_gather_keys * tc.num_key_value_heads * tc.head_dim, dtype=self.dtype,
                           device=self.device)

    @torch.inference_mode()
    def profile(self, num_pages: int) -> None:
        """The largest forward the scheduler can produce, on a throwaway pool of num_pages: a
        prefill chunk of the whole token budget through the target (its features into the
        draft's context, the logits of a full decode batch's rows), and a full decode batch's
        blocks through the draft; beside it, the room a long chunk's key gather takes."""
        self.target_kv, self.draft_kv = self.make_pools(num_pages)
        num_tokens = self.config.max_num_batched_tokens
        seq = dummy_sequence(num_pages)
        room = self.gather_room()
        hidden = self.forward([Entry(seq, 0, [0] * num_tokens)], num_prefill_seqs=1)
        if self.draft is not None:
            self.propose_blocks([Entry(seq, 0, [0] * self.width) for _ in range(self.max_decode_seqs)])
        self.target.compute_logits(hidden[: self.max_decode_seqs * self.width])
        del hidden, room
        self.target_kv = self.draft_kv = None

    @torch.inference_mode()
    def warm_up(self, kinds: tuple[str, ...] = ("piecewise", "verify", "propose")) -> None:
        """Every graph the dispatcher serves, captured before the first request (largest first:
        the graphs' shared pool grows once), each after one eager run that compiles and autotunes
        its kernels (ours, flash-linear-attention's chunk and step kernels, the MoE kernels,
        cuBLAS's choices); then the logits stage at every verify bucket. The torch reference
        attention (BLOCKSPEC_ATTENTION=reference, a sliding-window draft layer) buckets keys by
        the live length, so its FULL graphs are captured on first use. Without capture (CPU
        tests) the same forwards make the static buffers."""
        from tqdm import tqdm
        graphs, cost = self.graphs, StageCost(self.device)
        work = [("piecewise", n, None) for n in graphs.piecewise_tokens] if "piecewise" in kinds else []
        if not graphs.bucket_keys:
            work += [("verify", n, None) for n in graphs.full_tokens if "verify" in kinds]
            if self.draft is not None and "propose" in kinds:
                work += [("propose", n, w) for w in graphs.draft_widths for n in graphs.draft_sizes]
        work.sort(key=lambda item: -item[1] * (item[2] or 1))           # tokens (a draft's: blocks × width)
        for kind, size, width in tqdm(work, desc="capturing CUDA graphs", unit="graph",
                                      disable=not sys.stderr.isatty()):
            self.idle_forward(kind, size, width)
            if kind != "propose":
                # The logits of the rows a step of this size reads: at most every decoding row (what
                # profile() measured): a prefill chunk reads its last row only, and 2,048 rows of a
                # 248k vocabulary were 2 GiB no step ever takes (the MoE ran out on an 80 GB card).
                rows = min(size, self.max_decode_seqs * self.width)
                self.target.compute_logits(torch.zeros(rows, self.target.hidden_size, device=self.device,
                                                       dtype=self.dtype))
        if self.is_hybrid:
            self.states.clear([0])                # the captures ran on padding rows (state slot 0)
        self.num_forwards = 0
        logger.info(f"blockspec: warmed and captured {graphs.num_graphs} CUDA graphs in {cost.done()}: "
                    f"{graphs.describe()}")

    def idle_forward(self, kind: str, size: int, width: int | None = None) -> Any:
        """One forward of a bucket on padding rows only (page 0, state slot 0: nobody's memory),
        through the path a step of that shape takes: "verify" (size tokens of decode rows),
        "propose" (size blocks of `width`, the full block when None), "piecewise" (a prefill of
        size tokens, captured here)."""
        pages = -(-max(size, self.width) // self.page_size)
        idle = dummy_sequence(0)
        idle.block_table = [0] * min(pages, self.config.pages_per_seq)
        if kind == "propose":
            return self.propose_blocks([Entry(idle, 0, [0] * (width or self.width)) for _ in range(size)])
        if kind == "verify":
            # Rows of distinct tokens, so that a MoE target routes them as it routes text: rows of one
            # token are one hidden state in every layer and all pick the same experts, and the cost
            # table then priced a 16-row verify of Qwen3.5-35B-A3B like a few rows' (its real rows
            # read ~100 of 256 experts a layer): adaptive narrowed where the whole block paid.
            ids = padding_ids(size, self.target.config.vocab_size)
            return self.forward([Entry(idle, 0, ids[at: at + self.width]) for at in range(0, size, self.width)])
        # A prefill of `size` tokens in sequences no longer than the pool's table holds.
        span = self.config.pages_per_seq * self.page_size
        chunks = [Entry(idle, 0, [0] * min(span, size - at)) for at in range(0, size, span)]
        plan = self.graphs.plan(size, len(chunks), True, min(span, size), len(idle.block_table))
        meta = self.prepare(chunks, len(chunks), plan)
        if self.graphs.capture and plan.mode == PIECEWISE:
            derive_positions(meta, self.page_size)
            self.graphs.capture_piecewise(size, self.target_forward, meta)
            return None
        return self.forward(chunks, num_prefill_seqs=len(chunks))

    def make_graphs(self, capture: bool, bucket_keys: bool | None = None, padded: bool = True) -> GraphDispatcher:
        """The dispatcher of this runner's forwards: CUDA graphs, or (capture=False) the same
        padded shapes run eagerly, which CPU tests hold to the eager path; padded=False: exact
        shapes, every forward eager. bucket_keys: key buckets by live length (the default where
        the torch reference attention runs)."""
        if bucket_keys is None:
            bucket_keys = not self.attention_reads_live_length
        # Narrower draft blocks only where the policy chooses widths (fixed drafts whole blocks).
        narrow = narrower_widths(self.width) if self.draft is not None and self.config.speculation == "adaptive" else ()
        graphs = GraphDispatcher(self.width, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                 self.config.pages_per_seq, self.page_size, self.device, capture, padded=padded,
                                 bucket_keys=bucket_keys, stashing=self.is_hybrid and self.draft is not None,
                                 draft_widths=narrow)
        graphs.probe, graphs.has_draft = self.probe, self.draft is not None
        return graphs

    def probe(self, kind: str, size: int, width: int | None = None) -> None:
        """A bucket's forward on padding rows as a step runs it, for the dispatcher's cost table;
        not counted among the engine's forwards."""
        forwards = self.num_forwards
        out = self.idle_forward(kind, size, width)
        if kind == "verify":
            self.target.compute_logits(out[:size])
        self.num_forwards = forwards

    @property
    def attention_reads_live_length(self) -> bool:
        """Whether every attention layer runs the Triton kernels (they read context_lens on the
        device); the reference, and with it any sliding-window draft layer, gathers a fixed count."""
        windows = getattr(self.draft.config, "layer_window", ()) if self.draft is not None else ()
        return uses_kernels(self.device) and all(window is None for window in windows)

    @property
    def max_decode_seqs(self) -> int:
        """The most sequences one step can decode at the full block width (seats and token budget)."""
        return max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // self.width))

    @property
    def stashes_verify_states(self) -> bool:
        """A hybrid target verifying drafts keeps the recurrent state after every verify row."""
        return self.is_hybrid and self.draft is not None

    @property
    def is_hybrid(self) -> bool:
        return self.states is not None

    # -- batches ----------------------------------------------------------------------------

    def plan(self, entries: list[Entry], num_prefill_seqs: int = 0, eager: bool = False) -> Plan:
        """The dispatcher's plan for a target forward over these rows (eager: exact shapes)."""
        num_tokens, cols = sum(len(entry.tokens) for entry in entries), max(len(entry.seq.block_table) for entry in entries)
        if eager:
            return Plan(EAGER, BatchDescriptor(num_tokens, len(entries), num_prefill_seqs > 0), cols, live_keys(entries))
        return self.graphs.plan(num_tokens, len(entries), num_prefill_seqs > 0, live_keys(entries), cols)

    def prepare(self, entries: list[Entry], num_prefill_seqs: int, plan: Plan, uniform: bool = False
                ) -> AttentionMetadata:
        """The metadata of a flat ragged batch in the plan's shape, packed on the host and moved to
        the device in one copy; positions and slot_mapping are derived on the device from the
        query starts, context lengths and block tables (`derive_positions`, inside a FULL graph),
        so the host's work grows with sequences and pages, not with tokens. uniform: blocks of
        one width (the draft's), padding sequences of that width too; else padding sequences
        have no rows and padding tokens belong to none."""
        lens = [len(entry.tokens) for entry in entries]
        rows, num_tokens, cols = plan.desc.num_seqs, plan.desc.num_tokens, plan.cols
        pad_width = lens[0] if uniform else 0
        packed = self.device_ints(self.pack(entries, rows, cols, num_tokens, pad_width))
        views = unpack(packed, rows, num_tokens, cols)
        if not self.is_hybrid:
            views["state_slots"] = None
        if uniform:
            width, query_lens = pad_width, None
        elif plan.bounded:
            width, query_lens = 0, None
        else:
            same = all(n == lens[0] for n in lens) and num_tokens == sum(lens) and rows == len(entries)
            width = lens[0] if same else 0
            query_lens = None if same else lens + [0] * (rows - len(entries))
        # A step with prefill chunks keeps its key counts on the host too: its long chunks' attention
        # takes its shapes from them (layers/attention.py long_prefills).
        host_lens = ([entry.start + len(entry.tokens) for entry in entries] + [pad_width] * (rows - len(entries))
                     if num_prefill_seqs and not plan.bounded else None)
        return AttentionMetadata(num_seqs=rows, width=width, **views, max_context_len=plan.keys,
                                 page_size=self.page_size, kv=self.target_kv.layers, states=self.states,
                                 packed=packed, query_lens=query_lens, num_prefill_seqs=num_prefill_seqs,
                                 keep_steps=self.is_hybrid and self.draft is not None,
                                 max_rows=self.width if plan.bounded and not uniform else 0,
                                 context_lens_host=host_lens, max_gather_keys=self.max_gather_keys)

    def pack(self, entries: list[Entry], rows: int, cols: int, num_tokens: int, pad_width: int) -> np.ndarray:
        """Host ints in `unpack`'s layout: padding sequences (pad_width rows each) use page 0, state
        slot 0 and rope offset 0, padding tokens id 0. Positions, slot_mapping and rope_positions are
        left 0 (`derive_positions`). An entry reaching image rows has no one rope offset: its step
        rotates by `step_rows`' positions instead, so 0 goes there. Written into one zeroed array
        field by field (a Python list of every token and page, then converted, cost ~8 µs a
        sequence at 256 sequences)."""
        n = len(entries)
        out = np.zeros(4 * num_tokens + rows + 1 + rows * cols + 3 * rows, dtype=np.int64)
        at = 4 * num_tokens
        starts, tables = out[at: at + rows + 1], out[at + rows + 1: at + rows + 1 + rows * cols].reshape(rows, cols)
        context_lens, state_slots, offsets = out[at + rows + 1 + rows * cols:].reshape(3, rows)
        lens = np.fromiter((len(entry.tokens) for entry in entries), dtype=np.int64, count=n)
        num_real = int(lens.sum())
        out[:num_real] = np.fromiter(chain.from_iterable(entry.tokens for entry in entries), dtype=np.int64,
                                     count=num_real)
        np.cumsum(lens, out=starts[1: n + 1])
        starts[n + 1:] = num_real + pad_width * np.arange(1, rows - n + 1)
        pages = np.fromiter((len(entry.seq.block_table) for entry in entries), dtype=np.int64, count=n)
        tables[:n][np.arange(cols)[None] < pages[:, None]] = np.fromiter(         # row-major: each table in turn
            chain.from_iterable(entry.seq.block_table for entry in entries), dtype=np.int64, count=int(pages.sum()))
        context_lens[:n] = np.fromiter((entry.start for entry in entries), dtype=np.int64, count=n) + lens
        context_lens[n:] = pad_width                            # positions 0 … width − 1, inside page 0
        state_slots[:n] = np.fromiter((entry.seq.state_slot or 0 for entry in entries), dtype=np.int64, count=n)
        if self.target.visual is not None:
            offsets[:n] = [rope_offset(entry) or 0 for entry in entries]
        return out

    def forward(self, entries: list[Entry], num_prefill_seqs: int = 0,
                drafts: tuple[Proposal, list[int]] | None = None) -> torch.Tensor:
        """The target over a flat batch (the first num_prefill_seqs entries prefill chunks; drafts:
        the proposal and each decoding entry's k_b, written into its verify rows) → hidden
        [≥ rows, hidden], its rows in the entries' order (a graph's static output: read it
        before the next forward)."""
        self.flush_states()                 # the last verify's rollback reads the stash this overwrites
        multimodal = step_rows(self.target.visual, entries, self.device)    # images: M-RoPE, the tower's tokens
        plan = self.plan(entries, num_prefill_seqs, eager=multimodal is not None)
        meta = self.prepare(entries, num_prefill_seqs, plan)
        if drafts is not None:
            proposal, num_drafts = drafts
            self.place_drafts(meta, proposal, num_drafts, sum(len(e.tokens) for e in entries[:num_prefill_seqs]))
        self.num_forwards += 1
        if multimodal is not None:
            # [today] A prefill chunk reaching image rows takes the tower's tokens (and DeepStack
            # features) at those rows and rotates at 3-D M-RoPE positions, which no graph takes: that
            # step runs eagerly, exact shapes. Every other step of an image sequence (decode, verify,
            # text-only chunks) rotates at its positions + rope offset and goes through the graphs.
            self.derive(meta)
            return self.target_forward(meta, multimodal)
        return self.graphs.run("verify", plan, self.target_forward, meta, self.derive)

    def propose_blocks(self, blocks: list[Entry]):
        """The draft over blocks of one width → what `propose` reads (rows past the blocks' are
        padding)."""
        plan = self.graphs.plan_draft(len(blocks), live_keys(blocks), max(len(b.seq.block_table) for b in blocks),
                                      len(blocks[0].tokens))
        meta = self.prepare(blocks, 0, plan, uniform=True)
        self.num_forwards += 1
        return self.graphs.run("propose", plan, self.draft_proposal, meta, self.derive)

    def derive(self, meta: AttentionMetadata) -> None:
        derive_positions(meta, self.page_size)

    def device_ints(self, values: list) -> torch.Tensor:
        return device_longs(values, self.device)

    def processor_of(self, seq: Sequence) -> LogitsProcessor | None:
        """The sequence's logits processor, made here (the engine thread) when first needed;
        None for a request that changes nothing in the distribution."""
        if seq.logits_processor is None and seq.request.processes_logits:
            seq.logits_processor = LogitsProcessor(seq.request, self.target.lm_head.out_features, self.device)
        return seq.logits_processor

    # -- [prefix] state-slot copies the cache manager asks for (cache/prefix.py) -------------

    def restore_snapshots(self, seqs: list[Sequence]) -> None:
        """A hybrid hit resumes from its snapshot: copied into the sequence's slot before its
        first forward."""
        for seq in seqs:
            if seq.restore_from is not None:
                self.states.copy(seq.restore_from, seq.state_slot)
                seq.restore_from = None

    def take_snapshots(self, seqs: list[Sequence]) -> None:
        """After a prefill chunk: the state at its end, for the tree (the chunk ends on a page)."""
        for seq in seqs:
            if seq.snapshot_into is not None:
                self.states.copy(seq.state_slot, seq.snapshot_into)

    def snapshot_page_boundaries(self, seqs: list[Sequence], num_accepted: list[int], from_stash: bool) -> None:
        """[prefix] Hybrid decode: a sequence with a pending slot whose kept positions cross a
        page boundary keeps the state at that boundary there (from the verify's per-position
        stash; plain decoding feeds one position, so its slot is that state already). The
        cache manager files it under that page when the sequence ends (cache/prefix.py)."""
        rows, slots, kept = [], [], []
        for row, (seq, accepted) in enumerate(zip(seqs, num_accepted)):
            boundary = (seq.num_cached + accepted + 1) // self.page_size * self.page_size
            if seq.pending_slot is None or boundary <= seq.num_cached:
                continue
            seq.pending_boundary = boundary
            rows.append(row)
            slots.append(seq.pending_slot)
            kept.append(boundary - seq.num_cached)
        if slots and from_stash:
            self.states.select(slots, kept, keep_stash=True, rows=rows)
        elif slots:
            for row, slot in zip(rows, slots):
                self.states.copy(seqs[row].state_slot, slot)

    def clear_states(self, seqs: list[Sequence]) -> None:
        """Zero the recurrent state of sequences starting from their first token."""
        if self.is_hybrid:
            self.states.clear([seq.state_slot for seq in seqs if seq.num_cached == 0])

    # -- the step ---------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        """One forward of the target over the whole step (after one of the draft over the
        decoding sequences' blocks), and its results on the host."""
        return self.collect(self.launch(batch))

    def defer(self, work: Callable[[], None]) -> None:
        """Host work that no step waits for (what the adaptive policy learns from a verify, a
        cycle's time, forgetting an ended sequence): done by `learn`, after the next launch,
        while the device runs that step, not between a step's end and the next one's launch.
        The widths of step N + 1 are then planned from what steps up to N − 1 taught."""
        self.deferred.append(work)

    def learn(self) -> None:
        """The deferred work, in the order it was deferred."""
        work, self.deferred = self.deferred, []
        for item in work:
            item()

    @torch.inference_mode()
    def launch(self, batch: Batch) -> Launched:
        """The step's forwards, up to the target's logits, reading none of their results back
        (on CUDA they may still be running when this returns: the engine works meanwhile)."""
        for seq in [s for s, _ in batch.prefill] + batch.decode:
            self.processor_of(seq)
        if batch.prefill:                   # a slot the rollback writes may be a new sequence's now
            self.flush_states()
        self.clear_states([seq for seq, _ in batch.prefill])
        self.restore_snapshots([seq for seq, _ in batch.prefill])
        # The early draft is this step's or none (never a later one's); its output is let go once
        # its rows are read, before the verify allocates (forward_step).
        logits, proposal, first_logits = self.forward_step(batch, self.take_early())
        self.take_snapshots([seq for seq, _ in batch.prefill])
        for seq, n in batch.prefill:        # the tower's tokens are kept only while a prompt's rows remain
            if completes_prefill(seq, n):
                seq.vision_outputs = {}
        return self.stage_readback(Launched(batch, logits, proposal, first_logits))

    def take_early(self) -> EarlyDraft | None:
        early, self.early = self.early, None
        return early

    def stage_readback(self, launched: Launched) -> Launched:
        """What collect reads, decided on the device now and on its way to the host: the first
        tokens, and the verify's verdict unless a decoding sequence processes its logits (its
        processed rows need the drafts on the host first: judged in collect)."""
        batch = launched.batch
        if launched.first_logits is not None:
            launched.draws = self.draw_first(batch, launched.first_logits)
        if batch.decode and not any(seq.logits_processor is not None for seq in batch.decode):
            launched.verdict = judge(batch.decode, launched.proposal, launched.logits, None,
                                     batch.num_drafts).stage()
        return launched

    @torch.inference_mode()
    def draft_ahead(self, launched: Launched) -> None:
        """Step N + 1's draft, launched now, right behind step N's verify and before its results
        are read: the device denoises it while the host commits step N, schedules step N + 1 and
        prepares its verify (at 64 sequences of the Qwen3-8B shape the H200 waited ~7 ms a cycle
        for that host work, issue 31). Each block is the next step's [x, MASK × (W − 1)] at the
        next step's positions, with x and the context length (+ a + 1) taken from the verdict on
        the device. Drafted for the sequences step N decodes whose next block the verdict alone
        decides: greedy, or sampling without drafts this step (the rejection rule's bonus is
        drawn on the host), and the sequences whose prompt this step ends (their first token is
        drawn on the device: without this, an arrival's first decode step ran a second draft
        forward for it alone, ~1.2 ms of the H200 at the Qwen3-8B shape), in a step where no
        decoding sequence processes its logits and none asks for logprobs (their host reads
        would wait behind this draft), that plan to draft next step (adaptive's plan_ahead) and
        may still commit more than one token; at the width the next step plans. (A sampling row
        that verifies drafts reads the device in its rejection rule: in a step with early rows
        that read waits behind the early draft, as it waited before for the next step's.)
        Step N + 1 takes a sequence's row only if the sequence is where the verdict put it
        (EarlyDraft.row_of) and drafts that width; the others are drafted then, as before."""
        self.early = None
        batch, verdict, draws = launched.batch, launched.verdict, launched.draws
        if not self.drafts_early or batch.decode and verdict is None:
            return
        if draws is not None and any(r is not None for r in draws.raw) or any(
                seq.request.num_logprobs is not None for seq in batch.decode):
            return
        plan = self.speculation.ahead_draft()
        width = (plan[1] if plan is not None else 0) or self.width
        limit = self.config.pages_per_seq * self.page_size

        def drafts_next(seq: Sequence, longest: int) -> bool:
            return (seq.request.num_allowed > 1 and (plan is None or plan[0].get(id(seq), 0) > 0)
                    and longest <= limit)
        # Decoding sequences: each block is packed at its step-N length (its context length there
        # num_cached + W) and gains a + 1 on the device; the plan's keys and table columns hold
        # the longest the verdict can make (k + 1 further).
        rows = [b for b, (seq, k) in enumerate(zip(batch.decode, batch.num_drafts))
                if (seq.request.params.is_greedy or k == 0) and drafts_next(seq, seq.num_cached + k + 1 + width)]
        # Arrivals: a prompt this step ends starts decoding at its end, from the first token.
        ending = draws.ending if draws is not None and draws.chosen is not None else []
        firsts = [j for j, i in enumerate(ending) if batch.prefill[i][0].logits_processor is None
                  and drafts_next(batch.prefill[i][0], batch.prefill[i][0].num_cached + batch.prefill[i][1] + width)]
        if not rows and not firsts:
            return
        mask = self.draft.mask_token_id
        seqs = [batch.decode[b] for b in rows] + [batch.prefill[ending[j]][0] for j in firsts]
        base = [seq.num_cached for seq in seqs[: len(rows)]] + [
            batch.prefill[ending[j]][0].num_cached + batch.prefill[ending[j]][1] for j in firsts]
        longest = max([base[r] + batch.num_drafts[b] + 1 + width for r, b in enumerate(rows)]
                      + [start + width for start in base[len(rows):]])
        cols = max(max(len(seq.block_table) for seq in seqs), -(-longest // self.page_size))
        plan_draft = self.graphs.plan_draft(len(seqs), longest, cols, width)
        meta = self.prepare([Entry(seq, start, [0] + [mask] * (width - 1)) for seq, start in zip(seqs, base)], 0,
                            plan_draft, uniform=True)
        advance, anchors = [], []
        if rows:
            index = self.device_ints(rows)
            accepted = verdict.accepted.index_select(0, index)                               # [n, 1]
            advance.append(accepted[:, 0] + 1)
            anchors.append(verdict.target_ids.index_select(0, index).gather(1, accepted)[:, 0])
        if firsts:
            chosen = draws.chosen.index_select(0, self.device_ints(firsts))
            advance.append(torch.zeros_like(chosen))
            anchors.append(chosen)
        n = len(seqs)
        meta.context_lens[:n] += torch.cat(advance)
        meta.input_ids.view(-1, width)[:n, 0] = torch.cat(anchors)
        self.num_forwards += 1
        out = self.graphs.run("propose", plan_draft, self.draft_proposal, meta, self.derive)
        origins = [("verify", b) for b in rows] + [("first", ending[j]) for j in firsts]
        self.early = EarlyDraft(seqs, origins, width, out, base)
        self.early_rows[0] += len(seqs)

    @torch.inference_mode()
    def collect(self, launched: Launched) -> StepResult:
        """The host side of a launched step: first tokens, then accepted drafts (one read of the
        device for the whole batch), logprobs."""
        batch = launched.batch
        first_tokens = self.first_tokens(batch, launched.first_logits, launched.draws)
        result = (self.finish_decode(batch.decode, batch.num_drafts, launched.logits, launched.proposal,
                                     launched.verdict) if batch.decode else None)
        if self.early is not None:
            self.early.settle(first_tokens, result)
        staged = launched.verdict.staged if launched.verdict is not None else None
        return StepResult(first_tokens, result, staged.waited if staged is not None else 0.0)

    def blocks(self, decode: list[Sequence], width: int) -> list[Entry]:
        """The draft's blocks [x, MASK × (W − 1)] at each sequence's next positions."""
        mask = self.draft.mask_token_id if self.draft is not None else 0
        return [Entry(seq, seq.num_cached, [seq.anchor] + [mask] * (width - 1)) for seq in decode]

    def forward_step(self, batch: Batch, early: EarlyDraft | None = None
                     ) -> tuple[torch.Tensor | None, Proposal | None, torch.Tensor | None]:
        """The draft over the decoding sequences (early: its rows launched ahead, draft_ahead),
        then one flat target forward over prefill chunks and verify rows → (verify logits
        [B, max k + 1, V], proposal, the logits [P, V] of the P prefill chunks that end their
        prompt)."""
        decode, num_drafts = batch.decode, batch.num_drafts
        proposal = self.propose_for(decode, num_drafts, batch.draft_width or self.width, early)
        del early
        if proposal is not None:
            proposal.observed = self.speculation.step_observes        # this step's, read before the next is planned
        if proposal is not None and self.speculation.late:
            # Verify what this cycle's own drafts are worth (CPU: no sync to read them).
            proposal.drafted = batch.drafted = list(num_drafts)
            batch.num_drafts[:] = num_drafts = self.speculation.refined(decode, proposal.confidence, num_drafts)
        entries = [Entry(seq, seq.num_cached, seq.tokens[seq.num_cached: seq.num_cached + n])
                   for seq, n in batch.prefill]
        entries += [Entry(seq, seq.num_cached, [seq.anchor] + [0] * k) for seq, k in zip(decode, num_drafts)]
        drafts = (proposal, num_drafts) if proposal is not None and any(num_drafts) else None
        hidden = self.forward(entries, len(batch.prefill), drafts)
        first = [samples_first_token(seq, n) for seq, n in batch.prefill]
        num_first = sum(first)
        logits = self.target.compute_logits(self.logit_hidden(hidden, batch, first)) if num_first or decode else None
        first_logits = logits[:num_first] if num_first else None
        if not decode:
            return None, proposal, first_logits
        verify = logits[num_first:]
        width = max(num_drafts) + 1
        if all(k + 1 == width for k in num_drafts):
            return verify.view(len(decode), width, -1), proposal, first_logits
        # Rows past a sequence's k_b repeat its last row (never read: acceptance stops at k_b).
        return verify[self.device_ints(padded_verify_rows(num_drafts, width))], proposal, first_logits

    def propose_for(self, decode: list[Sequence], num_drafts: list[int], width: int,
                    early: EarlyDraft | None = None) -> Proposal | None:
        """The drafts of the sequences that verify some (k_b > 0), in blocks of `width` (≥ max
        k_b + 1; the early draft's, if wider and it holds most rows): the early draft's rows where it holds them (read first: the draft forward
        below would overwrite its readout), one draft forward over the rest; rows of the others
        hold no drafts (acceptance reads none of them)."""
        drafting = [b for b, k in enumerate(num_drafts) if k > 0]
        if self.draft is None or not drafting:
            return None
        parts: list[tuple[list[int], Proposal]] = []
        rest = drafting
        if early is not None:
            rows = [early.row_of(decode[b], early.width) for b in drafting]
            held = sum(row is not None for row in rows)
            if early.width > width and 2 * held >= len(drafting):
                # Planned narrower than the early block (a cap fell, or the plan changed) while
                # the early draft holds most of the rows: its blocks' first slots serve the plan,
                # so the step drafts at the early width (the verify reads k_b ≤ width − 1 of
                # each) rather than dropping those rows for a second draft forward over all.
                width = early.width
            elif early.width != width:
                rows = [None] * len(drafting)                # another width: drafted below
            have = [(b, row) for b, row in zip(drafting, rows) if row is not None]
            if have:
                self.early_rows[1] += len(have)
                self.early_rows[2] += sum(early.origins[row][0] == "first" for _, row in have)
                seqs = [decode[b] for b, _ in have]
                # The draft logits are read only for rows that sample or process them, or for
                # confidences the readout did not take (propose): else not gathered (at 256 rows
                # of 15 slots over a 152k vocabulary, 1.2 GB).
                logits = any(not seq.request.params.is_greedy or seq.logits_processor is not None for seq in seqs) \
                    or self.speculation.wants_confidences and getattr(early.out, "confidence", True) is None
                part = self.proposal_of(draft_rows(early.out, [r for _, r in have], logits), seqs)
                rest = [b for b, row in zip(drafting, rows) if row is None]
                if rest and part.confidence is not None:
                    # A view of the graphs' shared readout until now: the draft forward below
                    # would overwrite it before merged() reads it.
                    part.confidence = part.confidence.clone()
                parts.append(([b for b, _ in have], part))
        if rest:
            seqs = [decode[b] for b in rest]
            parts.append((rest, self.proposal_of(self.propose_blocks(self.blocks(seqs, width)), seqs)))
        return confidence_to_host(self.merged(parts, len(decode), width))

    def merged(self, parts: list[tuple[list[int], Proposal]], num_seqs: int, width: int) -> Proposal:
        """Proposals of parts of a batch (each: the batch rows it covers) → one for all num_seqs
        rows; rows no part covers hold zeros (no drafts)."""
        if len(parts) == 1 and parts[0][0] == list(range(num_seqs)):
            return parts[0][1]
        first = parts[0][1]
        drafts = torch.zeros(num_seqs, width - 1, dtype=first.drafts.dtype, device=self.device)
        probs: list[torch.Tensor | None] = [None] * num_seqs
        confidence = None
        if first.confidence is not None:
            confidence = torch.zeros(num_seqs, width - 1, dtype=first.confidence.dtype, device=first.confidence.device)
        for batch_rows, part in parts:
            index = self.device_ints(batch_rows)
            drafts[index] = part.drafts
            for i, b in enumerate(batch_rows):
                probs[b] = part.probs[i]
            if confidence is not None:
                confidence[index.to(confidence.device)] = part.confidence.to(confidence.device)
        return Proposal(drafts, probs, confidence)

    def proposal_of(self, drafted, seqs: list[Sequence]) -> Proposal:
        """The drafts the draft's output proposes for seqs, drawn with each one's parameters."""
        return propose(drafted, seqs, confidence=self.speculation.wants_confidences)

    def place_drafts(self, meta: AttentionMetadata, proposal: Proposal, num_drafts: list[int], at: int) -> None:
        """The drafts go into their verify rows: sequence b's row 1 + j takes d_{j+1}, j < k_b."""
        ks = np.asarray(num_drafts, dtype=np.int64)
        src_row = np.repeat(np.arange(len(ks)), ks)                           # [Σ k_b]
        src_col = np.arange(int(ks.sum())) - np.repeat(np.cumsum(ks) - ks, ks)
        dst = np.repeat(verify_starts(ks, at) + 1, ks) + src_col
        index = self.device_ints(np.stack((dst, src_row, src_col)))
        meta.input_ids[index[0]] = proposal.drafts[index[1], index[2]]

    def logit_hidden(self, hidden: torch.Tensor, batch: Batch, first: list[bool]) -> torch.Tensor:
        """The rows of the flat batch whose logits are needed: the last row of each prefill chunk
        that ends its prompt (first[i]: its first token), then every verify row. The verify rows
        are one run after the prefill rows: a slice of hidden, no index built row by row."""
        lens = np.array([n for _, n in batch.prefill], dtype=np.int64)
        at, num_verify = int(lens.sum()), sum(batch.num_drafts) + len(batch.num_drafts)
        if not any(first):
            return hidden[at: at + num_verify]
        ends = (np.cumsum(lens) - 1)[np.array(first, dtype=bool)]
        return hidden[self.device_ints(np.concatenate((ends, np.arange(at, at + num_verify))))]

    def draw_first(self, batch: Batch, logits: torch.Tensor) -> FirstDraws:
        """The first token of each prefill chunk's sequence whose prompt ends in this step (logits
        [P, V]: those prompts' last rows), chosen on the device, and on its way to the host. The
        greedy rows that process nothing take one argmax for all of them (the ids each row's own
        argmax gives; 64 arrivals were 64 argmax launches and a stack), the others their own draw."""
        ending = [i for i, (seq, n) in enumerate(batch.prefill) if samples_first_token(seq, n)]
        if not ending:
            return FirstDraws(ending, [], None)
        seqs = [batch.prefill[i][0] for i in ending]
        raw = self.raw_logprobs(seqs, logits.unsqueeze(1))          # before any processing
        tokens = first_argmax(logits)                                              # [P]
        for j, seq in enumerate(seqs):
            if self.processor_of(seq) is not None or not seq.request.params.is_greedy:
                tokens[j] = self.draw_own(seq, logits[j: j + 1])
        return FirstDraws(ending, raw, Staged(tokens), tokens)

    def draw_own(self, seq: Sequence, scores: torch.Tensor) -> torch.Tensor:
        """One first token drawn with the sequence's own processor, parameters and generator
        (scores [1, V])."""
        if seq.logits_processor is not None:
            scores = seq.logits_processor.rows(scores, [])
        return sample(scores[0], seq.request.params, seq.generator)

    def first_tokens(self, batch: Batch, logits: torch.Tensor | None,
                     draws: FirstDraws | None = None) -> list[FirstToken | None]:
        """Advance each prefill chunk's sequence; the first token where its prompt ended (draws:
        chosen when the step was launched; drawn now when not given)."""
        if draws is None and logits is not None:
            draws = self.draw_first(batch, logits)
        for seq, n in batch.prefill:
            seq.num_cached += n
        result: list[FirstToken | None] = [None] * len(batch.prefill)
        if draws is None or draws.tokens is None:
            return result
        for i, rows, token in zip(draws.ending, draws.raw, draws.tokens.tolist()):
            result[i] = FirstToken(token, self.scored(batch.prefill[i][0], rows, [token]))
        return result

    def finish_decode(self, decode: list[Sequence], num_drafts: list[int], logits: torch.Tensor,
                      proposal: Proposal | None, verdict: Verdict | None = None) -> DecodeResult:
        """Verify logits [B, max k + 1, V] → accepted drafts (each ≤ its k_b), new tokens,
        logprobs; a hybrid target keeps the state after each sequence's last accepted row.
        verdict: judged when the step was launched (stage_readback), else judged here."""
        raw = self.raw_logprobs(decode, logits)                                 # before any processing
        processed = {}
        if verdict is None:             # a logits processor decodes: its processed rows first, then the verdict
            processed = process_verify(decode, proposal, logits, num_drafts)
            verdict = judge(decode, proposal, logits, processed, num_drafts)
        num_accepted, new_tokens = accept(decode, proposal, logits, processed, num_drafts, verdict)
        if proposal is not None and proposal.confidence is not None and proposal.observed:   # a step to learn from
            self.defer(lambda: self.speculation.observe(decode, proposal.confidence, num_drafts, num_accepted,
                                                        proposal.drafted))
        if self.is_hybrid:
            self.snapshot_page_boundaries(decode, num_accepted, from_stash=self.draft is not None)
        if self.is_hybrid and self.draft is not None:
            self.flush_states()
            self.pending_select = ([seq.state_slot for seq in decode], [a + 1 for a in num_accepted])
        logprobs = [self.scored(seq, rows, tokens) for seq, rows, tokens in zip(decode, raw, new_tokens)]
        return DecodeResult(num_accepted, new_tokens, logprobs, list(num_drafts))

    def flush_states(self) -> None:
        """Each verified sequence's recurrent state set to its last accepted row (StatePool.select
        from the verify's stash), deferred from finish_decode to the next target forward (or the
        next step that prefills: its slots may have been a finished sequence's): the next draft
        forward, which reads no recurrent state, is launched first, so the device runs it while
        the host issues these copies instead of waiting for them (0.45 ms a cycle of Qwen3.5-4B
        at one sequence on the H200, issue 31). Nothing reads a sequence's slot in between."""
        if self.pending_select is not None:
            slots, kept = self.pending_select
            self.pending_select = None
            self.states.select(slots, kept)

    @staticmethod
    def raw_logprobs(seqs: list[Sequence], logits: torch.Tensor) -> list[torch.Tensor | None]:
        """logits [B, T, V] → per sequence that asked for logprobs, the log-softmax of its rows,
        taken before sampling may process the logits (the raw distribution, as vLLM reports)."""
        return [log_softmax_rows(logits[b]) if seq.request.num_logprobs is not None else None
                for b, seq in enumerate(seqs)]

    @staticmethod
    def scored(seq: Sequence, rows: torch.Tensor | None, tokens: list[int]) -> list[TokenLogprob] | None:
        return None if rows is None else token_logprobs(rows, tokens, seq.request.num_logprobs)

    def draft_proposal(self, meta: AttentionMetadata):
        """The draft's B blocks [x, MASK × (T − 1)] at the verify's positions, seeing the
        committed context (num_cached positions) of the draft pool → what the draft proposes
        from: DFlash 1 logits [B, T − 1, V] (slot i predicts d_i), or DFlash 2's CandidateWalk
        (candidates, edge scores, greedy drafts). The draft rotates at the cache positions, an
        image sequence's too (the M-RoPE shift is the target's alone)."""
        width = meta.width
        draft_meta = dataclasses.replace(meta, kv=self.draft_kv.layers, context_lens=meta.context_lens - width,
                                         states=None, state_slots=None, keep_steps=False, shared={},
                                         context_lens_host=None)
        hidden = self.draft(self.target.embed(meta.input_ids), meta.positions, draft_meta)
        anchors = meta.input_ids.view(meta.num_seqs, width)[:, 0]
        out = self.draft.propose(hidden.view(meta.num_seqs, width, -1), anchors, self.target.lm_head)
        if isinstance(out, torch.Tensor):       # DFlash 1: argmax (+ confidences) inside the forward
            out = DraftReadout.of(out, self.speculation.reads_confidences)
        return self.graphs.draft_output(out)

    def target_forward(self, meta: AttentionMetadata, multimodal: MultimodalRows | None = None) -> torch.Tensor:
        """Target forward → hidden [N, hidden], rotating at meta.rope_positions (multimodal: at its
        M-RoPE positions); the features of every row join the draft's context at their cache
        positions (those past the accepted prefix lie past the sequence's length: masked, then
        overwritten; a bucket's padding tokens go to page 0)."""
        out = self.target(meta.input_ids, meta.rope_positions, meta, self.capture_layers, multimodal)
        if self.draft is not None:
            self.draft.append_context(out.features, meta.positions, meta.slot_mapping, self.draft_kv.layers)
        return out.hidden


def draft_rows(out: Any, rows: list[int], logits: bool = True) -> Any:
    """A draft output's rows (DFlash 1's readout, DFlash 2's walk), in the order given; `propose`
    reads an output's first rows, so the leading rows in order are the output itself. logits
    False: DFlash 1's logits are not gathered (the caller's rows never read them: a view of the
    output's first rows stands in, of the right shape)."""
    if rows == list(range(len(rows))):
        return out
    index = device_longs(rows, out.device if isinstance(out, torch.Tensor) else out.drafts.device)
    if isinstance(out, CandidateWalk):
        return CandidateWalk(out.candidate_ids[index], out.edge_scores[index], out.drafts[index], out.vocab_size)
    if isinstance(out, DraftReadout):
        return DraftReadout(out.logits[index] if logits else out.logits[: len(rows)], out.drafts[index],
                            None if out.confidence is None else out.confidence[index])
    return out[index]


def confidence_to_host(proposal: Proposal) -> Proposal:
    """The confidences (adaptive) start on their way to pinned host memory once the proposal is
    whole, so the policy reads them later (after the verify's one readback, which comes after
    this copy on the stream) without a sync of its own; nothing reads them before then."""
    if proposal.confidence is not None and proposal.confidence.is_cuda:
        host = torch.empty(proposal.confidence.shape, dtype=proposal.confidence.dtype, pin_memory=True)
        proposal.confidence = host.copy_(proposal.confidence, non_blocking=True)
    return proposal


def verify_starts(num_drafts: np.ndarray, at: int) -> np.ndarray:
    """Each decoding sequence's first verify row (its anchor's) in a flat batch whose verify rows
    begin at row `at`: sequence b has k_b + 1 rows."""
    widths = num_drafts + 1
    return at + np.cumsum(widths) - widths


def padded_verify_rows(num_drafts: list[int], width: int) -> np.ndarray:
    """[B, width]: sequence b's verify rows in the flat verify logits, its last (row k_b) repeated
    past k_b."""
    ks = np.asarray(num_drafts, dtype=np.int64)
    return verify_starts(ks, 0)[:, None] + np.minimum(np.arange(width)[None], ks[:, None])


def samples_first_token(seq: Sequence, num_tokens: int) -> bool:
    """Whether a chunk of num_tokens ends seq's prompt with nothing generated yet."""
    return completes_prefill(seq, num_tokens) and not seq.request.output_ids


def live_keys(entries: list[Entry]) -> int:
    return max(entry.start + len(entry.tokens) for entry in entries)


def derive_positions(meta: AttentionMetadata, page_size: int) -> None:
    """Fill positions, slot_mapping and rope_positions [N] in place: sequence b's rows feed
    positions context_lens[b] − n_b … context_lens[b] − 1, stored at its block table's slot of
    each, and rotate at those + rope_offsets[b]; a bucket's padding tokens (past query_start[B])
    take position 0 and slot 0, in page 0 (graph-safe: no host sync)."""
    seq, row = token_rows(meta)
    starts = meta.starts
    lengths = starts[1:] - starts[:-1]
    torch.add((meta.context_lens - lengths)[seq], row, out=meta.positions)
    torch.add(meta.positions, meta.rope_offsets[seq], out=meta.rope_positions)
    padded = meta.bounded or meta.positions.shape[0] > meta.num_tokens
    if padded:
        real = torch.arange(meta.positions.shape[0], device=starts.device) < starts[-1]
        meta.positions.masked_fill_(~real, 0)
        meta.rope_positions.masked_fill_(~real, 0)
    pages = meta.block_tables[seq, meta.positions // page_size]
    torch.add(pages * page_size, meta.positions % page_size, out=meta.slot_mapping)
    if padded:
        meta.slot_mapping.masked_fill_(~real, 0)


def padding_ids(count: int, vocab_size: int) -> list[int]:
    """`count` token ids spread over the vocabulary, the same every time (an odd stride walks
    every id of a power-of-two vocabulary before it repeats one)."""
    return [(1 + 7919 * i) % vocab_size for i in range(count)]
