"""The model runner: owns the target, the draft, their pools and the CUDA graphs, and runs one
batch at a time for the scheduler. Only the engine thread calls it (invariant 2).

Two kinds of forward:
- prefill(seq, n): the next n positions of one sequence's prompt (a chunk); its features go
  into the draft's context K/V; at the prompt's end the first token is sampled.
- decode(seqs): one DFlash cycle for the whole batch (spec/dflash.py): propose → verify →
  accept, then every sequence's recurrent state is set to its own accepted position. Plain
  decoding is the same cycle with T = 1 and no draft.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from blockspec.cache import KVPool, StatePool
from blockspec.config import EngineConfig
from blockspec.engine.cuda_graphs import GraphedForwards
from blockspec.engine.logprobs import TokenLogprob, log_softmax_rows, token_logprobs
from blockspec.engine.sequence import Sequence
from blockspec.engine.logits import LogitsProcessor
from blockspec.engine.scheduler import FirstToken
from blockspec.engine.spec.dflash import accept, process_verify, propose
from blockspec.layers import AttentionMetadata
from blockspec.layers.attention import unpack, uses_kernels
from blockspec.sampling import sample


@dataclass
class DecodeResult:
    num_accepted: list[int]          # drafts each sequence's verify accepted
    new_tokens: list[list[int]]      # a_b + 1 tokens per sequence (before stop / length cuts)
    logprobs: list[list[TokenLogprob] | None] | None = None   # per sequence, for those that asked
    num_drafts: list[int] | None = None   # k_i each sequence verified


class ModelRunner:
    def __init__(self, target: nn.Module, draft: nn.Module | None, config: EngineConfig) -> None:
        self.target, self.config = target, config
        self.draft = draft if draft is not None and config.block_size > 1 else None
        self.width = config.block_size if self.draft is not None else 1
        weight = target.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        # Target layers whose outputs feed the draft (none without a draft).
        self.capture_layers = tuple(self.draft.target_layer_ids) if self.draft is not None else ()
        self.page_size = config.page_size
        num_slots = config.total_pages * config.page_size
        tc = target.config
        self.target_kv = KVPool(target.num_attention_layers, num_slots, tc.num_key_value_heads, tc.head_dim,
                                self.dtype, self.device)
        self.draft_kv = None
        if self.draft is not None:
            dc = self.draft.config
            self.draft_kv = KVPool(dc.num_hidden_layers, num_slots, dc.num_key_value_heads, dc.head_dim,
                                   self.dtype, self.device)
        shapes = target.recurrent_shapes
        num_snapshots = config.prefix_state_slots if config.prefix_cache else 0     # [prefix] slots after the seqs'
        self.states = (StatePool(config.max_num_seqs + 1 + num_snapshots, shapes, self.dtype, self.device)
                       if shapes else None)
        self.num_forwards = 0                            # target + draft forwards, for tests and stats
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = self.make_graphs(capture=True)

    def make_graphs(self, capture: bool) -> GraphedForwards:
        """The decode cycle through fixed-shape buffers: CUDA graphs, or (capture=False) the
        same padded path run eagerly, which CPU tests hold to the eager one."""
        return GraphedForwards(self.width, self.config.max_num_seqs, self.config.pages_per_seq,
                               self.page_size, self.device, capture, bucket_keys=not self.attention_reads_live_length)

    @property
    def attention_reads_live_length(self) -> bool:
        """Whether every attention layer runs the Triton kernels (they read context_lens on the
        device); the reference, and with it any sliding-window draft layer, gathers a fixed count."""
        windows = getattr(self.draft.config, "layer_window", ()) if self.draft is not None else ()
        return uses_kernels(self.device) and all(window is None for window in windows)

    @property
    def is_hybrid(self) -> bool:
        return self.states is not None

    # -- batches ----------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence], width: int, starts: list[int], tokens: list[list[int]],
                padded: bool = False) -> AttentionMetadata:
        """The target's metadata for sequences feeding tokens[b] (width each) from starts[b],
        packed on the host and moved to the device in one copy. padded: rows and keys rounded
        up to a captured graph's shape (the real sequences are the first rows); then positions
        and slot_mapping are derived inside each graph (run_forward), else right here."""
        live_keys = max(starts) + width
        if padded:
            rows, cols, keys = self.graphs.shape(len(seqs), live_keys)
        else:
            rows, cols, keys = len(seqs), max(len(seq.block_table) for seq in seqs), live_keys
        host = self.pack(seqs, width, starts, tokens, rows, cols)
        is_cuda = self.device.type == "cuda"
        packed = torch.tensor(host, dtype=torch.long, pin_memory=is_cuda).to(self.device, non_blocking=is_cuda)
        views = unpack(packed, rows, width, cols)
        if not padded:
            derive_positions(views["positions"], views["slot_mapping"], views["block_tables"], views["context_lens"],
                             width, self.page_size)
        if not self.is_hybrid:
            views["state_slots"] = None
        return AttentionMetadata(num_seqs=rows, width=width, **views, max_context_len=keys, page_size=self.page_size,
                                 kv=self.target_kv.layers, states=self.states,
                                 keep_steps=self.is_hybrid and width > 1, packed=packed)

    def pack(self, seqs: list[Sequence], width: int, starts: list[int], tokens: list[list[int]],
             rows: int, cols: int) -> list[int]:
        """Host ints in `unpack`'s layout; padding rows use page 0 and state slot 0. Positions
        and slot_mapping are left 0: `derive_positions` computes them on the device from
        context_lens and the block tables, so the host's work grows with pages, not tokens."""
        ids, tables, context_lens, state_slots = [], [], [], []
        for seq, start, row in zip(seqs, starts, tokens):
            ids += row
            tables += seq.block_table + [0] * (cols - len(seq.block_table))
            context_lens.append(start + width)
            state_slots.append(seq.state_slot or 0)
        num_padding = rows - len(seqs)
        ids += [0] * (num_padding * width)
        tables += [0] * (num_padding * cols)
        context_lens += [width] * num_padding                   # positions 0 … T − 1, inside page 0
        state_slots += [0] * num_padding
        return ids + [0] * (2 * rows * width) + tables + context_lens + state_slots

    # -- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seq: Sequence, num_tokens: int) -> FirstToken | None:
        """Compute the next num_tokens positions of seq; return its first output token when the
        prompt is done and nothing was generated yet (else None)."""
        start = seq.num_cached
        self.clear_states([seq])
        if seq.restore_from is not None:            # [prefix] a hybrid hit resumes from its snapshot
            self.states.copy(seq.restore_from, seq.state_slot)
            seq.restore_from = None
        meta = self.prepare([seq], num_tokens, [start], [seq.tokens[start: start + num_tokens]])
        meta.keep_steps = False
        out = self.target(meta.input_ids, meta.positions, meta, self.capture_layers)
        self.num_forwards += 1
        if self.draft is not None:
            self.draft.append_context(out.features, meta.positions, meta.slot_mapping, self.draft_kv.layers)
        if seq.snapshot_into is not None:           # [prefix] the state at this chunk's end, for the tree
            self.states.copy(seq.state_slot, seq.snapshot_into)
        seq.num_cached += num_tokens
        if seq.is_prefilling or seq.request.output_ids:
            return None
        logits = self.target.compute_logits(out.hidden[-1:])                      # [1, V]
        raw = self.raw_logprobs([seq], logits.view(1, 1, -1))[0]          # before any processing
        if self.processor_of(seq) is not None:
            logits = seq.logits_processor.rows(logits, [])
        token = int(sample(logits[0], seq.request.params, seq.generator))
        return FirstToken(token, self.scored(seq, raw, [token]))

    def processor_of(self, seq: Sequence) -> LogitsProcessor | None:
        """The sequence's logits processor, made here (the engine thread) when first needed;
        None for a request that changes nothing in the distribution."""
        if seq.logits_processor is None and seq.request.processes_logits:
            seq.logits_processor = LogitsProcessor(seq.request, self.target.lm_head.weight.shape[0], self.device)
        return seq.logits_processor

    # -- decode -----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> DecodeResult:
        """One cycle for every sequence: propose T − 1 drafts, verify T tokens, accept."""
        num_seqs, width = len(seqs), self.width
        for seq in seqs:
            self.processor_of(seq)
        mask = self.draft.mask_token_id if self.draft is not None else 0
        blocks = [[seq.anchor] + [mask] * (width - 1) for seq in seqs]          # [x, MASK × (T − 1)]
        meta = self.prepare(seqs, width, [seq.num_cached for seq in seqs], blocks, padded=self.graphs is not None)
        if self.graphs is not None:
            meta = self.graphs.bind(meta)
        proposal = None
        if self.draft is not None:
            proposal = propose(self.run_forward("propose", self.draft_proposal, meta), seqs)
            meta.input_ids.view(meta.num_seqs, width)[:num_seqs, 1:] = proposal.drafts  # [x, d1 … dT−1]
        logits = self.run_forward("verify", self.target_logits, meta)[: num_seqs * width]
        logits = logits.view(num_seqs, width, -1)
        raw = self.raw_logprobs(seqs, logits)                                   # before any processing
        num_accepted, new_tokens = accept(seqs, proposal, logits, process_verify(seqs, proposal, logits))
        if self.is_hybrid:
            self.snapshot_page_boundaries(seqs, num_accepted, from_stash=meta.keep_steps)
        if meta.keep_steps:
            self.states.select(meta.state_slots[:num_seqs], [a + 1 for a in num_accepted])
        logprobs = [self.scored(seq, rows, tokens) for seq, rows, tokens in zip(seqs, raw, new_tokens)]
        return DecodeResult(num_accepted, new_tokens, logprobs, [width - 1] * num_seqs)

    @staticmethod
    def raw_logprobs(seqs: list[Sequence], logits: torch.Tensor) -> list[torch.Tensor | None]:
        """logits [B, T, V] → per sequence that asked for logprobs, the log-softmax of its rows,
        taken before sampling may process the logits (the raw distribution, as vLLM reports)."""
        return [log_softmax_rows(logits[b]) if seq.request.num_logprobs is not None else None
                for b, seq in enumerate(seqs)]

    @staticmethod
    def scored(seq: Sequence, rows: torch.Tensor | None, tokens: list[int]) -> list[TokenLogprob] | None:
        return None if rows is None else token_logprobs(rows, tokens, seq.request.num_logprobs)

    def run_forward(self, kind: str, fn, meta: AttentionMetadata) -> torch.Tensor:
        self.num_forwards += 1
        if self.graphs is None:
            return fn(meta)

        def graphed(m: AttentionMetadata) -> torch.Tensor:
            derive_positions(m.positions, m.slot_mapping, m.block_tables, m.context_lens, m.width, self.page_size)
            return fn(m)
        return self.graphs.run(kind, graphed, meta)

    def draft_proposal(self, meta: AttentionMetadata):
        """The draft's B blocks [x, MASK × (T − 1)] at the verify's positions, seeing the
        committed context (num_cached positions) of the draft pool → what the draft proposes
        from: DFlash 1 logits [B, T − 1, V] (slot i predicts d_i), or DFlash 2's CandidateWalk
        (candidates, edge scores, greedy drafts)."""
        width = meta.width
        draft_meta = dataclasses.replace(meta, kv=self.draft_kv.layers, context_lens=meta.context_lens - width,
                                         states=None, state_slots=None, keep_steps=False, shared={})
        hidden = self.draft(self.target.embed(meta.input_ids), meta.positions, draft_meta)
        anchors = meta.input_ids.view(meta.num_seqs, width)[:, 0]
        return self.draft.propose(hidden.view(meta.num_seqs, width, -1), anchors, self.target.lm_head)

    def target_logits(self, meta: AttentionMetadata) -> torch.Tensor:
        """Target forward → logits [B·T, V]; the features of all T positions join the draft's
        context (those past the accepted prefix lie past the sequence's length: masked, then
        overwritten)."""
        out = self.target(meta.input_ids, meta.positions, meta, self.capture_layers)
        if self.draft is not None:
            self.draft.append_context(out.features, meta.positions, meta.slot_mapping, self.draft_kv.layers)
        return self.target.compute_logits(out.hidden)

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
            self.states.select(torch.tensor(slots, device=self.device), kept, keep_stash=True, rows=rows)
        elif slots:
            for row, slot in zip(rows, slots):
                self.states.copy(seqs[row].state_slot, slot)

    def clear_states(self, seqs: list[Sequence]) -> None:
        """Zero the recurrent state of sequences starting from their first token."""
        if self.is_hybrid:
            self.states.clear([seq.state_slot for seq in seqs if seq.num_cached == 0])


def derive_positions(positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, width: int, page_size: int) -> None:
    """Fill positions and slot_mapping [B·T] in place: row b feeds positions context_lens[b] − T …
    context_lens[b] − 1, stored at its block table's slot of each (graph-safe: no host sync)."""
    rows = positions.view(-1, width)
    torch.add((context_lens - width)[:, None], torch.arange(width, device=positions.device), out=rows)
    pages = block_tables.gather(1, rows // page_size)
    torch.add(pages * page_size, rows % page_size, out=slot_mapping.view(-1, width))
