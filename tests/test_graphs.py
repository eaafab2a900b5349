"""The graph dispatcher (engine/graphs.py) on CPU: its buckets, and the padded path it plans — FULL
shapes for decode / verify rows of ragged widths, PIECEWISE shapes for steps with prefill chunks —
run eagerly (capture=False) and held to the plain eager step: a batch with arrivals (mixed
steps), decode-only steps and random verify widths per sequence and cycle decodes token for
token as the eager engine does, for dense, hybrid and MoE targets, plain, DFlash and DFlash 2.
tests/gpu/test_graph_dispatch.py holds the graphs' replay to the same path on the device."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import fixtures
from blockspec.engine.graphs import (EAGER, FULL, PIECEWISE, BatchDescriptor, bucket, capture_sizes,
                                     token_buckets)
from blockspec.loader import load_draft, load_model
from helpers import OracleDraft, make_engine, make_request, run_batch
from test_adaptive import ForcedWidths, use_policy
from test_dflash2 import install_oracle


def test_buckets_cover_every_size_and_end_at_the_limit():
    for limit in (1, 3, 16, 100, 256):
        sizes = capture_sizes(limit)
        assert sizes[-1] == limit and sizes == sorted(set(sizes))
        assert all(bucket(n, sizes) >= n for n in range(1, limit + 1))
        assert bucket(limit + 1, sizes) is None                   # above the largest: eager, no StopIteration
    tokens = token_buckets(2048)
    assert tokens[-1] == 2048 and bucket(2049, tokens) is None
    # 15 padding rows at most up to 256 tokens, a quarter more rows at most beyond
    assert all(bucket(n, tokens) <= (n + 15 if n <= 256 else n * 5 / 4) for n in range(1, 2049))


def test_plans_by_descriptor(dense):
    engine = make_engine(dense["target"], dense["dflash"], block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    graphs = engine.runner.make_graphs(capture=False)
    assert graphs.full_tokens[-1] == 32 and graphs.piecewise_tokens[-1] == 64
    full = graphs.plan(13, 5, False, live_keys=40, cols=3)
    assert (full.mode, full.desc) == (FULL, BatchDescriptor(16, 8, False)) and full.bounded
    assert full.cols == graphs.pages_per_seq
    mixed = graphs.plan(50, 3, True, live_keys=40, cols=3)
    assert (mixed.mode, mixed.desc, mixed.cols) == (PIECEWISE, BatchDescriptor(64, 3, True), 3)
    assert graphs.plan(40, 10, False, 40, 3).mode == EAGER              # past the FULL buckets
    draft_plan = graphs.plan_draft(3, 40, 3)
    assert (draft_plan.mode, draft_plan.desc) == (FULL, BatchDescriptor(16, 4, False))
    assert engine.runner.make_graphs(capture=False, padded=False).plan(13, 5, False, 40, 3).mode == EAGER


# -- models ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    target = load_model(str(qwen3_dir)).model
    draft2_dir = fixtures.write_dflash2_draft(tmp_path_factory.mktemp("graphs-d2") / "d2", qwen3_dir)
    return dict(target=target, dflash=load_draft(str(qwen3_draft_dir), target),
                dflash2=load_draft(str(draft2_dir), target), vocab=151643)


def hf_saved(tmp_path_factory, name: str, make, randomise):
    root = tmp_path_factory.mktemp(f"graphs-{name}")
    ref = make()
    randomise(ref)
    ref.save_pretrained(root / "target")
    return root


def small_draft(root, hidden: int, layers: int, vocab: int):
    shape = root / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": layers,
                                                   "vocab_size": vocab}))
    return fixtures.write_dflash_draft(root / "draft", shape, target_layer_ids=[0, 2], mask_token_id=vocab - 1)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_hybrid import TEXT, VOCAB, hf_model, randomise
    root = hf_saved(tmp_path_factory, "hybrid", lambda: hf_model("qwen3_5"), randomise)
    target = load_model(str(root / "target"), device="cpu", dtype="float32").model
    draft = small_draft(root, TEXT["hidden_size"], TEXT["num_hidden_layers"], VOCAB)
    return dict(target=target, dflash=load_draft(str(draft), target), vocab=VOCAB)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_moe import ATTENTION, VOCAB, hf_model, randomise
    root = hf_saved(tmp_path_factory, "moe", lambda: hf_model("qwen3_5_moe"), randomise)
    target = load_model(str(root / "target"), device="cpu", dtype="float32").model
    draft = small_draft(root, ATTENTION["hidden_size"], ATTENTION["num_hidden_layers"], VOCAB)
    return dict(target=target, dflash=load_draft(str(draft), target), vocab=VOCAB)


# -- padded == eager -----------------------------------------------------------------------------

BLOCK = 4
CASES = [("dense", "plain"), ("dense", "dflash"), ("dense", "dflash2"), ("hybrid", "plain"),
         ("hybrid", "dflash"), ("moe", "plain"), ("moe", "dflash")]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (9, 30, 5, 90)]


def requests(vocab: int):
    return [make_request(f"r{i}", p, max_tokens=10 + 2 * i) for i, p in enumerate(prompts(vocab))]


def engine_factory(models, name: str, padded: bool, references: dict[str, list[int]], modes: Counter):
    """Two requests decode, two arrive at step 3 (one of them prefilled in chunks of the 32-token
    budget): PIECEWISE-shaped steps, then FULL-shaped ones, with verify widths drawn at random
    per sequence and cycle (the same draws for the padded and the eager engine)."""
    target = models["target"]
    config = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)

    def build():
        if name == "plain":
            engine = make_engine(target, **config)
        elif name == "dflash2":
            install_oracle(models["dflash2"], list(references.values()))
            engine = make_engine(target, models["dflash2"], block_size=BLOCK, **config)
            use_policy(engine, ForcedWidths(BLOCK - 1, seed=11))
        else:
            oracle = OracleDraft(models["dflash"], references)
            engine = make_engine(target, oracle, block_size=BLOCK, **config)
            oracle.bind(engine)
            use_policy(engine, ForcedWidths(BLOCK - 1, seed=11))
        graphs = engine.runner.graphs = engine.runner.make_graphs(capture=False, padded=padded)
        real = graphs.run

        def run(kind, plan, fn, meta, prepare):
            modes[(kind, plan.mode)] += 1
            return real(kind, plan, fn, meta, prepare)
        graphs.run = run
        return engine
    return build


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_padded_path_decodes_like_the_eager_step(request, kind, name):
    models = request.getfixturevalue(kind)
    vocab = models["vocab"]
    plain = make_engine(models["target"], max_num_seqs=4, max_model_len=256)
    _, runs = run_batch(lambda: plain, requests(vocab))
    references = {run.request.request_id: run.request.prompt_ids + run.output_ids for run in runs}
    results = {}
    for padded in (False, True):
        modes = Counter()
        first, later = requests(vocab)[:2], requests(vocab)[2:]
        _, runs = run_batch(engine_factory(models, name, padded, references, modes), first, arrivals={3: later})
        results[padded] = [(run.output_ids, run.stats.acceptance_lengths) for run in runs]
        if padded:
            assert modes[("verify", FULL)] > 3 and modes[("verify", PIECEWISE)] > 2, modes
            assert name == "plain" or modes[("propose", FULL)] > 3, modes
        else:
            assert set(mode for _, mode in modes) == {EAGER}
    assert results[True] == results[False]
    if name != "plain":                       # drafts were accepted in part and whole: the rows mattered
        lengths = {n for _, accepted in results[True] for n in accepted}
        assert len(lengths) >= 3, lengths
