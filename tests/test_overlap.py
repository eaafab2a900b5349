"""Overlap (invariant 12): with `Engine.overlap` on, a step's events go to their consumers after
the next step's forwards are launched (on CUDA while the device runs them). Nothing else may
change: every request's events (token ids, finish reason, logprobs, stats), outputs and the
failure isolation are the same with overlap on and off. On CPU the launch is the compute, so
the engine defaults overlap off there; these tests switch it on to hold it to the same results."""
from __future__ import annotations

import pytest
import torch

import fixtures
from blockspec.engine.engine import Engine
from blockspec.loader import load_draft, load_model
from blockspec.sampling import SamplingParams
from helpers import make_engine, make_request, run_batch
from test_reliability import FailOnce

VOCAB = fixtures.HYBRID_VOCAB - 1


@pytest.fixture(scope="module")
def models(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    dense = load_model(str(qwen3_dir)).model
    root = tmp_path_factory.mktemp("overlap-hybrid")
    hybrid_dir = fixtures.write_hybrid_checkpoint(root / "target")
    hybrid = load_model(str(hybrid_dir)).model
    draft_dir = fixtures.write_dflash_draft(root / "draft", hybrid_dir, target_layer_ids=[0, 2], mask_token_id=VOCAB)
    return {"dense": (dense, load_draft(str(qwen3_draft_dir), dense)),
            "hybrid": (hybrid, load_draft(str(draft_dir), hybrid))}


def prompts(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 11, 30)]


def requests():
    """Greedy, and one seeded sampling request with logprobs; ragged max_tokens."""
    made = []
    for i, prompt in enumerate(prompts()):
        params = dict(temperature=0.8, seed=11) if i == 1 else {}
        request = make_request(f"r{i}", prompt, max_tokens=6 + 3 * i, **params)
        if i == 1:
            request.num_logprobs = 2
        made.append(request)
    return made


def events_of(runs) -> dict[str, list[tuple]]:
    return {run.request.request_id: [(e.token_ids, e.finish_reason, e.error,
                                      [(lp.token_id, lp.logprob) for lp in e.logprobs] if e.logprobs else None)
                                     for e in run.events] for run in runs}


def run(models, kind: str, spec: bool, overlap: bool, **config):
    target, draft = models[kind]

    def build() -> Engine:
        engine = make_engine(target, draft if spec else None, block_size=4 if spec else 1, **config)
        engine.overlap = overlap
        return engine
    batch = requests()
    # r3 arrives while the others decode; r0 is aborted mid-way
    return run_batch(build, batch[:3], arrivals={2: [batch[3]]}, aborts={4: [batch[0]]})


@pytest.mark.parametrize("kind,spec", [("dense", False), ("dense", True), ("hybrid", True)])
def test_overlap_changes_no_event_output_or_stat(models, kind, spec):
    _, off = run(models, kind, spec, overlap=False)
    _, on = run(models, kind, spec, overlap=True)
    assert events_of(on) == events_of(off)
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
    assert {r.request.request_id: r.finish_reason for r in on} == {"r0": "abort", "r1": "length", "r2": "length",
                                                                    "r3": "length"}


def test_overlap_sends_a_steps_events_after_the_next_launch(models):
    """On: the events of step n reach their consumer inside step n + 1, after its launch and
    before its collect (the device's time); off: inside step n, after its collect."""
    for overlap in (False, True):
        timeline: list[tuple[str, int]] = []
        target, draft = models["hybrid"]
        engine = make_engine(target, draft, block_size=4)
        engine.overlap = overlap
        launch, collect, steps = engine.runner.launch, engine.runner.collect, [0]

        def launched(batch, launch=launch, timeline=timeline):
            timeline.append(("launch", steps[0]))
            return launch(batch)

        def collected(result, collect=collect, timeline=timeline):
            timeline.append(("collect", steps[0]))
            return collect(result)
        engine.runner.launch, engine.runner.collect = launched, collected
        runs = []
        for request in requests()[:2]:
            events = []
            engine.submit(request, lambda e, events=events, timeline=timeline: timeline.append(("event", steps[0])))
            runs.append(events)
        while engine.has_work:
            engine.step()
            steps[0] += 1
        seen = []
        for i, (what, step) in enumerate(timeline):
            if what == "event":
                marks = [w for w, s in timeline[:i] if s == step and w != "event"]
                ran = any(w == "launch" and s == step for w, s in timeline)
                seen.append(marks)
                # on: between this step's launch and collect, or in a step that ran nothing;
                # off: after this step's collect
                assert marks == (["launch"] if overlap else ["launch", "collect"]) or not ran, (overlap, timeline)
        assert seen.count(["launch"] if overlap else ["launch", "collect"]) > 4


def test_overlap_on_keeps_a_failing_request_alone(models):
    """A request whose commit raises ends with an error alone; the others equal their runs
    with overlap off (and pages come back)."""
    results = {}
    for overlap in (False, True):
        target, draft = models["dense"]
        engine = make_engine(target, draft, block_size=4)
        engine.overlap = overlap
        engine.fault_hook = FailOnce("commit", RuntimeError("injected fault"), "r1", nth=2)
        free = engine.cache.num_free_pages

        def build(engine=engine):
            return engine
        _, runs = run_batch(build, requests()[:3])
        assert engine.fault_hook.fired and engine.cache.num_free_pages == free
        results[overlap] = events_of(runs)
        assert runs[1].finish_reason == "error" and "injected fault" in runs[1].events[-1].error
    assert results[True] == results[False]


def test_a_stream_with_overlap_on_ends_with_the_same_events(qwen3_dir):
    """LLM.stream steps the engine itself: with overlap on, the final event still comes (the
    step with nothing left to run sends what is queued)."""
    from blockspec.llm import LLM
    llm = LLM(str(qwen3_dir), show_progress=False, max_num_seqs=2, max_model_len=256)
    params = SamplingParams(max_tokens=7, temperature=0.0)
    streams = {}
    for overlap in (False, True):
        llm.engine.overlap = overlap
        events = list(llm.stream(llm.make_request("s", prompts()[1], params)))
        streams[overlap] = [(e.token_ids, e.finish_reason) for e in events]
    assert streams[True] == streams[False] and streams[True][-1][1] == "length"
