"""Round 64 audit of the model-state and exactness core: behaviours that no other test pinned,
each found by planting a realistic bug that the suite let through (scripts/mutation_check.py,
group audit64b). Every test asserts exact tokens, exact states or exact page counts."""
from __future__ import annotations

import json

import pytest
import torch

import fixtures
from blockspec.loader import load_draft, load_model
from blockspec.sampling import SamplingParams, sample, sample_rows

from helpers import OracleDraft, make_engine, make_request, run_alone, run_batch

SHORT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target)


# ---- sampling: a row's draw depends on nothing else in the batch ------------------------------

def test_rows_differing_only_in_top_k_are_each_drawn_with_their_own_filter():
    """sample_rows shapes rows that share their filters together; two rows with the same
    temperature but different top_k must not share one: each row's token is what the per-row
    sampler draws from its own generator (a batch-dependent draw otherwise)."""
    logits = 4 * torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, seed=0), SamplingParams(temperature=0.7, top_k=1, seed=0),
              SamplingParams(temperature=0.7, top_k=5, seed=0)]
    for seed in range(8):
        generators = [torch.Generator().manual_seed(seed + 100 * i) for i in range(3)]
        twins = [torch.Generator().manual_seed(seed + 100 * i) for i in range(3)]
        got = sample_rows(logits, params, generators).tolist()
        expected = [int(sample(logits[i], params[i], twins[i])) for i in range(3)]
        assert got == expected, seed
        assert got[1] == int(logits[1].argmax())           # top_k = 1 is greedy whatever the noise


# ---- paged K/V: every position a sequence writes lies in a page of its own --------------------

def test_pages_cover_every_written_position_and_batched_sequences_never_share_one(dense):
    """Two prompts of one length decode together on pages of 16: after every step each running
    sequence's block table covers all the positions it has cached, holds no page twice and not the
    padding page 0, no page belongs to both; and each output equals its request alone."""
    target, _ = dense
    page_size = 16
    prompts = {"a": [11, 22, 33, 44, 55], "b": [66, 77, 88, 99, 111]}

    def requests():
        return [make_request(rid, prompt, max_tokens=20) for rid, prompt in prompts.items()]
    alone = {r.request_id: run_alone(lambda: make_engine(target, page_size=page_size), r).output_ids for r in requests()}
    engine = make_engine(target, page_size=page_size)
    batch = requests()
    for request in batch:
        engine.submit(request, lambda event: None)
    while not all(r.is_finished for r in batch):
        engine.step()
        owners: dict[int, str] = {}
        for seq in engine.scheduler.running:
            table = seq.block_table
            assert len(table) * page_size >= seq.num_cached, (seq.request_id, len(table), seq.num_cached)
            assert 0 not in table and len(set(table)) == len(table)
            for page in table:
                assert owners.setdefault(page, seq.request_id) == seq.request_id, page
    assert [(r.finish_reason, len(r.output_ids)) for r in batch] == [("length", 20)] * 2   # not an error
    assert {r.request_id: r.output_ids for r in batch} == alone
    assert engine.cache.usage == 0.0


# ---- sampled DFlash: the draft's draws come from the request's own generator -------------------

def test_a_seeded_sampled_dflash_request_repeats_alone_and_in_a_batch(dense):
    """With a draft that is often right (so drafts are accepted and their draws matter), a seeded
    sampling request gives the same tokens on every run, alone or beside other seeded requests:
    the drafts, the acceptance coins and the residual draws all come from its generator."""
    from test_dflash import dflash_engine, plain
    target, draft = dense
    reference = plain(target, SHORT, max_tokens=14).output_ids
    # At temperature 0.5 the sampled output follows the greedy one for a while, and q gives the
    # oracle's token ≈ 0.7 (e^{6.5/0.5} against the flat rest): which draft is drawn matters.
    oracle = OracleDraft(draft, SHORT + reference, sharpness=6.5)
    params = dict(max_tokens=14, temperature=0.5, top_k=4)

    def request(rid: str, seed: int):
        return make_request(rid, SHORT, **params, seed=seed)
    first = run_alone(lambda: dflash_engine(target, oracle, 4), request("x", 7)).request
    again = run_alone(lambda: dflash_engine(target, oracle, 4), request("x", 7)).request
    assert first.stats.accepted_tokens > 0                   # drafts were accepted: they were judged
    assert again.output_ids == first.output_ids
    _, runs = run_batch(lambda: dflash_engine(target, oracle, 4),
                        [request("y", 1), request("x", 7)])
    assert {run.request.request_id: run.output_ids for run in runs}["x"] == first.output_ids


# ---- the DFlash draft: slot i of the block proposes d_i ------------------------------------------

def test_the_drafts_are_read_from_the_mask_slots_not_the_anchor(dense, qwen3_draft_dir):
    """A block is [anchor, MASK × (T − 1)]: slot 0 holds the anchor (already committed), slot i
    proposes d_i. propose's logits are the target head over the published architecture's
    hidden states of slots 1 … T − 1."""
    from safetensors.torch import load_file
    from test_dflash import add_context, draft_metadata, draft_pool, reference_draft_forward
    target, draft = dense
    weights = load_file(str(qwen3_draft_dir / "model.safetensors"))
    config = json.loads((qwen3_draft_dir / "config.json").read_text())
    features = torch.randn(12, 2 * 64, generator=torch.Generator().manual_seed(3))
    block = torch.tensor([9707] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7)
    pool, tables = draft_pool(draft, 32)
    with torch.no_grad():
        embeds = target.embed(block)
        add_context(draft, pool, tables[0], features, 0)
        meta = draft_metadata(pool, tables, [12], 8)
        hidden = draft(embeds, meta.positions, meta).view(1, 8, -1)
        logits = draft.propose(hidden, block[:1], target.lm_head)
        expected = target.lm_head(reference_draft_forward(weights, config, features, embeds)[1:])
    assert logits.shape == (1, 7, target.config.vocab_size)
    assert torch.allclose(logits[0], expected, atol=1e-3, rtol=1e-3)


# ---- hybrid targets: a prefill group's padding rows are inert ----------------------------------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = fixtures.write_hybrid_checkpoint(tmp_path_factory.mktemp("audit64-hybrid") / "target")
    return load_model(str(path)).model


def states_after_prefill(target, prompts: dict[str, list[int]]) -> dict[str, list[torch.Tensor]]:
    """Each request's recurrent state (every GDN layer's SSM state and conv window) right after
    the one step that prefills all of them together."""
    engine = make_engine(target)
    for rid, prompt in prompts.items():
        engine.submit(make_request(rid, prompt, max_tokens=4), lambda event: None)
    engine.step()
    seqs = engine.scheduler.running
    assert sorted((seq.request_id, seq.num_cached) for seq in seqs) == sorted((r, len(p)) for r, p in prompts.items())
    pool = engine.runner.states
    return {seq.request_id: [t[seq.state_slot].clone() for t in pool.ssm + pool.conv] for seq in seqs}


def test_a_short_prompt_prefilled_beside_a_long_one_keeps_its_own_recurrent_state(hybrid):
    """A prefill group is padded to its longest chunk; the padding rows after a short prompt must
    neither write (β = 0) nor decay (g = 0) its state. Greedy tokens of the tiny hybrid barely
    depend on a decayed state, so the state itself is compared with the prompt's alone."""
    gen = torch.Generator().manual_seed(1)
    prompts = {"short": torch.randint(0, 255, (5,), generator=gen).tolist(),
               "long": torch.randint(0, 255, (16,), generator=gen).tolist()}   # one step prefills both
    together = states_after_prefill(hybrid, prompts)
    for rid, prompt in prompts.items():
        alone = states_after_prefill(hybrid, {rid: prompt})[rid]
        for got, expected in zip(together[rid], alone, strict=True):
            scale = float(expected.abs().max())
            assert scale > 0.01                                 # a state worth comparing
            assert float((got - expected).abs().max()) <= 1e-4 * scale, rid


def states_after_steps(target, steps: list[dict[str, list[int]]]) -> dict[str, list[torch.Tensor]]:
    """Each request's recurrent state after the engine runs one step per entry of `steps`, the
    entry's requests submitted just before it (the others keep decoding greedily)."""
    engine = make_engine(target)
    for arrivals in steps:
        for rid, prompt in arrivals.items():
            engine.submit(make_request(rid, prompt, max_tokens=8), lambda event: None)
        engine.step()
    pool = engine.runner.states
    return {seq.request_id: [t[seq.state_slot].clone() for t in pool.ssm + pool.conv]
            for seq in engine.scheduler.running}


def test_a_prefill_chunk_beside_decoding_rows_keeps_both_states_exact(hybrid):
    """One step whose batch holds a prompt's chunk (the prefill group) and another sequence's
    decode row (the decode group): each group's rows are its own (their offsets, their slots),
    so both states are the ones each request reaches alone. tests/test_gdn_interpreter.py runs
    this through the step kernel, where each group's row offsets are made once a forward."""
    gen = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 255, (n,), generator=gen).tolist() for n in (7, 5))
    mixed = states_after_steps(hybrid, [{"first": first}, {}, {"second": second}])   # step 3 is mixed
    alone_first = states_after_steps(hybrid, [{"first": first}, {}, {}])
    alone_second = states_after_steps(hybrid, [{"second": second}])
    for rid, alone in (("first", alone_first), ("second", alone_second)):
        for got, expected in zip(mixed[rid], alone[rid], strict=True):
            scale = float(expected.abs().max())
            assert scale > 0.01                                 # a state worth comparing
            assert float((got - expected).abs().max()) <= 1e-4 * scale, rid
