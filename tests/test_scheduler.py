"""The scheduler and its cache manager with no model at all: the step is computed, then
"run" by hand (num_cached advanced, tokens committed) as the engine would after a forward."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from blockspec.cache import CacheManager, DoubleFreeError
from blockspec.config import EngineConfig
from blockspec.engine.request import Request
from blockspec.engine.scheduler import Batch, Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.sampling import SamplingParams


def make_seq(name: str, prompt_len: int, max_tokens: int = 64) -> Sequence:
    request = Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), frozenset(), 4096)
    return Sequence(request, torch.device("cpu"))


def make_scheduler(num_pages: int = 64, page_size: int = 4, width: int = 4, num_slots: int = 0,
                   **config) -> Scheduler:
    settings = dict(max_model_len=1024, max_num_seqs=8, page_size=page_size, num_pages=num_pages,
                    block_size=width)
    settings.update(config)
    return Scheduler(EngineConfig(**settings), CacheManager(num_pages, page_size, num_slots), width)


def run_step(scheduler: Scheduler, batch: Batch) -> None:
    """What the engine does after the forward: prefill chunks advance; a finished prompt gets
    its first token (a preempted sequence's recompute does not: its anchor is committed already);
    each decode sequence accepts all its drafts."""
    for seq, length in batch.prefill:
        seq.num_cached += length
        if not seq.is_prefilling and not seq.request.output_ids:
            seq.request.commit([7])
    for seq, num_drafts in zip(batch.decode, batch.num_drafts):
        scheduler.postprocess_decode(seq, num_drafts, [7] * (num_drafts + 1), None, num_drafts)


def finish_done(scheduler: Scheduler) -> None:
    for seq in list(scheduler.running):
        if seq.request.is_finished:
            scheduler.finish(seq)


# -- fairness and the token budget ------------------------------------------------------------

def test_a_decoding_sequence_rides_in_every_step_while_a_long_prompt_prefills():
    """Never two prefill-only steps while a decode waits: here, stronger, no step leaves the
    decoding sequence out (a scheduler where prefill always wins fails at the second step)."""
    scheduler = make_scheduler(num_pages=256, max_prefill_tokens=16, max_num_batched_tokens=20)
    short = make_seq("short", 5)
    scheduler.add(short)
    run_step(scheduler, scheduler.schedule())           # short's whole prompt → it decodes
    assert not short.is_prefilling
    long = make_seq("long", 200)
    scheduler.add(long)
    steps = 0
    while long.is_prefilling:
        batch = scheduler.schedule()
        assert batch.decode == [short], f"step {steps} left the decoding sequence out"
        assert [s for s, _ in batch.prefill] == [long]
        assert batch.num_tokens <= 20
        run_step(scheduler, batch)
        steps += 1
    assert steps == -(-200 // 16)


def test_the_token_budget_caps_every_step_and_prefill_takes_what_decoding_leaves():
    scheduler = make_scheduler(num_pages=512, max_prefill_tokens=1000, max_num_batched_tokens=24)
    decoders = [make_seq(f"d{i}", 3) for i in range(3)]
    for seq in decoders:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())            # 9 prompt tokens: all three in one step
    assert all(not s.is_prefilling for s in decoders)
    prompt = make_seq("p", 100)
    scheduler.add(prompt)
    for _ in range(5):
        batch = scheduler.schedule()
        assert batch.num_drafts == [3, 3, 3]                   # the full block each
        assert batch.prefill == [(prompt, 24 - 12)]           # the budget's rest
        assert batch.num_tokens == 24
        run_step(scheduler, batch)


def test_a_prompt_gets_half_of_what_the_decode_rows_leave_when_the_drafts_would_fill_the_budget():
    """Four sequences verifying blocks of 4 fill a 16-token budget: a prompt that arrives gets
    (16 − 4) // 2 = 6 positions a step, the drafts cut from the longest k down to the 6 left (a
    scheduler that lets the drafts fill the budget never prefills it while they decode); a seeded
    sampling request keeps its whole block; with the prompt done, every block is whole again."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=16)
    decoders = [make_seq(f"d{i}", 3, max_tokens=500) for i in range(3)]
    seeded = Sequence(Request("seeded", [1, 2, 3], SamplingParams(max_tokens=500, temperature=0.8, seed=3),
                              frozenset(), 4096), torch.device("cpu"))
    for seq in [*decoders, seeded]:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()
    assert batch.num_drafts == [3, 3, 3, 3] and not batch.prefill            # the budget, whole
    run_step(scheduler, batch)
    prompt = make_seq("p", 100)
    scheduler.add(prompt)
    chunks = []
    while prompt.is_prefilling:
        batch = scheduler.schedule()
        assert batch.decode == [*decoders, seeded] and batch.num_drafts[3] == 3 and batch.num_tokens == 16
        chunks.append((batch.prefill[0][1], batch.num_drafts[:3]))
        run_step(scheduler, batch)
        assert len(chunks) <= 17
    assert chunks == [(6, [1, 1, 1])] * 16 + [(4, [2, 2, 1])]          # the last chunk needs 4: 2 more drafts
    batch = scheduler.schedule()             # no prompt: the five decoders share the budget (fit_budget)
    drafts = dict(zip(batch.decode, batch.num_drafts))
    assert set(drafts) == {*decoders, seeded, prompt} and batch.num_tokens == 16
    assert drafts[seeded] == 3 and sorted(drafts[s] for s in [*decoders, prompt]) == [2, 2, 2, 2]


def test_a_prompt_gets_the_one_row_the_decoders_leave():
    """Four decoders under a 5-token budget leave one row: it goes to the prompt, not to a draft."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=5)
    decoders = [make_seq(f"d{i}", 3, max_tokens=500) for i in range(4)]
    for seq in decoders:
        scheduler.add(seq)
    while any(seq.is_prefilling for seq in decoders):
        run_step(scheduler, scheduler.schedule())
    prompt = make_seq("p", 10)
    scheduler.add(prompt)
    for step in range(10):
        batch = scheduler.schedule()
        assert batch.num_drafts == [0, 0, 0, 0] and batch.prefill == [(prompt, 1)], (step, batch.num_drafts)
        run_step(scheduler, batch)
    assert not prompt.is_prefilling


def test_several_prompts_prefill_in_one_step():
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", 10 + i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.prefill == [(s, 10 + i) for i, s in enumerate(seqs)] and not batch.decode


def decoding_at_widths(prompt_len: int, widths: list[int]):
    """Sequences of prompt_len tokens prefilled in one step, then scheduled to verify `widths`
    drafts each (the policy's hook): (scheduler, seqs, that decode batch)."""
    scheduler = make_scheduler(num_pages=512)
    seqs = [make_seq(f"s{i}", prompt_len) for i in range(len(widths))]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    scheduler.verify_widths = lambda decoding: widths[: len(decoding)]
    return scheduler, seqs, scheduler.schedule()


def test_verify_widths_is_the_one_hook_for_k():
    scheduler, seqs, batch = decoding_at_widths(4, [0, 2, 3])
    assert batch.num_drafts == [0, 2, 3] and batch.num_tokens == 1 + 3 + 4
    before = [len(s.block_table) for s in seqs]
    run_step(scheduler, batch)
    assert [s.num_cached for s in seqs] == [4 + 1, 4 + 3, 4 + 4]
    assert before == [2, 2, 2]                        # 4 + k + 1 positions of 4 per page


def test_a_sequence_that_drafts_has_pages_for_the_whole_draft_block():
    """A sequence verifying k ≥ 1 drafts still feeds the draft a block of the full width at
    num_cached … num_cached + W − 1: its pages cover those positions (else the block's rows past
    its table land in page 0, shared by every sequence of the step); a plain row (k = 0) needs
    pages for its one position only. Prompts of 2 in pages of 4, blocks of 4: k = 1 verifies
    positions 2-3 (one page) but drafts 2-5 (two)."""
    _, seqs, batch = decoding_at_widths(2, [0, 1, 3])
    assert batch.num_drafts == [0, 1, 3] and [s.num_cached for s in seqs] == [2, 2, 2]
    assert [len(s.block_table) for s in seqs] == [1, 2, 2]

# -- memory -----------------------------------------------------------------------------------

def test_every_page_is_freed_exactly_once():
    cache = CacheManager(num_pages=10, page_size=4)
    seq = make_seq("a", 10)
    cache.grow(seq, 10)
    pages = list(seq.block_table)
    assert len(pages) == 3 and cache.num_free_pages == 6
    cache.release(seq)
    assert seq.block_table == [] and cache.num_free_pages == 9
    cache.release(seq)                                   # preempted, then ended: nothing twice
    assert cache.num_free_pages == 9
    with pytest.raises(DoubleFreeError):
        cache.pages.free(pages[:1])
    assert cache.num_free_pages == 9


def test_a_shared_page_is_freed_when_its_last_holder_lets_go():
    cache = CacheManager(num_pages=6, page_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    cache.grow(a, 8)
    cache.pages.incref(a.block_table[:1])                # b starts with a's first page (a prefix)
    b.block_table = a.block_table[:1]
    cache.grow(b, 8)
    assert cache.num_free_pages == 2
    cache.release(a)
    assert cache.num_free_pages == 3 and cache.pages.refcount(b.block_table[0]) == 1
    cache.release(b)
    assert cache.num_free_pages == 5


def test_preemption_and_ending_free_each_page_once_through_the_scheduler():
    """A sequence preempted for pages and later ended is released twice (preempt, finish);
    every page returns exactly once and the pool ends full."""
    scheduler = make_scheduler(num_pages=9, page_size=4, width=4, num_slots=8)
    a, b = make_seq("a", 8, max_tokens=10), make_seq("b", 8, max_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    preempted = False
    for _ in range(60):
        batch = scheduler.schedule()
        preempted |= b.num_preemptions > 0
        if batch.is_empty:
            break
        run_step(scheduler, batch)
        finish_done(scheduler)
    assert preempted and a.request.is_finished and b.request.is_finished
    for seq in (a, b):
        scheduler.finish(seq)
    assert scheduler.cache.num_free_pages == 8 and scheduler.cache.slots.num_free == 8


def test_admission_waits_for_free_pages_and_takes_the_oldest_first():
    scheduler = make_scheduler(num_pages=9, page_size=4, width=4)
    first, second = make_seq("first", 20), make_seq("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule()
    assert scheduler.running == [first]                  # 24 positions: 6 pages of 8; second needs 3
    assert list(scheduler.waiting) == [second]


def test_a_sequence_larger_than_the_pool_is_unservable():
    scheduler = make_scheduler(num_pages=5, page_size=4, width=4)
    seq = make_seq("big", 30)
    scheduler.add(seq)
    assert scheduler.schedule().is_empty and scheduler.unservable == [seq]


def test_admission_needs_a_free_state_slot():
    scheduler = make_scheduler(num_pages=64, num_slots=1)
    a, b = make_seq("a", 4), make_seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    assert scheduler.running == [a] and a.state_slot == 1 and b.state_slot is None
    scheduler.finish(a)
    scheduler.schedule()
    assert scheduler.running == [b] and b.state_slot == 1


def test_decoding_sequences_share_a_budget_their_blocks_overflow():
    """Four decoding sequences of 4-token blocks under a 13-token budget: every one decodes every
    step, their drafts cut from the longest down to the 9 the rows leave (3, 2, 2, 2), instead of
    three whole blocks and one sequence sitting the step out (fit_budget)."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=13)
    seqs = [make_seq(f"s{i}", 3) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    for _ in range(4):
        batch = scheduler.schedule()
        assert len(batch.decode) == 4 and batch.num_tokens == 13 and sorted(batch.num_drafts) == [2, 2, 2, 3]
        run_step(scheduler, batch)


def test_nothing_to_cut_leaves_the_rows_to_take_turns():
    """Plain rows beyond the budget, and seeded blocks (kept whole) beyond it: fit_budget has no
    draft to cut, so the widths stay and the rows that do not fit wait for the next step."""
    plain = [make_seq(f"p{i}", 3) for i in range(5)]
    assert Scheduler.fit_budget(plain, [0] * 5, 4) == [0] * 5
    seeded = [Sequence(Request(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.8, seed=i),
                               frozenset(), 4096), torch.device("cpu")) for i in range(3)]
    assert Scheduler.fit_budget(seeded, [3, 3, 3], 8) == [3, 3, 3]
    assert Scheduler.fit_budget([*seeded, *plain[:2]], [3, 3, 3, 2, 2], 8) == [3, 3, 3, 0, 0]


def test_decoding_sequences_beyond_the_budget_take_turns():
    """Five decoding sequences under a 4-token budget: four rows fit a step (no drafts); the one
    left out goes first in the next, so every sequence decodes in every other step at least."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=20)
    seqs = [make_seq(f"s{i}", 3) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())                  # the five prompts in one step
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=4)
    last_seen = {seq.request_id: 0 for seq in seqs}
    for step in range(1, 9):
        batch = scheduler.schedule()
        assert len(batch.decode) == 4 and batch.num_tokens == 4 and not any(batch.num_drafts)
        for seq in batch.decode:
            last_seen[seq.request_id] = step
        assert all(step - seen <= 1 for seen in last_seen.values()), (step, last_seen)
        run_step(scheduler, batch)


def test_a_cut_never_gives_a_sequence_more_drafts_than_it_planned():
    """Three decoders planned at k = 1, 3, 3 under a budget that leaves 6 drafts: the cut lowers
    the longest to one cap (2) and hands the draft left over to the first sequence below its own
    plan (1, 3, 2), never to one already at it (k = 1 is the first sequence's cap: its max_tokens,
    or what the policy found worth verifying)."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=9)
    seqs = [make_seq(f"s{i}", 3, max_tokens=500) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    scheduler.verify_widths = lambda decoding: [1, 3, 3][: len(decoding)]
    batch = scheduler.schedule()
    assert batch.decode == seqs and batch.num_drafts == [1, 3, 2] and batch.num_tokens == 9


def test_a_finished_sequence_leaves_no_turn_behind():
    """The decode turns (who waited longest goes first) are kept for running sequences only: one
    that ends takes its entry with it, so a server's scheduler does not grow with every request
    it ever served, nor a new sequence given a freed object's id inherit its turn."""
    scheduler = make_scheduler(num_pages=512, max_num_batched_tokens=64)
    for round_ in range(3):
        seqs = [make_seq(f"r{round_}-{i}", 3, max_tokens=6) for i in range(4)]
        for seq in seqs:
            scheduler.add(seq)
        while scheduler.has_work:
            run_step(scheduler, scheduler.schedule())
            finish_done(scheduler)
        assert all(seq.request.is_finished for seq in seqs)
        assert scheduler._last_decoded == {}, scheduler._last_decoded

# -- issue 36: the token budget and the queue, under load ----------------------------------------

def test_no_step_exceeds_the_token_budget_and_no_chunk_is_empty():
    """Budgets that are and are not multiples of the 4-token verify block, prompts arriving while
    others decode, several prefilling at once: every step carries at most the budget's rows, every
    prefill chunk is at least one token and every k is 0 … 3."""
    import random
    rng = random.Random(36)
    multi_prefill = remainder_taken = 0
    for budget in range(5, 24):
        scheduler = make_scheduler(num_pages=512, max_num_seqs=8, max_prefill_tokens=1000,
                                   max_num_batched_tokens=budget)
        pending = [make_seq(f"b{budget}-{i}", rng.randrange(1, 30), max_tokens=rng.randrange(4, 24))
                   for i in range(12)]
        for step in range(500):
            for _ in range(rng.randrange(0, 3)):
                if pending:
                    scheduler.add(pending.pop(0))
            batch = scheduler.schedule()
            assert batch.num_tokens <= budget, (budget, step, batch)
            assert all(length >= 1 for _, length in batch.prefill), (budget, step, batch.prefill)
            assert all(0 <= k <= 3 for k in batch.num_drafts)
            multi_prefill += len(batch.prefill) >= 2
            remainder_taken += budget % 4 != 0 and bool(batch.decode) and bool(batch.prefill)
            run_step(scheduler, batch)
            finish_done(scheduler)
            if not pending and not scheduler.has_work:
                break
        assert not pending and not scheduler.has_work, budget
    assert multi_prefill > 0 and remainder_taken > 0          # both shapes of step were met


def test_a_preempted_sequence_goes_back_to_the_head_of_the_waiting_queue():
    """a and b decode in a pool of 8 pages; c arrives later and waits for room; when the pool runs
    dry b (the newest running) is preempted and waits in front of c, and is admitted again first."""
    scheduler = make_scheduler(num_pages=9, page_size=4, width=4)
    a, b, c = make_seq("a", 8, max_tokens=16), make_seq("b", 8, max_tokens=16), make_seq("c", 14, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler, scheduler.schedule())
    assert scheduler.running == [a, b]
    scheduler.add(c)
    admissions: list[str] = []
    queue_at_preemption = None
    for _ in range(100):
        before = set(map(id, scheduler.running))
        batch = scheduler.schedule()
        if b.num_preemptions == 1 and queue_at_preemption is None:
            queue_at_preemption = [s.request_id for s in scheduler.waiting]
        admissions += [s.request_id for s in scheduler.running if id(s) not in before]
        if batch.is_empty and not scheduler.has_work:
            break
        run_step(scheduler, batch)
        finish_done(scheduler)
    assert b.num_preemptions == 1 and queue_at_preemption == ["b", "c"]
    assert admissions == ["b", "c"]                # after the preemption: b again, then c
    assert all(s.request.is_finished for s in (a, b, c))
