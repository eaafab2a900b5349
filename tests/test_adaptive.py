"""Adaptive speculation (issue 21): the allocation (pure, no models), the calibration, and that
any verify width is lossless — greedy output equal to plain decoding at fixed widths 0 … T − 1,
random widths per cycle and the adaptive policy, DFlash 1 and 2, with a grammar and penalties;
sampled output keeping plain sampling's distribution under random widths."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import fixtures
from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.spec import policy
from blockspec.engine.spec.dflash import Proposal, Verdict, accept
from blockspec.engine.spec.policy import (NUM_BINS, RAGGED_MARGIN, WARMUP_OBSERVATIONS, Calibration, CostTable,
                                          Speculation, allocate, expected_committed, forwards_ms, interpolate)
from blockspec.loader import load_draft, load_model
from blockspec.sampling import SamplingParams

from helpers import ForwardCounter, OracleDraft, make_engine, make_request, run_alone, run_batch, submit

# ---- the allocation (pure) -------------------------------------------------------------------

# An H200-like shape in milliseconds: flat (memory-bound) up to 256 rows, then linear.
ROOFLINE = CostTable.analytic(flat_rows=256, ms_flat=6.0, ms_per_row=0.02, draft_ms=1.0)


def rate(alloc_widths, probs, costs: CostTable) -> float:
    """Expected tokens per ms of given widths (the check's own arithmetic): the draft runs over
    the sequences with k > 0 only."""
    tokens = sum(expected_committed(p.tolist(), k) for p, k in zip(probs, alloc_widths))
    rows = len(alloc_widths) + sum(alloc_widths)
    drafting = sum(1 for k in alloc_widths if k > 0)
    draft = float(costs.draft(drafting)) if drafting else 0.0
    return tokens / (float(costs.target(rows)) + draft)


def test_expected_committed_is_one_plus_the_prefix_products():
    assert expected_committed([0.5, 0.5, 1.0], 0) == 1.0
    assert expected_committed([0.5, 0.5, 1.0], 1) == 1.5
    assert expected_committed([0.5, 0.5, 1.0], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


def test_low_load_gives_every_sequence_the_full_block():
    probs = torch.rand(4, 15, generator=torch.Generator().manual_seed(0)) * 0.7 + 0.25
    alloc = allocate(probs, [15] * 4, ROOFLINE)
    assert alloc.widths == [15] * 4 and alloc.runs_draft
    assert alloc.expected_tokens == pytest.approx(sum(expected_committed(p.tolist(), 15) for p in probs))


def test_high_load_drops_the_confidence_poor_positions():
    """128 sequences × 16 rows is 8× the flat region: half the sequences are sure of their
    drafts, half sure only of the first. The unsure positions are dropped, the sure kept, and the
    result beats both plain decoding and the fixed block."""
    num = 128
    probs = torch.full((num, 15), 0.95, dtype=torch.float64)
    probs[1::2, 1:] = 0.05
    alloc = allocate(probs, [15] * num, ROOFLINE)
    widths = alloc.widths
    assert all(w <= 1 for w in widths[1::2]) and all(w >= 4 for w in widths[0::2])
    assert sum(widths) < num * 15
    chosen = rate(widths, probs, ROOFLINE)
    assert chosen > rate([15] * num, probs, ROOFLINE) and chosen > rate([0] * num, probs, ROOFLINE)
    assert chosen == pytest.approx(alloc.expected_tokens / alloc.ms)


def test_nothing_worth_verifying_means_no_draft():
    probs = torch.full((64, 15), 0.01, dtype=torch.float64)
    alloc = allocate(probs, [15] * 64, ROOFLINE)
    assert alloc.widths == [0] * 64 and not alloc.runs_draft
    assert alloc.ms == pytest.approx(float(ROOFLINE.target(64)))     # no draft time in a plain step


def test_the_allocation_is_the_best_of_every_greedy_prefix():
    """On random inputs the chosen widths beat (or tie) every fixed width and a random sample of
    other allocations: a check of the rule, not of one case."""
    gen = torch.Generator().manual_seed(1)
    for num in (1, 8, 64, 200):
        probs = torch.rand(num, 7, generator=gen, dtype=torch.float64)
        alloc = allocate(probs, [7] * num, ROOFLINE)
        best = rate(alloc.widths, probs, ROOFLINE)
        for k in range(8):
            assert best >= rate([k] * num, probs, ROOFLINE) - 1e-12
        rng = random.Random(num)
        for _ in range(50):
            assert best >= rate([rng.randint(0, 7) for _ in range(num)], probs, ROOFLINE) - 1e-12


def test_caps_floors_and_padded_buckets():
    probs = torch.full((3, 7), 0.9, dtype=torch.float64)
    assert allocate(probs, [7, 2, 0], ROOFLINE).widths == [7, 2, 0]               # caps (max_tokens)
    poor = torch.full((3, 7), 0.01, dtype=torch.float64)
    steep = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=1.0, draft_ms=0.0)
    assert allocate(poor, [7, 7, 7], steep, floors=[0, 7, 0]).widths == [0, 7, 0]      # a seeded request
    # Once the draft runs, rows inside the flat region are free: taken even at p = 0.01.
    assert allocate(poor, [7, 7, 7], ROOFLINE, floors=[0, 7, 0]).widths == [7, 7, 7]
    # Padded to a 64-token graph anyway: rows up to the bucket cost nothing more, so they are taken.
    assert sum(allocate(torch.full((3, 7), 0.3, dtype=torch.float64), [7] * 3, steep).widths) < 21
    graphed = CostTable((1, 64, 128), (1.0, 64.0, 128.0), (1, 4), (0.0, 0.0), padded=True)
    assert allocate(torch.full((3, 7), 0.3, dtype=torch.float64), [7] * 3, graphed).widths == [7] * 3
    assert graphed.target(2).item() == 64.0 and graphed.target(65).item() == 128.0
    assert graphed.target(256).item() == 256.0                        # past the largest graph: eager, linear
    assert graphed.draft(0).item() == 0.0                             # nobody drafts: no draft forward


def test_a_ragged_allocation_must_beat_the_whole_block_by_the_margin():
    """With margin m the policy narrows only where its predicted rate beats verifying every slot
    up to its cap by more than m; a gain below it keeps the whole, uniform block."""
    rows = CostTable.analytic(flat_rows=1, ms_flat=10.0, ms_per_row=0.05, draft_ms=0.0)
    probs = torch.full((4, 7), 0.5, dtype=torch.float64)          # deep slots: little survival
    free = allocate(probs, [7] * 4, rows)
    whole = allocate(probs, [7] * 4, rows, margin=1.0)
    assert sum(free.widths) < 28 and whole.widths == [7] * 4
    gain = (free.expected_tokens / free.ms) / (whole.expected_tokens / whole.ms) - 1
    assert 0 < gain < 1.0
    assert allocate(probs, [7] * 4, rows, margin=gain * 0.9).widths == free.widths
    assert allocate(probs, [7] * 4, rows, margin=gain * 1.1).widths == [7] * 4


def test_plain_steps_need_no_margin_over_the_whole_block():
    """The margin guards ragged plans; no drafts at all is a uniform (plain) step, taken on any
    predicted gain: a draft that costs a little more than it saves is not verified whole (on
    SmolLM2 at 16 and 64 requests the whole block measured 0.87–1.01 × plain, round 45)."""
    probs = torch.full((4, 7), 0.05, dtype=torch.float64)
    costs = CostTable.analytic(flat_rows=64, ms_flat=10.0, ms_per_row=0.05, draft_ms=0.8)
    whole = allocate(probs, [7] * 4, costs, floors=[7] * 4)                # the whole block, priced
    assert whole.widths == [7] * 4
    gain = (4 / costs.target_ms_of(4)) / (whole.expected_tokens / whole.ms) - 1
    assert 0 < gain < 0.05
    assert allocate(probs, [7] * 4, costs, margin=0.05).widths == [0] * 4


def test_a_sequence_whose_draft_does_not_pay_gets_no_draft_forward():
    """The draft costs 1 ms per drafting sequence: a sequence whose drafts are hopeless is left
    at k = 0 (and out of the draft forward) while the confident ones keep their blocks; the
    chosen rate is what the check's own arithmetic gives, and beats drafting for everyone."""
    per_seq = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.01), (1, 64), (1.0, 64.0))
    probs = torch.full((4, 7), 0.9, dtype=torch.float64)
    probs[2] = 0.02
    alloc = allocate(probs, [7] * 4, per_seq)
    assert alloc.widths == [7, 7, 0, 7]
    assert alloc.ms == pytest.approx(float(per_seq.target(4 + 21)) + 3.0)
    assert rate(alloc.widths, probs, per_seq) > rate([7] * 4, probs, per_seq)
    assert forwards_ms(per_seq, alloc.widths) == pytest.approx(alloc.ms)


def test_host_work_per_cycle_makes_more_tokens_per_cycle_worth_it():
    """Forwards alone favour plain steps here; a cycle's fixed host work (learnt online by
    Speculation.record_cycle) tips the balance toward verifying the drafts."""
    steep = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.5, draft_ms=1.0)
    probs = torch.full((8, 7), 0.6, dtype=torch.float64)
    assert not allocate(probs, [7] * 8, steep).runs_draft
    assert min(allocate(probs, [7] * 8, steep, fixed_ms=200.0).widths) >= 4
    # The fit: steps whose real time is half the table's forwards + 2 ms per sequence + 0.5 ms
    # per committed token (the host terms are kept in the table's units: ÷ the scale).
    spec = Speculation("adaptive", 7, costs=steep)
    rng = random.Random(0)
    for _ in range(200):
        widths = [rng.randint(0, 7)] * rng.randint(1, 16)
        forwards, seqs, tokens = forwards_ms(steep, widths), len(widths), rng.randint(1, 60)
        spec.record_cycle((0.5 * forwards + 2.0 * seqs + 0.5 * tokens) / 1e3, widths, tokens)
    # The table's forwards grow with the sequences as the host term does, so the fit may share
    # the per-sequence cost between the scale and that term (the ridge picks the split): what
    # it must get right is every step's time, here for widths and loads it never saw.
    for widths, tokens in (([7] * 20, 90), ([0] * 3, 3), ([2, 5, 0, 7], 11), ([1] * 30, 40)):
        truth = 0.5 * forwards_ms(steep, widths) + 2.0 * len(widths) + 0.5 * tokens
        assert spec.predicted_step_ms(widths, tokens) == pytest.approx(truth, rel=0.03)


def test_on_a_host_bound_load_the_learning_cycles_teach_that_wider_verifies_cost_nothing():
    """SmolLM2 at 64 requests on the H100 (round 54's table): the device prices 8 rows a sequence
    above 4 (2.43 against 1.98 ms), so the policy verifies k = 3 in blocks of 4; but the host
    bounds the step (3.9 ms whatever the widths), so whole blocks commit more for nothing. With
    the pace at stride 16 the fit learns that from the learning cycles' whole blocks (fitted
    every time, out of the pace's turn) and each term's own ridge, and the plan widens."""
    table = CostTable((1, 64, 128, 256, 384, 512), (1.6, 1.69, 1.75, 1.98, 2.15, 2.43), (1, 64), (0.411, 0.71),
                      True, ((4, (0.422, 0.637)),))
    probs = np.array([[0.62, 0.45, 0.35, 0.3, 0.28, 0.26, 0.25]] * 64)
    spec = Speculation("adaptive", 7, costs=table)
    spec.pace.choose = lambda: 16
    spec.calibration.engine_seen[:] = WARMUP_OBSERVATIONS         # past the warm-up, whose cycles
    assert not spec.learns(64, 0)                                 # are fitted at the pace's turns

    def plan() -> list[int]:
        return allocate(probs, [7] * 64, table, fixed_ms=spec.overhead_ms_per_seq * 64,
                        per_token_ms=spec.overhead_ms_per_token, margin=RAGGED_MARGIN, draft_widths=table.draft_widths,
                        marginal=spec.marginal_scale).widths
    assert set(plan()) == {3}
    survival = np.cumprod(probs[0])
    for step in range(2000):
        learns = step % 86 == 0                                   # a learning cycle: whole blocks
        k = 7 if learns else 3
        spec.record_cycle(3.9e-3, [k] * 64, int(64 * (1 + survival[:k].sum())), 0 if learns else 4, learns=learns)
    assert spec.pace.stride == 16 and spec.marginal_scale < 0.5
    assert set(plan()) == {7}


def test_steps_that_all_verify_one_width_leave_the_drafts_at_the_tables_price():
    """One sequence verifying the whole block every step (the CPU demo pair at one request): the
    plain forwards, the drafts and the sequences are then one constant, so the steps cannot say
    what the forwards or the drafts cost apart from the host's work. The host's 8 ms a step go to
    the per-sequence term, the forwards and the drafts keep the table's price (a joint ridge made
    the drafts 1.69 × the table's: scale 1.23, δ's 1.38), and every width's time is predicted,
    those the steps never ran too. Steps of another width at the same load then price the drafts
    (here at half the table's), the forwards still held."""
    table = CostTable.analytic(flat_rows=1, ms_flat=6.0, ms_per_row=0.4, draft_ms=3.0)
    spec = Speculation("adaptive", 7, costs=table)
    rng = random.Random(0)

    def truth(k: int, tokens: int, drafts: float = 1.0) -> float:
        plain = forwards_ms(table, [0])
        return plain + drafts * (forwards_ms(table, [k]) - plain) + 8.0 + 0.05 * tokens
    for _ in range(300):
        tokens = rng.randint(1, 8)
        spec.record_cycle(truth(7, tokens) / 1e3, [7], tokens)
    assert spec.identified() == (False, False)
    assert spec.forward_scale == pytest.approx(1.0) and spec.marginal_scale == pytest.approx(1.0)
    for k in (0, 1, 3, 7):
        for tokens in (1, 8):
            assert spec.predicted_step_ms([k], tokens) == pytest.approx(truth(k, tokens), rel=0.01)
    for step in range(300):
        k, tokens = (7 if step % 2 else 1), rng.randint(1, 8)
        spec.record_cycle(truth(k, tokens, drafts=0.5) / 1e3, [k], tokens)
    assert spec.identified() == (False, True)
    assert spec.forward_scale == pytest.approx(1.0) and spec.marginal_scale == pytest.approx(0.5, abs=0.05)
    for k in (0, 3, 7):
        assert spec.predicted_step_ms([k], 4) == pytest.approx(truth(k, 4, drafts=0.5), rel=0.02)


def test_the_fit_learns_what_a_draft_row_really_costs():
    """Steps whose drafts cost half what the table says over a plain step (the demo pair's
    table on the 2-core CPU priced the rows of k = 7 over k = 3 at twice the steps' time): the
    fit predicts those times, and the allocation, which verified k = 5 on the table alone,
    widens once it has seen the steps (with the true costs k = 7 is best; the fit's share of the
    drafts' cost between its per-token and draft terms, which tokens growing with the drafts
    leaves open, puts it at 6 or 7: every step's time is what it must predict)."""
    table = CostTable.analytic(flat_rows=1, ms_flat=10.0, ms_per_row=1.0, draft_ms=4.0, draft_ms_per_seq=1.0)
    probs = torch.tensor([[0.9, 0.85, 0.9, 0.9, 0.9, 0.9, 0.9]] * 8, dtype=torch.float64)
    spec = Speculation("adaptive", 7, costs=table)
    before = allocate(probs, [7] * 8, table).widths
    rng = random.Random(1)
    for _ in range(300):
        widths = [rng.choice((0, 1, 3, 7)) for _ in range(rng.randint(1, 12))]
        plain = forwards_ms(table, [0] * len(widths))
        tokens = len(widths) + sum(widths) // 2
        spec.record_cycle((plain + 0.5 * (forwards_ms(table, widths) - plain) + 0.3 * tokens) / 1e3, widths, tokens)
    assert spec.marginal_scale < 0.8
    for widths, tokens in (([7] * 8, 36), ([3, 0, 1], 5)):
        plain = forwards_ms(table, [0] * len(widths))
        truth = plain + 0.5 * (forwards_ms(table, widths) - plain) + 0.3 * tokens
        assert spec.predicted_step_ms(widths, tokens) == pytest.approx(truth, rel=0.03)
    after = allocate(probs, [7] * 8, table, fixed_ms=spec.overhead_ms_per_seq * 8,
                     per_token_ms=spec.overhead_ms_per_token, marginal=spec.marginal_scale).widths
    assert before == [5] * 8 and min(after) >= 6


def test_the_learning_interval_follows_each_fit():
    """learning_interval keeps its value per load only until the next fit (it is asked twice a
    step): once the steps have shown 2 ms of host work a sequence that the table does not price,
    the interval at that load is the fitted one (whole blocks then cost less against a plain
    step: learning cycles come sooner), not the table's from before."""
    table = CostTable.analytic(flat_rows=1, ms_flat=10.0, ms_per_row=1.0, draft_ms=4.0, draft_ms_per_seq=1.0)
    spec = Speculation("adaptive", 7, costs=table)
    before = spec.learning_interval(8)
    assert before == spec.interval_of(8)
    rng = random.Random(2)
    for _ in range(100):
        widths = [rng.choice((0, 1, 3, 7)) for _ in range(rng.randint(1, 12))]
        seconds = (forwards_ms(table, widths) + 2.0 * len(widths)) / 1e3
        spec.fit(seconds, widths, len(widths) + sum(widths) // 2, 0)
        assert spec.learning_interval(8) == spec.interval_of(8)
    assert spec.overhead_ms_per_seq > 1.0 and spec.learning_interval(8) < 0.9 * before


def test_cost_table_interpolates_and_extrapolates():
    table = CostTable((1, 16, 64), (2.0, 2.0, 8.0), (1,), (1.0,))
    assert interpolate(torch.tensor([0.5, 1.0, 8.0, 40.0, 128.0], dtype=torch.float64),
                       table.target_rows, table.target_ms).tolist() == [2.0, 2.0, 2.0, 5.0, 16.0]
    with pytest.raises(ValueError):
        CostTable((4, 2), (1.0, 1.0), (1,), (1.0,))


def test_a_measured_table_is_the_least_squares_monotone_fit():
    """One slow sample does not lift the buckets after it (a running maximum made 32 … 64
    verify tokens look free on a shared CPU); already monotone times stay as measured."""
    from blockspec.engine.graphs import monotone
    assert monotone([13.5, 18.2, 20.5, 20.5, 29.0]) == [13.5, 18.2, 20.5, 20.5, 29.0]
    assert monotone([10.0, 40.0, 20.0, 30.0, 50.0]) == [10.0, 30.0, 30.0, 30.0, 50.0]
    fitted = monotone([3.0, 1.0, 2.0])
    assert fitted == sorted(fitted) and sum(fitted) == pytest.approx(6.0)   # the mean kept: least squares
    assert monotone([]) == []


# ---- calibration -----------------------------------------------------------------------------

def test_calibration_learns_an_overconfident_draft_and_each_sequence_its_own():
    """The draft says 0.95 for everything; sequence 0's drafts are accepted 20 % of the time,
    sequence 1's 90 %. After some cycles the calibrated p follows the observed rates, and the
    pre-draft prediction (recent prefix products) tells the two apart."""
    cal = Calibration(4)
    rows = torch.tensor([0, 1])
    conf = torch.full((2, 4), 0.95, dtype=torch.float64)
    assert cal.calibrate(conf, rows)[0, 0] == pytest.approx(0.95)                  # prior: its word
    rng = random.Random(0)
    for _ in range(300):
        calibrated = cal.calibrate(conf, rows)
        accepted = []
        for rate_ in (0.2, 0.9):
            a = 0
            while a < 4 and rng.random() < rate_:
                a += 1
            accepted.append(a)
        cal.observe(conf, calibrated, [4, 4], accepted, rows)
    calibrated = cal.calibrate(conf, rows)
    assert abs(float(calibrated[0, 0]) - 0.2) < 0.12 and abs(float(calibrated[1, 0]) - 0.9) < 0.08
    # A later slot is judged only when the ones before it were accepted: still ≈ 0.9 there.
    assert abs(float(calibrated[1, 3]) - 0.9) < 0.08
    predicted = cal.predicted(rows)
    assert predicted[0, 0] < 0.4 < 0.8 < predicted[1, 0]
    # A new sequence (row 2, never seen) is predicted at the engine-wide top bin: it gets drafts.
    assert float(cal.predicted(torch.tensor([2]))[0, 0]) > 0.3
    cal.reset(0)
    assert cal.calibrate(conf, rows)[0, 0] != calibrated[0, 0]


def test_a_new_sequence_starts_from_what_the_engines_sequences_realised():
    """A weak draft whose confidences sit in the middle bins never informs the top bin, so a new
    sequence predicted at the top bin's estimate would verify whole blocks again (on CPU, SmolLM2's
    draft: ~20 cycles of each request). It starts from the engine's recent cycles instead; before
    any, at the top bin (a fresh draft is tried); and the average is the same however the cycles
    were batched."""
    conf = np.full((2, 4), 0.35)
    one, two = Calibration(4), Calibration(4)
    assert one.predicted([5])[0, 0] > 0.9                                   # nothing seen: try it
    for _ in range(60):
        calibrated = one.calibrate(conf, [0, 1])
        one.observe(conf[:1], calibrated[:1], [4], [0], [0])
        one.observe(conf[1:], calibrated[1:], [4], [0], [1])
        two.observe(conf, two.calibrate(conf, [0, 1]), [4, 4], [0, 0], [0, 1])
    assert float(one.engine_estimate()[0, NUM_BINS - 1]) > 0.9              # the top bin: still its prior
    newcomer = one.predicted([5])
    assert newcomer[0, 0] < 0.4 and np.array_equal(newcomer, two.predicted([5]))
    assert np.allclose(newcomer, one.predicted([0]), atol=0.05)               # what the others do now


def test_speculation_skips_the_draft_when_nothing_pays_and_probes_now_and_then():
    """A sequence whose drafts are never accepted, at a load where rows are dear: after it is
    learnt, cycles run without the draft; a learning cycle comes back only after the interval
    that keeps its cost within 1 % of the plain steps' time."""
    dear = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.3, draft_ms=0.5)
    spec = Speculation("adaptive", 7, costs=dear)
    seqs = [SimpleNamespace(request=SimpleNamespace(num_allowed=100, params=SamplingParams())) for _ in range(4)]
    conf = torch.full((4, 7), 0.9, dtype=torch.float64)
    decisions = []
    for _ in range(600):
        widths = spec.planned_widths(seqs)
        decisions.append(any(widths))
        assert widths in ([0] * 4, [7] * 4)          # nothing pays, or a learning cycle's whole blocks
        spec.observe(seqs, conf, widths, [0] * 4)
    interval = spec.learning_interval(4)             # (1 + 0.3·31 + 0.5 − 1.9) / (0.01 · 1.9) ≈ 468
    assert interval == pytest.approx((0.3 * 31 - 0.3 * 3 + 0.5) / (0.01 * 1.9))
    assert decisions[0] and not any(decisions[100:450]) and sum(decisions[450:]) == 1
    assert spec.calibration.engine_seen.sum() >= WARMUP_OBSERVATIONS                # it learnt first


def test_a_sequence_left_without_drafts_by_a_bad_patch_drafts_again_and_a_hopeless_one_backs_off():
    """Two sequences whose drafts are accepted whole for 60 cycles; then one of them has four
    cycles of low confidence, each rejected at its first draft, and is left at k = 0. Nothing
    observes a sequence that does not draft, so before round 56 it decoded plain until the next
    learning cycle (~160 cycles here; on the CPU demo pair, the rest of a response). Its
    prediction now relaxes back toward its settled one: it drafts again within a few steps, not
    in a learning cycle. A sequence whose drafts are never accepted again is tried less and less
    often: each failed return doubles the time its prediction takes to relax."""
    costs = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.05, draft_ms=0.5, draft_ms_per_seq=0.5)

    def run(hopeless: bool) -> list[tuple[int, int, bool]]:
        spec = Speculation("adaptive", 7, costs=costs)
        seqs = [request_of(num_allowed=1000), request_of(num_allowed=1000)]
        assert spec.learning_interval(2) > 150
        steps = []
        for step in range(400):
            widths = spec.planned_widths(seqs)
            steps.append((step, widths[1], spec.step_learns))
            conf = torch.full((2, 7), 0.9, dtype=torch.float64)
            bad = 60 <= step < 64 or (hopeless and step >= 60)
            if bad:
                conf[1] = 0.15
            spec.observe(seqs, conf, widths, [widths[0], 0 if bad else widths[1]])
        return steps

    patch = run(hopeless=False)
    assert [k for _, k, _ in patch[:60]] == [7] * 60
    idle = [step for step, k, _ in patch[60:] if k == 0]
    assert idle and len(idle) <= 5 and idle[-1] < 72, idle                 # a few plain steps, then drafts
    assert all(k == 7 for step, k, learns in patch[72:] if not learns)
    assert not any(learns for step, _, learns in patch[60:72])
    tries = [step for step, k, learns in run(hopeless=True)[64:] if k > 0 and not learns]
    gaps = np.diff(tries)
    assert 3 <= len(tries) <= 8 and all(gaps[1:] >= 1.5 * gaps[:-1]), tries          # backs off


def test_a_row_given_to_a_new_sequence_is_neither_idle_nor_returning():
    """A sequence left at k = 0, brought back, then ended before its first verdict: the next
    sequence given its row starts as any newcomer, not relaxed as an idle one nor judged (its
    backoff raised) as a return."""
    costs = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.05, draft_ms=0.5, draft_ms_per_seq=0.5)
    spec = Speculation("adaptive", 7, costs=costs)
    spec.calibration.engine_seen[:] = WARMUP_OBSERVATIONS                    # a draft as good as its word
    spec.calibration.engine_accepted[:] = WARMUP_OBSERVATIONS * (np.arange(NUM_BINS) + 0.5) / NUM_BINS
    spec.learning_interval = lambda num_seqs: math.inf
    good, bad = request_of(num_allowed=1000), request_of(num_allowed=1000)
    row = int(spec.rows([good, bad])[1])
    states = []
    for step in range(60):
        widths = spec.planned_widths([good, bad])
        states.append((widths[1], row in spec._idle[0], row in spec._returning))
        if row in spec._returning:
            break
        conf = torch.full((2, 7), 0.9, dtype=torch.float64)
        if step >= 5:
            conf[1] = 0.15                                      # from the sixth cycle: a bad patch
        spec.observe([good, bad], conf, widths, [widths[0], widths[1] if step < 5 else 0])
    assert states[-1] == (states[-1][0], False, True) and states[-1][0] > 0, states    # brought back
    assert any(idle for _, idle, _ in states)                                          # after idling
    spec.forget(bad)
    newcomer = request_of(num_allowed=1000)
    assert int(spec.rows([newcomer])[0]) == row
    assert row not in spec._returning and row not in spec._idle[0] and spec._backoff[row] == 0


def backed_off(spec: Speculation, seqs: list, good_from: int, steps: int, patch_at: int | None = None
               ) -> list[tuple[int, int, int]]:
    """Two sequences accepted whole, except the second's drafts: rejected at the first draft
    (confidence 0.15) from step 60 to `good_from` (it is left at k = 0 and fails its returns:
    its backoff grows), and for four steps from `patch_at` → (step, its k, its backoff)."""
    row = int(spec.rows(seqs)[1])
    out = []
    for step in range(steps):
        widths = spec.planned_widths(seqs)
        conf = torch.full((2, 7), 0.9, dtype=torch.float64)
        bad = 60 <= step < good_from or patch_at is not None and patch_at <= step < patch_at + 4
        if bad:
            conf[1] = 0.15
        spec.observe(seqs, conf, widths, [widths[0], 0 if bad else widths[1]])
        out.append((step, widths[1], int(spec._backoff[row])))
    return out


def test_a_return_that_pays_resets_the_backoff():
    """A sequence whose returns failed three times (its relaxation 8 × slower) drafts again once
    its drafts are accepted: that first paying return resets its backoff, so a later bad patch
    leaves it at k = 0 for a few steps only, as a sequence that never failed."""
    costs = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.05, draft_ms=0.5, draft_ms_per_seq=0.5)
    spec = Speculation("adaptive", 7, costs=costs)
    spec.learning_interval = lambda num_seqs: math.inf            # returns only, no learning cycle
    steps = backed_off(spec, [request_of(num_allowed=1000), request_of(num_allowed=1000)], good_from=150,
                       steps=320, patch_at=290)
    assert max(backoff for _, _, backoff in steps[:150]) >= 3
    back = next(step for step, k, _ in steps[150:] if k > 0)                     # the first paying return
    assert steps[back][2] == 0 and all(k == 7 for _, k, _ in steps[back: 290])
    idle = [step for step, k, _ in steps[290:] if k == 0]
    assert idle and idle[-1] < 302, idle                                         # drafts again within a few


def test_a_reused_row_starts_without_the_old_sequences_backoff():
    """A sequence that backed off (failed returns) ends; the next sequence given its row starts at
    backoff 0: its first bad patch leaves it at k = 0 for a few steps, as any newcomer's."""
    costs = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.05, draft_ms=0.5, draft_ms_per_seq=0.5)
    spec = Speculation("adaptive", 7, costs=costs)
    spec.learning_interval = lambda num_seqs: math.inf
    good, hopeless = request_of(num_allowed=1000), request_of(num_allowed=1000)
    row = int(spec.rows([good, hopeless])[1])
    assert backed_off(spec, [good, hopeless], good_from=150, steps=150)[-1][2] >= 3
    spec.forget(hopeless)
    newcomer = request_of(num_allowed=1000)
    assert int(spec.rows([newcomer])[0]) == row and spec._backoff[row] == 0
    steps = backed_off(spec, [good, newcomer], good_from=0, steps=70, patch_at=30)   # a bad patch at 30-33 only
    idle = [step for step, k, _ in steps[30:] if k == 0]
    assert idle and idle[-1] < 42, idle


def request_of(num_allowed: int = 100, **params) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(num_allowed=num_allowed, params=SamplingParams(**params)))


def learnt_worthless(spec: Speculation, cycles: int = 100) -> None:
    """Four greedy sequences whose drafts are never accepted, past the warm-up: the policy has
    learnt that no draft pays (and is not due a learning cycle for a while)."""
    seqs = [request_of() for _ in range(4)]
    conf = torch.full((4, spec.num_slots), 0.9, dtype=torch.float64)
    for _ in range(cycles):
        spec.observe(seqs, conf, spec.planned_widths(seqs), [0] * 4)
    assert not any(spec.planned_widths(seqs))


def test_seeded_sampling_keeps_the_whole_block_under_adaptive_and_the_others_keep_theirs():
    """Rows dear, drafts learnt worthless: greedy and unseeded sampling requests verify nothing,
    a seeded one still verifies its whole block, alone or with others (which then do not draft
    at all), so its random draws, and its output, do not depend on what else runs."""
    dear = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.3, draft_ms=0.5)
    spec = Speculation("adaptive", 7, costs=dear)
    learnt_worthless(spec)
    greedy, seeded, unseeded = request_of(), request_of(temperature=0.8, seed=5), request_of(temperature=0.8)
    for batch, expected in (([seeded], [7]), ([greedy, seeded, unseeded], [0, 7, 0]), ([unseeded, seeded], [0, 7])):
        widths = spec.planned_widths(batch)
        assert widths == expected, (widths, expected)
    assert spec.planned_widths([greedy, unseeded]) == [0, 0]       # without it: no draft at all


def test_a_reused_calibration_row_starts_fresh():
    """A sequence that ended leaves its row to the next one: no counts, no recent average of the
    old sequence, so the new one is calibrated as any newcomer is (the engine-wide estimate)."""
    spec = Speculation("adaptive", 7, costs=ROOFLINE)
    old, other = request_of(), request_of()
    conf = torch.full((2, 7), 0.95, dtype=torch.float64)
    rows = spec.rows([old, other])
    for _ in range(20):
        calibrated = spec.calibration.calibrate(conf, rows)
        spec.calibration.observe(conf, calibrated, [7, 7], [0, 7], rows)
    old_row = int(rows[0])
    assert spec.calibration.seen[old_row].sum() > 0
    spec.forget(old)
    new = request_of()
    newcomer = request_of()
    assert int(spec.rows([new])[0]) == old_row
    cal = spec.calibration
    assert cal.seen[old_row].sum() == 0 and cal.accepted[old_row].sum() == 0 and np.isnan(cal.recent[old_row]).all()
    fresh_row = spec.rows([newcomer])
    assert np.array_equal(cal.calibrate(conf[:1], [old_row]), cal.calibrate(conf[:1], fresh_row))
    assert np.array_equal(cal.predicted([old_row]), cal.predicted(fresh_row))


def test_widths_planned_ahead_are_the_widths_planned_then(monkeypatch):
    """plan_ahead (made while the device runs step N) gives step N + 1 exactly the widths that
    planning at N + 1 would, from the same calibration; each cut to a cap that step N's tokens
    lowered (not re-priced); each sequence's own width in another order or when sequences
    ended; ignored for a batch with a sequence it was not made for, and used once. (The idle
    sequences' relaxation, tested on its own above, is held off: it moves the state with the
    steps planned, and this test plans many more steps on one twin than on the other.)"""
    monkeypatch.setattr(policy, "IDLE_MEMORY", 1.0)
    def trained() -> tuple[Speculation, list]:
        """Past the warm-up, with a different picture per sequence (built twice: the same state)."""
        probs = np.array([0.97, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1])
        seqs = [request_of() for _ in range(6)]
        spec = Speculation("adaptive", 7, costs=CostTable.analytic(flat_rows=16, ms_flat=5.0, ms_per_row=0.2,
                                                                   draft_ms=1.0))
        rows = spec.rows(seqs)
        for _ in range(80):
            conf = np.stack([np.clip(probs * (0.6 + 0.08 * b), 0, 1) for b in range(6)])
            spec.calibration.observe(conf, spec.calibration.calibrate(conf, rows), [7] * 6,
                                     [int(3 * b / 5) for b in range(6)], rows)
        return spec, seqs
    spec, seqs = trained()
    twin, twin_seqs = trained()                           # plans every step when it comes, as before
    spec.plan_ahead(seqs)
    planned_then = twin.planned_widths(twin_seqs)
    assert spec.planned_widths(seqs) == planned_then and len(set(planned_then)) > 1
    assert spec._ahead is None                            # used by the step it was made for, once
    for b in range(6):
        for allowed in (100, 4, 3, 2, 1):                 # step N left sequence b this many tokens
            spec.plan_ahead(seqs)
            plan = spec._ahead[1].tolist()
            seqs[b].request.num_allowed = twin_seqs[b].request.num_allowed = allowed
            cut = [min(k, allowed - 1) if c == b else k for c, k in enumerate(plan)]
            assert spec.planned_widths(seqs) == cut, (b, allowed)                    # a lower cap: cut, kept
        seqs[b].request.num_allowed = twin_seqs[b].request.num_allowed = 100
    spec.plan_ahead(seqs)
    assert spec.planned_widths([]) == [] and spec._ahead is None      # nothing decodes: no plan left over
    spec.plan_ahead(seqs)                                 # another order: each sequence's own width
    assert spec.planned_widths(seqs[::-1]) == planned_then[::-1] == twin.planned_widths(twin_seqs[::-1])
    sentinel = np.full(6, 3)
    assert planned_then != sentinel.tolist()
    spec.learning_interval = lambda num_seqs: math.inf  # no learning cycle (every cap) among these
    for ended in ([0], [2, 5], list(range(1, 6))):      # sequences that ended at step N: the rest keep theirs
        spec._ahead = (list(seqs), np.arange(6))
        assert spec.planned_widths([seq for b, seq in enumerate(seqs) if b not in ended][::-1]) == \
            [b for b in range(6) if b not in ended][::-1]
    newcomer, twin_newcomer = request_of(), request_of()
    for batch, twin_batch in ((seqs[:5] + [newcomer], twin_seqs[:5] + [twin_newcomer]),
                              ([newcomer] + seqs, [twin_newcomer] + twin_seqs)):
        spec._ahead = (list(seqs), sentinel)              # nothing planned for the newcomer: anew
        assert spec.planned_widths(batch) == twin.planned_widths(twin_batch) != sentinel[:len(batch)].tolist()


# A draft whose forward costs 0.02 ms per row of its blocks (compute-bound, as at 64+ sequences
# on the H200): blocks of 2 / 4 / 8 cost a quarter / half / all of the full block's.
def draft_by_width(width: int) -> tuple[float, ...]:
    return tuple(0.02 * width * b for b in (1, 64))


NARROW = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.01), (1, 64), draft_by_width(8),
                   narrow=tuple((w, draft_by_width(w)) for w in (2, 4)))


def test_a_narrower_draft_block_is_taken_when_its_rows_are_what_pays():
    """Survival falls fast after two slots: the best allocation verifies ~2 drafts a sequence,
    and pricing the draft at blocks of 4 beats the full block of 8 (the check's arithmetic); a
    seeded request's floor keeps the full block; without narrow widths in the table, the full."""
    probs = torch.tensor([[0.95, 0.9, 0.2, 0.1, 0.1, 0.1, 0.1]] * 16, dtype=torch.float64)
    full = allocate(probs, [7] * 16, NARROW)
    best = allocate(probs, [7] * 16, NARROW, draft_widths=NARROW.draft_widths)
    assert best.draft_width == 4 and max(best.widths) <= 3 and best.rate > full.rate
    assert best.ms == pytest.approx(float(NARROW.target(16 + sum(best.widths))) + float(NARROW.draft(16, 4)))
    assert forwards_ms(NARROW, best.widths, 4) == pytest.approx(best.ms)
    floored = allocate(probs, [7] * 16, NARROW, floors=[7] + [0] * 15, draft_widths=NARROW.draft_widths)
    assert floored.draft_width is None and floored.widths[0] == 7
    plain_table = CostTable(NARROW.target_rows, NARROW.target_ms, NARROW.draft_batch, NARROW.draft_ms)
    assert allocate(probs, [7] * 16, plain_table, draft_widths=plain_table.draft_widths).draft_width is None


def test_the_draft_block_covers_the_widest_verify_and_a_seeded_request_keeps_its_whole_block():
    spec = Speculation("adaptive", 7, costs=NARROW)
    greedy = [request_of() for _ in range(3)]
    assert spec.draft_width(greedy, [1, 0, 1]) == 2
    assert spec.draft_width(greedy, [1, 3, 2]) == 4
    assert spec.draft_width(greedy, [1, 4, 2]) == 0               # 0: the full block of 8
    assert spec.draft_width(greedy, [0, 0, 0]) == 0               # nobody drafts
    seeded = request_of(temperature=0.8, seed=3)
    assert spec.draft_width([greedy[0], seeded], [1, 1]) == 0
    assert spec.draft_width([greedy[0], seeded], [1, 0]) == 2     # the seeded one does not draft
    assert Speculation("fixed", 7, costs=NARROW).draft_width(greedy, [1, 1, 1]) == 0


def test_a_narrower_block_keeps_the_old_chances_past_it():
    """A cycle drafted at a block of 4 says nothing about slots 4 … 7: their conditional chances
    stay as the whole blocks left them, on top of the new prefix."""
    cal = Calibration(7)
    wide = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    cal.observe(wide, wide, [7], [7], [0])
    before = cal.predicted([0])
    narrow = np.array([[0.5, 0.5, 0.5, math.nan, math.nan, math.nan, math.nan]])
    calibrated = cal.calibrate(narrow, [0])
    assert np.isnan(calibrated[0, 3:]).all() and not np.isnan(calibrated[0, :3]).any()
    cal.observe(narrow, calibrated, [3], [1], [0])
    after = cal.predicted([0])
    np.testing.assert_allclose(after[0, 3:], before[0, 3:])
    assert not np.allclose(after[0, :3], before[0, :3])


# ---- losslessness at any width: greedy ------------------------------------------------------

PROMPT = [int(t) for t in torch.randint(0, 151643, (30,), generator=torch.Generator().manual_seed(21))]
WRONG = {2, 5, 6, 13, 20, 21, 27}
BLOCK = 8


def use_policy(engine, policy) -> None:
    """The engine's speculation policy, for the scheduler (before the draft) and the runner."""
    engine.runner.speculation = engine.scheduler.speculation = policy


class ForcedWidths(Speculation):
    """Widths chosen by the test before the step: a fixed k, or seeded random ones per sequence
    and cycle (0 included: that sequence does not draft; now and then every k is 0: no draft)."""

    def __init__(self, num_slots: int, k: int | None = None, seed: int = 0):
        super().__init__("fixed", num_slots)
        self.k, self.rng, self.chosen = k, random.Random(seed), []

    def planned_widths(self, seqs):
        if self.k is not None:
            widths = [self.k] * len(seqs)
        elif self.rng.random() < 0.2:
            widths = [0] * len(seqs)
        else:
            widths = [self.rng.randint(0, self.num_slots) for _ in seqs]
        self.chosen += widths
        return widths


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target)


@pytest.fixture(scope="module")
def reference(dense):
    target, _ = dense
    return run_alone(lambda: make_engine(target), make_request("r", PROMPT, max_tokens=30)).output_ids


class HonestOracle(OracleDraft):
    """The oracle, unsure exactly where it is wrong: a flat logit there (confidence ≈ 1 / V)."""

    def read_logits(self, hidden, lm_head):
        logits = super().read_logits(hidden, lm_head)
        for b, (_, anchor) in enumerate(self._rows):
            for i in range(logits.shape[1]):
                if anchor + 1 + i - len(PROMPT) in WRONG:
                    logits[b, i] = 0.0
        return logits


def oracle_engine(dense, reference, policy, honest=False, **config):
    """An engine whose draft proposes the reference with the WRONG positions corrupted (honest:
    unsure there); policy: the speculation policy to use instead of the engine's own (None: its own)."""
    target, draft = dense
    corrupted = [(t + 1) % 151643 if i in WRONG else t for i, t in enumerate(reference)]
    oracle = (HonestOracle if honest else OracleDraft)(draft, PROMPT + corrupted)
    engine = make_engine(target, oracle, block_size=BLOCK, **config)
    oracle.bind(engine)
    if policy is not None:
        use_policy(engine, policy)
    return engine, oracle


def expected_lengths(max_tokens: int, k: int) -> list[int]:
    committed, lengths = 1, []
    while committed < max_tokens:
        good = 0
        while good < k and committed + good not in WRONG:
            good += 1
        lengths.append(min(good + 1, max_tokens - committed))
        committed += lengths[-1]
    return lengths


@pytest.mark.parametrize("k", range(BLOCK))
def test_greedy_fixed_width_equals_plain_and_accepts_at_most_k(dense, reference, k):
    engine, oracle = oracle_engine(dense, reference, ForcedWidths(BLOCK - 1, k))
    draft_counter = ForwardCounter(oracle)
    try:
        run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    finally:
        draft_counter.handle.remove()
    assert run.output_ids == reference
    assert run.stats.acceptance_lengths == expected_lengths(30, k)
    assert (draft_counter.count == 0) == (k == 0)                     # k = 0 everywhere: no draft


def test_drafts_cut_to_make_room_for_a_prompt_keep_every_output(dense):
    """Three sequences verifying blocks of 8 fill a 24-token budget; a 150-token prompt arrives:
    the scheduler cuts their drafts so that it prefills (scheduler.leave_room_for_prompts), it
    finishes while they still decode, and every output is the one each request gets alone."""
    target, draft = dense
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 151643, (n,), generator=gen).tolist() for n in (6, 9, 12, 150)]
    lengths = (40, 40, 40, 8)
    expected = [run_alone(lambda: make_engine(target), make_request("e", p, max_tokens=n)).output_ids
                for p, n in zip(prompts, lengths)]
    engine = make_engine(target, draft, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=3 * BLOCK)
    runs = [submit(engine, make_request(f"d{i}", p, max_tokens=n)) for i, (p, n) in enumerate(zip(prompts[:3], lengths))]
    finished_at: dict[str, int] = {}
    for step in range(400):
        if step == 3:
            runs.append(submit(engine, make_request("long", prompts[3], max_tokens=lengths[3])))
        engine.step()
        for run in runs:
            finished_at.setdefault(run.request.request_id, step) if run.request.is_finished else None
        if len(finished_at) == 4:
            break
    assert [run.output_ids for run in runs] == expected
    assert finished_at["long"] < min(finished_at[f"d{i}"] for i in range(3)), finished_at


def test_greedy_random_widths_equals_plain_alone_batched_and_padded(dense, reference):
    target, _ = dense
    forced = ForcedWidths(BLOCK - 1, seed=3)
    engine, _ = oracle_engine(dense, reference, forced, max_num_seqs=4)
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference
    assert {0, BLOCK - 1} <= set(forced.chosen) and len(set(forced.chosen)) >= 4
    others = [[int(t) for t in torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(n))]
              for n in (5, 17, 40)]
    expected = [run_alone(lambda: make_engine(target), make_request("o", p, max_tokens=20)).output_ids
                for p in others]

    # A batch of four, each with its own width in one ragged step, eagerly and through the padded
    # graph-shaped path (FULL graphs of ragged widths).
    for graph_shaped in (False, True):
        forced = ForcedWidths(BLOCK - 1, seed=4)

        def factory():
            made, _ = oracle_engine(dense, reference, forced, max_num_seqs=4)
            if graph_shaped:
                made.runner.graphs = made.runner.make_graphs(capture=False)
            return made
        _, runs = run_batch(factory, [make_request("r", PROMPT, max_tokens=30)]
                            + [make_request(f"o{i}", p, max_tokens=20) for i, p in enumerate(others)])
        assert [r.output_ids for r in runs] == [reference] + expected, graph_shaped
        assert len(set(forced.chosen)) >= 4


class Hopeless(OracleDraft):
    """The oracle for every request but `hopeless`, whose drafts are always wrong and which the
    draft knows it is unsure of (flat logits: confidence 1 / V). Records each forward's rows, and
    the anchor position of each hopeless row drafted."""

    def __init__(self, real_draft, sequences, hopeless: str):
        super().__init__(real_draft, sequences)
        self.hopeless, self.batches, self.hopeless_anchors = sequences[hopeless], [], []

    def read_logits(self, hidden, lm_head):
        logits = super().read_logits(hidden, lm_head)
        self.batches.append(len(self._rows))
        for b, (sequence, anchor) in enumerate(self._rows):
            if sequence is self.hopeless:
                logits[b] = 0.0
                self.hopeless_anchors.append(anchor)
        return logits


@pytest.mark.parametrize("late", [False, True])
def test_adaptive_policy_drops_the_draft_of_a_sequence_it_does_not_pay_for(dense, reference, monkeypatch, late):
    """The real policy, the draft's cost 0.5 ms per drafting sequence: two requests with the
    same prompt, one drafted perfectly, one hopelessly. After its first two cycles (the second
    is planned before the first one's verdict is learnt: the policy learns while the device runs
    the next step) the hopeless one verifies nothing and is left out of the draft forward (one
    row per draft forward), the good one keeps whole blocks; both outputs equal plain decoding's.
    Left at k = 0, the hopeless one comes back to drafting now and then (its prediction relaxes:
    Speculation.allocation), each time for at most two cycles, later and later after each failed
    return. late (the widths refined after the draft, as on CPU): who drafts is still planned."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)              # no learning cycles in 30 tokens
    target, draft = dense
    costs = CostTable((1, 4096), (1.0, 1.0 + 4095 * 0.05), (1, 64), (0.5, 32.0))
    oracle = Hopeless(draft, {"good": PROMPT + reference, "bad": PROMPT + [0] * 64}, hopeless="bad")
    engine = make_engine(target, oracle, block_size=BLOCK, max_num_seqs=2)
    oracle.bind(engine)
    spec = Speculation("adaptive", BLOCK - 1, costs=costs)
    spec.late = late
    spec.record_cycle = lambda *_: None        # the host-work fit learns this machine's load: not here
    use_policy(engine, spec)
    _, (good, bad) = run_batch(lambda: engine, [make_request("good", PROMPT, max_tokens=30),
                                                make_request("bad", PROMPT, max_tokens=30)])
    assert good.output_ids == bad.output_ids == reference
    assert good.stats.acceptance_lengths == [8, 8, 8, 5]
    assert bad.stats.acceptance_lengths == [1] * 29 and bad.stats.accepted_tokens == 0
    assert oracle.batches[:4] == [2, 2, 1, 1]                 # the good one drafts alone from its third cycle
    # The hopeless one's cycles with a draft (one token a cycle: its anchor less the first's).
    drafted = [anchor - oracle.hopeless_anchors[0] for anchor in oracle.hopeless_anchors]
    runs = [[drafted[0]]]
    for cycle in drafted[1:]:
        runs.append([cycle]) if cycle != runs[-1][-1] + 1 else runs[-1].append(cycle)
    assert runs[0] == [0, 1] and all(len(run) <= 2 for run in runs), runs
    gaps = [b[0] - a[-1] for a, b in zip(runs, runs[1:])]
    assert len(drafted) <= 10 and gaps == sorted(gaps) and gaps[-1] > gaps[0], runs
    # Late, those drafts were hardly verified (its own low confidences refined them away: a row
    # or two in all), yet they taught the plan to stop drafting for it.
    widths = bad.stats.verify_widths
    verified = sum(1 for k in widths if k > 0)
    assert bad.stats.draft_tokens == sum(widths) and len(oracle.batches) == 2 + len(drafted)
    if late:
        assert sum(widths) <= 3, widths
    else:
        assert widths == [BLOCK - 1 if c in drafted else 0 for c in range(len(widths))], widths
    assert engine.counters.spec_widths[0] == bad.stats.cycles - verified


def test_late_widths_learn_from_and_price_every_sequence_drafted_for(dense, reference, monkeypatch):
    """Late widths (refined after the draft, CPU): the runner keeps the widths the draft ran for
    apart from the refined ones it verifies. With every draft refined to k = 0, the verify is still
    learnt from for the sequence drafted for (observe's drafted_widths: else a draft never verified
    is planned and drafted for ever) and the step's time is priced with its draft (record_cycle's
    drafting); the output is plain decoding's."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)
    spec, _ = counting_policy()
    spec.late = True
    spec.refined = lambda seqs, confidence, widths: [0] * len(widths)          # every draft refined away
    observed, priced = [], []
    real_observe, real_record = spec.observe, spec.record_cycle
    spec.observe = lambda seqs, conf, widths, accepted, drafted=None: (
        observed.append((list(widths), drafted and list(drafted))), real_observe(seqs, conf, widths, accepted, drafted))[1]
    spec.record_cycle = lambda seconds, widths, *args: (priced.append((list(widths), args[4])),
                                                        real_record(seconds, widths, *args))[1]
    engine, _ = oracle_engine(dense, reference, spec, honest=True, speculation="adaptive")
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=12))
    assert run.output_ids == reference[:12] and run.stats.draft_tokens == 0
    assert observed and all(widths == [0] and drafted[0] > 0 for widths, drafted in observed), observed
    assert priced and all(widths == [0] and drafting == 1 for widths, drafting in priced), priced


class Pattern(Speculation):
    """Each request's widths by its own cycle count: pattern[request id][i mod length]."""

    def __init__(self, num_slots: int, pattern: dict[str, list[int]]):
        super().__init__("fixed", num_slots)
        self.pattern, self.cycles = pattern, {}

    def planned_widths(self, seqs):
        widths = []
        for seq in seqs:
            i = self.cycles.get(seq.request_id, 0)
            self.cycles[seq.request_id] = i + 1
            widths.append(self.pattern[seq.request_id][i % len(self.pattern[seq.request_id])])
        return widths


def test_a_sequence_that_skips_drafting_keeps_the_drafts_context_exact(dense, reference, monkeypatch):
    """The real (random) draft: a sequence that verifies k = 0 for some cycles (no draft row)
    still has every committed position's context K/V when it drafts again — its draft logits
    there equal those of a run that drafted every cycle (alone, and in a batch next to one that
    drafts every cycle), and its output equals plain decoding's."""
    from blockspec.engine import model_runner
    from blockspec.engine.spec.dflash import DraftReadout
    target, draft = dense
    real = model_runner.propose
    seen: dict[str, dict[int, torch.Tensor]] = {}

    def recording(out, seqs, confidence=False):
        logits = out.logits if isinstance(out, DraftReadout) else out
        for b, seq in enumerate(seqs):
            if seq.request_id == "r":
                seen.setdefault(tag, {})[seq.num_cached] = logits[b].clone()
        return real(out, seqs, confidence)
    monkeypatch.setattr(model_runner, "propose", recording)
    other = [int(t) for t in torch.randint(0, 151643, (11,), generator=torch.Generator().manual_seed(7))]
    cases = {"every": ({"r": [BLOCK - 1]}, ["r"]),
             "skipping": ({"r": [BLOCK - 1, 0, 0, 3, 0, BLOCK - 1]}, ["r"]),
             "batched": ({"r": [0, BLOCK - 1, 0, 0, 2], "o": [BLOCK - 1]}, ["r", "o"])}
    for tag, (pattern, ids) in cases.items():
        engine = make_engine(target, draft, block_size=BLOCK, max_num_seqs=2)
        use_policy(engine, Pattern(BLOCK - 1, pattern))
        prompts = {"r": PROMPT, "o": other}
        _, runs = run_batch(lambda: engine, [make_request(i, prompts[i], max_tokens=30) for i in ids])
        assert runs[0].output_ids == reference, tag
    for tag in ("skipping", "batched"):
        common = [p for p in seen[tag] if p in seen["every"]]
        assert len(common) >= 8, tag
        for p in common:
            torch.testing.assert_close(seen[tag][p], seen["every"][p], rtol=1e-4, atol=1e-4)


def test_speculation_metrics_are_exact_histograms(dense, reference):
    """/metrics' three speculation histograms (server/spec_metrics.py) after a run with known
    widths: one width observation per sequence-cycle, summing to the drafts verified; accepted
    tokens summing to the request's accepted drafts."""
    from prometheus_client import CollectorRegistry, generate_latest
    from blockspec.server.state import EngineCollector
    engine, _ = oracle_engine(dense, reference, ForcedWidths(BLOCK - 1, k=3))
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    registry = CollectorRegistry()
    registry.register(EngineCollector(SimpleNamespace(engine=engine)))
    text = generate_latest(registry).decode()

    def value(line_start: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))
    cycles = run.stats.cycles
    assert value("blockspec_spec_verify_width_count") == cycles
    assert value("blockspec_spec_verify_width_sum") == 3 * cycles
    assert value('blockspec_spec_verify_width_bucket{le="2"}') == 0
    assert value('blockspec_spec_verify_width_bucket{le="3"}') == cycles
    assert value("blockspec_spec_verified_tokens_per_cycle_sum") == 3 * cycles
    # As the verify judged them, before max_tokens cut the last block (the request's stats after).
    judged, committed = [], 1
    while committed < 30:
        good = 0
        while good < 3 and committed + good not in WRONG and committed + good < 30:   # the oracle knows 30
            good += 1
        judged.append(good)
        committed += good + 1
    assert value("blockspec_spec_accepted_tokens_per_cycle_sum") == sum(judged) >= run.stats.accepted_tokens
    assert value("blockspec_spec_accepted_tokens_per_cycle_count") == cycles
    # The realised acceptance, one observation per sequence-cycle.
    assert value("blockspec_spec_accepted_per_sequence_count") == cycles
    assert value("blockspec_spec_accepted_per_sequence_sum") == sum(judged)
    assert value('blockspec_spec_accepted_per_sequence_bucket{le="2"}') == sum(a <= 2 for a in judged) < cycles
    # Per request (meta_info): cycles by the width verified (cut to what max_tokens allowed) and
    # by the drafts accepted.
    from blockspec.server.generation import meta_info
    choice = SimpleNamespace(generation=SimpleNamespace(stats=run.stats, processor=SimpleNamespace(
        completion_tokens=len(run.output_ids))))
    meta = meta_info([choice])
    cut = [min(3, 30 - 2 - sum(run.stats.acceptance_lengths[:i])) for i in range(cycles)]   # 1 + Σ out so far
    assert run.stats.verify_widths == cut and cut[-1] < 3
    assert meta.spec_verify_width_histogram == [cut.count(k) for k in range(4)]
    assert meta.spec_accept_histogram == [[n - 1 for n in run.stats.acceptance_lengths].count(a) for a in range(4)]


def test_a_seeded_request_under_adaptive_speculation_is_the_same_alone_and_batched(dense, reference, monkeypatch):
    """Adaptive speculation, rows dear: a seeded sampling request's output alone equals its
    output beside greedy and unseeded requests (whose widths, and draft blocks, the policy
    narrows); the greedy one still equals plain decoding."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)              # narrowing from the first cycle
    dear = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.3, draft_ms=0.1)
    dear = CostTable(dear.target_rows, dear.target_ms, dear.draft_batch, dear.draft_ms,
                     narrow=tuple((w, tuple(ms * w / BLOCK for ms in dear.draft_ms)) for w in (2, 4)))

    widths: list[int] = []

    def engine():
        spec = Speculation("adaptive", BLOCK - 1, costs=dear)
        spec.record_cycle = lambda *_: None        # the host-work fit learns this machine's load: not here
        made, _ = oracle_engine(dense, reference, spec, honest=True, speculation="adaptive", max_num_seqs=4)
        launch = made.runner.launch
        made.runner.launch = lambda batch: (widths.append(batch.draft_width), launch(batch))[1]
        return made

    def seeded():
        return make_request("seeded", PROMPT, max_tokens=12, temperature=0.9, seed=7)
    alone = run_alone(engine, seeded())
    widths.clear()
    made, runs = run_batch(engine, [make_request("greedy", PROMPT, max_tokens=30), seeded(),
                                    make_request("unseeded", PROMPT, max_tokens=4, temperature=0.9)])
    assert {2, 4} & set(widths)                     # the others drafted narrower blocks meanwhile
    assert runs[1].output_ids == alone.output_ids
    assert runs[1].stats.acceptance_lengths == alone.stats.acceptance_lengths
    assert runs[0].output_ids == reference
    assert sum(k * n for k, n in made.counters.spec_widths.items()) < (BLOCK - 1) * sum(made.counters.spec_widths.values())


class RandomAdaptive(Speculation):
    """Adaptive mode (its draft blocks chosen by draft_width from the table's widths), the k of
    each sequence and cycle drawn by the test (seeded), within its caps."""

    def __init__(self, num_slots: int, costs: CostTable, seed: int = 0):
        super().__init__("adaptive", num_slots, costs=costs)
        self.rng = random.Random(seed)

    def planned_widths(self, seqs):
        return [min(self.rng.choice([0, 1, 1, 2, 3, 5, 7]), cap) for cap in self.caps(seqs)]


def test_narrower_draft_blocks_are_lossless_and_run_at_the_width_they_need(dense, reference, monkeypatch):
    """The real (random) draft at blocks of 2, 4 and 8 as the step's widest verify needs: three
    greedy requests, alone and batched, equal plain decoding; each draft forward denoised the
    narrowest block holding its step's widest k + 1."""
    from blockspec.engine import model_runner
    target, draft = dense
    real, blocks = model_runner.propose, []

    def recording(out, seqs, confidence=False):
        blocks.append(out.drafts.shape[1] + 1)          # DraftReadout: the forward's argmax [B, W − 1]
        return real(out, seqs, confidence)
    monkeypatch.setattr(model_runner, "propose", recording)
    costs = CostTable((1, 4096), (5.0, 46.0), (1, 64), draft_by_width(BLOCK),
                      narrow=tuple((w, draft_by_width(w)) for w in (2, 4)))
    engine = make_engine(target, draft, block_size=BLOCK, max_num_seqs=3, speculation="adaptive")
    assert engine.runner.graphs.draft_widths == (2, 4, BLOCK)
    use_policy(engine, RandomAdaptive(BLOCK - 1, costs))
    steps = []
    original = engine.runner.launch
    engine.runner.launch = lambda batch: (steps.append((list(batch.num_drafts), batch.draft_width)), original(batch))[1]
    _, runs = run_batch(lambda: engine, [make_request(f"r{i}", PROMPT, max_tokens=30) for i in range(3)])
    assert all(run.output_ids == reference for run in runs)
    drafted = [(ks, width) for ks, width in steps if any(ks)]
    assert [width or BLOCK for _, width in drafted] == blocks
    assert [min(w for w in (2, 4, BLOCK) if w >= max(ks) + 1) for ks, _ in drafted] == blocks
    assert {2, 4, BLOCK} <= set(blocks)


@pytest.mark.measured_costs
def test_adaptive_mode_measures_its_costs_and_is_lossless(dense, reference):
    """Adaptive mode: the cost table measured at startup on this CPU through the dispatcher (the
    powers of two of its token and sequence buckets and the largest, run at their own size:
    interpolated between; monotone), then allocation."""
    from blockspec.engine.graphs import sparse
    assert sparse([1, 2, 4, 8, 16, 32, 48, 64, 80]) == [1, 2, 4, 8, 16, 32, 64, 80]
    engine, _ = oracle_engine(dense, reference, None, speculation="adaptive", max_num_seqs=4)
    table, graphs = engine.runner.speculation.costs, engine.runner.graphs
    assert table is not None and not table.padded and not graphs.padded
    assert table.target_rows == tuple(sparse(graphs.full_tokens)) and table.target_rows[-1] == 4 * BLOCK
    assert set(table.target_rows) == {n for n in graphs.full_tokens if n & (n - 1) == 0} | {4 * BLOCK}
    assert table.draft_batch == tuple(graphs.draft_sizes) == (1, 2, 4)
    assert list(table.target_ms) == sorted(table.target_ms) and list(table.draft_ms) == sorted(table.draft_ms)
    assert table.narrow_widths == (2, 4) and all(list(ms) == sorted(ms) for _, ms in table.narrow)
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference


def test_the_depth_correction_brings_predicted_survival_to_what_verifies_realised():
    """Speculation.corrected (BLOCKSPEC_ADAPTIVE_DEPTH=1): each depth's predicted survival scaled by
    what the verifies realised at that depth ÷ what was predicted for them, never above 1, never
    growing with depth; depths no verify judged (past a narrow k) keep their prediction; off,
    the prediction as it is."""
    spec = Speculation("adaptive", 6, costs=CostTable.analytic(flat_rows=16, ms_flat=5.0, ms_per_row=0.2,
                                                               draft_ms=1.0))
    seqs = [request_of() for _ in range(2)]
    rows = spec.rows(seqs)
    raw = spec.calibration.predicted(rows)                     # a fresh draft: the top bin's prior
    predicted = np.cumprod(raw, axis=1)[0]
    for _ in range(400):                                       # judged to depth 4: half survive all of it
        spec.learn_depth(rows, [4, 4], [4, 0])
    ratio = spec.depth_ratio()
    assert np.allclose(ratio[:4], 0.5 / predicted[:4], rtol=0.02)          # realised ÷ predicted
    assert np.all(ratio[4:] == 1.0)                                         # never judged: the prior
    corrected = spec.corrected(raw, apply=True)
    survival = np.cumprod(corrected, axis=1)
    assert np.allclose(survival[:, :4], 0.5, rtol=0.05)                     # what the verifies realised
    assert np.all(np.diff(survival, axis=1) <= 1e-12) and np.all(survival <= 1.0)
    assert np.allclose(survival[:, 4:], np.minimum(np.cumprod(raw, axis=1)[:, 4:], survival[:, 3:4]))
    assert spec.corrected(raw, apply=False) is raw
    for _ in range(1200):                                      # now every block accepted whole (the old fades)
        spec.learn_depth(rows, [4, 4], [4, 4])
    assert np.allclose(np.cumprod(spec.corrected(raw, apply=True), axis=1)[:, :4], 1.0, rtol=0.05)


def test_adaptive_with_the_depth_correction_is_lossless(dense, reference, monkeypatch):
    """The correction on (as BLOCKSPEC_ADAPTIVE_DEPTH=1 sets it): the greedy output is plain's, and
    it learnt from the verifies."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "APPLY_DEPTH", True)
    engine, _ = oracle_engine(dense, reference, None, speculation="adaptive", max_num_seqs=4)
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference
    assert engine.runner.speculation._depth[1].sum() > 0


def test_speculation_option_is_validated_and_off_runs_no_draft(dense):
    with pytest.raises(ConfigError, match="--speculation"):
        EngineConfig(speculation="sometimes")
    target, draft = dense
    counter = ForwardCounter(draft)
    try:
        engine = make_engine(target, draft, block_size=4, speculation="off")
        run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=6))
    finally:
        counter.handle.remove()
    assert counter.count == 0 and engine.runner.draft is None and not run.stats.speculative


def test_dflash1_and_2_with_grammar_and_penalties_at_random_widths(dense, qwen3_dir, tmp_path):
    """DFlash 1 (an oracle draft) and DFlash 2 (its walk over oracle-boosted candidates) under a
    JSON grammar and penalties: greedy output equal to plain decoding at random widths per cycle."""
    from test_dflash2 import install_oracle
    from test_logits import PROMPT as JSON_PROMPT, SCHEMA
    from blockspec.engine.request import Request
    from blockspec.structured import GrammarSpec, compile_grammar, grammar_compiler
    from blockspec.tokenizer import Tokenizer
    target, draft1 = dense
    draft2 = load_draft(str(fixtures.write_dflash2_draft(tmp_path / "d2", qwen3_dir)), target)
    compiler = grammar_compiler(Tokenizer.from_dir(qwen3_dir), target.lm_head.weight.shape[0])
    grammar = compile_grammar(compiler, GrammarSpec("json_schema", SCHEMA))
    stops = frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID})
    cases = {"grammar": (dict(), True),
             "penalties": (dict(presence_penalty=1.0, repetition_penalty=1.3, logit_bias=((100, 3.0),),
                                min_tokens=3), False),
             "both": (dict(frequency_penalty=0.5), True)}
    for name, (params, with_grammar) in cases.items():
        def req():
            return Request("r", JSON_PROMPT, SamplingParams(max_tokens=40, **params), stops, 1024,
                           grammar=grammar if with_grammar else None)
        expected = run_alone(lambda: make_engine(target), req()).output_ids
        assert len(expected) >= 12, (name, expected)
        install_oracle(draft2, [JSON_PROMPT + expected])
        oracle1 = OracleDraft(draft1, JSON_PROMPT + expected)
        for kind, draft in (("dflash1", oracle1), ("dflash2", draft2)):
            for seed in (0, 1):
                def factory():
                    made = make_engine(target, draft, block_size=BLOCK)
                    if draft is oracle1:
                        oracle1.bind(made)
                    use_policy(made, ForcedWidths(BLOCK - 1, seed=seed))
                    return made
                run = run_alone(factory, req())
                assert run.output_ids == expected, (name, kind, seed)
                assert max(run.stats.acceptance_lengths) > 2, (name, kind)       # drafts were accepted
        del draft2.propose                                                       # back to the class's


# ---- losslessness at any width: sampling -----------------------------------------------------

def test_sampled_accept_never_reads_past_k():
    """Row k's distribution is the bonus's after k kept drafts; rows past k are poison (NaN):
    reading them would fail. One-hot p = q on the drafts: all k are kept, a_b = k exactly."""
    vocab, width = 6, 5
    drafts = torch.tensor([[1, 2, 3, 4]])
    logits = torch.full((1, width, vocab), float("nan"))
    q = torch.zeros(4, vocab)
    for k in range(5):
        for i in range(k):
            logits[0, i] = -1e9
            logits[0, i, drafts[0, i]] = 0.0
            q[i] = torch.nn.functional.one_hot(drafts[0, i], vocab).float()
        logits[0, k] = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.1, 0.3])
        seq = SimpleNamespace(request=SimpleNamespace(params=SamplingParams(temperature=1.0, seed=1)),
                              generator=torch.Generator().manual_seed(0))
        rows = logits.clone()
        rows[0, k + 1:] = float("nan")
        num_accepted, new_tokens = accept([seq], Proposal(drafts, [q]), rows, num_drafts=[k])
        assert num_accepted == [k] and new_tokens[0][:k] == drafts[0, :k].tolist()


def test_sampled_output_keeps_plain_sampling_distribution_at_random_widths(dense):
    """As tests/test_dflash.py's distribution test, with each cycle's widths random in 0 … T − 1:
    positions 1–3 follow plain sampling's tokens."""
    target, draft = dense
    prompt = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    reference = run_alone(lambda: make_engine(target), make_request("r", prompt, max_tokens=4)).output_ids
    oracle = OracleDraft(draft, prompt + reference, sharpness=2.0)
    params = dict(max_tokens=4, temperature=1.0, top_k=4)
    runs = 160

    def outputs(factory, seed0):
        requests = [make_request(f"s{s}", prompt, seed=seed0 + s, **params) for s in range(runs)]
        _, done = run_batch(factory, requests)
        return [tuple(r.output_ids[1:4]) for r in done]

    def spec():
        made = make_engine(target, oracle, block_size=4, max_num_seqs=runs)
        oracle.bind(made)
        use_policy(made, ForcedWidths(3, seed=5))
        return made

    plain_out = outputs(lambda: make_engine(target, max_num_seqs=runs), 0)
    spec_out = outputs(spec, 10_000)
    assert oracle.calls > 0
    for position in (0, 1, 2):
        a = [o[position] for o in plain_out]
        b = [o[position] for o in spec_out]
        support = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in support], [b.count(t) for t in support]])
        table = table[:, table.sum(0) >= 5]
        assert chi2_contingency(table).pvalue > 1e-3


def test_the_allocation_plans_only_the_rows_a_step_holds():
    """256 sequences of confident drafts (p = 0.9, caps 15) on a table where rows are cheap: with no
    budget every slot is taken (4,096 rows); under a 2,048-token budget the allocation takes the
    best slots that fit beside the 256 rows — the first 7 of every block, 2,048 rows — never more;
    a seeded request's floor is kept whatever the budget; a budget that fits everything changes
    nothing."""
    probs = np.full((256, 15), 0.9)
    cheap = CostTable.analytic(flat_rows=4096, ms_flat=6.0, ms_per_row=0.001, draft_ms=1.0)
    free = allocate(probs, [15] * 256, cheap)
    assert sum(free.widths) == 256 * 15
    fit = allocate(probs, [15] * 256, cheap, max_rows=2048)
    assert sum(k + 1 for k in fit.widths) <= 2048 and sorted(set(fit.widths)) == [7]
    floors = [15] + [0] * 255
    kept = allocate(probs, [15] * 256, cheap, floors, max_rows=300)
    assert kept.widths[0] == 15 and sum(k + 1 for k in kept.widths) <= 300 + 15
    assert allocate(probs, [15] * 256, cheap, max_rows=8192).widths == free.widths
    spec = Speculation("adaptive", 7, costs=cheap, max_rows=64)
    assert spec.max_rows == 64


# ---- the bench's latent acceptance profile ----------------------------------------------------

def test_latent_profile_hits_its_mean_and_its_confidence_is_informative():
    """Whole blocks of 16 verified along many requests: the mean acceptance length is the asked
    6.5; drafts reported at high confidence are accepted far more often than low ones; the same
    request id gives the same latents (every mode sees the same text difficulty)."""
    from blockspec.bench import LatentProfile, parse_accept_profile, solve_mean_probability
    m = solve_mean_probability(6.5, 16)
    assert 1 + sum(m ** i for i in range(1, 16)) == pytest.approx(6.5, abs=1e-6)
    profile = parse_accept_profile("latent:6.5", 16)
    lengths, by_confidence = [], {True: [], False: []}
    for r in range(200):
        request = SimpleNamespace(request_id=f"r{r}")
        pi, u = profile.latents(request, 2000)
        j = 0
        while j < 1900:
            a = 0
            while a < 15 and u[j + 1 + a] < pi[j + 1 + a]:
                a += 1
            lengths.append(a + 1)
            for i in range(min(a + 1, 15)):
                by_confidence[pi[j + 1 + i] > 0.5].append(i < a)
            j += a + 1
    assert abs(sum(lengths) / len(lengths) - 6.5) < 0.35
    assert np.mean(by_confidence[True]) > 0.9 > 0.35 > np.mean(by_confidence[False])
    r3 = SimpleNamespace(request_id="r3")
    assert np.array_equal(LatentProfile(6.5, 16).latents(r3, 50)[0][:50], profile.latents(r3, 2000)[0][:50])
    assert np.array_equal(LatentProfile(6.5, 16).latents(r3, 2000)[0][:2000], profile.latents(r3, 2000)[0][:2000])
    for bad in ("latent", "latent:x", "flat:3", "latent:20", "latent:3:0"):
        with pytest.raises(ValueError):
            parse_accept_profile(bad, 16)


def test_latent_profile_cycles_read_each_sequences_own_slots():
    """The profile's wrappers, vectorised over the batch: each sequence's confidences are π at its
    own output positions (from the anchor's next), its acceptance the leading slots with u < π
    capped at its own k, and its new tokens the target's argmax rows up to there — as one
    sequence at a time computes them."""
    from blockspec.bench import LatentProfile
    profile = LatentProfile(4.0, 8)
    seqs = [SimpleNamespace(request=SimpleNamespace(request_id=f"s{i}", prompt_ids=[0] * (3 + i), max_model_len=400,
                                                    params=SamplingParams()),
                            num_cached=3 + i + 17 * i) for i in range(6)]
    widths = [7, 0, 3, 7, 1, 5]
    logits = torch.randn(6, 8, 50, generator=torch.Generator().manual_seed(0))
    proposal = SimpleNamespace(drafts=torch.zeros(6, 7, dtype=torch.long), confidence=None)
    proposed = profile.propose(lambda out, seqs, confidence: proposal)(None, seqs, True)
    verdict = profile.judge(lambda *a: Verdict(torch.zeros(6, 1, dtype=torch.long), logits.argmax(-1)))(
        seqs, proposed, logits, None, widths)
    num_accepted, new_tokens = accept(seqs, proposed, logits, None, widths, verdict)
    argmax = logits.argmax(-1).tolist()
    for b, seq in enumerate(seqs):
        pi, u = profile.latents(seq.request, 500)
        start = seq.num_cached - len(seq.request.prompt_ids) + 1
        assert proposed.confidence[b].tolist() == pi[start: start + 7].tolist()
        a = 0
        while a < widths[b] and u[start + a] < pi[start + a]:
            a += 1
        assert num_accepted[b] == a and new_tokens[b] == argmax[b][: a + 1]
    assert sum(num_accepted) > 0 and num_accepted[1] == 0


def test_the_readout_in_the_draft_forward_proposes_what_the_logits_would(dense, qwen3_dir, monkeypatch):
    """The draft forward takes the argmax and the confidences itself (`DraftReadout`, inside the
    propose graph on CUDA): for greedy, seeded-sampling and grammar-processed sequences in one
    adaptive batch, every cycle's drafts and confidences equal what `propose` makes from the
    bare logits (the path before), and the outputs equal each request's alone."""
    from test_logits import PROMPT as JSON_PROMPT, SCHEMA
    from blockspec.engine import model_runner
    from blockspec.engine.request import Request
    from blockspec.engine.spec.dflash import DraftReadout, draft_confidence, with_sampled
    from blockspec.structured import GrammarSpec, compile_grammar, grammar_compiler
    from blockspec.tokenizer import Tokenizer
    target, draft = dense
    grammar = compile_grammar(grammar_compiler(Tokenizer.from_dir(qwen3_dir), target.lm_head.weight.shape[0]),
                              GrammarSpec("json_schema", SCHEMA))
    stops = frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID})

    def requests():
        return [Request("greedy", PROMPT, SamplingParams(max_tokens=24), stops, 1024),
                Request("sampled", PROMPT[:20], SamplingParams(max_tokens=24, temperature=0.9, seed=5), stops, 1024),
                Request("json", JSON_PROMPT, SamplingParams(max_tokens=24), stops, 1024, grammar=grammar)]
    alone = {r.request_id: run_alone(lambda: make_engine(target, draft, block_size=BLOCK, speculation="adaptive"),
                                     r).output_ids for r in requests()}
    real, compared, redrawn = model_runner.propose, [], []

    def both_ways(out, seqs, confidence=False):
        assert isinstance(out, DraftReadout) and (out.confidence is not None) == confidence
        states = [seq.generator.get_state() if seq.generator is not None else None for seq in seqs]
        before = real(out.logits.clone(), seqs, confidence)
        for seq, state in zip(seqs, states):
            if state is not None:
                seq.generator.set_state(state)
        proposal = real(out, seqs, confidence)
        assert torch.equal(proposal.drafts, before.drafts)
        assert (proposal.confidence is None) == (before.confidence is None)
        if proposal.confidence is not None:       # the rule before: p(d) of every draft, q(d) where sampled
            logits = out.logits[: len(seqs)]
            assert torch.equal(proposal.confidence, with_sampled(draft_confidence(logits, before.drafts), before))
        compared.append({seq.request_id for seq in seqs})
        redrawn.extend(seq.logits_processor is not None and not torch.equal(proposal.drafts[b], out.drafts[b])
                       for b, seq in enumerate(seqs))
        return proposal
    monkeypatch.setattr(model_runner, "propose", both_ways)
    engine = make_engine(target, draft, block_size=BLOCK, max_num_seqs=3, speculation="adaptive")
    assert engine.runner.speculation.reads_confidences
    _, runs = run_batch(lambda: engine, requests())
    assert [run.output_ids for run in runs] == [alone[r.request_id] for r in requests()]
    assert any(ids == {"greedy", "sampled", "json"} for ids in compared)
    assert any(redrawn)                     # the grammar changed some drafts away from the argmax


def test_the_pools_profile_runs_a_draft_forward_before_any_step(dense, monkeypatch):
    """On CUDA the pool is sized by a profile that runs a full decode batch through the draft
    before anything else (ModelRunner.profile); that forward reads out the confidences when the
    policy reads them, so the policy must exist by then (round 42's H200 run failed at startup
    on exactly this). Here the profile runs on CPU too, at the same point of the startup."""
    from blockspec.engine.model_runner import ModelRunner
    target, draft = dense
    real, profiled = ModelRunner.size_pool, []

    def profiling_first(self, graphed):
        self.profile(self.config.max_num_batched_tokens // self.page_size + 2)
        profiled.append(self.speculation.reads_confidences)
        return real(self, graphed)
    monkeypatch.setattr(ModelRunner, "size_pool", profiling_first)
    engine = make_engine(target, draft, block_size=BLOCK, speculation="adaptive")
    assert profiled == [True]
    request = make_request("r", PROMPT, max_tokens=12)
    reference = run_alone(lambda: make_engine(target, None), make_request("r", PROMPT, max_tokens=12))
    assert run_alone(lambda: engine, request).output_ids == reference.output_ids


class PlanCounter(Speculation):
    """The real adaptive policy, recording each step's batch and whether its widths were planned
    on the spot (between the sync and the launch) rather than taken from plan_ahead."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[frozenset, bool]] = []
        self._planning = False

    def planned_widths(self, seqs):
        self._planning, self._on_the_spot = True, False
        planned = {} if self._ahead is None else {id(seq): k for seq, k in zip(*self._ahead)}
        capped = any(planned.get(id(seq), 0) > cap for seq, cap in zip(seqs, self.caps(seqs)))
        try:
            return super().planned_widths(seqs)
        finally:
            self._planning = False
            if seqs:
                self.steps.append((frozenset(seq.request_id for seq in seqs), self._on_the_spot, capped))

    def allocation(self, seqs, ahead=0):
        self._on_the_spot = self._on_the_spot or self._planning
        return super().allocation(seqs, ahead)


def test_an_arrival_is_planned_for_while_its_prompt_runs(dense, reference, monkeypatch):
    """plan_ahead covers the sequences whose prompt the step completes: the first decode step
    of the batch (the prompts of two requests) and of a request arriving mid-run take the widths
    made while the step before ran, and so does every other step: after a sequence ended (the
    others keep their widths) and where a request's last tokens cut a planned width (cut to the
    cap). The outputs are plain decoding's."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)
    target, _ = dense
    spec = PlanCounter("adaptive", BLOCK - 1, costs=CostTable.analytic(flat_rows=64, ms_flat=5.0, ms_per_row=0.05,
                                                                       draft_ms=1.0))
    spec.record_cycle = lambda *_: None
    spec.learning_interval = lambda num_seqs: math.inf              # no learning cycles: plans only
    engine, _ = oracle_engine(dense, reference, spec, max_num_seqs=3)
    _, runs = run_batch(lambda: engine, [make_request("a", PROMPT, max_tokens=30), make_request("b", PROMPT, max_tokens=18)],
                        arrivals={3: [make_request("c", PROMPT, max_tokens=24)]})
    assert [run.output_ids for run in runs] == [reference, reference[:18], reference[:24]]
    batches = [ids for ids, _, _ in spec.steps]
    assert batches[0] == {"a", "b"} and {"a", "b", "c"} in batches
    joined = batches.index(frozenset({"a", "b", "c"}))
    assert not spec.steps[0][1] and not spec.steps[joined][1]       # planned ahead, arrival included
    ended = capped_steps = 0
    for (before, _, _), (ids, on_the_spot, capped) in zip(spec.steps, spec.steps[1:]):
        assert not on_the_spot, (before, ids, capped)
        ended += ids < before
        capped_steps += capped
    assert ended == 2 and capped_steps > 0            # both cases were met, and planned ahead


def test_the_engine_average_is_the_same_cycle_by_cycle_and_in_any_batches():
    """Calibration's engine-wide average of recent cycles (what a new sequence starts from) is
    learnt in one pass over a verify's cycles; it equals, bit for bit, the average taken one
    cycle at a time, however the cycles are split into verifies (from none yet, and from one)."""
    from blockspec.engine.spec.policy import ENGINE_EMA, engine_average
    rng = np.random.default_rng(3)
    for trial in range(60):
        cycles = rng.random((int(rng.integers(0, 30)), 7))
        start = np.full(7, np.nan) if trial % 2 else rng.random(7)
        want = start.copy()
        for cycle in cycles:
            want = cycle if np.isnan(want).any() else (1 - ENGINE_EMA) * want + ENGINE_EMA * cycle
        cut = int(rng.integers(0, len(cycles) + 1))
        assert np.array_equal(engine_average(start.copy(), cycles), want, equal_nan=True)
        assert np.array_equal(engine_average(engine_average(start.copy(), cycles[:cut]), cycles[cut:]), want,
                              equal_nan=True)


def counting_policy() -> tuple[Speculation, list[int]]:
    """An adaptive policy over a table where drafts cost (0.3 ms a verify row, 0.5 ms a draft),
    and the list its calibration appends to for each verify it learns from."""
    dear = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.3, draft_ms=0.5)
    spec = Speculation("adaptive", BLOCK - 1, costs=dear)
    learnt: list[int] = []
    real_observe = spec.calibration.observe
    spec.calibration.observe = lambda *args: (learnt.append(1), real_observe(*args))[1]
    return spec, learnt


def test_arms_measure_both_then_keep_the_faster_and_remeasure_the_other():
    """The measured choice (policy.Arms): at a new load the policy and whole blocks each run a
    window first; then the one whose own steps committed more tokens a second runs, the other one
    window in ARM_EXPLORE × (the faster's rate ÷ its own)²; another load is measured on its own."""
    from blockspec.engine.spec.policy import ARM_EXPLORE, ARM_WINDOW, Arms
    arms = Arms()
    ms = {"policy": 3.0, "whole": 2.0}                 # the same tokens a step, whole blocks faster

    def run(load: int, steps: int) -> list[str]:
        taken = []
        for _ in range(steps):
            assert arms.upcoming(load) == arms.arm(load) or arms.windows[load][1] == ARM_WINDOW - 1
            taken.append(arms.windows[load][0])
            arms.record(load, taken[-1], 20, ms[taken[-1]] / 1e3)
        return taken
    gap = round(ARM_EXPLORE * 1.5 ** 2)                # 18 windows apart: the policy is 1.5 × slower
    taken = run(4, ARM_WINDOW * (2 * gap + 1))
    windows = [taken[i] for i in range(0, len(taken), ARM_WINDOW)]
    assert windows[:2] == ["policy", "whole"]                                  # both measured first
    assert [i for i, arm in enumerate(windows) if arm == "policy"] == [0, gap, 2 * gap]
    assert arms.rate(4, "whole") > arms.rate(4, "policy")
    ms["policy"] = 1.0                                 # the load changed: the policy became faster
    later = run(4, ARM_WINDOW * 3 * gap)               # its re-measurements find it
    assert later[-ARM_WINDOW:] == ["policy"] * ARM_WINDOW
    assert run(6, ARM_WINDOW)[0] == "policy" and arms.rate(6, "whole") == 0.0   # a load of its own


def test_an_arm_far_behind_is_remeasured_rarely_and_one_level_every_explore_windows():
    """Arms.interval: an arm's windows ARM_EXPLORE of them apart at equal rates, ARM_EXPLORE ×
    gap² behind, at most MAX_EXPLORE; plain windows are PLAIN_WINDOW steps. The plain arm 5 ×
    slower than the policy (one sequence on the GPU) runs 2 steps in 402, 0.5 % of them."""
    from blockspec.engine.spec.policy import ARM_EXPLORE, ARM_WINDOW, MAX_EXPLORE, PLAIN_WINDOW, Arms
    arms = Arms(("policy", "plain"))
    for arm, ms in (("policy", 1.0), ("plain", 5.0), ("whole", 1.0), ("slow", 1e3)):
        for _ in range(ARM_WINDOW):
            arms.record(1, arm, 6, ms / 1e3)
    assert arms.interval(1, "policy", "whole") == ARM_EXPLORE * ARM_WINDOW
    assert arms.interval(1, "policy", "plain") == pytest.approx(ARM_EXPLORE * 25 * PLAIN_WINDOW) == 400
    assert arms.interval(1, "policy", "slow") == MAX_EXPLORE * ARM_WINDOW
    taken = [arms.arm(1) for _ in range(850)]
    starts = [i for i, arm in enumerate(taken) if arm == "plain" and taken[i - 1] != "plain"]
    assert starts == [400, 802] and taken.count("plain") == 2 * PLAIN_WINDOW


def test_adaptive_with_measured_arms_is_lossless_and_runs_both(dense, reference, monkeypatch):
    """BLOCKSPEC_ADAPTIVE_ARMS=1: steps of whole blocks (no policy work) and of the policy's
    plans alternate while both are measured; the output still equals plain decoding's, and the
    policy learns nothing from whole-block steps."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "MEASURE_ARMS", True)
    monkeypatch.setattr(policy, "ARM_WINDOW", 2)
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)
    spec, learnt = counting_policy()
    # The table's prices alone: the fit would learn this machine's step time, whose host work per
    # step (tens of ms on CPU against the table's few) makes whole blocks worth it at one load.
    spec.fit = lambda *args, **kwargs: None
    engine, _ = oracle_engine(dense, reference, spec, honest=True, speculation="adaptive")
    steps = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: (steps.append((batch.arm, list(batch.num_drafts),
                                                        spec.caps(batch.decode).tolist())), launch(batch))[1]
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference
    decode = [step for step in steps if step[1]]
    assert {"policy", "whole"} == {arm for arm, _, _ in decode}
    assert all(ks == caps for arm, ks, caps in decode if arm == "whole")
    assert any(arm == "policy" and ks != caps for arm, ks, caps in decode)       # the policy narrowed
    assert 0 < len(learnt) < len(decode)                                         # not from whole blocks
    assert spec.arms.sums[1]["whole"][2] > 0 and spec.arms.sums[1]["policy"][2] > 0


def test_three_arms_are_measured_in_turn_then_the_fastest_runs_and_the_others_when_due():
    """Arms with the plain arm (and whole blocks): each runs a window first, in order; then the
    fastest by its own steps' tokens a second, each other one window ARM_EXPLORE × its gap² of
    its windows after its last began (the policy 1.5 × slower: 144 steps; whole blocks 2 ×: 256);
    the plain arm's windows are PLAIN_WINDOW steps."""
    from blockspec.engine.spec.policy import ARM_EXPLORE, ARM_WINDOW, PLAIN_WINDOW, Arms
    arms = Arms(("policy", "whole", "plain"))
    ms = {"policy": 3.0, "whole": 4.0, "plain": 2.0}            # the same tokens a step: plain fastest
    taken = []
    for _ in range(300):
        taken.append(arms.arm(4))
        arms.record(4, taken[-1], 20, ms[taken[-1]] / 1e3)
    starts = [(i, arm) for i, arm in enumerate(taken) if i == 0 or taken[i - 1] != arm]
    assert starts[:3] == [(0, "policy"), (ARM_WINDOW, "whole"), (2 * ARM_WINDOW, "plain")]
    assert taken[2 * ARM_WINDOW: 2 * ARM_WINDOW + PLAIN_WINDOW + 1] == ["plain"] * (PLAIN_WINDOW + 1)
    policy_gap, whole_gap = ARM_WINDOW * ARM_EXPLORE * 1.5 ** 2, ARM_WINDOW * ARM_EXPLORE * 2.0 ** 2
    explored = [(i, arm) for i, arm in starts[3:] if arm != "plain"]
    assert explored == [(policy_gap, "policy"), (ARM_WINDOW + whole_gap, "whole"), (2 * policy_gap, "policy")]


def test_a_steps_time_is_measured_at_the_load_it_was_planned_at():
    """Arms count a step against its window at len(seqs).bit_length() (planned_widths) and
    record its time at the same load (record_cycle): at 3 sequences (load 2) the policy's window
    runs, then the plain arm's; both then measured, the faster (plain, 3 × the tokens a second)
    keeps running, the policy re-measured only when due. Recorded at another load (3), neither
    would ever count as measured and the arms would alternate window by window."""
    from blockspec.engine.spec.policy import ARM_WINDOW, PLAIN_WINDOW
    spec = Speculation("adaptive", 7, costs=ROOFLINE, plain_arm=True)
    spec.learning_interval = lambda num_seqs: math.inf
    spec._warm = True
    seqs = [request_of() for _ in range(3)]
    arms = []
    for _ in range(ARM_WINDOW + PLAIN_WINDOW + 20):
        widths = spec.planned_widths(seqs)
        arms.append(spec.step_arm)
        seconds = 1e-3 if spec.step_arm == "plain" else 3e-3
        spec.record_cycle(seconds, widths, num_tokens=len(seqs), arm=spec.step_arm)
    assert arms == ["policy"] * ARM_WINDOW + ["plain"] * (PLAIN_WINDOW + 20)
    assert set(spec.arms.sums) == {len(seqs).bit_length()}
    assert spec.arms.sums[2]["policy"][2] == ARM_WINDOW and spec.arms.sums[2]["plain"][2] == PLAIN_WINDOW + 20


def test_the_fit_learns_from_the_policys_steps_only():
    """record_cycle: every arm's step counts toward its arm's rate, but only the policy's steps
    are fitted (a plain arm's or whole blocks' steps are not the policy's work, and their
    widths never vary: fitted, 40 ms plain steps would price every forward at 4 × the table's)."""
    from blockspec.engine.spec import policy
    table = CostTable.analytic(flat_rows=1, ms_flat=10.0, ms_per_row=1.0, draft_ms=4.0, draft_ms_per_seq=1.0)
    spec = Speculation("adaptive", 7, costs=table, plain_arm=True)
    spec.arms = policy.Arms(("policy", "whole", "plain"))
    for arm, widths in (("plain", [0, 0, 0]), ("whole", [7, 7, 7])):
        for _ in range(20):
            spec.record_cycle(4 * forwards_ms(table, widths) / 1e3, widths, 3, arm=arm)
    assert spec.arms.sums[2]["plain"][2] == spec.arms.sums[2]["whole"][2] == 20
    assert (spec.forward_scale, spec.marginal_scale, spec.overhead_ms_per_seq, spec.overhead_ms_per_token) == (
        1.0, 1.0, 0.0, 0.0) and not spec._xtx.any()
    spec.record_cycle(4 * forwards_ms(table, [3, 0, 1]) / 1e3, [3, 0, 1], 5, arm="policy")
    assert spec._xtx.any()                                  # (the pace's first turn: fitted)


def test_the_plain_arm_joins_the_arms_when_asked(monkeypatch):
    """make_arms: none where the policy runs alone; the plain arm beside the policy (and whole
    blocks under BLOCKSPEC_ADAPTIVE_ARMS=1); Speculation keeps its choice across reset."""
    from blockspec.engine.spec import policy
    assert policy.make_arms(False) is None and policy.make_arms(True).arms == ("policy", "plain")
    spec = Speculation("adaptive", BLOCK - 1, plain_arm=True)
    spec.reset()
    assert spec.arms.arms == ("policy", "plain") and Speculation("adaptive", BLOCK - 1).arms is None
    monkeypatch.setattr(policy, "MEASURE_ARMS", True)
    assert policy.make_arms(True).arms == ("policy", "whole", "plain")


def test_the_plain_arm_is_opt_in(dense, reference, monkeypatch):
    """BLOCKSPEC_PLAIN_ARM=1 (policy.PLAIN_ARM) gives an engine's policy the plain arm; without
    it the policy runs alone (no arms)."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "PLAIN_ARM", True)
    assert oracle_engine(dense, reference, None, speculation="adaptive")[0].runner.speculation.arms.arms == (
        "policy", "plain")
    monkeypatch.setattr(policy, "PLAIN_ARM", False)
    assert oracle_engine(dense, reference, None, speculation="adaptive")[0].runner.speculation.arms is None


def test_a_plain_step_is_planned_ahead_without_drafts_and_that_plan_serves_no_other_arm():
    """plan_ahead for a step the plain arm will take: k = 0 for each sequence (a seeded sampling
    one keeps its block), so the early draft (ahead_draft) drafts none of the others; where the
    step turns out the policy's after all (the rates moved between: Arms.next_arm), it is
    planned anew, not served those zeros."""
    spec = Speculation("adaptive", 7, costs=ROOFLINE, plain_arm=True)
    spec.learning_interval = lambda num_seqs: math.inf          # no learning cycle (every cap)
    spec._warm = True
    seqs = [request_of(), request_of(temperature=0.8, seed=5), request_of()]
    load = len(seqs).bit_length()
    spec.arms.windows[load] = ["plain", 4, 1]                   # mid-window: the next step is plain
    spec.plan_ahead(seqs)
    plan, width = spec.ahead_draft()
    assert [plan[id(seq)] for seq in seqs] == [0, 7, 0] and width == 0
    assert spec.planned_widths(seqs) == [0, 7, 0] and spec.step_arm == "plain"
    spec.plan_ahead(seqs)
    spec.arms.windows[load] = ["policy", 4, 2]                  # the arm changed since the plan
    assert spec.planned_widths(seqs) == spec.allocation(seqs) and spec.step_arm == "policy"
    assert any(k > 0 for k in spec.planned_widths(seqs)[::2])   # (the greedy rows draft here)


def test_adaptive_with_the_plain_arm_is_lossless_and_its_steps_verify_no_drafts(dense, reference, monkeypatch):
    """The plain arm's windows: every sequence at k = 0 (a seeded sampling request would keep its
    block); the policy's windows narrow as before; the output equals plain decoding's, and the
    policy learns nothing from plain steps."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy, "ARM_WINDOW", 2)
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)
    dear = CostTable.analytic(flat_rows=1, ms_flat=1.0, ms_per_row=0.3, draft_ms=0.5)
    spec = Speculation("adaptive", BLOCK - 1, costs=dear, plain_arm=True)
    learnt: list[int] = []
    real_observe = spec.calibration.observe
    spec.calibration.observe = lambda *args: (learnt.append(1), real_observe(*args))[1]
    spec.fit = lambda *args, **kwargs: None
    engine, _ = oracle_engine(dense, reference, spec, honest=True, speculation="adaptive")
    steps = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: (steps.append((batch.arm, list(batch.num_drafts))), launch(batch))[1]
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference
    decode = [step for step in steps if step[1]]
    assert {"policy", "plain"} == {arm for arm, _ in decode}
    assert all(ks == [0] for arm, ks in decode if arm == "plain")
    assert any(arm == "policy" and ks != [0] for arm, ks in decode)
    assert 0 < len(learnt) < len(decode)                                         # not from plain steps
    assert spec.arms.sums[1]["plain"][2] > 0 and spec.arms.sums[1]["policy"][2] > 0


@pytest.mark.pace
def test_the_pace_keeps_the_policys_work_hidden_or_within_its_budget():
    """Pace.choose: every step where the host's wait for the verdict would still cover the
    policy's work once more at stride 1 (the device hides it); else the smallest stride that keeps
    the work within POLICY_BUDGET of a step, at most MAX_STRIDE."""
    from blockspec.engine.spec.policy import MAX_STRIDE, POLICY_BUDGET, Pace
    pace = Pace()
    assert pace.choose() == 1                                        # nothing measured yet
    pace.work_ms = {"observe": 0.4, "fit": 0.1, "plan": 0.3}         # 0.8 ms of work a turn
    for _ in range(50):
        pace.stepped(2.5e-3, 0.0)                                    # host-bound: the host never waits
    assert pace.stride == math.ceil(0.8 / (POLICY_BUDGET * 2.5)) == 16
    for _ in range(200):
        pace.stepped(2.5e-3, 1.2e-3)                                 # at stride 16 the host waits 1.2 ms:
    assert pace.stride == 16                                         # 1.2 − 0.8·15/16 < 0.8, not hidden at 1
    for _ in range(200):
        pace.stepped(2.5e-3, 2.0e-3)                                 # 2.0 ms: 2.0 − 0.75 ≥ 0.8, hidden at 1
    assert pace.stride == 1
    for _ in range(200):
        pace.stepped(2.5e-3, 0.9e-3)                                 # at stride 1 it waits 0.9 ms ≥ 0.8: still hidden
    assert pace.stride == 1
    for _ in range(200):
        pace.stepped(2.5e-3, 0.5e-3)                                 # 0.5 ms, less than the work: it would be
    assert pace.stride == 16                                         # exposed somewhere in the cycle
    pace.work_ms = {"observe": 20.0, "fit": 0.0, "plan": 0.0}
    pace.stepped(2.5e-3, 0.0)
    assert pace.stride == MAX_STRIDE
    counted = [pace.due("observe") for _ in range(2 * MAX_STRIDE)]
    assert counted == [True] + [False] * (MAX_STRIDE - 1) + [True] + [False] * (MAX_STRIDE - 1)


@pytest.mark.pace
def test_at_a_stride_the_policy_learns_fits_and_plans_every_strideth_time():
    """With the pace at stride 4: a step's verify is learnt from (its confidences read) every 4th
    time (a learning cycle's whole blocks always), the cost fit runs every 4th step (and on every
    learning cycle past the warm-up, whose whole blocks are its evidence of what drafts cost), and
    plan_ahead keeps the plan it made for the same sequences in between (one allocation in 4),
    an arrival planned for at once."""
    spec = Speculation("adaptive", 7, costs=CostTable.analytic(flat_rows=16, ms_flat=5.0, ms_per_row=0.2,
                                                               draft_ms=1.0))
    spec.pace.choose = lambda: 4
    spec.pace.stride = 4
    seqs = [request_of() for _ in range(6)]
    learnt, fitted, allocated = [], [], []
    real_observe, real_fit, real_allocation = spec.calibration.observe, spec.fit, spec.allocation
    spec.calibration.observe = lambda *args: (learnt.append(1), real_observe(*args))[1]
    spec.fit = lambda *args: (fitted.append(1), real_fit(*args))[1]
    spec.allocation = lambda batch, ahead=0: (allocated.append(len(batch)), real_allocation(batch, ahead))[1]
    conf = torch.full((6, 7), 0.8, dtype=torch.float64)
    for step in range(8):                            # the warm-up: learning cycles of one width,
        assert spec.planned_widths(seqs) == [7] * 6 and spec.step_learns       # every one learnt
        spec.record_cycle(5e-3, [7] * 6, 18, learns=True)                      # from, fitted at the
    assert len(fitted) == 2                                                    # pace's turns
    fitted.clear()
    spec.calibration.engine_seen[:] = WARMUP_OBSERVATIONS                          # past the warm-up
    spec.learning_interval = lambda num_seqs: math.inf
    observed = []
    for step in range(12):
        spec.planned_widths(seqs)
        observed.append(spec.wants_confidences)             # the runner reads (and defers) only these
        if spec.wants_confidences:
            spec.observe(seqs, conf, [7] * 6, [2] * 6)
        spec.record_cycle(5e-3, [7] * 6, 18)
    assert observed == [True, False, False, False] * 3 and len(learnt) == 3 and len(fitted) == 3
    spec.learning_interval = lambda num_seqs: 0.0                                  # a learning cycle: always
    spec.planned_widths(seqs)
    assert spec.step_learns and spec.wants_confidences
    spec.record_cycle(5e-3, [7] * 6, 18, learns=True)                              # learnt and fitted,
    spec.record_cycle(5e-3, [7] * 6, 18, learns=True)                              # out of the pace's turn
    assert len(fitted) == 5
    spec.learning_interval = lambda num_seqs: math.inf
    allocated.clear()
    plans = []
    for step in range(8):
        spec.plan_ahead(seqs)
        plans.append(spec.planned_widths(seqs))
    assert allocated == [6, 6] and all(plan == plans[0] for plan in plans)
    arrival = request_of()
    spec.plan_ahead(seqs + [arrival])                                              # not in the kept plan
    assert allocated == [6, 6, 7]


@pytest.mark.pace
@pytest.mark.parametrize("late", [False, True])
def test_adaptive_at_a_stride_is_lossless(dense, reference, monkeypatch, late):
    """The pace at stride 3 (the policy's work every third time, plans kept in between): the
    output still equals plain decoding's, and only the steps planned to be learnt from are (late
    too, where every step reads its confidences to refine its widths)."""
    from blockspec.engine.spec import policy
    monkeypatch.setattr(policy.Pace, "choose", lambda self: 3)
    monkeypatch.setattr(policy, "WARMUP_OBSERVATIONS", 0)
    spec, learnt = counting_policy()
    spec.late = late
    # The host-work fit reads this machine's clock, and a step it prices cheap brings learning
    # cycles (every one learnt from) within a 30-token request: held at the table's prices.
    spec.fit = lambda *args: None
    engine, _ = oracle_engine(dense, reference, spec, honest=True, speculation="adaptive")
    run = run_alone(lambda: engine, make_request("r", PROMPT, max_tokens=30))
    assert run.output_ids == reference
    assert spec.pace.stride == 3 and spec.pace.counts["observe"] > 3 and 0 < len(learnt) < spec.pace.counts["observe"]


def test_late_widths_follow_this_cycles_own_confidences_with_the_draft_paid():
    """Speculation.refined (late: CPU, where reading the draft costs no sync): once the drafts
    exist, each sequence verifies what this cycle's calibrated confidences make worth it — all of
    a confident block, the confident prefix of a mixed one, none of a hopeless one, a seeded
    request its whole block. The draft's cost is paid whatever is verified, and stays in the
    step's time (allocate's draft_paid); a learning cycle, and a policy that is not late, keep
    every drafted width."""
    dear_draft = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.5), (1, 64), (50.0, 50.0))
    spec = Speculation("adaptive", 7, costs=dear_draft)
    spec.late = True
    seqs = [request_of(), request_of(), request_of(), request_of(temperature=1.0, seed=3)]
    spec.calibration.engine_seen[:] = WARMUP_OBSERVATIONS                    # a draft as good as its word
    spec.calibration.engine_accepted[:] = WARMUP_OBSERVATIONS * (np.arange(NUM_BINS) + 0.5) / NUM_BINS
    spec.learning_interval = lambda num_seqs: math.inf
    conf = torch.tensor([[0.97] * 7, [0.97, 0.97] + [0.02] * 5, [0.02] * 7, [0.02] * 7], dtype=torch.float64)
    # Who drafts is planned, each a whole block: at this draft's price none of the greedy three
    # alone; beside the seeded request, which drafts anyway, the (flat-priced) draft costs the
    # others nothing more, and all four draft.
    assert spec.planned_widths(seqs[:3]) == [0, 0, 0]
    assert spec.planned_widths(seqs) == [7, 7, 7, 7]
    late = spec.refined(seqs, conf, [7, 7, 7, 7])
    assert late[0] == 7 and 1 <= late[1] <= 3 and late[2] == 0 and late[3] == 7, late
    probs = spec.calibration.calibrate(conf.numpy(), spec.rows(seqs))
    floors = spec.floors(spec.rows(seqs))
    assert allocate(probs, [7] * 4, dear_draft, floors, draft_paid=True, margin=RAGGED_MARGIN).widths == late
    # Rows ten times cheaper beside the 50 ms draft: a verify row costs 0.1 % of the step, so every
    # block is verified whole (priced against the verify alone, the same rows looked worth
    # leaving out: [7, 2, 0, 7]).
    cheap_rows = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.05), (1, 64), (50.0, 50.0))
    assert allocate(probs, [7] * 4, cheap_rows, floors, draft_paid=True, margin=RAGGED_MARGIN).widths == [7] * 4
    spec.step_learns = True
    assert spec.refined(seqs, conf, [7, 7, 7, 7]) == [7, 7, 7, 7]
    spec.step_learns, spec.late = False, False
    assert spec.refined(seqs, conf, [7, 7, 7, 7]) == [7, 7, 7, 7]


def test_a_paid_draft_stays_in_the_steps_time_at_its_own_batch_whatever_is_verified():
    """allocate(draft_paid=True): the draft already ran for every sequence with a cap, so its cost
    is the same whatever is verified, and it stays in the step's time. Rows 0.5 ms each over a
    6 ms plain step of three sequences (hand-computed rates below):
    - a 50 ms draft, one confident block beside two hopeless ones: paid, the confident block is
      verified (9.2 tokens in 59.5 ms against 3 in 56); priced as if not yet run, drafting at all
      would cost 50 ms and the step stays plain;
    - a draft of 10 ms for one block and 90 ms for three, one sequence with a cap, confidences
      0.5: the 10 ms it ran for one makes 3 of its rows the best (3.875 tokens in 17.5 ms, 0.2214 a
      ms; 2 rows 0.2206, 4 rows 0.2188); priced at three sequences' 90 ms it would verify all 7."""
    dear_draft = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.5), (1, 64), (50.0, 50.0))
    probs = torch.tensor([[0.97] * 7, [0.02] * 7, [0.02] * 7], dtype=torch.float64)
    assert allocate(probs, [7] * 3, dear_draft, draft_paid=True, margin=RAGGED_MARGIN).widths == [7, 0, 0]
    assert allocate(probs, [7] * 3, dear_draft, draft_paid=False, margin=RAGGED_MARGIN).widths == [0, 0, 0]
    by_batch = CostTable((1, 4096), (5.0, 5.0 + 4095 * 0.5), (1, 3), (10.0, 90.0))
    halves = torch.full((3, 7), 0.5, dtype=torch.float64)
    paid = allocate(halves, [7, 0, 0], by_batch, draft_paid=True, margin=RAGGED_MARGIN)
    assert paid.widths == [3, 0, 0]
    assert paid.ms == pytest.approx(6.0 + 3 * 0.5 + 10.0) and paid.expected_tokens == pytest.approx(3.875)


def test_late_widths_never_refine_a_sampling_row_and_price_the_drafts_they_ran():
    """A sampling row's k is fixed before its drafts are drawn (the rejection rule is exact only
    then): late widths neither widen it at planning nor refine it after the draft, whatever the
    confidences of what it drew; a greedy row beside it is refined. The cost fit prices the draft
    over the sequences it ran for, a sequence refined to k = 0 included."""
    spec = Speculation("adaptive", 7, costs=CostTable.analytic(flat_rows=1, ms_flat=5.0, ms_per_row=0.5,
                                                               draft_ms=1.0, draft_ms_per_seq=0.5))
    spec.late = True
    spec.calibration.engine_seen[:] = WARMUP_OBSERVATIONS
    spec.calibration.engine_accepted[:] = WARMUP_OBSERVATIONS * (np.arange(NUM_BINS) + 0.5) / NUM_BINS
    spec.learning_interval = lambda num_seqs: math.inf
    greedy, sampled = request_of(), request_of(temperature=1.0)
    spec.allocation = lambda seqs, ahead=0: [3] * len(seqs)            # the plan: both draft, k = 3
    assert spec.planned_widths([greedy, sampled]) == [7, 3]           # widened: the greedy row only
    hopeless = torch.full((2, 7), 0.01, dtype=torch.float64)
    assert spec.refined([greedy, sampled], hopeless, [7, 3]) == [0, 3]
    sure = torch.full((2, 7), 0.99, dtype=torch.float64)
    assert spec.refined([greedy, sampled], sure, [7, 3]) == [7, 3]
    table = spec.costs
    assert forwards_ms(table, [0, 3], drafting=2) == pytest.approx(table.target_ms_of(5) + table.draft_ms_of(2))
    assert forwards_ms(table, [0, 3]) == pytest.approx(table.target_ms_of(5) + table.draft_ms_of(1))
    fitted = []
    spec.fit = lambda *args: fitted.append(args)
    spec.record_cycle(5e-3, [0, 3], 3, 0, drafting=2)
    assert fitted[-1][-1] == 2
