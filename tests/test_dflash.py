"""DFlash decoding: lossless at every block size, exact bookkeeping at every edge."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, chi2_contingency

from blockspec.cache import KVPool
from blockspec.config import ConfigError
from blockspec.engine.request import Request
from blockspec.layers import AttentionMetadata
from blockspec.llm import LLM
from blockspec.loader import LoadError, load_draft, load_model
from blockspec.models.dflash import default_target_layer_ids
from blockspec.sampling import SamplingParams, rejection_sample

import fixtures
from helpers import (ForwardCounter, OneSequence, OracleDraft, graph_shaped, make_engine, padded, run_alone, run_batch,
                     run_until_done, submit)

STOPS = frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID})
SHORT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
LONG = [int(t) for t in torch.randint(0, 151643, (270,), generator=torch.Generator().manual_seed(5))]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def pairs(qwen3_dir, qwen3_draft_dir, llama_dir, llama_draft_dir):
    out = {}
    for kind, (t, d) in {"qwen3": (qwen3_dir, qwen3_draft_dir), "llama": (llama_dir, llama_draft_dir)}.items():
        target = load_model(str(t)).model
        out[kind] = (target, load_draft(str(d), target))
    return out


def make_request(prompt, stops=STOPS, max_model_len=MAX_MODEL_LEN, request_id="r", **params) -> Request:
    params.setdefault("max_tokens", 40)
    return Request(request_id, prompt, SamplingParams(**params), stops, max_model_len)


def plain(target, prompt, **params) -> Request:
    return run_alone(lambda: make_engine(target), make_request(prompt, **params)).request


def dflash_engine(target, draft, block_size=None, **config):
    block_size = block_size or draft.block_size
    engine = make_engine(target, draft, block_size=block_size, **config)
    if isinstance(draft, OracleDraft):
        draft.bind(engine)
    return engine


def dflash(target, draft, prompt, block_size=None, **params) -> Request:
    """One request alone on a DFlash engine; its events carry exactly its output, one finishes."""
    return run_alone(lambda: dflash_engine(target, draft, block_size), make_request(prompt, **params)).request


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_greedy_dflash_equals_plain_at_every_block_size(pairs, kind, prompt):
    target, draft = pairs[kind]
    reference = plain(target, prompt).output_ids
    for block_size in (1, 2, 4, 8, 16):
        request = dflash(target, draft, prompt, block_size)
        assert request.output_ids == reference, f"block size {block_size}"
        assert request.finish_reason == "length"
        assert sum(request.stats.acceptance_lengths) == len(reference) - 1


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_oracle_draft_accepts_whole_blocks(pairs, block_size):
    target, draft = pairs["qwen3"]
    max_tokens = 37
    reference = plain(target, LONG, max_tokens=max_tokens).output_ids
    oracle = OracleDraft(draft, LONG + reference)
    request = dflash(target, oracle, LONG, block_size, max_tokens=max_tokens)
    assert request.output_ids == reference
    lengths = request.stats.acceptance_lengths
    # The first token comes from prefill; then full blocks until max_tokens shortens the last.
    remaining, expected = max_tokens - 1, []
    while remaining:
        expected.append(min(block_size, remaining))
        remaining -= expected[-1]
    assert lengths == expected
    assert request.stats.accepted_tokens == sum(lengths) - len(lengths)
    assert request.stats.draft_tokens == sum(n - 1 for n in lengths)
    # One draft forward per cycle (engine v2 drafts a full block every cycle, also when a single
    # token is still allowed; the old loop skipped the draft then — never the case here).
    assert oracle.calls == request.stats.cycles == len(lengths)


@pytest.mark.parametrize("stop_at", [1, 3, 6, 7, 8, 13])
def test_stop_id_inside_an_accepted_block_ends_right_after_it(pairs, stop_at):
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=30).output_ids
    stop_token = reference[stop_at]
    first = reference.index(stop_token)        # the first occurrence ends generation
    stops = STOPS | {stop_token}
    expected = reference[: first + 1]
    for drafter in (draft, OracleDraft(draft, SHORT + reference)):
        request = dflash(target, drafter, SHORT, 8, max_tokens=30, stops=stops)
        assert request.output_ids == expected
        assert request.finish_reason == "stop"
        assert request.stats.output_tokens == len(expected)
        assert sum(request.stats.acceptance_lengths) == len(expected) - 1
        # acceptance length = accepted + 1 on every cycle, the one cut by the stop id included
        stats = request.stats
        assert stats.accepted_tokens == sum(stats.acceptance_lengths) - stats.cycles
    plain_request = plain(target, SHORT, max_tokens=30, stops=stops)
    assert plain_request.output_ids == expected and plain_request.finish_reason == "stop"



def first_occurrences(tokens: list[int]) -> dict[int, int]:
    """Each token's first index in tokens."""
    first: dict[int, int] = {}
    for i, token in enumerate(tokens):
        first.setdefault(token, i)
    return first


def test_the_first_of_two_stop_ids_in_one_accepted_block_ends_it(pairs):
    """Two different stop ids inside one block (the oracle accepts whole blocks of 8: output
    1 … 8 is the first cycle's): the output ends at the first, the second is never emitted."""
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=30).output_ids
    first = first_occurrences(reference)
    inside = sorted(i for token, i in first.items() if 1 <= i <= 8)
    assert len(inside) >= 2, reference
    early, late = inside[0], inside[-1]
    stops = STOPS | {reference[early], reference[late]}
    expected = reference[: early + 1]
    for drafter in (draft, OracleDraft(draft, SHORT + reference)):
        request = dflash(target, drafter, SHORT, 8, max_tokens=30, stops=stops)
        assert request.output_ids == expected and request.finish_reason == "stop"
        assert request.stats.output_tokens == len(expected)
    assert plain(target, SHORT, max_tokens=30, stops=stops).output_ids == expected


@pytest.mark.parametrize("stop_at", [1, 5, 8, 9])
def test_a_stop_id_that_is_the_last_allowed_token_finishes_with_stop(pairs, stop_at):
    """max_tokens ends the output exactly at a stop id: the model stopped, the reason is stop
    (a stop id inside the block, at its end and in the next cycle's first slot)."""
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=30).output_ids
    index = first_occurrences(reference)[reference[stop_at]]
    stops = STOPS | {reference[index]}
    expected = reference[: index + 1]
    for drafter in (None, draft, OracleDraft(draft, SHORT + reference)):
        request = (plain(target, SHORT, max_tokens=index + 1, stops=stops) if drafter is None else
                   dflash(target, drafter, SHORT, 8, max_tokens=index + 1, stops=stops))
        assert request.output_ids == expected and request.finish_reason == "stop"
    # one token short of it: the limit, not the stop id, ends the output
    assert dflash(target, draft, SHORT, 8, max_tokens=index, stops=stops).finish_reason == "length"


def test_logprobs_are_cut_with_the_tokens_at_a_stop_id_inside_a_block(pairs):
    """A request asking for logprobs: a stop id inside an accepted block cuts its logprobs with
    its tokens (one per emitted token, none for the drafts after the stop)."""
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=30).output_ids
    index = first_occurrences(reference)[reference[3]]
    stops = STOPS | {reference[index]}
    for drafter in (draft, OracleDraft(draft, SHORT + reference)):
        request = make_request(SHORT, max_tokens=30, stops=stops)
        request.num_logprobs = 1
        run = run_alone(lambda: dflash_engine(target, drafter, 8), request)
        assert request.output_ids == reference[: index + 1] and request.finish_reason == "stop"
        assert [lp.token_id for lp in request.output_logprobs] == request.output_ids
        streamed = [lp for event in run.events for lp in event.logprobs or []]
        assert streamed == request.output_logprobs


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 8, 9])
def test_max_tokens_is_exact(pairs, max_tokens):
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=20).output_ids
    oracle = OracleDraft(draft, SHORT + reference)
    for drafter in (draft, oracle):
        request = dflash(target, drafter, SHORT, 8, max_tokens=max_tokens)
        assert request.output_ids == reference[:max_tokens]
        assert request.finish_reason == "length"
        lengths = request.stats.acceptance_lengths
        assert sum(lengths) == max_tokens - 1 and len(lengths) == request.stats.cycles
    # the oracle's blocks are whole until max_tokens cuts the last one: 8 per cycle, then the rest
    assert lengths == [8] * ((max_tokens - 1) // 8) + ([(max_tokens - 1) % 8] if (max_tokens - 1) % 8 else [])



def test_context_limit_ends_the_request(pairs):
    target, draft = pairs["qwen3"]
    limit = len(SHORT) + 11
    request = make_request(SHORT, max_tokens=100, max_model_len=limit)
    run_alone(lambda: dflash_engine(target, draft, 8), request)
    assert len(request.output_ids) == 11 and request.finish_reason == "length"
    assert request.output_ids == plain(target, SHORT, max_tokens=11).output_ids


def test_block_size_cannot_exceed_the_drafts(qwen3_dir, qwen3_draft_dir):
    """Engine v2 refuses it when configuring (the old loop silently clamped to the draft's 16)."""
    with pytest.raises(ConfigError, match="--block-size 64 exceeds the draft's block size 16"):
        LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=64, show_progress=False)


def test_closing_the_stream_stops_compute_and_the_next_request_is_exact(pairs, qwen3_dir, qwen3_draft_dir):
    reference = plain(pairs["qwen3"][0], LONG, max_tokens=40).output_ids     # the same weights, loaded apart
    llm = LLM(str(qwen3_dir), draft=str(qwen3_draft_dir), block_size=4, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=4, show_progress=False)
    counter_t, counter_d = ForwardCounter(llm.target), ForwardCounter(llm.draft)
    try:
        request = llm.make_request("closed", SHORT, SamplingParams(max_tokens=200))
        events = llm.stream(request)
        for _ in range(3):
            next(events)
        before = (counter_t.count, counter_d.count, llm.engine.runner.num_forwards)
        assert before[0] > 0 and before[1] > 0
        events.close()                              # the consumer goes away
        assert request.is_aborted
        with pytest.raises(StopIteration):
            next(events)
        llm.engine.step()                           # the next step drops it before any compute
        assert (counter_t.count, counter_d.count, llm.engine.runner.num_forwards) == before
        assert request.finish_reason == "abort" and not llm.engine.has_work
        assert llm.engine.cache.usage == 0.0            # its pages went back
    finally:
        counter_t.handle.remove(), counter_d.handle.remove()
    assert llm.generate_ids(LONG, SamplingParams(max_tokens=40)).token_ids == reference


def test_abort_flag_stops_within_one_cycle(pairs):
    target, draft = pairs["qwen3"]
    counter = ForwardCounter(target)
    try:
        engine = dflash_engine(target, draft, 4)
        run = submit(engine, make_request(SHORT, max_tokens=200))
        while len(run.events) < 2:
            engine.step()
        run.request.abort()
        before = counter.count
        run_until_done(engine, [run])
        assert counter.count == before               # no verify after the flag was seen
        assert run.events[-1].finish_reason == "abort" and run.request.finish_reason == "abort"
        run.check_events()
        assert engine.cache.usage == 0.0
    finally:
        counter.handle.remove()


# ---- sampling ---------------------------------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    """Fixed p and q on 6 tokens: the first emitted token is distributed exactly as p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03], [1 / 6] * 6])
    q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10]])
    draws = 100_000
    counts = np.zeros(6)
    drafts = torch.multinomial(q[0], draws, replacement=True, generator=gen)
    accepted = 0
    for d in drafts.tolist():
        a, bonus = rejection_sample(torch.tensor([d]), p, q, gen)
        counts[d if a == 1 else bonus] += 1
        accepted += a
    expected = p[0].double().numpy()
    assert chisquare(counts, expected / expected.sum() * counts.sum()).pvalue > 1e-3
    # acceptance rate is Σ min(p, q)
    assert abs(accepted / draws - float(torch.minimum(p[0], q[0]).sum())) < 0.01



def test_sampled_dflash_matches_plain_token_distribution(pairs):
    """At temperature 1 (top-k 4), DFlash's tokens at positions 1-3 follow plain sampling's.
    Block size 3: positions 1 and 2 are drafts (accepted or resampled from the residual) and
    position 3 is the bonus after a whole block, or the next cycle's first token. Every run is its
    own seeded request; they run as one batch per engine (each request keeps its own generator,
    so a batch is many independent runs). Three tests at p < 1e-3: a false alarm in ~1 of 330."""
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=4).output_ids
    oracle = OracleDraft(draft, SHORT + reference, sharpness=2.0)   # right often, not always
    params = dict(max_tokens=4, temperature=1.0, top_k=4)
    runs = 160

    def outputs(factory, seed0):
        requests = [make_request(SHORT, request_id=f"s{s}", seed=seed0 + s, **params) for s in range(runs)]
        _, done = run_batch(factory, requests)
        return [tuple(r.output_ids[1:4]) for r in done]

    plain_out = outputs(lambda: make_engine(target, max_num_seqs=runs), 0)
    spec_out = outputs(lambda: dflash_engine(target, oracle, 3, max_num_seqs=runs), 10_000)
    assert oracle.calls > 0
    for position in (0, 1, 2):
        a = [o[position] for o in plain_out]
        b = [o[position] for o in spec_out]
        support = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in support], [b.count(t) for t in support]])
        table = table[:, table.sum(0) >= 5]
        assert chi2_contingency(table).pvalue > 1e-3


def test_same_seed_same_output_under_dflash(pairs):
    target, draft = pairs["qwen3"]
    outputs = [dflash(target, draft, SHORT, 8, temperature=0.8, seed=s).output_ids for s in (3, 3, 4)]
    assert outputs[0] == outputs[1] != outputs[2]


# ---- the draft itself -------------------------------------------------------------------

def reference_draft_forward(weights: dict, config: dict, features: torch.Tensor, block_embeds: torch.Tensor,
                            context_start: int = 0) -> torch.Tensor:
    """The published DFlash draft architecture written out directly from the z-lab-format
    weights, without a cache: every block slot attends to all context and all block positions."""
    eps, heads, kv_heads, hd = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def rms(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, h, d]
        inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    ctx = rms(features @ weights["fc.weight"].T, weights["hidden_norm.weight"])     # [C, H]
    num_ctx, num_blk = ctx.shape[0], block_embeds.shape[0]
    pos = torch.arange(context_start, context_start + num_ctx + num_blk)
    x = block_embeds
    for i in range(config["num_hidden_layers"]):
        w = {k[len(f"layers.{i}."):]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rope(rms((h @ w["self_attn.q_proj.weight"].T).view(num_blk, heads, hd), w["self_attn.q_norm.weight"]), pos[num_ctx:])
        kv_in = torch.cat((ctx, h))
        k = rope(rms((kv_in @ w["self_attn.k_proj.weight"].T).view(-1, kv_heads, hd), w["self_attn.k_norm.weight"]), pos)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(-1, kv_heads, hd)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5, dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(num_blk, heads * hd)
        x = x + o @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms(x, weights["norm.weight"])



def draft_pool(draft, capacity: int, page_size: int = 8, num_seqs: int = 1):
    """A draft K/V pool holding num_seqs sequences of `capacity` positions, pages 1… in order."""
    pages_per_seq = -(-capacity // page_size)
    pool = KVPool(draft.config.num_hidden_layers, (num_seqs * pages_per_seq + 1) * page_size,
                  draft.config.num_key_value_heads, draft.config.head_dim, torch.float32, torch.device("cpu"))
    tables = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(num_seqs)]
    return pool, tables


def add_context(draft, pool, table, features, start, page_size=8):
    """Features [C, K·H] of positions start … start + C − 1 into the draft's pool."""
    positions = torch.arange(start, start + features.shape[0])
    slots = torch.tensor(table)[positions // page_size] * page_size + positions % page_size
    draft.append_context(features, positions, slots, pool.layers)


def draft_metadata(pool, tables, context_lens, width, page_size=8):
    """A propose forward's metadata: each block sits right after its committed context."""
    positions = torch.cat([torch.arange(c, c + width) for c in context_lens])
    table = torch.tensor(tables)
    slots = table.repeat_interleave(width, 0).gather(1, (positions // page_size)[:, None])[:, 0] * page_size \
        + positions % page_size
    return AttentionMetadata(num_seqs=len(tables), width=width, input_ids=torch.zeros_like(positions),
                             positions=positions, slot_mapping=slots,
                             block_tables=table, context_lens=torch.tensor(context_lens),
                             max_context_len=max(context_lens) + width, page_size=page_size, kv=pool.layers)


def test_draft_forward_matches_the_published_architecture(pairs, qwen3_draft_dir):
    """Two sequences in one draft forward (different context lengths, different blocks), each
    against the architecture written out directly; context arrives in parts, as in decoding."""
    from safetensors.torch import load_file
    target, draft = pairs["qwen3"]
    weights = load_file(str(qwen3_draft_dir / "model.safetensors"))
    config = json.loads((qwen3_draft_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    features = [torch.randn(30, 2 * 64, generator=gen), torch.randn(13, 2 * 64, generator=gen)]
    blocks = torch.tensor([[77091] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7,
                           [9707] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7])
    pool, tables = draft_pool(draft, 64, num_seqs=2)
    with torch.no_grad():
        embeds = target.embed(blocks.view(-1))
        # sequence 0: a prefill's context, a draft, then one verify's context
        add_context(draft, pool, tables[0], features[0][:20], 0)
        draft(embeds[:8], torch.arange(20, 28), draft_metadata(pool, tables[:1], [20], 8))
        add_context(draft, pool, tables[0], features[0][20:], 20)
        add_context(draft, pool, tables[1], features[1], 0)
        meta = draft_metadata(pool, tables, [30, 13], 8)
        got = draft(embeds, meta.positions, meta).view(2, 8, -1)
        expected = [reference_draft_forward(weights, config, features[b], embeds.view(2, 8, -1)[b]) for b in (0, 1)]
    for b in (0, 1):
        assert torch.allclose(got[b], expected[b], atol=1e-4, rtol=1e-4), b
    # context K/V kept in the pool, block K/V never written (its slots are still zero)
    k_pool = pool.layers[0][0]
    slots = lambda table, lo, hi: [table[p // 8] * 8 + p % 8 for p in range(lo, hi)]   # noqa: E731
    assert k_pool[slots(tables[0], 0, 30)].abs().amin(dim=(1, 2)).gt(0).all()
    assert k_pool[slots(tables[0], 30, 38)].eq(0).all() and k_pool[slots(tables[1], 13, 21)].eq(0).all()


def test_the_draft_sees_exactly_the_committed_context(pairs):
    """In every propose of a batch, each block's anchor sits right after its sequence's committed
    context (the draft pool's valid positions), and the block's positions are consecutive."""
    target, draft = pairs["qwen3"]
    seen = []

    def spy(_module, args):
        _, positions, meta = args
        seen.append((meta.query_positions.clone(), meta.context_lens.clone(), meta.num_seqs))
    handle = draft.register_forward_pre_hook(spy)
    try:
        requests = [make_request(SHORT, request_id="a", max_tokens=12),
                    make_request(LONG[:40], request_id="b", max_tokens=9)]
        run_batch(lambda: dflash_engine(target, draft, 4), requests)
    finally:
        handle.remove()
    assert max(num for _, _, num in seen) == 2
    for query_positions, context_lens, _ in seen:
        assert torch.equal(query_positions[:, 0], context_lens)
        assert torch.equal(query_positions - query_positions[:, :1], torch.arange(4).expand_as(query_positions))
    # the first propose of a sequence sees its whole prompt
    contexts = {int(n) for _, context_lens, _ in seen for n in context_lens}
    assert {len(SHORT), 40} <= contexts


def test_draft_config_is_read_as_zlab_writes_it(qwen3_draft_dir, pairs):
    target, draft = pairs["qwen3"]
    assert draft.mask_token_id == 151669
    assert draft.target_layer_ids == (0, 2)
    assert draft.block_size == 16
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]      # Qwen3-8B's published ids
    assert default_target_layer_ids(28, 1) == [14]
    # targets too shallow for the rule (bench --layers 2): every id a real layer, never negative
    assert default_target_layer_ids(2, 2) == [1, 1] and default_target_layer_ids(1, 3) == [0, 0, 0]



def test_sliding_window_draft_layers_are_causal_and_windowed(tmp_path, qwen3_dir, pairs):
    target, _ = pairs["qwen3"]
    path = fixtures.write_dflash_draft(tmp_path / "swa", qwen3_dir, num_layers=2,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    draft = load_draft(str(path), target)
    assert draft.layers[0].self_attn.is_causal and draft.layers[0].self_attn.window == 4
    assert not draft.layers[1].self_attn.is_causal and draft.layers[1].self_attn.window is None
    feats = torch.randn(10, 128, generator=torch.Generator().manual_seed(1))
    pool, tables = draft_pool(draft, 32)
    add_context(draft, pool, tables[0], feats, 0)
    meta = draft_metadata(pool, tables, [10], 4)
    rope = draft.rotary_emb(meta.positions, torch.float32)

    def layer0(ids):
        with torch.no_grad():
            return draft.layers[0](target.embed(torch.tensor(ids)), rope, meta)

    # Causal first layer: changing a later block slot must not change an earlier slot's layer-0 output.
    out, other = layer0([100, 200, 300, 400]), layer0([100, 200, 300, 999])
    assert torch.equal(out[:3], other[:3]) and not torch.equal(out[3], other[3])
    # Windowed: block slot 0 (position 10) sees context positions 7…9 only: changing position 6 does not
    # change its output, changing position 9 does.
    for position, changes_slot0 in ((6, False), (9, True)):
        moved = feats.clone()
        moved[position] += 1.0
        add_context(draft, pool, tables[0], moved, 0)
        out_moved = layer0([100, 200, 300, 400])
        assert torch.equal(out_moved[0], out[0]) != changes_slot0, position
        add_context(draft, pool, tables[0], feats, 0)
    reference = plain(target, SHORT).output_ids
    assert dflash(target, draft, SHORT, 8).output_ids == reference


def test_draft_that_does_not_fit_the_target_is_refused(tmp_path, qwen3_dir, pairs):
    target, _ = pairs["qwen3"]
    path = fixtures.write_dflash_draft(tmp_path / "bad", qwen3_dir, target_layer_ids=[0, 9])
    with pytest.raises(LoadError, match="target_layer_ids"):
        load_draft(str(path), target)


def test_graph_shaped_runs_equal_eager(pairs):
    """What CUDA graphs replay — batches padded with rows at page 0, keys gathered over the whole
    per-sequence capacity — equals the eager metadata: the target through prefill, verify blocks
    and decode steps, the draft through contexts arriving in pieces. (Engine v2 has no separate
    static runners; the graph path is the same forward under graph-shaped metadata.)"""
    target, draft = pairs["qwen3"]
    ids = LONG[:60]
    eager = OneSequence(target, 128, page_size=8, capture_layers=draft.target_layer_ids)
    shaped = OneSequence(target, 128, page_size=8, capture_layers=draft.target_layer_ids)
    for lo, hi in ((0, 40), (40, 48), (48, 49), (49, 57), (57, 60)):
        expected, expected_features = eager.forward(ids[lo:hi], keep_steps=hi - lo > 1)
        got, features = shaped.forward(ids[lo:hi], keep_steps=hi - lo > 1, shape=graph_shaped(4))
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5), (lo, hi)
        assert torch.allclose(features, expected_features, atol=1e-5, rtol=1e-5), (lo, hi)
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randn(n, 128, generator=gen) for n in (20, 3, 1, 8, 5)]
    block = target.embed(torch.tensor([77091] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7))
    pool, tables = draft_pool(draft, 256)
    padded_pool, _ = draft_pool(draft, 256)
    start = 0
    with torch.no_grad():
        for context in contexts:
            add_context(draft, pool, tables[0], context, start)
            add_context(draft, padded_pool, tables[0], context, start)
            start += context.shape[0]
            meta = draft_metadata(pool, tables, [start], 8)
            expected = draft(block, meta.positions, meta)
            shaped_meta = graph_shaped(4)(draft_metadata(padded_pool, tables, [start], 8))
            got = draft(torch.cat((block, torch.zeros(24, block.shape[1]))), shaped_meta.positions, shaped_meta)[:8]
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), start
    assert start == 37


def test_padded_graph_path_decodes_like_eager(pairs):
    """The engine's CUDA-graph path (ModelRunner.make_graphs), run eagerly on the CPU: batches
    padded to a captured size, keys gathered to a fixed bucket, drafts written into the static
    input ids between propose and verify. It decodes exactly like the eager path."""
    target, draft = pairs["qwen3"]
    reference = plain(target, LONG, max_tokens=30).output_ids
    engine = padded(make_engine(target))
    assert run_alone(lambda: engine, make_request(LONG, max_tokens=30)).output_ids == reference
    assert engine.runner.graphs.full                          # the padded path really ran
    for block_size in (2, 8):
        oracle = OracleDraft(draft, LONG + reference)
        engine = padded(dflash_engine(target, oracle, block_size))
        request = run_alone(lambda: engine, make_request(LONG, max_tokens=30)).request
        assert request.output_ids == reference
        assert set(request.stats.acceptance_lengths[:-1]) == {block_size}
        assert {keys for _, _, keys in engine.runner.graphs.full} == {512}    # 270 + 30 keys → bucket 512
        real = run_alone(lambda: padded(dflash_engine(target, draft, block_size)), make_request(LONG, max_tokens=30))
        assert real.output_ids == reference


def test_context_features_are_transformers_hidden_states_of_the_layer_ids(pairs, qwen3_dir):
    """target_layer_ids mean "output of decoder layer l" = transformers' hidden_states[l + 1];
    an off-by-one here silently lowers acceptance while staying lossless, so pin it."""
    from transformers import AutoModelForCausalLM
    target, draft = pairs["qwen3"]
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    ids = torch.tensor([LONG[:40]])
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states
    _, ours = OneSequence(target, 64, capture_layers=draft.target_layer_ids).forward(ids[0])
    expected = torch.cat([hidden[layer + 1][0] for layer in draft.target_layer_ids], dim=-1)
    assert draft.target_layer_ids == (0, 2)
    assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-4)
    # and the engine's runner captures exactly these layers for the draft
    engine = dflash_engine(target, draft, 4)
    assert engine.runner.capture_layers == (0, 2)
