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
from blockspec.engine.graphs import (EAGER, FULL, PIECEWISE, BatchDescriptor, GraphDispatcher, bucket,
                                     capture_sizes, token_buckets)
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
    assert graphs.plan(40, 10, False, 40, 3).mode == PIECEWISE          # past the FULL buckets
    assert graphs.plan(65, 3, True, 40, 3).mode == EAGER                # past the token budget
    draft_plan = graphs.plan_draft(3, 40, 3)
    assert (draft_plan.mode, draft_plan.desc) == (FULL, BatchDescriptor(16, 4, False))
    assert engine.runner.make_graphs(capture=False, padded=False).plan(13, 5, False, 40, 3).mode == EAGER


def test_a_full_graph_serves_as_many_sequences_as_it_has_slots():
    """A FULL graph of N tokens has min(N, max_num_seqs) sequence slots, and a step that fills
    every slot takes it: 8 plain rows of 8 sequences run in the 8-token graph (not the PIECEWISE
    path past it), max_num_seqs single rows in the max_num_seqs bucket."""
    graphs = GraphDispatcher(4, 8, 64, pages_per_seq=4, page_size=16, device=torch.device("cpu"), capture=False)
    for num_seqs in (1, 2, 4, 8):
        plan = graphs.plan(num_seqs, num_seqs, False, live_keys=40, cols=3)
        assert (plan.mode, plan.desc) == (FULL, BatchDescriptor(num_seqs, num_seqs, False)), num_seqs
    assert graphs.plan(32, 8, False, 40, 3).desc == BatchDescriptor(32, 8, False)     # 8 whole blocks


def test_a_stashing_targets_full_graphs_have_a_slot_per_started_block():
    """A hybrid target's FULL graphs stash every row's state in slots × block rows: ⌈tokens ÷
    block⌉ slots, so one plain row runs in the 1-token graph (one slot) and 5 rows of 2 sequences
    in the 8-token graph (two slots), not padded to a whole block per sequence."""
    graphs = GraphDispatcher(4, 8, 64, pages_per_seq=4, page_size=16, device=torch.device("cpu"), capture=False,
                             stashing=True)
    assert [graphs.seq_slots(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 64)] == [1, 1, 1, 1, 2, 2, 3, 8, 8]
    assert graphs.plan(1, 1, False, 40, 3).desc == BatchDescriptor(1, 1, False)
    assert graphs.plan(2, 1, False, 40, 3).desc == BatchDescriptor(2, 1, False)
    assert graphs.plan(5, 2, False, 40, 3).desc == BatchDescriptor(8, 2, False)
    assert graphs.plan(3, 2, False, 40, 3).desc == BatchDescriptor(8, 2, False)       # 4 tokens: one slot

# -- models ------------------------------------------------------------------------------------

def build_models(kind: str, root, device: str = "cpu", dense_dirs=None) -> dict:
    """The target of a kind (dense, hybrid, moe) with a DFlash draft (and a DFlash 2 draft for the
    dense target), fp32 on `device`; dense_dirs: the dense target's and draft's checkpoints."""
    if kind == "dense":
        target_dir, draft_dir = dense_dirs
        target = load_model(str(target_dir), device=device, dtype="float32").model
        draft2_dir = fixtures.write_dflash2_draft(root / "d2", target_dir)
        return dict(target=target, dflash=load_draft(str(draft_dir), target),
                    dflash2=load_draft(str(draft2_dir), target), vocab=151643)
    if kind == "hybrid":
        from test_hybrid import TEXT as shape, VOCAB as vocab, hf_model, randomise
        ref = hf_model("qwen3_5")
    else:
        from test_moe import ATTENTION as shape, VOCAB as vocab, hf_model, randomise
        ref = hf_model("qwen3_5_moe")
    randomise(ref)
    ref.save_pretrained(root / "target")
    target = load_model(str(root / "target"), device=device, dtype="float32").model
    (root / "shape").mkdir()
    (root / "shape" / "config.json").write_text(json.dumps({"hidden_size": shape["hidden_size"],
                                                            "num_hidden_layers": shape["num_hidden_layers"],
                                                            "vocab_size": vocab}))
    draft = fixtures.write_dflash_draft(root / "draft", root / "shape", target_layer_ids=[0, 2],
                                        mask_token_id=vocab - 1)
    return dict(target=target, dflash=load_draft(str(draft), target), vocab=vocab)


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    return build_models("dense", tmp_path_factory.mktemp("graphs-dense"), dense_dirs=(qwen3_dir, qwen3_draft_dir))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_models("hybrid", tmp_path_factory.mktemp("graphs-hybrid"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_models("moe", tmp_path_factory.mktemp("graphs-moe"))


# -- padded == eager -----------------------------------------------------------------------------

BLOCK = 4
CASES = [("dense", "plain"), ("dense", "dflash"), ("dense", "dflash2"), ("hybrid", "plain"),
         ("hybrid", "dflash"), ("moe", "plain"), ("moe", "dflash")]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (9, 30, 5, 90)]


def requests(vocab: int):
    return [make_request(f"r{i}", p, max_tokens=10 + 2 * i) for i, p in enumerate(prompts(vocab))]


def engine_factory(models, name: str, graphs: str, references: dict[str, list[int]], modes: Counter,
                   oracles: bool = True):
    """Two requests decode, two arrive at step 3 (one of them prefilled in chunks of the 32-token
    budget): PIECEWISE-shaped steps, then FULL-shaped ones, with verify widths drawn at random
    per sequence and cycle (the same draws on every path). graphs: "eager" (exact shapes),
    "padded" (the dispatcher's shapes, capture=False), "captured" (the engine's own graphs,
    captured at startup on CUDA). oracles: drafts that know the target's continuations (they read
    the host inside the draft's forward, which a graph cannot capture: off where one is compared
    with captured graphs)."""
    target = models["target"]
    config = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                  cuda_graphs=graphs == "captured")

    def build():
        if name == "plain":
            engine = make_engine(target, **config)
        elif name == "dflash2":
            if oracles:
                install_oracle(models["dflash2"], list(references.values()))
            engine = make_engine(target, models["dflash2"], block_size=BLOCK, **config)
        else:
            draft = OracleDraft(models["dflash"], references) if oracles else models["dflash"]
            engine = make_engine(target, draft, block_size=BLOCK, **config)
            if oracles:
                draft.bind(engine)
        if name != "plain":
            use_policy(engine, ForcedWidths(BLOCK - 1, seed=11))
        if graphs != "captured":
            engine.runner.graphs = engine.runner.make_graphs(capture=False, padded=graphs == "padded")
        dispatcher = engine.runner.graphs
        real = dispatcher.run

        def run(kind, plan, fn, meta, prepare):
            modes[(kind, plan.mode)] += 1
            return real(kind, plan, fn, meta, prepare)
        dispatcher.run = run
        return engine
    return build


def check_against_eager(models, name: str, graphs: str) -> None:
    """The batch with arrivals on the `graphs` path decodes as on the eager path, both through
    every plan kind the path has."""
    vocab = models["vocab"]
    plain = make_engine(models["target"], max_num_seqs=4, max_model_len=256, cuda_graphs=False)
    _, runs = run_batch(lambda: plain, requests(vocab))
    references = {run.request.request_id: run.request.prompt_ids + run.output_ids for run in runs}
    results, oracles = {}, graphs != "captured"          # both paths run the same drafts
    for path in ("eager", graphs):
        modes = Counter()
        first, later = requests(vocab)[:2], requests(vocab)[2:]
        _, runs = run_batch(engine_factory(models, name, path, references, modes, oracles), first,
                            arrivals={3: later})
        results[path] = [(run.output_ids, run.stats.acceptance_lengths) for run in runs]
        if path == "eager":
            assert set(mode for _, mode in modes) == {EAGER}
        else:
            assert modes[("verify", FULL)] > 3 and modes[("verify", PIECEWISE)] > 2, modes
            assert name == "plain" or modes[("propose", FULL)] > 3, modes
    assert results[graphs] == results["eager"]
    if name != "plain" and graphs != "captured":     # drafts accepted in part and whole: the rows mattered
        lengths = {n for _, accepted in results[graphs] for n in accepted}
        assert len(lengths) >= 3, lengths


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_padded_path_decodes_like_the_eager_step(request, kind, name):
    check_against_eager(request.getfixturevalue(kind), name, "padded")
