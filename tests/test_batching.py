"""Continuous batching: every request of a batch decodes exactly as it would alone.

A dense Qwen3 and a hybrid Qwen3.5 fixture, plain and DFlash, with mixed prompt lengths and
max_tokens, a stop id, an abort mid-batch and requests arriving while others decode; seeded
sampling; preemption under a pool too small for every sequence; chunked prefill. DFlash runs
mostly with an oracle draft whose proposals are right except every few tokens, so acceptance
lengths are long and ragged across the batch (a bookkeeping slip shows as a different length).
"""
from __future__ import annotations

import json

import pytest
import torch

import fixtures
from blockspec.loader import load_draft, load_model
from blockspec.engine.request import Request
from blockspec.sampling import SamplingParams
from helpers import OracleDraft, make_engine, make_request, padded, run_alone, run_batch, submit

STOP_FREE = frozenset()


# -- models ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target), 151643


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_hybrid import TEXT, VOCAB, hf_model, randomise
    root = tmp_path_factory.mktemp("batching-hybrid")
    ref = hf_model("qwen3_5")
    randomise(ref)
    ref.save_pretrained(root / "target")
    target = load_model(str(root / "target"), device="cpu", dtype="float32").model
    shape_dir = root / "shape"
    shape_dir.mkdir()
    (shape_dir / "config.json").write_text(json.dumps({"hidden_size": TEXT["hidden_size"],
                                                       "num_hidden_layers": TEXT["num_hidden_layers"],
                                                       "vocab_size": VOCAB}))
    path = fixtures.write_dflash_draft(root / "draft", shape_dir, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
    return target, load_draft(str(path), target), VOCAB - 1


@pytest.fixture(params=["dense", "hybrid"])
def model(request):
    return request.param, request.getfixturevalue(request.param)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def corrupted(tokens: list[int], vocab: int, every: int, offset: int) -> list[int]:
    """A copy with every `every`-th token (from `offset`) wrong: the oracle's partial acceptances."""
    out = list(tokens)
    for i in range(offset, len(out), every):
        out[i] = (out[i] + 1) % vocab
    return out


class Mode:
    """How requests decode: plain, or DFlash with the oracle (given continuations) or the real draft."""

    def __init__(self, name: str, target, draft, block_size: int = 1, **config) -> None:
        self.name, self.target, self.draft, self.block_size, self.config = name, target, draft, block_size, config
        self.oracle_sequences: dict[str, list[int]] | None = None

    def factory(self, **overrides):
        config = {**self.config, **overrides}

        def build():
            if self.name == "plain":
                return make_engine(self.target, **config)
            if self.name == "real":
                return make_engine(self.target, self.draft, block_size=self.block_size, **config)
            oracle = OracleDraft(self.draft, self.oracle_sequences)
            engine = make_engine(self.target, oracle, block_size=self.block_size, **config)
            oracle.bind(engine)
            return engine
        return build


def make_mode(kind: str, models, name: str, references: dict[str, list[int]] | None = None,
              prompts_by_id: dict[str, list[int]] | None = None, **config) -> Mode:
    target, draft, vocab = models
    block_size = {"plain": 1}.get(name, 4 if kind == "dense" else 8)
    mode = Mode(name, target, draft, block_size, **config)
    if name == "oracle":
        every = 2 * block_size + 1             # room for whole blocks between wrong proposals
        mode.oracle_sequences = {rid: prompts_by_id[rid] + corrupted(references[rid], vocab, every, 3 + i % 4)
                                 for i, rid in enumerate(sorted(references))}
    return mode


def plain_references(target, specs: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    factory = lambda: make_engine(target)      # noqa: E731
    return {rid: run_alone(factory, make_request(rid, prompt, max_tokens=max_tokens)).output_ids
            for rid, prompt in specs.items()}


def assert_same_as_alone(batch_run, alone_run) -> None:
    rid = batch_run.request.request_id
    assert batch_run.output_ids == alone_run.output_ids, rid
    assert batch_run.finish_reason == alone_run.finish_reason, rid
    assert batch_run.stats.acceptance_lengths == alone_run.stats.acceptance_lengths, rid
    assert batch_run.stats.accepted_tokens == alone_run.stats.accepted_tokens, rid
    assert batch_run.stats.draft_tokens == alone_run.stats.draft_tokens, rid


# -- greedy: a batch with every complication ---------------------------------------------------

CASES = [("dense", "plain"), ("dense", "oracle"), ("hybrid", "plain"), ("hybrid", "oracle"), ("hybrid", "real")]


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_greedy_batch_equals_each_request_alone(request, kind, name):
    models = request.getfixturevalue(kind)
    target, _, vocab = models
    lengths = [5, 37, 12, 23, 9, 61]
    ids = [f"r{i}" for i in range(len(lengths))]
    prompt_of = dict(zip(ids, prompts(vocab, lengths, seed=1)))
    max_tokens = dict(zip(ids, [14, 30, 22, 40, 9, 18]))
    # the oracle needs every plain continuation; otherwise only r2's (for its stop id)
    references = plain_references(target, prompt_of if name == "oracle" else {"r2": prompt_of["r2"]}, 40)
    # r2 stops at a token of its own output (the first occurrence ends it, stop kept)
    stop_token = references["r2"][7]
    stops = {"r2": (stop_token,)}
    mode = make_mode(kind, models, name, references, prompt_of)

    def requests():
        return {rid: make_request(rid, prompt_of[rid], max_tokens=max_tokens[rid],
                                  stop_token_ids=stops.get(rid, ())) for rid in ids}

    alone = {rid: run_alone(mode.factory(), req) for rid, req in requests().items()}
    assert alone["r2"].finish_reason == "stop" and alone["r2"].output_ids[-1] == stop_token
    assert len(alone["r2"].output_ids) <= 8
    assert {alone[rid].finish_reason for rid in ids if rid != "r2"} == {"length"}
    if name == "oracle":                       # long, ragged acceptances: the check below means something
        lengths_seen = [n for rid in ids for n in alone[rid].stats.acceptance_lengths]
        assert max(lengths_seen) == mode.block_size and any(1 < n < mode.block_size for n in lengths_seen)

    batch = requests()
    engine, runs = run_batch(mode.factory(), [batch[rid] for rid in ("r0", "r1", "r2", "r3")],
                             arrivals={3: [batch["r4"]], 6: [batch["r5"]]},   # while others decode
                             aborts={5: [batch["r3"]]})
    by_id = {run.request.request_id: run for run in runs}
    assert max(engine.counters.decode_batch_sizes) >= 3           # it really ran as a batch
    for rid in ids:
        if rid == "r3":
            continue
        assert_same_as_alone(by_id[rid], alone[rid])
    aborted = by_id["r3"]
    assert aborted.finish_reason == "abort" and aborted.events[-1].finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < len(alone["r3"].output_ids)
    assert aborted.output_ids == alone["r3"].output_ids[: len(aborted.output_ids)]
    assert engine.cache.usage == 0.0 and not engine.has_work      # every page went back
    if engine.cache.slots is not None:
        assert engine.cache.slots.num_free == engine.config.max_num_seqs


# -- seeded sampling ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,name", [("dense", "plain"), ("dense", "oracle"), ("hybrid", "real")])
def test_seeded_sampling_batch_equals_alone(request, kind, name):
    models = request.getfixturevalue(kind)
    target, _, vocab = models
    prompt_list = prompts(vocab, [7, 19, 7, 30], seed=2)
    prompt_list[2] = prompt_list[0]                      # the same prompt under two seeds
    ids = [f"s{i}" for i in range(4)]
    prompt_of = dict(zip(ids, prompt_list))
    seeds = dict(zip(ids, [11, 12, 13, None]))          # s3 is greedy, in the same batch
    references = plain_references(target, prompt_of, 16) if name == "oracle" else None
    mode = make_mode(kind, models, name, references, prompt_of)
    if name == "oracle":
        mode.oracle_sequences = {rid: prompt_of[rid] + references[rid] for rid in ids}

    def requests():
        return [make_request(rid, prompt_of[rid], max_tokens=16, temperature=0.0 if seeds[rid] is None else 0.8,
                             seed=seeds[rid]) for rid in ids]

    alone = {r.request_id: run_alone(mode.factory(), r) for r in requests()}
    _, runs = run_batch(mode.factory(), requests()[:2], arrivals={2: requests()[2:]})
    for run in runs:
        assert_same_as_alone(run, alone[run.request.request_id])
    assert alone["s0"].output_ids != alone["s2"].output_ids          # the seed matters: really sampling
    greedy = run_alone(make_mode(kind, models, "plain").factory(), make_request("g", prompt_of["s0"], max_tokens=16))
    assert alone["s0"].output_ids != greedy.output_ids


# -- preemption ------------------------------------------------------------------------------

PREEMPTION_CASES = [("dense", "plain", 12), ("dense", "oracle", 16), ("hybrid", "real", 16)]


@pytest.mark.parametrize("kind,name,num_pages", PREEMPTION_CASES, ids=[f"{k}-{n}" for k, n, _ in PREEMPTION_CASES])
def test_preempted_requests_complete_exactly(request, kind, name, num_pages):
    """A pool of 11-15 usable pages of 4 positions for four sequences that grow to 8-9 pages each:
    the newest are preempted (pages and state slot freed, recomputed later from their tokens)
    and every request still ends with its output alone."""
    models = request.getfixturevalue(kind)
    target, _, vocab = models
    ids = [f"p{i}" for i in range(4)]
    prompt_of = dict(zip(ids, prompts(vocab, [6, 9, 7, 8], seed=3)))
    references = plain_references(target, prompt_of, 24) if name == "oracle" else None
    mode = make_mode(kind, models, name, references, prompt_of)

    def requests():
        return [make_request(rid, prompt_of[rid], max_tokens=24) for rid in ids]

    alone = {r.request_id: run_alone(mode.factory(), r) for r in requests()}
    engine, runs = run_batch(mode.factory(num_pages=num_pages, page_size=4), requests())
    for run in runs:
        assert_same_as_alone(run, alone[run.request.request_id])
    assert sum(run.seq.num_preemptions for run in runs) > 0
    assert engine.cache.num_free_pages == num_pages - 1


# Regression tests: before f65423e, admission checked each prompt's pages against the free
# count but reserved nothing, so both cases below raised MemoryError out of Engine.step.

def test_two_prompts_that_fit_only_one_at_a_time_both_complete(dense):
    """9 usable pages of 4: each 20-token prompt needs 6 pages, so admission (counting the pages
    it already promised in the same step) takes one, then the other: no preemption needed."""
    target, _, _ = dense
    requests = lambda: [make_request(f"r{i}", list(range(100 + i, 120 + i)), max_tokens=5) for i in range(2)]  # noqa: E731
    alone = {r.request_id: run_alone(lambda: make_engine(target), r) for r in requests()}
    _, runs = run_batch(lambda: make_engine(target, num_pages=10, page_size=4), requests())
    for run in runs:
        assert_same_as_alone(run, alone[run.request.request_id])
    assert sum(run.seq.num_preemptions for run in runs) == 0


def test_a_prefilling_sequence_keeps_its_pages_while_others_decode(dense):
    """7 usable pages of 4: b (16 tokens, 5 pages) is admitted while a decodes; a's decode steps
    take pages b's later one-token chunks need."""
    target, _, _ = dense
    a = lambda: make_request("a", list(range(100, 108)), max_tokens=20)    # noqa: E731
    b = lambda: make_request("b", list(range(200, 216)), max_tokens=3)     # noqa: E731
    alone = {r.request_id: run_alone(lambda: make_engine(target), r) for r in (a(), b())}
    _, runs = run_batch(lambda: make_engine(target, num_pages=8, page_size=4, max_prefill_tokens=1), [a()],
                        arrivals={2: [b()]})
    for run in runs:
        assert_same_as_alone(run, alone[run.request.request_id])
    assert sum(run.seq.num_preemptions for run in runs) > 0


# -- chunked prefill -------------------------------------------------------------------------

@pytest.mark.parametrize("kind,name", [("dense", "plain"), ("dense", "oracle"), ("hybrid", "real")])
def test_chunked_prefill_equals_unchunked(request, kind, name):
    """A 270-token prompt in chunks of 16, alternating with another request's decode steps."""
    models = request.getfixturevalue(kind)
    target, _, vocab = models
    long_prompt, short_prompt = prompts(vocab, [270, 11], seed=4)
    prompt_of = {"long": long_prompt, "short": short_prompt}
    references = plain_references(target, prompt_of, 20) if name == "oracle" else None
    mode = make_mode(kind, models, name, references, prompt_of)

    def requests():
        return [make_request("short", short_prompt, max_tokens=20), make_request("long", long_prompt, max_tokens=20)]

    unchunked = {r.request_id: run_alone(mode.factory(), r) for r in requests()}
    engine = mode.factory(max_prefill_tokens=16)
    chunks: list[int] = []

    def factory():
        built = engine()
        launch = built.runner.launch

        def recorded(batch):
            chunks.extend(num_tokens for _, num_tokens in batch.prefill)
            return launch(batch)
        built.runner.launch = recorded
        return built

    short, long = requests()
    _, runs = run_batch(factory, [short], arrivals={2: [long]})
    for run in runs:
        assert_same_as_alone(run, unchunked[run.request.request_id])
    assert max(chunks) == 16 and sum(chunks) == 270 + 11 and len(chunks) >= 270 // 16 + 1


# -- the CUDA-graph path, eagerly ------------------------------------------------------------

@pytest.mark.parametrize("kind,name", [("dense", "oracle"), ("hybrid", "plain"), ("hybrid", "real"),
                                       ("hybrid", "oracle")])
def test_padded_graph_path_batch_equals_alone(request, kind, name):
    """Three sequences' rows padded to a FULL graph's token bucket (padding sequences without rows
    and padding tokens on page 0 / state slot 0: plain hybrid decoding writes the recurrent state
    in place, padding sequences included),
    keys gathered to a fixed bucket, greedy and seeded sampling mixed in one batch: each
    request's output and acceptances are those it gets alone on the eager path."""
    models = request.getfixturevalue(kind)
    target, _, vocab = models
    ids = ["g0", "g1", "t2"]
    prompt_of = dict(zip(ids, prompts(vocab, [13, 29, 8], seed=5)))
    references = plain_references(target, prompt_of, 24)
    mode = make_mode(kind, models, name, references, prompt_of)

    def requests():
        return [make_request("g0", prompt_of["g0"], max_tokens=24), make_request("g1", prompt_of["g1"], max_tokens=17),
                make_request("t2", prompt_of["t2"], max_tokens=20, temperature=0.8, seed=5)]

    alone = {r.request_id: run_alone(mode.factory(), r) for r in requests()}
    build = mode.factory()
    engine, runs = run_batch(lambda: padded(build()), requests())
    for run in runs:
        assert_same_as_alone(run, alone[run.request.request_id])
    verify = [desc for kind, desc, _ in engine.runner.graphs.full if kind == "verify"]
    assert max(desc.num_seqs for desc in verify) > 3                      # padded past the 3 live sequences
    assert all(desc.num_tokens in engine.runner.graphs.full_tokens for desc in verify)
    assert max(engine.counters.decode_batch_sizes) == 3


def test_padding_rows_stay_inside_page_0_when_the_block_outgrows_a_page(padding_models):
    """Block 8 over pages of 4 positions: padded rows of the graph path must write inside page 0,
    never into page 1 (the first page a sequence gets)."""
    target, draft, prompts = padding_models
    params = SamplingParams(max_tokens=20)
    alone = [decode(target, None, [p], params, page_size=4)[0] for p in prompts]
    for drafter in (None, draft):
        engine = padded(make_engine(target, drafter, block_size=8 if drafter else 1, page_size=4, max_num_seqs=4))
        requests = [Request(f"r{i}", p, params, frozenset(), 1024) for i, p in enumerate(prompts)]
        for request in requests:
            engine.submit(request, lambda event: None)
        while not all(r.is_finished for r in requests):
            engine.step()
        assert [r.output_ids for r in requests] == alone


def decode(target, draft, prompts, params, **config) -> list[list[int]]:
    engine = make_engine(target, draft, **config)
    requests = [Request(f"a{i}", p, params, frozenset(), 1024) for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request, lambda event: None)
    while not all(r.is_finished for r in requests):
        engine.step()
    return [r.output_ids for r in requests]


@pytest.fixture(scope="module")
def padding_models(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target), [[5, 6, 7], list(range(100, 130)), [9, 9]]


# -- issue 36: the graphs' batch sizes ----------------------------------------------------------

def test_graph_sizes_include_max_num_seqs_and_cover_every_batch_up_to_it():
    """For every max_num_seqs 1 … 512 the captured sizes end at max_num_seqs itself, and every
    decode batch of 1 … max_num_seqs sequences pads to a captured size (StopIteration at 128
    sequences on the H200 was a batch above the largest size)."""
    from blockspec.engine.graphs import bucket, capture_sizes
    for max_num_seqs in range(1, 513):
        sizes = capture_sizes(max_num_seqs)
        assert sizes[0] == 1 and sizes[-1] == max_num_seqs and sizes == sorted(set(sizes)), max_num_seqs
        for num_seqs in range(1, max_num_seqs + 1):
            assert num_seqs <= bucket(num_seqs, sizes) in sizes, (max_num_seqs, num_seqs)


@pytest.mark.parametrize("max_num_seqs, budget", [(8, 2048), (8, 16), (5, 22), (3, 7)])
def test_the_runners_graphs_serve_every_decode_batch_and_the_bench_reads_them_at_any_concurrency(
        dense, max_num_seqs, budget):
    """The runner's draft graph sizes end at the most sequences one step decodes at the full block
    (seats and token budget); the bench's graph timing asks for that step's graphs, not the
    concurrency's."""
    from types import SimpleNamespace
    from blockspec.bench.forward import graph_replay_ms
    target, draft, _ = dense
    engine = make_engine(target, draft, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    graphs = engine.runner.graphs = engine.runner.make_graphs(capture=False, bucket_keys=False)   # as the kernels
    most = min(max_num_seqs, budget // 4)
    assert engine.runner.max_decode_seqs == most == graphs.max_draft_seqs == graphs.draft_sizes[-1]
    assert graphs.plan_draft(most, 0, 1).desc.num_seqs == most
    engine.runner.warm_up(kinds=("verify", "propose"))         # the static buffers, as captured on CUDA
    graphs.capture = True
    for static in graphs.full.values():
        static.graph = SimpleNamespace(replay=lambda: None)     # stands in for the device's graph
    assert set(graph_replay_ms(engine, 4 * max_num_seqs)) == {"propose_graph_ms", "verify_graph_ms"}


def test_every_request_queued_before_a_step_is_prefilled_in_that_step(dense):
    """A burst of arrivals (issue 30: 64 × 256 over HTTP) waits for one step, not one step per
    few arrivals: the step admits everything the inbox holds when it starts and, when seats and
    the token budget allow, prefills every prompt in its one forward, so each gets its first token
    there; the first tokens equal each request's alone. The engine's stamps on each request
    (the server's first-token stages) are in order."""
    target, draft, vocab = dense
    config = dict(block_size=8, max_num_seqs=64, max_num_batched_tokens=1024, max_prefill_tokens=1024)
    requests = [make_request(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts(vocab, [8 + i % 9 for i in range(64)]))]
    assert sum(len(r.prompt_ids) for r in requests) <= 1024
    engine = make_engine(target, draft, **config)
    runs = [submit(engine, r) for r in requests]
    engine.step()
    assert engine.num_waiting == 0 and engine.num_running == 64
    assert [len(run.tokens) for run in runs] == [1] * 64
    for run in runs:
        request = run.request
        assert request.submitted_at <= request.admitted_at <= request.first_token_at
    for i in (0, 31, 63):
        alone = run_alone(lambda: make_engine(target, draft, **config), make_request(f"a{i}", requests[i].prompt_ids,
                                                                                     max_tokens=4))
        assert alone.tokens[0] == runs[i].tokens[0]
