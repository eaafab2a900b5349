"""The step on every rank: rank 0 decides, the other ranks compute the same forwards.

Rank 0's LeaderRunner sends each step once, as a StepPlan (what its ModelRunner.launch reads of
the batch's sequences: positions, block tables, state slots, prefill chunks), then runs the step
as on one device (launch, then collect). Each worker's WorkerRunner runs ModelRunner.step on the plan's SeqViews: the
same metadata, the same forwards, so every collective inside them (the row-parallel all-reduces,
the vocab-parallel lookups, the logits' all-gather) meets its peers in the same order. What only
rank 0 can decide — sampling, grammars, acceptance — it does on the gathered logits, which
every rank holds whole; the workers skip it. Two results of those decisions reach the workers:
- the drafts of a DFlash step, broadcast as one [B, T − 1] tensor between the draft forward and
  the verify (they may be sampled with a request's own generator, which only rank 0 has);
- each sequence's accepted length, carried by the next StepPlan: a worker selects a hybrid
  target's recurrent state (StatePool.select, from the verify's stash, which nothing touches
  in between) before that step's forwards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from blockspec.distributed.group import TPGroup
from blockspec.engine.memory import PoolSize
from blockspec.engine.model_runner import DecodeResult, Launched, ModelRunner, StepResult
from blockspec.engine.scheduler import Batch, FirstToken
from blockspec.engine.sequence import Sequence
from blockspec.engine.spec.dflash import Proposal


@dataclass(frozen=True)
class RequestView:
    """What the runner reads of a request on a worker: nothing that changes the forwards (a
    sharded target has no vision tower, so no request has images)."""
    output_ids: tuple[int, ...]
    processes_logits: bool = False
    num_logprobs: None = None
    multimodal: None = None


class TokensFrom:
    """A sequence's tokens from position `start` on (a prefill chunk), indexed as the whole list."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, index: slice) -> list[int]:
        return self.tokens[index.start - self.start: index.stop - self.start]


@dataclass
class SeqView:
    """A sequence as a worker's runner sees it for one step (picklable, no request behind it)."""
    num_cached: int
    block_table: list[int]
    state_slot: int | None
    anchor: int
    chunk: list[int]                        # prefill: the chunk's tokens; decode: none
    prefill_len: int
    has_output: bool
    restore_from: int | None = None
    snapshot_into: int | None = None
    pending_slot: int | None = None
    pending_boundary: int | None = None
    logits_processor: None = None

    @staticmethod
    def of(seq: Sequence, num_tokens: int = 0) -> "SeqView":
        chunk = seq.tokens[seq.num_cached: seq.num_cached + num_tokens] if num_tokens else []
        return SeqView(seq.num_cached, list(seq.block_table), seq.state_slot, seq.anchor, chunk, seq.prefill_len,
                       bool(seq.request.output_ids), seq.restore_from, seq.snapshot_into, seq.pending_slot)

    @property
    def tokens(self) -> TokensFrom:
        return TokensFrom(self.num_cached, self.chunk)

    @property
    def request(self) -> RequestView:
        return RequestView((0,) if self.has_output else ())


@dataclass
class StepPlan:
    """One step as rank 0 scheduled it, and the accepted lengths of the decode step before it."""
    prefill: list[tuple[SeqView, int]]
    decode: list[SeqView]
    num_drafts: list[int]
    accepted: list[int] | None = None
    draft_width: int = 0

    def batch(self) -> Batch:
        return Batch(list(self.prefill), list(self.decode), list(self.num_drafts), self.draft_width)


def agreed_pool(tp: TPGroup, size: PoolSize) -> PoolSize:
    """Every rank's pool gets the fewest pages any rank measured (rank 0 schedules for all)."""
    pages = torch.tensor([size.num_pages], dtype=torch.long)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=tp.control)
    return dataclasses.replace(size, num_pages=int(pages.item()))


class LeaderRunner(ModelRunner):
    """Rank 0: sends each step's plan, broadcasts the drafts, keeps the accepted lengths for the
    next plan. A failure inside a step leaves the ranks' collectives out of step: fatal. No early
    drafts: every draft forward follows a plan the workers received."""
    supports_early_drafts = False

    def __init__(self, target, draft, config, tp: TPGroup, on_fatal: Callable[[str], None]) -> None:
        self.tp, self.on_fatal = tp, on_fatal
        self._accepted: list[int] | None = None
        super().__init__(target, draft, config)

    def size_pool(self, graphed: bool) -> PoolSize:
        return agreed_pool(self.tp, super().size_pool(graphed))

    def launch(self, batch: Batch) -> Launched:
        plan = StepPlan([(SeqView.of(seq, n), n) for seq, n in batch.prefill],
                        [SeqView.of(seq) for seq in batch.decode], list(batch.num_drafts), self._accepted,
                        batch.draft_width)
        self._accepted = None
        try:
            self.tp.broadcast_message(plan)
            return super().launch(batch)
        except BaseException as exc:
            self.fail(exc)
            raise

    def collect(self, launched: Launched) -> StepResult:
        try:
            return super().collect(launched)
        except BaseException as exc:              # the workers would keep states rank 0 did not select
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        self.on_fatal(f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})")

    def proposal_of(self, drafted, seqs: list[Sequence]) -> Proposal:
        proposal = super().proposal_of(drafted, seqs)
        self.tp.broadcast_tensor(proposal.drafts.long().contiguous())
        return proposal

    def finish_decode(self, decode, num_drafts, logits, proposal, verdict=None) -> DecodeResult:
        result = super().finish_decode(decode, num_drafts, logits, proposal, verdict)
        self._accepted = list(result.num_accepted)
        return result


class WorkerRunner(ModelRunner):
    """Rank > 0: runs rank 0's plans; decides nothing."""
    supports_early_drafts = False

    def __init__(self, target, draft, config, tp: TPGroup) -> None:
        self.tp = tp
        self._verified: list[SeqView] = []
        super().__init__(target, draft, config)

    def size_pool(self, graphed: bool) -> PoolSize:
        return agreed_pool(self.tp, super().size_pool(graphed))

    def run(self, plan: StepPlan) -> None:
        if plan.accepted is not None:
            self.select_accepted(plan.accepted)
        self.step(plan.batch())

    def proposal_of(self, drafted, seqs: list[SeqView]) -> Proposal:
        num_slots = drafted.drafts.shape[1]         # W − 1: DFlash 2's walk or DFlash 1's readout
        drafts = torch.empty(len(seqs), num_slots, dtype=torch.long, device=self.device)
        return Proposal(self.tp.broadcast_tensor(drafts), [None] * len(seqs))

    def stage_readback(self, launched: Launched) -> Launched:
        return launched                          # nothing to read: rank 0 decides

    def first_tokens(self, batch: Batch, logits: torch.Tensor | None, draws=None) -> list[FirstToken | None]:
        for seq, n in batch.prefill:
            seq.num_cached += n
        return [None] * len(batch.prefill)

    def finish_decode(self, decode, num_drafts, logits, proposal, verdict=None) -> None:
        self._verified = decode

    def select_accepted(self, accepted: list[int]) -> None:
        """The recurrent state after each sequence's accepted prefix, as rank 0 selected it."""
        if not self.is_hybrid:
            return
        self.snapshot_page_boundaries(self._verified, accepted, from_stash=self.draft is not None)
        if self.draft is not None:
            self.states.select([seq.state_slot for seq in self._verified], [a + 1 for a in accepted])


@dataclass
class Load:
    """Build a runner on every rank from `make(tp, *args)` → (target, draft, EngineConfig): a
    module-level function, so that it pickles by name (each rank loads its own share)."""
    make: Callable
    args: tuple


@dataclass
class Unload:
    """Drop the runner (an LLM closed; another may be loaded next)."""


@dataclass
class Exit:
    """Stop the worker process."""
