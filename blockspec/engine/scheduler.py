"""Which sequences run in the next step, and what their results mean.

- Admission is FIFO: the oldest waiting sequence goes first, and nobody jumps a sequence that
  does not fit yet (no starvation). A sequence is admitted when a seat (max_num_seqs), a state
  slot (hybrid targets) and the pages for its prompt plus one block are free.
- A step is either prefill chunks (up to max_prefill_tokens positions over the prefilling
  sequences, oldest first) or one DFlash cycle of every decoding sequence. When both kinds wait,
  they alternate, so a long prompt never stalls the others for more than one chunk.
- Before a cycle each sequence gets pages for its block; when the pool runs dry the newest
  sequence is preempted (pages and slot freed, recomputed later from its tokens), never a crash.
- postprocess commits each sequence's new tokens (Request.commit cuts at stop ids, max_tokens
  and the context limit), rewinds it by length to its accepted prefix, and finishes it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from blockspec.config import EngineConfig
from blockspec.engine.logprobs import TokenLogprob
from blockspec.engine.model_runner import FirstToken, ModelRunner
from blockspec.engine.sequence import Sequence


@dataclass
class Batch:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, chunk length)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass
class Emitted:
    """What one step produced for one sequence (tokens already committed to its request)."""
    seq: Sequence
    token_ids: list[int]


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config, self.runner = config, runner
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.unservable: list[Sequence] = []        # too long for the whole pool: the engine ends them
        self.seat_limit = config.max_num_seqs         # lowered by the engine after an out-of-memory
        self._last_was_prefill = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        self._admit()
        prefilling = [s for s in self.running if s.is_prefilling]
        decoding = [s for s in self.running if not s.is_prefilling]
        if prefilling and not (decoding and self._last_was_prefill):
            self._last_was_prefill = True
            return Batch(prefill=self._chunks(prefilling))
        self._last_was_prefill = False
        return Batch(decode=self._reserve_blocks(decoding))

    def _admit(self) -> None:
        promised = 0                    # pages the sequences admitted in this call will claim
        while self.waiting and len(self.running) < self.seat_limit:
            seq = self.waiting[0]
            hit = self.runner.take_hit(seq)            # [prefix] cached pages need no room
            need = self.runner.pages_needed(seq, seq.prefill_len + self.runner.width)
            if need + promised > self.runner.allocator.num_free or not self.runner.has_free_state_slot:
                if hit is not None:
                    self.runner.drop_hit(seq)
                if not self.running and need > self.runner.allocator.num_free:
                    self.waiting.popleft()
                    self.unservable.append(seq)        # would not fit even in an empty pool
                    continue
                return
            promised += need
            self.waiting.popleft()
            self.runner.claim_state_slot(seq)
            self.runner.restore_snapshot(seq, hit)
            if hit is not None and seq.num_preemptions == 0:
                seq.request.stats.cached_tokens = seq.num_cached
                self.runner.prefix.record_query(len(seq.request.prompt_ids), seq.num_cached)
            seq.mark_admitted()
            self.running.append(seq)

    def _chunks(self, prefilling: list[Sequence]) -> list[tuple[Sequence, int]]:
        budget, chunks = self.config.max_prefill_tokens, []
        for seq in prefilling:
            if budget == 0 or seq not in self.running:
                continue
            length = self.runner.chunk_end(seq, min(budget, seq.prefill_len - seq.num_cached))
            if self._make_room(seq, seq.num_cached + length):
                chunks.append((seq, length))
                budget -= length
        return [(seq, length) for seq, length in chunks if seq in self.running]

    def _reserve_blocks(self, decoding: list[Sequence]) -> list[Sequence]:
        """Pages for every decoding sequence's next block, oldest first; when the pool runs dry
        the newest running sequences are preempted."""
        batch = []
        for seq in decoding:
            if seq in self.running and self._make_room(seq, seq.num_cached + self.runner.width):
                batch.append(seq)
        return [seq for seq in batch if seq in self.running]

    def _make_room(self, seq: Sequence, num_positions: int) -> bool:
        """Pages for seq's first num_positions. Short of pages, the newest running sequence is
        preempted — seq itself when it is the newest (as vLLM does): older sequences keep going."""
        while self.runner.pages_needed(seq, num_positions) > self.runner.allocator.num_free:
            if self.running == [seq]:
                self.running.remove(seq)
                self.runner.release(seq)
                self.unservable.append(seq)            # would not fit even alone
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.runner.grow(seq, num_positions)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free its pages and state; it waits at the front and recomputes from its tokens."""
        self.runner.release(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # -- after the step ---------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        self.runner.release(seq)
        for queue in (self.running, self.waiting, self.unservable):
            if seq in queue:
                queue.remove(seq)

    def postprocess_prefill(self, seq: Sequence, first_token: FirstToken | None) -> Emitted | None:
        self.runner.publish(seq, after_prefill=True)
        if first_token is None:
            return None
        now = time.perf_counter()
        seq.first_token_at = now
        seq.request.stats.prefill_s = now - (seq.admitted_at or now)
        return Emitted(seq, commit(seq, [first_token.token_id], first_token.logprobs))

    def postprocess_decode(self, seq: Sequence, num_accepted: int, new_tokens: list[int],
                           logprobs: list[TokenLogprob] | None = None) -> Emitted:
        """One sequence's cycle: commit its a + 1 new tokens, rewind it by length, count it."""
        allowed = min(self.runner.width, seq.request.num_allowed)      # tokens this cycle could commit
        committed = commit(seq, new_tokens, logprobs)
        # x and d_1 … d_a stay in the pools; the bonus (the next x) is fed by the next cycle.
        seq.num_cached += num_accepted + 1
        self.runner.publish(seq, after_prefill=False)
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
    if seq.first_token_at is not None:
        stats.decode_s = time.perf_counter() - seq.first_token_at
