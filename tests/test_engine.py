"""The engine and the in-process LLM: one owner of model state, every request ends exactly once,
streams interleave in one batch, configuration is validated in one place."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from blockspec.config import ConfigError
from blockspec.engine.request import Request, TokenEvent
from blockspec.engine.scheduler import Batch
from blockspec.engine.sequence import Sequence
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams, make_generator, sample


@pytest.fixture(scope="module")
def llm(qwen3_dir, qwen3_draft_dir):
    return LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=4, max_model_len=512, show_progress=False)


def test_two_live_streams_share_the_batch_and_each_equals_its_run_alone(llm):
    alone_a = llm.generate_ids([9707, 11], SamplingParams(max_tokens=20)).token_ids
    alone_b = llm.generate_ids([9707, 11, 1879, 0], SamplingParams(max_tokens=13)).token_ids
    assert (len(alone_a), len(alone_b)) == (20, 13)                  # real runs, not two equal failures
    first = llm.stream(llm.make_request("a", [9707, 11], SamplingParams(max_tokens=20)))
    second = llm.stream(llm.make_request("b", [9707, 11, 1879, 0], SamplingParams(max_tokens=13)))
    tokens_a = next(first).token_ids
    tokens_b = [t for event in second for t in event.token_ids]     # steps the engine for both
    tokens_a += [t for event in first for t in event.token_ids]
    assert (tokens_a, tokens_b) == (alone_a, alone_b)


def test_closing_a_stream_frees_its_pages_and_the_next_request_is_exact(llm):
    reference = llm.generate_ids([9707, 11], SamplingParams(max_tokens=12)).token_ids
    free_before = llm.engine.cache.num_free_pages
    stream = llm.stream(llm.make_request("gone", [9707, 11], SamplingParams(max_tokens=200)))
    next(stream)
    next(stream)
    stream.close()
    forwards = llm.engine.runner.num_forwards
    llm.engine.step()                                 # the abort is seen before any compute
    assert llm.engine.runner.num_forwards == forwards
    assert llm.engine.cache.num_free_pages == free_before
    assert llm.generate_ids([9707, 11], SamplingParams(max_tokens=12)).token_ids == reference


def test_generate_json_stats_are_consistent_for_plain_and_dflash(qwen3_dir, llm):
    plain = LLM(str(qwen3_dir), max_model_len=512, show_progress=False)
    for model in (plain, llm):
        result = model.generate_ids([9707, 11, 1879], SamplingParams(max_tokens=9))
        stats = result.as_json()["stats"]
        assert stats["cycles"] == len(stats["acceptance_lengths"])
        assert sum(stats["acceptance_lengths"]) == len(result.token_ids) - 1
        assert "<|im_end|>" not in result.text


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate_ids([9707, 11], SamplingParams(max_tokens=8)).token_ids
    tiny = llm.generate_ids([9707, 11], SamplingParams(max_tokens=8, temperature=1e-40, seed=1)).token_ids
    assert tiny == greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=1), "at least 2"),
    (dict(block_size=0), "at least 1"),
    (dict(max_num_seqs=0), "at least 1"),
    (dict(max_queue=0), "at least 1"),
    (dict(max_model_len=10**9), "exceeds the model's"),
])
def test_engine_config_is_validated_in_one_place(qwen3_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen3_dir), show_progress=False, **kwargs)


def test_block_size_needs_a_draft_and_fits_it(qwen3_dir, qwen3_draft_dir):
    with pytest.raises(ConfigError, match="needs a draft"):
        LLM(str(qwen3_dir), block_size=4, show_progress=False)
    with pytest.raises(ConfigError, match="exceeds the draft's block size 16"):
        LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=17, show_progress=False)


def make(llm, request_id: str, max_tokens: int = 6) -> Request:
    return llm.make_request(request_id, [9707, 11, 1879], SamplingParams(max_tokens=max_tokens))


def run_until_done(engine, requests: list[Request], finished: list[Request]) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    for request in requests:
        engine.submit(request, lambda event: events.setdefault(event.request_id, []).append(event))
    for _ in range(200):
        if len(finished) == len(requests):
            break
        engine.step()
    return events


def test_every_request_ends_exactly_once_even_when_a_step_fails(llm, monkeypatch):
    engine = llm.engine
    finished: list[Request] = []
    monkeypatch.setattr(engine, "on_finish", finished.append)
    real_launch, calls = engine.runner.launch, []

    def failing_once(batch):
        if batch.decode:
            calls.append(len(batch.decode))
            if len(calls) == 2:
                raise RuntimeError("kernel fault")
        return real_launch(batch)
    monkeypatch.setattr(engine.runner, "launch", failing_once)
    gone = make(llm, "gone")
    gone.abort()
    events = run_until_done(engine, [make(llm, "x"), make(llm, "y"), gone], finished)
    reasons = {rid: [e.finish_reason for e in evs if e.finish_reason] for rid, evs in events.items()}
    assert reasons == {"x": ["error"], "y": ["error"], "gone": ["abort"]}
    assert "kernel fault" in events["x"][-1].error
    assert sorted(r.request_id for r in finished) == ["gone", "x", "y"]
    assert engine.cache.usage == 0.0 and not engine.scheduler.has_work
    after = run_until_done(engine, [make(llm, "next")], finished)       # the engine keeps serving
    assert [e.finish_reason for e in after["next"] if e.finish_reason] == ["length"]


def test_engine_thread_serves_and_shutdown_aborts_what_is_open(qwen3_dir):
    import threading
    llm = LLM(str(qwen3_dir), max_model_len=512, show_progress=False)
    done, events = threading.Event(), []

    def on_event(event: TokenEvent) -> None:
        events.append(event)
        if event.finish_reason:
            done.set()
    llm.engine.start()
    llm.engine.submit(make(llm, "one", max_tokens=5), on_event)
    assert done.wait(30)
    assert [e.finish_reason for e in events if e.finish_reason] == ["length"]
    long_events: list[TokenEvent] = []
    llm.engine.submit(make(llm, "long", max_tokens=400), long_events.append)
    llm.engine.shutdown()
    assert [e.finish_reason for e in long_events if e.finish_reason] == ["abort"]


def test_a_sequence_larger_than_the_whole_pool_ends_with_a_clear_error(qwen3_dir):
    llm = LLM(str(qwen3_dir), max_model_len=100, num_pages=3, page_size=8, show_progress=False)
    events: list[TokenEvent] = []
    request = llm.make_request("huge", list(range(1, 40)), SamplingParams(max_tokens=5))
    llm.engine.submit(request, events.append)
    for _ in range(3):
        llm.engine.step()
    assert [e.finish_reason for e in events] == ["error"]
    assert "more KV-cache pages than the pool has" in events[0].error
    assert llm.generate_ids([1, 2, 3], SamplingParams(max_tokens=4)).finish_reason == "length"


def test_two_engines_on_one_target_do_not_disturb_each_other(llm):
    """Engines hold no state in the models: a plain engine built on the same target after a DFlash
    one leaves the DFlash engine's features (and output) intact."""
    from blockspec.config import EngineConfig
    from blockspec.engine.engine import Engine
    expected = llm.generate_ids([9707, 11], SamplingParams(max_tokens=9)).token_ids
    plain = Engine(llm.target, None, EngineConfig(max_model_len=512, max_num_seqs=2))
    assert llm.generate_ids([9707, 11], SamplingParams(max_tokens=9)).token_ids == expected
    request = llm.make_request("p", [9707, 11], SamplingParams(max_tokens=9))
    plain.submit(request, lambda event: None)
    while not request.is_finished:
        plain.step()
    assert request.output_ids == expected


def test_submit_after_shutdown_is_refused_not_lost(qwen3_dir):
    from blockspec.engine.engine import QueueFullError
    llm = LLM(str(qwen3_dir), max_model_len=128, show_progress=False)
    llm.engine.start()
    llm.engine.shutdown()
    with pytest.raises(QueueFullError, match="shutting down"):
        llm.engine.submit(make(llm, "late"), lambda event: None)
    assert llm.engine.num_waiting == 0


def test_each_hand_over_of_events_runs_inside_event_batch_in_order(llm):
    """Engine.event_batch (the server's wakeups_held): a step's events reach their callbacks inside
    one batch, each request's in the order they were made."""
    log: list[tuple] = []

    @contextmanager
    def batch():
        log.append(("enter",))
        yield
        log.append(("exit",))
    engine = llm.engine
    engine.event_batch = batch
    try:
        requests = [make(llm, name, max_tokens=9) for name in ("a", "b", "c")]
        for request in requests:
            engine.submit(request, lambda event: log.append(("event", event.request_id, event.token_ids)))
        while not all(r.is_finished for r in requests) or engine.has_work:
            engine.step()
    finally:
        engine.event_batch = None
    inside = False
    for before, entry in zip([("exit",)] + log, log):
        if entry[0] == "event":
            assert inside, log
        else:
            assert inside == (entry[0] == "exit") and before[0] != "enter", log    # no empty batch
            inside = entry[0] == "enter"
    assert not inside and log.count(("enter",)) >= 2
    for request in requests:
        tokens = [t for entry in log if entry[0] == "event" and entry[1] == request.request_id for t in entry[2]]
        assert tokens == request.output_ids


def test_events_reach_their_consumers_in_the_order_made_even_past_one_that_raises(llm, monkeypatch):
    """A step's events are handed over in the order the engine made them, across requests (not
    only each request's own), and a consumer that raises costs nothing to the events after its
    own in that hand-over: every event made is delivered, once."""
    engine = llm.engine
    made: list[TokenEvent] = []
    real_emit = engine._emit

    def emit(seq, event: TokenEvent) -> None:
        made.append(event)
        real_emit(seq, event)
    monkeypatch.setattr(engine, "_emit", emit)
    delivered: list[TokenEvent] = []

    def failing(event: TokenEvent) -> None:
        delivered.append(event)
        raise RuntimeError("a consumer's own bug")
    requests = [make(llm, name, max_tokens=5) for name in ("a", "b", "c")]
    engine.submit(requests[0], failing)                  # first in every hand-over: the rest follow it
    for request in requests[1:]:
        engine.submit(request, delivered.append)
    while not all(r.is_finished for r in requests) or engine.has_work:
        engine.step()
    assert len(made) > len(requests) and [id(e) for e in delivered] == [id(e) for e in made]
    for request in requests:
        assert [t for e in delivered if e.request_id == request.request_id for t in e.token_ids] == request.output_ids


def test_first_draws_take_each_rows_own_logits_processor_and_generator(llm):
    """draw_first's rows are the chunks that end their prompt (here after one that does not): the
    plain greedy rows share one argmax, a greedy row with a logits processor and the sampled rows
    each draw from their own row with their own processor and generator, and the raw logprobs
    are each row's own, taken before any processing."""
    runner = llm.engine.runner
    vocab = runner.target.lm_head.out_features
    prompt = [9707, 11, 1879, 13, 358, 1079]
    specs = [SamplingParams(),                                           # a chunk that does not end its prompt
             SamplingParams(),                                           # greedy: the shared argmax
             SamplingParams(logit_bias=((7, 100.0),)),                   # greedy, processed: its own draw
             SamplingParams(temperature=1.0, seed=3),                    # sampled: its own generator
             SamplingParams(),
             SamplingParams(temperature=0.8, top_k=50, seed=11, logit_bias=((5, 3.0),))]
    requests = [llm.make_request(f"r{i}", prompt, params) for i, params in enumerate(specs)]
    for i in (1, 3):
        requests[i].num_logprobs = 2
    seqs = [Sequence(request, runner.device) for request in requests]
    batch = Batch(prefill=[(seqs[0], 2)] + [(seq, len(prompt)) for seq in seqs[1:]])
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))   # the 5 ending rows
    with torch.random.fork_rng():
        torch.manual_seed(0)                     # a draw from the global generator is repeatable, and wrong
        draws = runner.draw_first(batch, logits)
    assert draws.ending == [1, 2, 3, 4, 5]
    biased = logits[4].clone()
    biased[5] += 3.0
    expected = [int(logits[0].argmax()), 7,
                int(sample(logits[2], specs[3], make_generator(specs[3], runner.device))),
                int(logits[3].argmax()),
                int(sample(biased, specs[5], make_generator(specs[5], runner.device)))]
    assert draws.chosen.tolist() == expected
    assert [r is not None for r in draws.raw] == [True, False, True, False, False]
    assert torch.equal(draws.raw[0], torch.log_softmax(logits[0:1].float(), dim=-1))
    assert torch.equal(draws.raw[2], torch.log_softmax(logits[2:3].float(), dim=-1))
