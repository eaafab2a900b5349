"""Tests that the mutation check (scripts/mutation_check.py) relies on: the sampling filters and
the bonus token against reference samplers, greedy acceptance of a matching *prefix*, partial
acceptance on a dense target at known acceptance lengths, and abort on the plain loop."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from blockspec.engine.spec.dflash import Proposal, accept, accept_sampled
from blockspec.loader import load_draft, load_model
from blockspec.sampling import SamplingParams, probs_from_logits, rejection_sample, sample, sample_from_probs

from helpers import ForwardCounter, OracleDraft, make_engine, make_request, run_alone, run_until_done, submit

# Chi-square tests reject at p < 1e-4: a false alarm once in 10 000 runs per test. Every mutant
# they target moves mass onto tokens the reference gives probability 0, which is checked exactly.
ALPHA = 1e-4
LOGITS = torch.tensor([3.0, 2.6, 2.2, 1.5, 1.0, 0.4, -0.5, -2.0])   # 8 tokens, all filters bite


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The filters as written in the docs (vLLM/HF semantics), one token at a time in numpy:
    top-k keeps the k largest scores (ties at the k-th kept); min-p drops tokens below
    min_p · max prob; top-p keeps the smallest prefix (by descending prob) whose mass before
    each kept token is < top_p; then renormalise."""
    scores = logits.double().numpy() / temperature
    keep = np.ones(len(scores), dtype=bool)
    if top_k > 0:
        kth = np.sort(scores)[::-1][top_k - 1]
        keep &= scores >= kth
    probs = np.where(keep, np.exp(scores - scores.max()), 0.0)
    probs /= probs.sum()
    if min_p > 0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    if top_p < 1.0:
        mass_before = 0.0
        for token in np.argsort(-probs, kind="stable"):
            if mass_before >= top_p:
                probs[token] = 0.0
            mass_before += probs[token] if probs[token] > 0 else 0.0
    return probs / probs.sum()


FILTERS = {"top-k=3": dict(top_k=3), "top-p=0.7": dict(top_p=0.7), "min-p=0.3": dict(min_p=0.3),
           "all": dict(top_k=5, top_p=0.9, min_p=0.1, temperature=0.7)}


@pytest.mark.parametrize("settings", FILTERS.values(), ids=FILTERS.keys())
def test_each_filter_equals_the_reference_sampler(settings):
    expected = reference_probs(LOGITS, **settings)
    assert (expected == 0).sum() >= 2                      # the filter removes something here
    params = SamplingParams(temperature=settings.get("temperature", 1.0), top_k=settings.get("top_k", 0),
                            top_p=settings.get("top_p", 1.0), min_p=settings.get("min_p", 0.0), seed=0)
    np.testing.assert_allclose(probs_from_logits(LOGITS, params).double().numpy(), expected, atol=1e-6)
    # Draws through sample(): never a filtered token; the kept ones at the reference frequencies.
    draws = 20_000
    ids = sample(LOGITS.expand(draws, -1), params, torch.Generator().manual_seed(1))
    counts = np.bincount(ids.numpy(), minlength=len(LOGITS))
    assert counts[expected == 0].sum() == 0, counts
    kept = expected > 0
    assert chisquare(counts[kept], draws * expected[kept]).pvalue > ALPHA


def one_hot(token: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


@pytest.mark.parametrize("num_accepted", [0, 2, 4])
def test_the_bonus_token_follows_the_right_distribution(num_accepted):
    """4 drafts; the first num_accepted are certain (p = q = one-hot), the next is certainly
    rejected (p gives it 0). Then the emitted token must follow normalize(max(p_a − q_a, 0)) after a
    rejection, and p_n (not p_{n−1}) after a full block. Every p row is different."""
    vocab, n = 6, 4
    drafts = torch.tensor([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(n + 1, vocab, generator=gen) + 0.05
    q = torch.zeros(n, vocab)
    for i in range(n):
        if i < num_accepted:
            p[i], q[i] = one_hot(int(drafts[i]), vocab), one_hot(int(drafts[i]), vocab)
        else:
            p[i, drafts[i]] = 0.0
            q[i] = 0.5 * one_hot(int(drafts[i]), vocab) + 0.5 / vocab
    p = p / p.sum(-1, keepdim=True)
    if num_accepted == n:
        expected = p[n]
    else:
        residual = (p[num_accepted] - q[num_accepted]).clamp_min(0.0)
        expected = residual / residual.sum()
    draws, counts = 6000, np.zeros(vocab)
    for _ in range(draws):
        a, token = rejection_sample(drafts, p, q, gen)
        assert a == num_accepted
        counts[token] += 1
    expected = expected.double().numpy()
    assert counts[expected == 0].sum() == 0, counts
    kept = expected > 0
    assert chisquare(counts[kept], draws * expected[kept] / expected[kept].sum()).pvalue > ALPHA


def test_greedy_accept_keeps_only_the_matching_prefix():
    """Drafts that match, miss, then match again: only the prefix before the miss is accepted
    (the later matches were judged on a context that contained the wrong draft)."""
    vocab = 10
    target_ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [4, 4, 4, 4, 4]])
    drafts = torch.tensor([[5, 6, 0, 8], [0, 2, 3, 4], [4, 4, 4, 4]])
    logits = torch.nn.functional.one_hot(target_ids, vocab).float()
    seq = SimpleNamespace(request=SimpleNamespace(params=SamplingParams()))   # greedy: all accept() reads
    num_accepted, new_tokens = accept([seq] * 3, Proposal(drafts, [None] * 3), logits)
    assert num_accepted == [2, 0, 4]
    assert new_tokens == [[5, 6, 7], [1], [4, 4, 4, 4, 4]]



def test_one_draw_is_torch_multinomials_draw():
    """sample_from_probs (the exponential race, no host read) draws what torch.multinomial draws
    from the same generator state, and leaves the generator where multinomial leaves it."""
    probs = torch.softmax(3 * torch.randn(4, 300, generator=torch.Generator().manual_seed(2)), dim=-1)
    probs[1, 100:] = 0.0                                     # a filtered row: zeros are never drawn
    probs[1] /= probs[1].sum()
    for seed in range(20):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(2):
            assert sample_from_probs(probs, ours).tolist() == torch.multinomial(probs, 1, generator=theirs).view(-1).tolist()
        assert sample_from_probs(probs[2], ours).item() == torch.multinomial(probs[2], 1, generator=theirs).item()


def sampling_seq(seed: int, **params) -> SimpleNamespace:
    params = SamplingParams(**params)
    generator = torch.Generator().manual_seed(seed) if not params.is_greedy else None
    return SimpleNamespace(request=SimpleNamespace(params=params), generator=generator)


def test_plain_sampled_rows_drawn_together_equal_the_per_sequence_rule():
    """accept() draws every sampling sequence that verifies no draft at once (draw_plain); each
    one's token and generator state equal accept_sampled's, its per-sequence reference, whatever
    the mix: greedy rows, filters shared or not, a processed row, k_b = 0 beside drafting rows."""
    vocab, width = 500, 4
    logits = 4 * torch.randn(7, width, vocab, generator=torch.Generator().manual_seed(3))
    kinds = [dict(), dict(temperature=0.7), dict(temperature=0.7), dict(temperature=1.0, top_k=20),
             dict(temperature=0.9, top_p=0.8, min_p=0.05), dict(temperature=0.7), dict()]
    processed = {5: torch.randn(1, vocab, generator=torch.Generator().manual_seed(4))}
    drafts = logits[:, :-1].argmax(-1)
    q = [None] * 2 + [torch.softmax(logits[2, :-1], dim=-1)] + [None] * 4    # row 2 samples its drafts
    for proposal, num_drafts, rows in ((None, [0] * 7, logits[:, :1]),
                                       (Proposal(drafts, q), [0, 0, 3, 0, 0, 0, 3], logits)):
        seqs = [sampling_seq(10 + b, **kind) for b, kind in enumerate(kinds)]
        twins = [sampling_seq(10 + b, **kind) for b, kind in enumerate(kinds)]
        num_accepted, new_tokens = accept(seqs, proposal, rows, dict(processed), num_drafts)
        for b, (seq, twin) in enumerate(zip(seqs, twins)):
            if seq.request.params.is_greedy or num_drafts[b] > 0:
                continue
            assert (num_accepted[b], new_tokens[b]) == accept_sampled(twin, None, b, processed.get(b, rows[b, :1]), 0)
            assert torch.equal(seq.generator.get_state(), twin.generator.get_state())
        assert new_tokens[0] == [int(rows[0, 0].argmax())]
        assert new_tokens[6][:-1] == (drafts[6].tolist() if proposal is not None else [])


# ---- a dense target with an oracle draft that is right, then wrong, at known positions --------

PROMPT = [int(t) for t in torch.randint(0, 151643, (40,), generator=torch.Generator().manual_seed(11))]
WRONG = {3, 4, 9, 17, 18, 19, 20, 21, 22, 23, 30}     # output positions the oracle gets wrong


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention) and a draft for it."""
    import fixtures
    root = tmp_path_factory.mktemp("acceptance-hybrid")
    target_dir = fixtures.write_hybrid_checkpoint(root / "target")
    target = load_model(str(target_dir)).model
    draft_dir = fixtures.write_dflash_draft(root / "draft", target_dir, target_layer_ids=[0, 2],
                                            mask_token_id=fixtures.HYBRID_VOCAB - 1)
    return target, load_draft(str(draft_dir), target)


HYBRID_PROMPT = [int(t) for t in torch.randint(0, 255, (40,), generator=torch.Generator().manual_seed(11))]


def expected_lengths(max_tokens: int, block_size: int) -> list[int]:
    """Output 0 comes from prefill; each cycle drafts the next T − 1 positions, keeps the drafts
    up to the first wrong one, and adds the target's own token."""
    committed, lengths = 1, []
    while committed < max_tokens:
        good = 0
        while good < block_size - 1 and committed + good not in WRONG:
            good += 1
        lengths.append(min(good + 1, max_tokens - committed))
        committed += lengths[-1]
    return lengths


@pytest.mark.parametrize("kind,block_size", [("dense", 3), ("dense", 4), ("dense", 8),
                                             ("hybrid", 2), ("hybrid", 4), ("hybrid", 8)])
def test_partial_acceptance_at_known_lengths(request, kind, block_size):
    """An oracle draft right except at WRONG positions: acceptance lengths are known exactly,
    and partial blocks occur. On the hybrid, each one selects a recurrent state in the middle of
    the verified block (StatePool.select), so its output equal to plain decoding is the check."""
    target, draft = request.getfixturevalue(kind)
    prompt, vocab = (PROMPT, 151643) if kind == "dense" else (HYBRID_PROMPT, 255)
    max_tokens = 34
    reference = run_alone(lambda: make_engine(target), make_request("r", prompt, max_tokens=max_tokens)).output_ids
    corrupted = [(t + 1) % vocab if i in WRONG else t for i, t in enumerate(reference)]
    oracle = OracleDraft(draft, prompt + corrupted)

    def engine():
        made = make_engine(target, oracle, block_size=block_size)
        oracle.bind(made)
        return made

    run = run_alone(engine, make_request("r", prompt, max_tokens=max_tokens))
    assert run.output_ids == reference
    lengths = expected_lengths(max_tokens, block_size)
    assert 1 in lengths and (block_size == 2 or any(1 < n < block_size for n in lengths))
    assert block_size in lengths                                      # whole blocks too
    assert run.stats.acceptance_lengths == lengths
    assert run.stats.accepted_tokens == sum(lengths) - len(lengths)


# ---- abort on the plain loop, alone and in a batch, counted in forwards -----------------------

def assert_only_the_first_aborted(engine, runs) -> None:
    """runs[0] aborted early, the others ran to their length, every page back."""
    assert runs[0].request.finish_reason == "abort" and len(runs[0].output_ids) < 10
    for run in runs:
        run.check_events()
    assert [r.request.finish_reason for r in runs[1:]] == ["length"] * (len(runs) - 1)
    assert engine.cache.usage == 0.0


@pytest.mark.parametrize("others", [0, 2])
def test_abort_stops_the_plain_loop_within_one_step(dense, others):
    target, _ = dense
    counter = ForwardCounter(target)
    try:
        engine = make_engine(target)
        runs = [submit(engine, make_request(f"r{i}", PROMPT, max_tokens=200 if i == 0 else 6))
                for i in range(others + 1)]
        while len(runs[0].events) < 3:
            engine.step()
        runs[0].request.abort()
        before = counter.count
        run_until_done(engine, runs)
        # the aborted request costs no forward after the flag; the others (6 tokens each, run in
        # one batch) at most 6 more steps
        assert counter.count - before <= (6 if others else 0)
        assert_only_the_first_aborted(engine, runs)
    finally:
        counter.handle.remove()


# ---- abort on the DFlash loop, alone and in a batch, counted in forwards ---------------------

@pytest.mark.parametrize("others", [0, 2])
def test_abort_stops_the_dflash_loop_within_one_cycle(dense, others):
    """Forwards of the target and the draft are counted: after the abort flag the aborted
    request costs none, the others (6 tokens each, block 4: at most 5 more cycles, one draft
    and one target forward each) no more than their own."""
    target, draft = dense
    counters = ForwardCounter(target), ForwardCounter(draft)
    try:
        engine = make_engine(target, draft, block_size=4)
        runs = [submit(engine, make_request(f"r{i}", PROMPT, max_tokens=200 if i == 0 else 6))
                for i in range(others + 1)]
        while len(runs[0].events) < 3:
            engine.step()
        runs[0].request.abort()
        before = [c.count for c in counters]
        run_until_done(engine, runs)
        after = [c.count - b for c, b in zip(counters, before)]
        if others:
            assert max(after) <= 5
        else:
            assert after == [0, 0]
        assert_only_the_first_aborted(engine, runs)
    finally:
        for counter in counters:
            counter.handle.remove()


def test_an_aborted_waiting_request_ends_at_the_next_step_before_any_compute(dense):
    """One seat: r0 decodes, r1 waits for the seat. r1's client leaves: the next step ends it
    with abort and no token (it is never admitted, never prefilled); r0 goes on to its own
    output alone, and every page comes back."""
    target, draft = dense
    alone = run_alone(lambda: make_engine(target, draft, block_size=4), make_request("r0", PROMPT, max_tokens=12))
    engine = make_engine(target, draft, block_size=4, max_num_seqs=1)
    runs = [submit(engine, make_request(f"r{i}", PROMPT, max_tokens=12)) for i in range(2)]
    while len(runs[0].events) < 2:
        engine.step()
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["r1"]
    runs[1].request.abort()
    engine.step()
    assert runs[1].request.finish_reason == "abort" and runs[1].output_ids == []
    assert not engine.scheduler.waiting and [s.request_id for s in engine.scheduler.running] == ["r0"]
    run_until_done(engine, runs)
    for run in runs:
        run.check_events()
    assert runs[0].output_ids == alone.output_ids and runs[0].request.finish_reason == "length"
    assert engine.cache.usage == 0.0 and not engine.has_work


def test_engine_shutdown_aborts_running_and_waiting_requests(dense):
    """One seat: one request decodes, two wait (one admitted to the queue, one still in the inbox).
    Shutdown ends all three with abort, exactly once, frees every page, and runs no forward."""
    target, draft = dense
    counter = ForwardCounter(target)
    try:
        engine = make_engine(target, draft, block_size=4, max_num_seqs=1)
        runs = [submit(engine, make_request(f"r{i}", PROMPT, max_tokens=200)) for i in range(2)]
        while len(runs[0].events) < 2:
            engine.step()
        assert engine.num_running == 1 and len(engine.scheduler.waiting) == 1
        runs.append(submit(engine, make_request("r2", PROMPT, max_tokens=200)))      # still in the inbox
        before = counter.count
        engine.shutdown()
        assert counter.count == before
        for run in runs:
            run.check_events()
            assert run.request.finish_reason == "abort"
        assert [len(r.output_ids) > 0 for r in runs] == [True, False, False]
        assert engine.cache.usage == 0.0 and not engine.has_work
    finally:
        counter.handle.remove()
