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

from blockspec.cache import KVPool, PageAllocator, StatePool
from blockspec.config import EngineConfig
from blockspec.engine.cuda_graphs import GraphedForwards
from blockspec.engine.sequence import Sequence
from blockspec.engine.spec.dflash import Proposal, accept, sample_drafts
from blockspec.layers import AttentionMetadata
from blockspec.sampling import sample


@dataclass
class DecodeResult:
    num_accepted: list[int]          # drafts each sequence's verify accepted
    new_tokens: list[list[int]]      # a_b + 1 tokens per sequence (before stop / length cuts)


class ModelRunner:
    def __init__(self, target: nn.Module, draft: nn.Module | None, config: EngineConfig) -> None:
        self.target, self.config = target, config
        self.draft = draft if draft is not None and config.block_size > 1 else None
        self.width = config.block_size if self.draft is not None else 1
        weight = target.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        target.capture_layers = tuple(self.draft.target_layer_ids) if self.draft is not None else ()
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.total_pages)
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
        self.states = StatePool(config.max_num_seqs + 1, shapes, self.dtype, self.device) if shapes else None
        self.num_forwards = 0                            # target + draft forwards, for tests and stats
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = self.make_graphs(capture=True)

    def make_graphs(self, capture: bool) -> GraphedForwards:
        """The decode cycle through fixed-shape buffers: CUDA graphs, or (capture=False) the
        same padded path run eagerly, which CPU tests hold to the eager one."""
        return GraphedForwards(self.width, self.config.max_num_seqs, self.config.pages_per_seq,
                               self.page_size, self.device, capture)

    @property
    def is_hybrid(self) -> bool:
        return self.states is not None

    # -- metadata ---------------------------------------------------------------------------

    def metadata(self, seqs: list[Sequence], width: int, starts: list[int]) -> AttentionMetadata:
        """The target's metadata for B sequences feeding `width` tokens from starts[b]."""
        page = self.page_size
        positions = [start + j for start in starts for j in range(width)]
        slots = []
        for seq, start in zip(seqs, starts):
            table = seq.block_table
            slots += [table[p // page] * page + p % page for p in range(start, start + width)]
        max_pages = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_pages - len(seq.block_table)) for seq in seqs]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)   # noqa: E731
        state_slots = as_tensor([seq.state_slot for seq in seqs]) if self.is_hybrid else None
        return AttentionMetadata(
            num_seqs=len(seqs), width=width, positions=as_tensor(positions), slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables), context_lens=as_tensor([s + width for s in starts]),
            max_context_len=max(starts) + width, page_size=page, kv=self.target_kv.layers,
            states=self.states, state_slots=state_slots, keep_steps=self.is_hybrid and width > 1)

    # -- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seq: Sequence, num_tokens: int) -> int | None:
        """Compute the next num_tokens positions of seq; return its first output token when the
        prompt is done and nothing was generated yet (else None)."""
        start = seq.num_cached
        meta = self.metadata([seq], num_tokens, [start])
        meta.keep_steps = False
        ids = torch.tensor(seq.tokens[start: start + num_tokens], dtype=torch.long, device=self.device)
        out = self.target(ids, meta.positions, meta)
        self.num_forwards += 1
        if self.draft is not None:
            self.draft.append_context(out.features, meta.positions, meta.slot_mapping, self.draft_kv.layers)
        seq.num_cached += num_tokens
        if seq.is_prefilling or seq.request.output_ids:
            return None
        logits = self.target.compute_logits(out.hidden[-1:])                      # [1, V]
        return int(sample(logits[0], seq.request.params, seq.generator))

    # -- decode -----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> DecodeResult:
        """One cycle for every sequence: propose T − 1 drafts, verify T tokens, accept."""
        width = self.width
        meta = self.metadata(seqs, width, [seq.num_cached for seq in seqs])
        anchors = torch.tensor([seq.anchor for seq in seqs], dtype=torch.long, device=self.device)
        proposal = self.propose(seqs, anchors, meta) if self.draft is not None else None
        block = anchors[:, None] if proposal is None else torch.cat((anchors[:, None], proposal.drafts), dim=1)
        logits = self.verify(block.reshape(-1), meta).view(len(seqs), width, -1)   # [B, T, V]
        num_accepted, new_tokens = accept(seqs, proposal, logits)
        if meta.keep_steps:
            kept = torch.tensor(num_accepted, device=self.device) + 1
            self.states.select(meta.state_slots, kept)
        return DecodeResult(num_accepted, new_tokens)

    def propose(self, seqs: list[Sequence], anchors: torch.Tensor, meta: AttentionMetadata) -> Proposal:
        """The draft's block [x, MASK × (T − 1)] per sequence, at the verify's positions, seeing
        the committed context (num_cached positions) of the draft pool."""
        width = meta.width
        block = torch.full((len(seqs), width), self.draft.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = anchors
        draft_meta = dataclasses.replace(meta, kv=self.draft_kv.layers, context_lens=meta.context_lens - width,
                                         states=None, state_slots=None, keep_steps=False)
        logits = self.run_forward("propose", self.draft_logits, block.view(-1), draft_meta)
        return sample_drafts(logits, seqs)

    def verify(self, block_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Target logits [B·T, V] of every sequence's block."""
        return self.run_forward("verify", self.target_logits, block_ids, meta)

    def run_forward(self, kind: str, fn, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.num_forwards += 1
        if self.graphs is None:
            return fn(ids, meta)
        return self.graphs.run(kind, fn, ids, meta)

    def draft_logits(self, block_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[B·T] block ids → draft logits [B, T − 1, V] (slot i predicts d_i)."""
        hidden = self.draft(self.target.embed(block_ids), meta.positions, meta)
        hidden = hidden.view(meta.num_seqs, meta.width, -1)[:, 1:]
        return self.draft.read_logits(hidden, self.target.lm_head)

    def target_logits(self, block_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Target forward → logits [B·T, V]; the features of all T positions join the draft's
        context (those past the accepted prefix lie past the sequence's length: masked, then
        overwritten)."""
        out = self.target(block_ids, meta.positions, meta)
        if self.draft is not None:
            self.draft.append_context(out.features, meta.positions, meta.slot_mapping, self.draft_kv.layers)
        return self.target.compute_logits(out.hidden)

    # -- memory -----------------------------------------------------------------------------

    def pages_needed(self, seq: Sequence, num_positions: int) -> int:
        return max(0, -(-num_positions // self.page_size) - len(seq.block_table))

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Give seq pages for positions [0, num_positions)."""
        seq.block_table += self.allocator.allocate(self.pages_needed(seq, num_positions))

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def claim_state_slot(self, seq: Sequence) -> None:
        if self.is_hybrid:
            seq.state_slot = self.states.allocate()

    @property
    def has_free_state_slot(self) -> bool:
        return not self.is_hybrid or self.states.num_free > 0
