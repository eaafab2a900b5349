"""The ragged step (issue 20): prefill chunks of several sequences and the verify (or plain
decode) rows of the decoding ones run in ONE target forward; every request's greedy output is
still the one it gets alone — dense, hybrid and MoE targets, plain, DFlash and DFlash 2, with
a grammar and penalties, across preemption — and a sequence never accepts past its k_i."""
from __future__ import annotations

import pytest
import torch

import fixtures
from blockspec.engine.engine import Engine
from blockspec.loader import load_draft, load_model
from helpers import OracleDraft, make_engine, make_request, run_alone, run_batch

BLOCK = 4


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def families(qwen3_dir, tmp_path_factory) -> dict:
    """kind → (target, {mode: draft or None}, vocab)."""
    from test_moe import VOCAB as MOE_VOCAB, hf_model
    root = tmp_path_factory.mktemp("ragged")
    out = {}
    dense = load_model(str(qwen3_dir)).model
    out["dense"] = (dense, qwen3_dir, 151643, {})
    hybrid_dir = fixtures.write_hybrid_checkpoint(root / "hybrid")
    out["hybrid"] = (load_model(str(hybrid_dir), device="cpu", dtype="float32").model, hybrid_dir,
                     fixtures.HYBRID_VOCAB, dict(target_layer_ids=[0, 2], mask_token_id=fixtures.HYBRID_VOCAB - 1))
    hf_model("qwen3_moe").save_pretrained(root / "moe")
    out["moe"] = (load_model(str(root / "moe"), device="cpu", dtype="float32").model, root / "moe", MOE_VOCAB,
                  dict(target_layer_ids=[0, 2], mask_token_id=MOE_VOCAB - 1))
    families = {}
    for kind, (target, directory, vocab, draft_args) in out.items():
        d1 = fixtures.write_dflash_draft(root / f"{kind}-d1", directory, **draft_args)
        d2 = fixtures.write_dflash2_draft(root / f"{kind}-d2", directory, **draft_args,
                                          **({} if kind == "dense" else dict(conv_group_size=8)))
        drafts = {"plain": None, "dflash": load_draft(str(d1), target), "dflash2": load_draft(str(d2), target)}
        families[kind] = (target, drafts, vocab)
    return families


def factory(target, draft, **config):
    return lambda: make_engine(target, draft, block_size=BLOCK if draft is not None else 1, **config)


def recording(build):
    """The engine's steps, as (number of prefill chunks, number of decoding sequences)."""
    steps: list[tuple[int, int]] = []

    def make() -> Engine:
        engine = build()
        real = engine.runner.launch

        def step(batch):
            steps.append((len(batch.prefill), len(batch.decode)))
            return real(batch)
        engine.runner.launch = step
        return engine
    return make, steps


def assert_same(batch_run, alone_run) -> None:
    rid = batch_run.request.request_id
    assert batch_run.output_ids == alone_run.output_ids, rid
    assert batch_run.finish_reason == alone_run.finish_reason, rid
    assert batch_run.stats.acceptance_lengths == alone_run.stats.acceptance_lengths, rid


CASES = [(kind, mode) for kind in ("dense", "hybrid", "moe") for mode in ("plain", "dflash", "dflash2")]


@pytest.mark.parametrize("kind,mode", CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_a_mixed_step_gives_every_request_its_output_alone(families, kind, mode):
    """Two requests decode while three prompts arrive: their three prefills and the two
    decoding sequences' verify rows share one target forward; with penalties on two of them."""
    target, drafts, vocab = families[kind]
    ids = [f"r{i}" for i in range(5)]
    prompt_of = dict(zip(ids, prompts(vocab, [9, 30, 14, 41, 6], seed=7)))
    extra = {"r1": dict(presence_penalty=0.7, repetition_penalty=1.3), "r3": dict(frequency_penalty=0.5)}

    def requests():
        return [make_request(rid, prompt_of[rid], max_tokens=12 + i, **extra.get(rid, {}))
                for i, rid in enumerate(ids)]

    build = factory(target, drafts[mode])
    alone = {r.request_id: run_alone(build, r) for r in requests()}
    plain = factory(target, None)
    for rid in ids:                                             # DFlash is lossless: plain decoding's output
        assert alone[rid].output_ids == run_alone(plain, requests()[ids.index(rid)]).output_ids
    make, steps = recording(build)
    batch = requests()
    _, runs = run_batch(make, batch[:2], arrivals={2: batch[2:]})
    assert any(num_prefill >= 2 and num_decode >= 1 for num_prefill, num_decode in steps), steps
    for run in runs:
        assert_same(run, alone[run.request.request_id])


@pytest.mark.parametrize("mode", ["plain", "dflash", "dflash2"])
def test_a_mixed_step_with_a_grammar(families, qwen3_dir, mode):
    from blockspec.structured import GrammarSpec, compile_grammar, grammar_compiler
    from blockspec.tokenizer import Tokenizer
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    target, drafts, vocab = families["dense"]
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    compiler = grammar_compiler(tokenizer, target.lm_head.weight.shape[0])
    grammar = compile_grammar(compiler, GrammarSpec("json_object"))
    ids = ["g0", "g1", "g2", "g3"]
    prompt_of = dict(zip(ids, prompts(vocab, [11, 25, 8, 17], seed=9)))

    def requests():
        return [Request(rid, prompt_of[rid], SamplingParams(max_tokens=14, presence_penalty=0.4 * (i % 2)),
                        tokenizer.stop_token_ids, 1024, grammar=grammar if i % 2 == 0 else None)
                for i, rid in enumerate(ids)]

    build = factory(target, drafts[mode])
    alone = {r.request_id: run_alone(build, r) for r in requests()}
    make, steps = recording(build)
    batch = requests()
    _, runs = run_batch(make, batch[:1], arrivals={2: batch[1:]})
    assert any(p >= 2 and d >= 1 for p, d in steps), steps
    for run in runs:
        assert_same(run, alone[run.request.request_id])
    free = run_alone(build, make_request("x", prompt_of["g0"], tokenizer.stop_token_ids, max_tokens=14))
    assert alone["g0"].output_ids != free.output_ids                    # the grammar did something


@pytest.mark.parametrize("kind,mode", [("dense", "dflash"), ("hybrid", "dflash2"), ("moe", "plain")])
def test_mixed_steps_across_preemption(families, kind, mode):
    """A pool too small for all: sequences are preempted while others prefill in the same steps,
    recomputed later (their prefills again mixed with decode rows), each output still alone's."""
    target, drafts, vocab = families[kind]
    ids = [f"p{i}" for i in range(4)]
    prompt_of = dict(zip(ids, prompts(vocab, [6, 13, 9, 10], seed=3)))

    def requests():
        return [make_request(rid, prompt_of[rid], max_tokens=22) for rid in ids]

    alone = {r.request_id: run_alone(factory(target, drafts[mode]), r) for r in requests()}
    make, steps = recording(factory(target, drafts[mode], num_pages=18, page_size=4))
    batch = requests()
    engine, runs = run_batch(make, batch[:2], arrivals={2: batch[2:]})
    assert sum(run.seq.num_preemptions for run in runs) > 0
    assert any(p >= 1 and d >= 1 for p, d in steps), steps
    for run in runs:
        assert_same(run, alone[run.request.request_id])
    assert engine.cache.num_free_pages == 17


def test_acceptance_never_passes_k(families):
    """An oracle draft whose proposals are always right: a sequence given k_i drafts accepts
    exactly k_i (+ the bonus) per cycle, k_i = 0 is a plain decode row, and the output is plain
    decoding's whatever the widths of the others in the batch."""
    target, drafts, vocab = families["dense"]
    ids = ["k0", "k1", "k3"]
    widths = {"k0": 0, "k1": 1, "k3": 3}
    prompt_of = dict(zip(ids, prompts(vocab, [10, 7, 19], seed=5)))
    plain = {rid: run_alone(factory(target, None), make_request(rid, prompt_of[rid], max_tokens=16)).output_ids
             for rid in ids}

    def build():
        oracle = OracleDraft(drafts["dflash"], {rid: prompt_of[rid] + plain[rid] for rid in ids})
        engine = make_engine(target, oracle, block_size=BLOCK)
        oracle.bind(engine)
        engine.scheduler.verify_widths = lambda decoding: [widths[seq.request_id] for seq in decoding]
        return engine
    _, runs = run_batch(build, [make_request(rid, prompt_of[rid], max_tokens=16) for rid in ids])
    for run in runs:
        rid = run.request.request_id
        assert run.output_ids == plain[rid], rid
        lengths = run.stats.acceptance_lengths
        assert all(n == widths[rid] + 1 for n in lengths[:-1]) and lengths[-1] <= widths[rid] + 1, (rid, lengths)
        assert run.stats.draft_tokens <= widths[rid] * len(lengths), rid        # drafts counted: ≤ k_i a cycle


def test_a_seeded_sampling_row_verifying_no_draft_draws_once_as_plain_decoding(families):
    """k_i = 0 for a seeded sampling sequence next to a greedy one that drafts (so the step has
    a proposal): its token is the one draw from row 0 (draw_plain), its generator used once a
    step as in plain decoding, so its output is plain decoding's, token for token."""
    target, drafts, vocab = families["dense"]
    prompt_of = dict(zip(["s", "g"], prompts(vocab, [11, 8], seed=9)))

    def requests():
        return [make_request("s", prompt_of["s"], max_tokens=12, temperature=1.0, seed=7),
                make_request("g", prompt_of["g"], max_tokens=12)]
    plain = {r.request_id: run_alone(factory(target, None), r).output_ids for r in requests()}

    def build():
        engine = make_engine(target, drafts["dflash"], block_size=BLOCK)
        engine.scheduler.verify_widths = lambda decoding: [0 if seq.request_id == "s" else BLOCK - 1
                                                           for seq in decoding]
        return engine
    _, runs = run_batch(build, requests())
    by_id = {run.request.request_id: run for run in runs}
    assert by_id["g"].stats.draft_tokens > 0 and by_id["s"].stats.draft_tokens == 0
    assert {rid: run.output_ids for rid, run in by_id.items()} == plain
