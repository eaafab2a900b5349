"""Which sequences run in the next step, how many tokens each, and what their results mean.

A step is {sequence: number of tokens} under a token budget (max_num_batched_tokens), as in
vLLM v1: every decoding sequence's verify rows (its anchor plus k_i drafts; k_i = 0 is a plain
decode row) and, with what the budget leaves, prefill chunks of the prefilling sequences, oldest
first (at most max_prefill_tokens prompt positions per step). Decoding never waits behind a
prompt: a chunk of it rides along with the decode rows in the same step; nor a prompt behind the
drafts: while one prefills, drafts are cut so that it gets at least half of what the decode rows
leave (leave_room_for_prompts).

- Admission is FIFO: the oldest waiting sequence goes first, and nobody jumps a sequence that
  does not fit yet (no starvation). A sequence is admitted when a seat (max_num_seqs), a state
  slot (hybrid targets) and the pages for its prompt plus one block are free.
- Memory is the cache manager's (cache/manager.py), which the scheduler owns: before a step each
  sequence gets pages for its tokens; when the pool runs dry the newest sequence is preempted
  (pages and slot freed, recomputed later from its tokens), never a crash.
- verify_widths is the one place that decides k_i (the drafts each sequence verifies).
- postprocess commits each sequence's new tokens (Request.commit cuts at stop ids, max_tokens
  and the context limit), rewinds it by length to its accepted prefix, and finishes it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from blockspec.cache import CacheManager, PrefixCacheManager
from blockspec.config import EngineConfig
from blockspec.engine.logprobs import TokenLogprob
from blockspec.engine.sequence import Sequence
from blockspec.engine.spec.policy import keeps_whole_block


@dataclass
class FirstToken:
    """The token sampled at the prompt's end, with its logprob if the request asked."""
    token_id: int
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Batch:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, chunk length)
    decode: list[Sequence] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)                 # k_i per decode sequence
    draft_width: int = 0                # the draft's block this step (≥ max k_i + 1); 0: the full block
    arm: str = "policy"                 # adaptive's measured choice this step (policy.Arms): "policy" or "whole"
    learns: bool = False                # adaptive: a learning cycle (every sequence its whole block)
    drafted: list[int] | None = None    # late widths (CPU): the k_i drafted for, before the runner refined num_drafts

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.prefill) + sum(k + 1 for k in self.num_drafts)


@dataclass
class Emitted:
    """What one step produced for one sequence (tokens already committed to its request)."""
    seq: Sequence
    token_ids: list[int]


class Scheduler:
    """width: tokens of a full verify block (the block size with a draft, else 1)."""

    def __init__(self, config: EngineConfig, cache: CacheManager, width: int) -> None:
        self.config, self.cache, self.width = config, cache, width
        self.speculation = None                      # the runner's Speculation (the engine sets it)
        self.prefix_cache = isinstance(cache, PrefixCacheManager)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.unservable: list[Sequence] = []        # too long for the whole pool: the engine ends them
        self.seat_limit = config.max_num_seqs         # lowered by the engine after an out-of-memory
        self._num_steps = 0
        self._last_decoded: dict[int, int] = {}      # id(seq) → the step it last decoded in
        self._num_removed = 0                        # sequences taken out of running (see is_running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- schedule ---------------------------------------------------------------------------

    def verify_widths(self, decoding: list[Sequence]) -> list[int]:
        """k_i: how many drafts each decoding sequence may verify this step (0 … width − 1; 0 is
        a plain decode row, and that sequence does not draft), final before anything runs: the
        speculation policy's (engine/spec/policy.py), else the full block."""
        if self.speculation is not None:
            return self.speculation.planned_widths(decoding)
        return [self.width - 1] * len(decoding)

    def schedule(self) -> Batch:
        self._admit()
        budget = self.config.max_num_batched_tokens
        self._num_steps += 1
        decoding, prefilling = self._split_running()
        # When the budget cannot hold every decoding sequence, the ones left out go first next
        # step (a stable sort: oldest first among equals), so none starves.
        last_decoded = self._last_decoded
        decoding.sort(key=lambda s: last_decoded.get(id(s), 0))
        decode: list[tuple[Sequence, int]] = []
        widths = self.leave_room_for_prompts(decoding, self.verify_widths(decoding), prefilling, budget)
        widths = self.fit_budget(decoding, widths, budget)
        removed = self._num_removed
        for seq, num_drafts in zip(decoding, widths):
            if num_drafts + 1 > budget:
                break                        # the rest decode next step (oldest first keeps order)
            # A sequence that drafts at all feeds the draft a block of up to T positions (the
            # step's draft width, decided after this loop): pages for T, whatever k it verifies.
            positions = self.width if num_drafts > 0 else 1
            if self.is_running(seq, removed) and self._make_room(seq, seq.num_cached + positions):
                decode.append((seq, num_drafts))
                budget -= num_drafts + 1
        chunks = self._chunks(prefilling, min(budget, self.config.max_prefill_tokens))
        # A prefill's pages may have preempted a decoding sequence scheduled above.
        if self._num_removed != removed:
            decode = [(seq, k) for seq, k in decode if seq in self.running]
        for seq, _ in decode:
            last_decoded[id(seq)] = self._num_steps
        seqs, ks = [seq for seq, _ in decode], [k for _, k in decode]
        width = self.speculation.draft_width(seqs, ks) if self.speculation is not None else 0
        return Batch(prefill=[(s, n) for s, n in chunks if s in self.running], decode=seqs, num_drafts=ks,
                     draft_width=width, arm=self.speculation.step_arm if self.speculation is not None else "policy",
                     learns=self.speculation is not None and self.speculation.step_learns)

    def _split_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode, and those that prefill, each in running order."""
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            (prefilling if seq.is_prefilling else decoding).append(seq)
        return decoding, prefilling

    def is_running(self, seq: Sequence, removed: int) -> bool:
        """Whether seq still runs, `removed` being _num_removed when the caller last knew it ran:
        the list is searched only after a sequence left it (a search per sequence per step was
        O(B²) at hundreds of sequences)."""
        return self._num_removed == removed or seq in self.running

    def leave_room_for_prompts(self, decoding: list[Sequence], widths: list[int], prefilling: list[Sequence],
                               budget: int) -> list[int]:
        """While prompts prefill, their chunks get at least half of what the decode rows leave of
        the budget (all they need if less): drafts are optional rows, cut from the longest k down
        (greedy output is the same at any k; sampling keeps its distribution). Without this, 32
        sequences verifying blocks of 16 fill a budget of 512 and a prompt that arrives waits
        until they end (97.7 s for 16k tokens on the H200). A seeded sampling request keeps its
        k (keeps_whole_block: its output must not depend on the load)."""
        room = budget - len(decoding)
        demand = sum(s.prefill_len - s.num_cached for s in prefilling)
        if room <= 0 or demand <= 0:
            return widths
        return cut_drafts(decoding, widths, room - min(demand, self.config.max_prefill_tokens, max(1, room // 2)))

    @staticmethod
    def fit_budget(decoding: list[Sequence], widths: list[int], budget: int) -> list[int]:
        """Where the budget does not hold every decoding sequence's rows, the drafts are cut (from
        the longest k down) until every sequence fits — none at all where the sequences' own rows
        exceed it, and those take turns — instead of leaving sequences out of the step: a slot
        deep in one block is worth less than the first slots of another (survival only falls
        along a block), and no sequence sits a step out. Round 48 on the H200: 256 sequences
        verifying blocks of 16 under 2,048 tokens decoded 128 a step, and speculation fell to
        0.82 × plain. A seeded sampling request keeps its k."""
        if sum(widths) + len(decoding) <= budget:
            return widths
        return cut_drafts(decoding, widths, budget - len(decoding))   # < 0: no drafts, rows take turns

    def _admit(self) -> None:
        promised = 0                    # pages the sequences admitted in this call will claim
        while self.waiting and len(self.running) < self.seat_limit:
            seq = self.waiting[0]
            hit = self.cache.take_hit(seq) if self.prefix_cache else None   # [prefix] cached pages need no room
            need = self.cache.pages_needed(seq, seq.prefill_len + self.width)
            if need + promised > self.cache.num_free_pages or not self.cache.has_free_state_slot:
                if hit is not None:
                    self.cache.drop_hit(seq)
                if not self.running and need > self.cache.num_free_pages:
                    self.waiting.popleft()
                    self.unservable.append(seq)        # would not fit even in an empty pool
                    continue
                return
            promised += need
            self.waiting.popleft()
            self.cache.claim_state_slot(seq)
            if hit is not None:
                self.cache.admit(seq, hit)
            seq.mark_admitted()
            self.running.append(seq)

    def _chunks(self, prefilling: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        chunks = []
        for seq in prefilling:
            if budget == 0 or seq not in self.running:
                continue
            length = min(budget, seq.prefill_len - seq.num_cached)
            if self.prefix_cache:
                length = self.cache.chunk_length(seq, length)      # [prefix] hybrid snapshot points
            if self._make_room(seq, seq.num_cached + length):
                chunks.append((seq, length))
                budget -= length
        return chunks

    def _make_room(self, seq: Sequence, num_positions: int) -> bool:
        """Pages for seq's first num_positions. Short of pages, the newest running sequence is
        preempted — seq itself when it is the newest (as vLLM does): older sequences keep going."""
        if self.cache.pages_needed(seq, num_positions) == 0:
            return True                        # most decode steps: the pages it has hold the block
        while self.cache.pages_needed(seq, num_positions) > self.cache.num_free_pages:
            if self.running == [seq]:
                self.running.remove(seq)
                self._num_removed += 1
                self.cache.release(seq)
                self.unservable.append(seq)            # would not fit even alone
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.cache.grow(seq, num_positions)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free its pages and state; it waits at the front and recomputes from its tokens."""
        self.cache.release(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self._num_removed += 1
        self.waiting.appendleft(seq)

    # -- after the step ---------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        self.cache.release(seq)
        self._last_decoded.pop(id(seq), None)
        self._num_removed += 1
        for queue in (self.running, self.waiting, self.unservable):
            if seq in queue:
                queue.remove(seq)

    def postprocess_prefill(self, seq: Sequence, first_token: FirstToken | None) -> Emitted | None:
        if self.prefix_cache:
            self.cache.publish(seq, after_prefill=True)
        if first_token is None:
            return None
        now = time.perf_counter()
        seq.first_token_at = now
        if seq.request.first_token_at is None:          # a preempted sequence's recompute is not its first
            seq.request.first_token_at = now
        seq.request.stats.prefill_s = now - (seq.admitted_at or now)
        return Emitted(seq, commit(seq, [first_token.token_id], first_token.logprobs))

    def postprocess_decode(self, seq: Sequence, num_accepted: int, new_tokens: list[int],
                           logprobs: list[TokenLogprob] | None = None, num_drafts: int | None = None) -> Emitted:
        """One sequence's cycle: commit its a + 1 new tokens, rewind it by length, count it.
        num_drafts: the k it verified (the full block when not given)."""
        num_drafts = self.width - 1 if num_drafts is None else num_drafts
        allowed = min(num_drafts + 1, seq.request.num_allowed)      # tokens this cycle could commit
        committed = commit(seq, new_tokens, logprobs)
        # x and d_1 … d_a stay in the pools; the bonus (the next x) is fed by the next cycle.
        seq.num_cached += num_accepted + 1
        if self.prefix_cache:
            self.cache.publish(seq, after_prefill=False)
        # Stats as if the block had been cut to the allowed length (drafts past it count for
        # nothing); acceptance length = accepted + 1 holds for every cut (stop id or length).
        accepted = max(0, min(num_accepted, len(committed) - 1))
        record_cycle(seq, num_drafts=allowed - 1, num_accepted=accepted, committed=len(committed))
        return Emitted(seq, committed)


def commit(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
    """Request.commit, and the logits processor's committed state follows (engine/logits.py).
    Both or neither: if the processor's advance fails (out of memory on the device: the engine
    preempts and recomputes), the request's commit is undone, so its output never holds tokens
    that were not emitted, nor runs ahead of its processor."""
    request = seq.request
    num_output, num_logprobs = len(request.output_ids), len(request.output_logprobs)
    finish_reason = request.finish_reason
    committed = request.commit(tokens, logprobs)
    if seq.logits_processor is not None:
        try:
            seq.logits_processor.advance(committed)
        except BaseException:
            del request.output_ids[num_output:], request.output_logprobs[num_logprobs:]
            request.finish_reason, request.stats.output_tokens = finish_reason, num_output
            raise
    return committed


def record_cycle(seq: Sequence, num_drafts: int, num_accepted: int, committed: int) -> None:
    stats = seq.request.stats
    stats.cycles += 1
    stats.draft_tokens += num_drafts
    stats.accepted_tokens += num_accepted
    stats.acceptance_lengths.append(committed)
    stats.verify_widths.append(num_drafts)
    if seq.first_token_at is not None:
        stats.decode_s = time.perf_counter() - seq.first_token_at


def cut_drafts(decoding: list[Sequence], widths: list[int], spare: int) -> list[int]:
    """widths with the drafts cut to `spare` in all: the kept blocks (keeps_whole_block) count
    first; the others are lowered to one cap, the largest that fits, then one more each (in
    order) while drafts are left. Unchanged where they fit."""
    cut = [b for b, seq in enumerate(decoding) if widths[b] and not keeps_whole_block(seq)]
    spare -= sum(widths) - sum(widths[b] for b in cut)           # the kept blocks come first
    if not cut or sum(widths[b] for b in cut) <= spare:
        return widths                   # nothing to cut (plain rows, kept blocks): the rows take turns
    spare, out = max(spare, 0), list(widths)
    cap, top = 0, max(widths[b] for b in cut)    # the largest per-sequence cap that fits, then one more each
    while cap < top and sum(min(widths[b], cap + 1) for b in cut) <= spare:
        cap += 1
    for b in cut:
        out[b] = min(widths[b], cap)
    left = spare - sum(out[b] for b in cut)
    for b in cut:
        if left > 0 and out[b] < widths[b]:
            out[b], left = out[b] + 1, left - 1
    return out
