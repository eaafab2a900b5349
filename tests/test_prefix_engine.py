"""Prefix caching through the engine: outputs with cache hits equal outputs without the cache.

Conversations of three turns (turn n + 1's prompt = turn n's prompt + its answer + a new user
message) on one engine with the cache, against every turn on a fresh engine with
--no-prefix-cache: dense, hybrid (Gated DeltaNet) and MoE targets; plain, DFlash and DFlash 2;
greedy and seeded sampling; a grammar; a pool small enough that cached pages are evicted and
sequences preempted; a prefix that ends mid-page; a hit that stops at the deepest hybrid
snapshot before the matched pages.
"""
from __future__ import annotations

import json

import pytest
import torch

import fixtures
from blockspec.loader import load_draft, load_model
from helpers import make_engine, make_request, run_batch, submit, run_until_done

PAGE = 16


# -- models ----------------------------------------------------------------------------------

def drafts_for(target, target_dir, shape_dir, root, mask_token_id: int) -> dict:
    d1 = fixtures.write_dflash_draft(root / "d1", shape_dir, target_layer_ids=[0, 2], mask_token_id=mask_token_id)
    d2 = fixtures.write_dflash2_draft(root / "d2", shape_dir, target_layer_ids=[0, 2], mask_token_id=mask_token_id,
                                      block_size=8)
    return {"plain": None, "dflash": load_draft(str(d1), target), "dflash2": load_draft(str(d2), target)}


def shape_of(root, hidden: int, layers: int, vocab: int):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": layers,
                                                  "vocab_size": vocab}))
    return root


@pytest.fixture(scope="module")
def dense(qwen3_dir, tmp_path_factory):
    target = load_model(str(qwen3_dir)).model
    root = tmp_path_factory.mktemp("prefix-dense")
    return target, drafts_for(target, qwen3_dir, qwen3_dir, root, fixtures.QWEN3_MASK_TOKEN_ID), 151643


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_hybrid import TEXT, VOCAB, hf_model, randomise
    root = tmp_path_factory.mktemp("prefix-hybrid")
    ref = hf_model("qwen3_5")
    randomise(ref)
    ref.save_pretrained(root / "target")
    target = load_model(str(root / "target"), device="cpu", dtype="float32").model
    shape = shape_of(root / "shape", TEXT["hidden_size"], TEXT["num_hidden_layers"], VOCAB)
    return target, drafts_for(target, root / "target", shape, root, VOCAB - 1), VOCAB - 1


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_moe import ATTENTION, VOCAB, hf_model, randomise
    root = tmp_path_factory.mktemp("prefix-moe")
    ref = hf_model("qwen3_moe")
    randomise(ref)
    ref.save_pretrained(root / "target")
    target = load_model(str(root / "target"), device="cpu", dtype="float32").model
    shape = shape_of(root / "shape", ATTENTION["hidden_size"], ATTENTION["num_hidden_layers"], VOCAB)
    return target, drafts_for(target, root / "target", shape, root, VOCAB - 1), VOCAB - 1


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def factory(target, draft, cache: bool, **config):
    block = {} if draft is None else {"block_size": 8}
    return lambda: make_engine(target, draft, prefix_cache=cache, **block, **config)


def conversation(build, first: list[int], follow_ups: list[list[int]], fresh: bool, **params):
    """Each turn's prompt is the last prompt + its answer + the next user message. fresh: every
    turn on a new engine (the reference). Returns [(output ids, cached tokens)], the engine."""
    engine, prompt, results = build(), list(first), []
    for turn, message in enumerate([[]] + follow_ups):
        if turn:
            prompt = prompt + results[-1][0] + message
        if fresh:
            engine = build()
        run = submit(engine, make_request(f"turn{turn}", prompt, max_tokens=20, **params))
        run_until_done(engine, [run])
        run.check_events()
        results.append((run.output_ids, run.stats.cached_tokens))
    return results, engine


def check_equal(target, draft, vocab: int, **params) -> list[int]:
    first, follow_ups = tokens(vocab, 45, 1), [tokens(vocab, 7, 2), tokens(vocab, 9, 3)]
    cached, engine = conversation(factory(target, draft, True), first, follow_ups, fresh=False, **params)
    reference, _ = conversation(factory(target, draft, False), first, follow_ups, fresh=True, **params)
    assert [out for out, _ in cached] == [out for out, _ in reference]
    assert all(n == 0 for _, n in reference)
    engine.cache.prefix.check()
    assert engine.cache.usage == 0.0                 # cached pages nobody uses count as free
    return [n for _, n in cached]


# -- exactness -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", "dflash", "dflash2"])
@pytest.mark.parametrize("kind", ["dense", "hybrid", "moe"])
def test_greedy_turns_with_hits_equal_the_cache_off(request, kind, mode):
    target, drafts, vocab = request.getfixturevalue(kind)
    hits = check_equal(target, drafts[mode], vocab)
    # turn 2's prompt is 45 + 20 + 7 = 72 tokens: 4 full pages short of its last position; turn 3's
    # 101 tokens match turn 2's committed pages (its last fed position is 91, or 92 at a stop).
    assert hits[0] == 0 and hits[1] == 64 and hits[2] == 80, hits


@pytest.mark.parametrize("kind,mode", [("dense", "dflash"), ("hybrid", "dflash"), ("hybrid", "plain"),
                                       ("moe", "dflash2")])
def test_seeded_sampling_with_hits_equals_the_cache_off(request, kind, mode):
    target, drafts, vocab = request.getfixturevalue(kind)
    hits = check_equal(target, drafts[mode], vocab, temperature=0.9, seed=11)
    assert hits[1] > 0 and hits[2] > 0


def test_grammar_turns_with_hits_equal_the_cache_off(dense, qwen3_dir):
    from blockspec.structured import GrammarSpec, compile_grammar, grammar_compiler
    from blockspec.tokenizer import Tokenizer
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    target, drafts, vocab = dense
    compiler = grammar_compiler(Tokenizer.from_dir(qwen3_dir), target.lm_head.weight.shape[0])
    grammar = compile_grammar(compiler, GrammarSpec("json_object"))
    system = tokens(vocab, 50, 5)

    def runs(cache: bool) -> tuple[list[list[int]], list[int]]:
        build = factory(target, drafts["dflash"], cache)
        engine, outs, hits = build(), [], []
        for i in range(3):
            if not cache:
                engine = build()
            req = Request(f"g{i}", system + tokens(vocab, 5, 20 + i), SamplingParams(max_tokens=12),
                          frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID}),
                          1024, grammar=grammar)
            run = submit(engine, req)
            run_until_done(engine, [run])
            outs.append(run.output_ids)
            hits.append(run.stats.cached_tokens)
        return outs, hits

    (with_cache, hits), (without, _) = runs(True), runs(False)
    assert with_cache == without and hits == [0, 48, 48]      # the shared 50 tokens: 3 full pages


# -- eviction and preemption -----------------------------------------------------------------

@pytest.mark.parametrize("kind,mode", [("dense", "dflash"), ("hybrid", "dflash"), ("moe", "plain")])
def test_eviction_and_preemption_keep_outputs_exact(request, kind, mode):
    """Four conversations sharing a system prompt, two turns each, in a pool of 24 pages of 4
    positions: cached pages are evicted to admit and grow sequences, and running sequences are
    preempted; every answer equals its answer alone with the cache off."""
    target, drafts, vocab = request.getfixturevalue(kind)
    draft = drafts[mode]
    system = tokens(vocab, 10, 7)
    first = {f"c{i}": system + tokens(vocab, 3 + i, 30 + i) for i in range(4)}

    def alone(prompt: list[int]) -> list[int]:
        engine = factory(target, draft, False)()
        run = submit(engine, make_request("ref", prompt, max_tokens=16))
        run_until_done(engine, [run])
        return run.output_ids

    build = factory(target, draft, True, num_pages=25, page_size=4)
    engine, runs = run_batch(build, [make_request(rid, p, max_tokens=16) for rid, p in first.items()])
    second = {}
    for run in runs:
        rid = run.request.request_id
        assert run.output_ids == alone(first[rid]), rid
        second[rid] = first[rid] + run.output_ids + tokens(vocab, 2, 50)
    preemptions = sum(run.seq.num_preemptions for run in runs)
    runs2 = [submit(engine, make_request(rid + "-2", p, max_tokens=16)) for rid, p in second.items()]
    run_until_done(engine, runs2)
    for run in runs2:
        run.check_events()
        assert run.output_ids == alone(second[run.request.request_id[:2]]), run.request.request_id
    preemptions += sum(run.seq.num_preemptions for run in runs2 if run.seq is not None)
    cache = engine.cache
    assert preemptions > 0 and cache.prefix.num_evicted > 0
    assert sum(run.stats.cached_tokens for run in runs2) > 0
    cache.prefix.check()
    assert cache.num_free_pages == 24 and cache.usage == 0.0
    cache.prefix.clear()
    assert cache.pages.num_free == 24 and not any(cache.pages._refs)     # every page back, exactly once


# -- where a hit ends --------------------------------------------------------------------------

def test_a_prefix_ending_mid_page_reuses_the_full_pages_before_it(dense):
    target, drafts, vocab = dense
    shared = tokens(vocab, 40, 9)                    # 2 full pages + 8 tokens of a third
    build = factory(target, drafts["dflash"], True)
    engine = build()
    outs = []
    for i, tail in enumerate([tokens(vocab, 6, 60), tokens(vocab, 6, 61)]):
        run = submit(engine, make_request(f"m{i}", shared + tail, max_tokens=12))
        run_until_done(engine, [run])
        outs.append((run.output_ids, run.stats.cached_tokens))
    reference = []
    for tail in [tokens(vocab, 6, 60), tokens(vocab, 6, 61)]:
        other = factory(target, drafts["dflash"], False)()
        run = submit(other, make_request("r", shared + tail, max_tokens=12))
        run_until_done(other, [run])
        reference.append(run.output_ids)
    assert [o for o, _ in outs] == reference
    assert [n for _, n in outs] == [0, 32]


def test_a_fully_cached_prompt_of_whole_pages_still_recomputes_its_last_position(dense):
    """A 48-token prompt (3 pages) run twice: the second time every page is cached, yet the hit
    stops one page short (the last position is recomputed for its logits and the draft's
    features) and the output equals the cache-off run."""
    target, drafts, vocab = dense
    prompt = tokens(vocab, 3 * PAGE, 12)
    for mode in ("plain", "dflash"):
        engine = factory(target, drafts[mode], True)()
        runs = []
        for i in range(2):
            runs.append(submit(engine, make_request(f"w{i}", prompt, max_tokens=8)))
            run_until_done(engine, runs[-1:])
        fresh = factory(target, drafts[mode], False)()
        reference = submit(fresh, make_request("r", prompt, max_tokens=8))
        run_until_done(fresh, [reference])
        assert [r.stats.cached_tokens for r in runs] == [0, 2 * PAGE], mode
        assert runs[0].output_ids == runs[1].output_ids == reference.output_ids, mode
        runs[1].check_events()


def test_a_hybrid_hit_stops_at_the_deepest_snapshot_then_snapshots_the_branch(hybrid):
    """Turn 1 (45 prompt tokens + 20 answer) leaves snapshots at 32 (its prompt's last full page)
    and 64 (its last page boundary). A prompt that follows it for 56 tokens matches 3 pages but
    resumes at 32; its prefill stops at 48 (where the tree branches) to snapshot there, so the
    next such prompt resumes at 48. Every output equals the cache-off one."""
    target, drafts, vocab = hybrid
    for mode in ("plain", "dflash"):
        build = factory(target, drafts[mode], True)
        engine = build()
        first = tokens(vocab, 45, 1)
        run = submit(engine, make_request("t1", first, max_tokens=20))
        run_until_done(engine, [run])
        history = first + run.output_ids
        depths = sorted(n.depth for n in engine.cache.prefix._snapshot_nodes.values())
        assert depths == [2, 4], depths
        results = []
        for i in range(2):
            prompt = history[:56] + tokens(vocab, 5, 70 + i)
            run = submit(engine, make_request(f"b{i}", prompt, max_tokens=10))
            run_until_done(engine, [run])
            fresh = factory(target, drafts[mode], False)()
            reference = submit(fresh, make_request("r", prompt, max_tokens=10))
            run_until_done(fresh, [reference])
            assert run.output_ids == reference.output_ids, (mode, i)
            results.append(run.stats.cached_tokens)
        assert results == [32, 48], (mode, results)
        engine.cache.prefix.check()


def test_a_stop_id_inside_a_block_caches_no_page_past_the_committed_tokens(dense):
    """A 9-token prompt, an oracle draft accepting whole blocks of 8: the third cycle feeds
    positions 25 … 32, and a stop id among its first tokens ends the output before position 32.
    The page of positions 16 … 31 was fed (drafts past the stop included) but is not full of
    committed tokens: it must not join the tree (check: every node a full page of tokens). The
    output is plain decoding's, cut at the stop id."""
    from helpers import OracleDraft
    target, drafts, vocab = dense
    prompt = tokens(vocab, 9, 21)
    fresh = factory(target, None, False)()
    reference = submit(fresh, make_request("r", prompt, max_tokens=30))
    run_until_done(fresh, [reference])
    output = reference.output_ids
    first = {}
    for i, token in enumerate(output):
        first.setdefault(token, i)
    stop_at = next(i for i in range(17, 22) if first[output[i]] == i)     # output 17 … 24: the third cycle's
    engine = factory(target, OracleDraft(drafts["dflash"], prompt + output), True)()
    engine.runner.draft.bind(engine)
    run = submit(engine, make_request("s", prompt, max_tokens=30, stop_token_ids=(output[stop_at],)))
    run_until_done(engine, [run])
    run.check_events()
    assert run.output_ids == output[: stop_at + 1] and run.finish_reason == "stop"
    assert run.stats.acceptance_lengths[:2] == [8, 8]
    engine.cache.prefix.check()
    assert engine.cache.prefix.num_nodes == 1            # only positions 0 … 15: the one full page


def test_no_prefix_cache_keeps_nothing(dense):
    target, drafts, vocab = dense
    engine = factory(target, None, False)()
    assert not hasattr(engine.cache, "prefix")
    prompt = tokens(vocab, 40, 4)
    for i in range(2):
        run = submit(engine, make_request(f"n{i}", prompt, max_tokens=4))
        run_until_done(engine, [run])
        assert run.stats.cached_tokens == 0
    assert engine.cache.pages.num_free == engine.cache.num_usable_pages
