"""Early drafts (engine/model_runner.py draft_ahead, issue 31): step N + 1's draft is launched
behind step N's verify, its anchors and context lengths taken from step N's verdict on the
device, before the host reads step N's results. On CUDA the engine does this by default; on
the CPU these tests switch it on. Nothing else may change: every request's tokens, events and
acceptance lengths are those of the same engine without early drafts, with arrivals, aborts,
preemptions, stop ids, sampling, a grammar's logits processor, DFlash 2 and a hybrid target —
and the early rows were really used (a test whose early drafts were all discarded proves nothing)."""
from __future__ import annotations

import pytest
import torch

import fixtures
from blockspec.engine.engine import Engine
from blockspec.loader import load_draft, load_model
from helpers import OracleDraft, make_engine, make_request, run_batch

VOCAB = fixtures.HYBRID_VOCAB - 1


@pytest.fixture(scope="module")
def models(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    dense = load_model(str(qwen3_dir)).model
    root = tmp_path_factory.mktemp("early-draft")
    hybrid_dir = fixtures.write_hybrid_checkpoint(root / "target")
    hybrid = load_model(str(hybrid_dir)).model
    draft_dir = fixtures.write_dflash_draft(root / "draft", hybrid_dir, target_layer_ids=[0, 2], mask_token_id=VOCAB)
    draft2_dir = fixtures.write_dflash2_draft(root / "draft2", qwen3_dir)
    return {"dense": (dense, load_draft(str(qwen3_draft_dir), dense)),
            "dflash2": (dense, load_draft(str(draft2_dir), dense)),
            "hybrid": (hybrid, load_draft(str(draft_dir), hybrid))}


def prompts(seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 21, 12, 30, 9)]


def requests(sampled: bool = True, stop: int | None = None):
    """Greedy requests of ragged lengths; one seeded sampling request (its drafts are judged on
    the host: never drafted early, while the others are)."""
    made = []
    for i, prompt in enumerate(prompts()):
        params = dict(temperature=0.8, seed=11) if sampled and i == 1 else {}
        stops = frozenset({stop}) if stop is not None and i == 2 else frozenset()
        made.append(make_request(f"r{i}", prompt, stops=stops, max_tokens=9 + 4 * i, **params))
    return made


def plain_outputs(target, reqs) -> dict[str, list[int]]:
    _, runs = run_batch(lambda: make_engine(target), reqs)
    return {run.request.request_id: run.request.prompt_ids + run.output_ids for run in runs}


class AnchorChecked(OracleDraft):
    """The oracle, and every block it denoises starts with its sequence's token at the block's
    first position (the anchor an early draft takes from the verdict on the device)."""

    def __init__(self, real, sequences, embed) -> None:
        super().__init__(real, sequences)
        self.embed, self.checked = embed, 0

    def forward(self, block_embeds, positions, meta):
        hidden = super().forward(block_embeds, positions, meta)
        first = block_embeds.view(meta.num_seqs, -1, block_embeds.shape[-1])[:, 0]
        for b, (sequence, anchor) in enumerate(self._rows):
            if sequence:                                      # not a padding row
                assert torch.equal(first[b], self.embed(torch.tensor([sequence[anchor]]))[0])
                self.checked += 1
        return hidden


def engine_with(target, draft, early: bool, oracle: dict[str, list[int]] | None = None, **config) -> Engine:
    block = config.pop("block_size", 4)
    if oracle is not None:
        draft = AnchorChecked(draft, oracle, target.embed)
    engine = make_engine(target, draft, block_size=block, **config)
    if oracle is not None:
        draft.bind(engine)
    engine.runner.drafts_early = early
    # Every draft each sequence was proposed, by (request, length): an early row must be the
    # very draft the serial path makes (random weights accept almost nothing, so equal
    # acceptance alone would not show a wrong context).
    engine.drafted = {}
    proposal_of = engine.runner.proposal_of

    def recorded(out, seqs):
        proposal = proposal_of(out, seqs)
        for i, seq in enumerate(seqs):
            engine.drafted[(seq.request_id, seq.num_cached)] = proposal.drafts[i].tolist()
        return proposal
    engine.runner.proposal_of = recorded
    return engine


def outcome(runs) -> dict[str, tuple]:
    return {run.request.request_id: (run.output_ids, run.finish_reason, run.stats.acceptance_lengths,
                                     [(e.token_ids, e.finish_reason) for e in run.events]) for run in runs}


def run_both(build, reqs_of, events=None):
    """The same requests on an engine without and with early drafts (events(requests) → the
    arrivals and aborts of run_batch, made from each run's own requests)."""
    out = []
    for early in (False, True):
        reqs = reqs_of()
        kwargs = events(reqs) if events is not None else {}
        engine, runs = run_batch(lambda: build(early), reqs[: len(reqs) - len(kwargs.get("arrivals", {}))],
                                 **kwargs)
        out.append((engine, outcome(runs), runs))
    (engine_off, off, _), (engine, on, runs) = out
    assert on == off
    assert engine.drafted == engine_off.drafted and engine.drafted
    return engine, on, runs


@pytest.mark.parametrize("kind", ["dense", "dflash2", "hybrid"])
def test_early_drafts_change_nothing_and_are_used(models, kind):
    """The real drafts (random weights: acceptance near 1), arrivals and an abort."""
    target, draft = models[kind]
    engine, on, _ = run_both(lambda early: engine_with(target, draft, early), requests,
                          lambda reqs: {"arrivals": {3: [reqs[4]]}, "aborts": {5: [reqs[0]]}})
    drafted, used, arrivals = engine.runner.early_rows
    assert used > 0 and drafted >= used and arrivals > 0       # r4's first decode step too
    assert on["r0"][1] == "abort" and on["r3"][1] == "length"


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_early_drafts_with_high_acceptance_keep_greedy_output_exact(models, kind):
    """An oracle draft that proposes the target's own continuation: sequences advance up to a
    whole block a cycle, so each early row starts at a position only the device knew; the greedy
    output is still the target's plain output, the stats those of the serial path."""
    target, draft = models[kind]
    greedy = requests(sampled=False)
    expected = plain_outputs(target, requests(sampled=False))
    engine, on, _ = run_both(lambda early: engine_with(target, draft, early, oracle=expected),
                          lambda: requests(sampled=False))
    for request in greedy:
        output, _, lengths, _ = on[request.request_id]
        assert request.prompt_ids + output == expected[request.request_id]
        assert max(lengths) == 4          # whole blocks accepted
    drafted, used, _ = engine.runner.early_rows
    assert used > 0 and drafted >= used


def test_early_drafts_under_preemption_and_stop_ids(models):
    """A pool too small for everyone: sequences are preempted and recomputed (their early rows
    must not be taken after), and a stop id cuts one request's block."""
    target, draft = models["dense"]
    expected = plain_outputs(target, requests(sampled=False))
    stop = expected["r2"][len(prompts()[2]) + 5]
    engine, on, runs = run_both(lambda early: engine_with(target, draft, early, oracle=expected, num_gpu_blocks=14,
                                                          page_size=4),
                                lambda: requests(sampled=False, stop=stop))
    assert on["r2"][1] == "stop"
    assert sum(run.seq.num_preemptions for run in runs) > 0
    assert engine.runner.early_rows[1] > 0


def test_a_logits_processor_in_the_batch_is_judged_on_the_host(models):
    """A request with a repetition penalty (a logits processor) makes its steps judge on the host:
    no early draft for them (all such requests: none at all), outputs as without early drafts."""
    target, draft = models["dense"]

    def reqs(every: bool):
        made = []
        for i, prompt in enumerate(prompts()):
            penalty = 1.3 if every or i == 3 else 1.0
            made.append(make_request(f"r{i}", prompt, max_tokens=9 + 4 * i, repetition_penalty=penalty))
        return made
    engine, _, _ = run_both(lambda early: engine_with(target, draft, early), lambda: reqs(False))
    assert engine.runner.early_rows[1] > 0          # the steps after r3 ended
    engine, _, _ = run_both(lambda early: engine_with(target, draft, early), lambda: reqs(True))
    assert engine.runner.early_rows == [0, 0, 0]


def test_adaptive_widths_with_early_drafts_keep_greedy_output_exact(models):
    """Adaptive speculation plans ragged widths and narrower draft blocks; the early draft uses
    the width planned ahead. Widths depend on measured step times, so only the greedy output is
    compared (with the plain output)."""
    target, draft = models["dense"]
    expected = plain_outputs(target, requests(sampled=False))
    engine, runs = run_batch(lambda: engine_with(target, draft, True, oracle=expected, speculation="adaptive",
                                                 block_size=8), requests(sampled=False))
    for run in runs:
        assert run.request.prompt_ids + run.output_ids == expected[run.request.request_id]
    assert engine.runner.early_rows[1] > 0


def test_a_step_planned_narrower_than_its_early_block_takes_the_early_rows(models):
    """The early draft denoises the block the plan made ahead (here the full 8); the step then
    plans narrower (k = 3 in a draft block of 4: a cap fell, or the plan changed). The early
    blocks' first slots serve it: the step drafts at the early width and takes the early rows
    instead of a second draft forward at 4 (round 51), and the greedy output is plain's."""
    target, draft = models["dense"]
    expected = plain_outputs(target, requests(sampled=False))

    def narrowed(early: bool) -> Engine:
        engine = engine_with(target, draft, early, speculation="adaptive", block_size=8)
        spec = engine.runner.speculation
        spec.plan_ahead = lambda seqs: setattr(spec, "_ahead", (list(seqs), spec.caps(seqs)))
        spec.ahead_draft = lambda: None if spec._ahead is None else (
            {id(seq): int(k) for seq, k in zip(*spec._ahead)}, 0)        # every sequence, the full block
        spec.planned_widths = lambda seqs: [min(3, int(c)) for c in spec.caps(seqs)]
        spec.draft_width = lambda seqs, widths: 4 if any(widths) else 0
        return engine
    engine, runs = run_batch(lambda: narrowed(True), requests(sampled=False))
    assert {run.request.request_id: run.request.prompt_ids + run.output_ids for run in runs} == expected
    drafted, taken, _ = engine.runner.early_rows
    assert taken >= 0.8 * drafted > 0, (drafted, taken)
    assert all(len(tokens) == 7 for tokens in engine.drafted.values())     # the early block's 7 slots
    serial, _ = run_batch(lambda: narrowed(False), requests(sampled=False))
    assert serial.runner.early_rows == [0, 0, 0]
    assert all(len(tokens) == 3 for tokens in serial.drafted.values())      # a block of 4 drafted then


def test_the_benchs_forced_acceptance_is_what_early_drafts_read(models):
    """`bench --accept-profile` forces each verify's accepted count (random weights accept
    nothing): it sets the verdict on the device, so the early drafts start where the host will
    put each sequence, and nearly every early row is taken (rows of sequences that end are not)."""
    from unittest import mock

    from blockspec.bench import LatentProfile
    from blockspec.engine import model_runner
    target, draft = models["dense"]
    profile = LatentProfile(3.0, 4)
    with mock.patch.object(model_runner, "propose", profile.propose(model_runner.propose)), \
            mock.patch.object(model_runner, "judge", profile.judge(model_runner.judge)):
        engine, on, _ = run_both(lambda early: engine_with(target, draft, early), lambda: requests(sampled=False))
    drafted, used, _ = engine.runner.early_rows
    assert max(max(lengths) for _, _, lengths, _ in on.values()) > 2
    assert used >= 0.8 * drafted > 0, (drafted, used)


def test_the_speculation_bench_takes_its_early_rows(monkeypatch):
    """`bench --compare-speculation`'s own path (its engines, its latent profile patched into
    judge and propose), early drafts forced on for the CPU: the forced acceptance holds and the
    next steps take the early rows (drafted and taken are in each point's result)."""
    from blockspec.bench.common import SHAPES, build_models
    from blockspec.bench.speculation import LatentProfile, speculation_sweep
    monkeypatch.setenv("BLOCKSPEC_EARLY_DRAFT", "1")
    torch.manual_seed(0)
    _, _, target, draft = build_models(SHAPES["host"], torch.device("cpu"), torch.float32, 4)
    for mode in ("fixed", "adaptive"):
        point = speculation_sweep(target, draft, 4, [2], 16, 24, mode, profile=LatentProfile(3.0, 4))[2]
        assert point["mean_acceptance_length"] > 1.5, (mode, point)
        assert point["early_rows_taken"] >= 0.7 * point["early_rows_drafted"] > 0, (mode, point)
