"""Hybrid targets (Qwen3.5, Qwen3-Next): agreement with transformers, GDN kernels, exact rollback.

Checkpoints are tiny random models written by transformers' own save_pretrained (fp32, CPU).
The multimodal layout is a real Qwen3_5ForConditionalGeneration with a tiny vision tower, saved
by transformers, plus dummy `mtp.*` tensors added to its safetensors file (released checkpoints
carry them; transformers drops them on load, and so must we).
"""
from __future__ import annotations

import copy
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.loader import load_model
from blockspec.models.gated_delta import (chunk_gated_delta_rule, recurrent_gated_delta_rule,
                                          select_kernels)
from blockspec.models.qwen3_5 import HybridConfig

import fixtures
from helpers import OneSequence, OracleDraft, graph_shaped

VOCAB = fixtures.HYBRID_VOCAB
TEXT = fixtures.HYBRID_TEXT
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def randomise(model: torch.nn.Module) -> None:
    """Move every weight off its init (zero-centred norms start at 0, gated norms at 1, which
    would hide a wrong norm) and sharpen the logits so greedy choices are clear-cut."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
        model.get_decoder().norm.weight.add_(8.0)


def hf_model(kind: str):
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)
    torch.manual_seed(0)
    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT))
    if kind == "qwen3_5_mm":
        config = Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)
        return Qwen3_5ForConditionalGeneration(config)
    if kind == "qwen3_next":
        return Qwen3NextForCausalLM(Qwen3NextConfig(**TEXT, num_experts=0))
    raise ValueError(kind)


def add_mtp_tensors(directory: Path) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors["mtp.fc.weight"] = torch.randn(32, 64)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(32)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """kind → (transformers model, our model loaded from its checkpoint)."""
    root = tmp_path_factory.mktemp("hybrid")
    pairs = {}
    for kind in ("qwen3_5", "qwen3_5_mm", "qwen3_next"):
        ref = hf_model(kind)
        randomise(ref)
        ref.save_pretrained(root / kind)
        if kind == "qwen3_5_mm":
            add_mtp_tensors(root / kind)
        ours = load_model(str(root / kind), device="cpu", dtype="float32").model
        pairs[kind] = (ref.eval(), ours)
    return pairs


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def prefill(model, ids: torch.Tensor, max_len: int = 512, page_size: int = 16):
    """A fresh sequence that has seen ids [1, L]: (the sequence, logits [L, V])."""
    seq = OneSequence(model, max_len, page_size=page_size)
    return seq, seq.forward(ids[0])[0]


# ── agreement with transformers ────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_mm", "qwen3_next"])
def test_logits_and_features_match_transformers(hybrids, kind):
    ref, ours = hybrids[kind]
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True)
    logits, features = OneSequence(ours, 256, capture_layers=(0, 2)).forward(ids[0])
    assert relative_error(logits, expected.logits[0]) < 1e-4
    expected_features = torch.cat((expected.hidden_states[1], expected.hidden_states[3]), dim=-1)[0]
    assert relative_error(features, expected_features) < 1e-4


def test_multimodal_layout_config(hybrids):
    _, ours = hybrids["qwen3_5_mm"]
    assert ours.config.tie_word_embeddings                 # from the outer config, not text_config
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.config.layer_types == tuple(TEXT["layer_types"])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_prefill_then_decode_equals_one_forward(hybrids, kind):
    _, ours = hybrids[kind]
    ids = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    _, full = prefill(ours, ids)
    seq, first = prefill(ours, ids[:, :70], page_size=8)
    steps = [seq.forward(ids[0, t:t + 1])[0] for t in range(70, 90)]
    assert relative_error(torch.cat([first, *steps]), full) < 1e-5


def greedy(model, prompt: list[int], num_new: int) -> list[int]:
    seq = OneSequence(model, len(prompt) + num_new)
    logits, _ = seq.forward(prompt)
    tokens = []
    for _ in range(num_new):
        tokens.append(int(logits[-1].argmax()))
        logits, _ = seq.forward([tokens[-1]])
    return tokens


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_greedy_matches_transformers_generate(hybrids, kind):
    ref, ours = hybrids[kind]
    gen = torch.Generator().manual_seed(3)
    for length in (5, 37, 300):
        prompt = torch.randint(0, VOCAB, (1, length), generator=gen)
        with torch.no_grad():
            expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
            tokens = greedy(ours, prompt[0].tolist(), 40)
        assert tokens == expected[0, length:].tolist(), f"prompt of {length} tokens"


# ── GDN kernels ────────────────────────────────────────────────────────────────────────────────

def gdn_inputs(num_tokens: int, seed: int = 0, k_dim: int = 8, v_dim: int = 6):
    gen = torch.Generator().manual_seed(seed)
    batch, k_heads, v_heads = 2, 2, 4
    q = torch.randn(batch, num_tokens, k_heads, k_dim, generator=gen)
    k = torch.randn(batch, num_tokens, k_heads, k_dim, generator=gen)
    v = torch.randn(batch, num_tokens, v_heads, v_dim, generator=gen)
    g = -2 * torch.rand(batch, num_tokens, v_heads, generator=gen)
    beta = torch.rand(batch, num_tokens, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 150])
def test_chunked_equals_recurrent(num_tokens):
    q, k, v, g, beta, state = gdn_inputs(num_tokens)
    out, final, steps = recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_steps=True)
    chunk_out, chunk_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert (chunk_out - out).abs().max() < 1e-5
    assert (chunk_final - final).abs().max() < 1e-5
    assert steps.shape == (2, num_tokens, 4, 8, 6) and steps.dtype == torch.float32
    # the kept state after position t is the final state of the prefix [0, t] run on its own
    for t in sorted({0, num_tokens // 2, num_tokens - 1}):
        _, prefix_final, _ = recurrent_gated_delta_rule(*(x[:, : t + 1] for x in (q, k, v, g, beta)), state)
        assert torch.allclose(steps[:, t], prefix_final, atol=1e-6), t


def test_recurrent_follows_the_stated_rule():
    """One token by hand: S ← e^g S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq (q, k normalised)."""
    q, k, v, g, beta, state = gdn_inputs(1)
    out, final, _ = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    b, j = 1, 3                                        # value head 3 reads key head 3 // 2 = 1
    qk, kk = q[b, 0, 1] / q[b, 0, 1].norm() / 8 ** 0.5, k[b, 0, 1] / k[b, 0, 1].norm()
    s = state[b, j] * g[b, 0, j].exp()
    s = s + torch.outer(kk, beta[b, 0, j] * (v[b, 0, j] - s.T @ kk))
    assert torch.allclose(final[b, j], s, atol=1e-5)
    assert torch.allclose(out[b, 0, j], s.T @ qk, atol=1e-5)


def test_select_kernels_on_cpu_is_torch():
    kernels = select_kernels(torch.device("cpu"))
    assert kernels.chunk is chunk_gated_delta_rule and kernels.recurrent is recurrent_gated_delta_rule


# ── replay-free rollback ───────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("kind,dtype,tolerance", [
    ("qwen3_5", torch.float64, 1e-6),
    ("qwen3_next", torch.float64, 1e-6),
    ("qwen3_5", torch.float32, 1e-5),
])
def test_rollback_selects_the_committed_state(hybrids, kind, dtype, tolerance):
    """Verify 6 tokens with keep_steps, keep n of them (StatePool.select): the recurrent states
    (SSM and conv window) and the next logits equal a fresh prefill over exactly the committed tokens.

    In fp64 (states too) the two paths differ only by rounding, so 1e-6 is a tight bound; in fp32
    a different forward shape alone (one prefill vs prefill + verify) moves conv inputs by ~1e-6.
    """
    ours = copy.deepcopy(hybrids[kind][1]).to(dtype)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (1, 21), generator=gen)
    block = torch.randint(0, VOCAB, (1, 6), generator=gen)
    next_token = torch.randint(0, VOCAB, (1, 1), generator=gen)
    start = prompt.shape[1]
    for kept in range(1, 7):
        seq, _ = prefill(ours, prompt, page_size=8)
        seq.forward(block[0], keep_steps=True)
        seq.rollback(start + kept)
        fresh, _ = prefill(ours, torch.cat((prompt, block[:, :kept]), dim=1), page_size=8)
        assert seq.length == fresh.length == start + kept
        for (ssm, conv), (fresh_ssm, fresh_conv) in zip(seq.recurrent_state(), fresh.recurrent_state(), strict=True):
            assert ssm.dtype == torch.promote_types(dtype, torch.float32)
            assert (ssm - fresh_ssm).abs().max() <= tolerance, f"ssm, kept {kept}"
            assert (conv - fresh_conv).abs().max() <= tolerance, f"conv, kept {kept}"
        after, _ = seq.forward(next_token[0])
        assert relative_error(after, fresh.forward(next_token[0])[0]) < tolerance


def test_rollback_refuses_what_the_saved_steps_cannot_give(hybrids):
    """select() needs the per-step states of a keep_steps forward, once."""
    _, ours = hybrids["qwen3_5"]
    prompt = torch.arange(10)[None]
    seq, _ = prefill(ours, prompt)
    seq.forward(torch.arange(10, 14))                  # no keep_steps: only the final state
    with pytest.raises(RuntimeError, match="kept its steps"):
        seq.rollback(12)
    seq, _ = prefill(ours, prompt)
    seq.forward(torch.arange(10, 14), keep_steps=True)
    seq.rollback(12)
    with pytest.raises(RuntimeError, match="kept its steps"):
        seq.rollback(11)                              # the stash is spent by the first select


def test_select_refuses_keeping_nothing_of_the_block(hybrids):
    _, ours = hybrids["qwen3_5"]
    seq, _ = prefill(ours, torch.arange(10)[None])
    seq.forward(torch.arange(10, 14), keep_steps=True)
    for bad in (0, 5):
        with pytest.raises(ValueError, match="keeps 1..4 positions"):
            seq.states.select([seq.state_slot], [bad])


def test_a_decode_cycle_keeps_the_state_at_each_page_boundary_its_kept_rows_reach():
    """[prefix] ModelRunner.snapshot_page_boundaries after a verify of 4 rows on pages of 16: a
    sequence whose kept rows (num_cached … num_cached + a) reach a page's last position keeps
    the state after that position in its pending slot, bit for bit (SSM state and conv window
    from the verify's stash), and remembers the boundary; one that reaches none keeps nothing."""
    from types import SimpleNamespace
    from blockspec.cache import StatePool
    from blockspec.cache.state_pool import RecurrentShape
    from blockspec.engine.model_runner import ModelRunner
    shapes = [RecurrentShape(conv_dim=3, conv_kernel=4, num_v_heads=2, k_dim=2, v_dim=2)] * 2
    pool = StatePool(20, shapes, torch.float32, torch.device("cpu"))
    width, window = 4, 3
    # (num_cached, accepted, the boundary kept: None where the kept rows reach none)
    cases = [(14, 1, 16), (13, 2, 16), (30, 3, 32), (17, 3, None), (15, 0, 16), (31, 3, 32), (16, 3, None)]
    stashes = []
    for layer in range(len(shapes)):
        steps = torch.randn(len(cases), width, 2, 2, 2, generator=torch.Generator().manual_seed(layer))
        conv = torch.randn(len(cases), 3, window + width, generator=torch.Generator().manual_seed(10 + layer))
        pool.stash(layer, steps, conv)
        stashes.append((steps, conv))
    seqs = [SimpleNamespace(num_cached=n, pending_slot=6 + b, pending_boundary=None, state_slot=1 + b)
            for b, (n, _, _) in enumerate(cases)]
    runner = SimpleNamespace(page_size=16, states=pool)
    ModelRunner.snapshot_page_boundaries(runner, seqs, [a for _, a, _ in cases], from_stash=True)
    for b, (seq, (num_cached, _, boundary)) in enumerate(zip(seqs, cases)):
        assert seq.pending_boundary == boundary, (b, seq.pending_boundary)
        for layer, (steps, conv) in enumerate(stashes):
            if boundary is None:
                assert not pool.ssm[layer][seq.pending_slot].any() and not pool.conv[layer][seq.pending_slot].any()
                continue
            kept = boundary - num_cached
            assert torch.equal(pool.ssm[layer][seq.pending_slot], steps[b, kept - 1])
            assert torch.equal(pool.conv[layer][seq.pending_slot], conv[b, :, kept: kept + window])
    assert pool.stashed[0] is not None              # the stash stays for the cycle's rollback


def test_a_stacked_pools_select_copy_and_clear_equal_the_per_layer_ones():
    """Layers of one shape share [L, slots, …] tensors, and a graphed verify stashes into the stacked
    space: select from it (every slot and row, with and without keep_stash / rows), copy and clear
    leave exactly the states the per-layer path leaves (a stash of its own, unstacked)."""
    from blockspec.cache.state_pool import RecurrentShape, StatePool
    shapes = [RecurrentShape(conv_dim=6, conv_kernel=4, num_v_heads=2, k_dim=3, v_dim=5)] * 3
    gen = torch.Generator().manual_seed(0)

    def pool_pair():
        fast, slow = StatePool(6, shapes, torch.float32, torch.device("cpu")), \
            StatePool(6, shapes, torch.float32, torch.device("cpu"))
        for pool in (fast, slow):
            pool.reserve_space(4, 5)
        for a, b in zip(fast.conv + fast.ssm, slow.conv + slow.ssm):
            a.copy_(torch.randn(a.shape, generator=gen))
            b.copy_(a)
        return fast, slow

    def stash(fast, slow, count):
        for layer in range(len(shapes)):
            steps, conv = fast.space_for(layer, count, 5)
            steps.copy_(torch.randn(steps.shape, generator=gen))
            conv.copy_(torch.randn(conv.shape, generator=gen))
            fast.stash(layer, steps, conv)
            slow.stash(layer, steps.clone(), conv.clone())              # not the space: per layer
        assert fast.in_space() and not slow.in_space()

    fast, slow = pool_pair()
    stash(fast, slow, 3)
    for pool in (fast, slow):
        pool.select([4, 1], [2, 5], keep_stash=True, rows=[2, 0])
        pool.select([1, 3, 5], [1, 3, 5])
    assert fast.stashed == [None] * 3 == slow.stashed
    for a, b in zip(fast.conv + fast.ssm, slow.conv + slow.ssm):
        assert torch.equal(a, b)
    for pool in (fast, slow):
        pool.copy(3, 0)
        pool.clear([5, 2])
    for a, b in zip(fast.conv + fast.ssm, slow.conv + slow.ssm):
        assert torch.equal(a, b)
    assert not fast.conv_all[:, 5].any() and torch.equal(fast.ssm_all[:, 0], fast.ssm_all[:, 3])


def test_whether_a_stash_is_in_the_space_is_answered_for_its_entries():
    """in_space() is remembered for the entries it was asked of (a graph's replay hands over a
    copy of the same list every cycle), and asked again when any entry changes: in place, by
    stash(), or a list of other entries; only a yes is remembered (an eager verify's stash is
    not kept alive by it)."""
    from blockspec.cache.state_pool import RecurrentShape, StatePool
    shapes = [RecurrentShape(conv_dim=6, conv_kernel=4, num_v_heads=2, k_dim=3, v_dim=5)] * 3
    pool = StatePool(6, shapes, torch.float32, torch.device("cpu"))
    pool.reserve_space(4, 5)
    for layer in range(3):
        pool.stash(layer, *pool.space_for(layer, 2, 5))
    graphs_list = list(pool.stashed)
    assert pool.in_space()
    pool.stashed = list(graphs_list)                    # a replay's copy: the same entries
    assert pool.in_space()
    steps, conv = pool.stashed[1]
    pool.stashed[1] = (steps.clone(), conv.clone())     # in place, outside the space
    assert not pool.in_space()
    eager = weakref.ref(pool.stashed[1][0])
    pool.stashed = list(graphs_list)
    assert eager() is None                              # a no keeps nothing of an eager stash alive
    assert pool.in_space()
    pool.stash(2, *pool.space_for(2, 3, 5))             # a different count of rows than the others
    assert not pool.in_space()
    pool.stashed = [None] * 3
    assert not pool.in_space()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_graph_shaped_metadata_equals_eager_on_hybrids(hybrids, kind):
    """Padded rows (page 0, state slot 0) and keys over the whole capacity, as a CUDA graph
    replays them: the same logits, the same states after a verify and its rollback."""
    _, ours = hybrids[kind]
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    eager, padded = OneSequence(ours, 64, page_size=8), OneSequence(ours, 64, page_size=8)
    for lo, hi, kept in ((0, 30, None), (30, 36, 3), (33, 34, None), (34, 40, 6)):
        if eager.length != lo:
            continue
        expected, _ = eager.forward(ids[lo:hi], keep_steps=kept is not None)
        got, _ = padded.forward(ids[lo:hi], keep_steps=kept is not None, shape=graph_shaped(3))
        assert relative_error(got, expected) < 1e-5, (lo, hi)
        if kept is not None:
            eager.rollback(lo + kept)
            padded.rollback(lo + kept)
        for (ssm, conv), (ssm_e, conv_e) in zip(padded.recurrent_state(), eager.recurrent_state()):
            assert (ssm - ssm_e).abs().max() < 1e-5 and (conv - conv_e).abs().max() < 1e-5
    assert eager.length == padded.length == 40


# ── configs we do not serve ────────────────────────────────────────────────────────────────────

def test_moe_config_gives_sparse_layers():
    """MoE variants load now (tests/test_moe.py); the config says which layers are sparse."""
    from transformers import Qwen3NextConfig
    config = Qwen3NextConfig(**TEXT, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2).to_dict()
    moe = HybridConfig.from_hf(config, "Qwen3NextForCausalLM").moe
    assert moe.num_experts == 4 and moe.shared_expert_intermediate_size > 0
    assert [moe.is_sparse(i) for i in range(4)] == [False, True, False, True]


def test_dense_layers_of_a_sparse_config_are_allowed():
    config = {**TEXT, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "mlp_only_layers": [0, 1, 2, 3]}
    assert HybridConfig.from_hf(config, "Qwen3NextForCausalLM").fused_gdn_projections


# ---- DFlash on hybrid targets: lossless, with exact (replay-free) rollback ------------------

@pytest.fixture(scope="module")
def hybrid_drafts(hybrids, tmp_path_factory) -> dict[str, torch.nn.Module]:
    import fixtures
    from blockspec.loader import load_draft
    root = tmp_path_factory.mktemp("hybrid-drafts")
    drafts = {}
    for kind in ("qwen3_5", "qwen3_next"):
        target_dir = root / f"{kind}-target"
        target_dir.mkdir()
        (target_dir / "config.json").write_text(json.dumps({"hidden_size": TEXT["hidden_size"],
                                                            "num_hidden_layers": TEXT["num_hidden_layers"],
                                                            "vocab_size": VOCAB}))
        path = fixtures.write_dflash_draft(root / kind, target_dir, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
        drafts[kind] = load_draft(str(path), hybrids[kind][1])
    return drafts


HYBRID_PROMPTS = {"short": [5, 17, 99, 3, 42, 7, 200],
                  "long": [int(t) for t in torch.randint(0, VOCAB - 1, (260,), generator=torch.Generator().manual_seed(8))]}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_dflash_equals_plain_on_hybrids(hybrids, hybrid_drafts, kind, prompt):
    from test_dflash import dflash, plain
    target, draft = hybrids[kind][1], hybrid_drafts[kind]
    ids = HYBRID_PROMPTS[prompt]
    reference = plain(target, ids, stops=frozenset(), max_tokens=30).output_ids
    assert len(set(reference)) > 3
    for block_size in (1, 2, 4, 8, 16):
        request = dflash(target, draft, ids, block_size, stops=frozenset(), max_tokens=30)
        assert request.output_ids == reference, block_size


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_oracle_bookkeeping_on_hybrids(hybrids, hybrid_drafts, kind):
    """Full blocks accepted with a draft that is always right; with one that is right for a
    few tokens then wrong, every partial rollback still leaves output equal to plain decoding
    (the seeds' "Paris,\\n,\\n,…" degeneration is exactly a failure of this)."""
    from test_dflash import dflash, plain
    target, draft = hybrids[kind][1], hybrid_drafts[kind]
    ids = HYBRID_PROMPTS["long"]
    reference = plain(target, ids, stops=frozenset(), max_tokens=33).output_ids
    full = dflash(target, OracleDraft(draft, ids + reference), ids, 8, stops=frozenset(), max_tokens=33)
    assert full.output_ids == reference and full.stats.acceptance_lengths == [8, 8, 8, 8]
    corrupted = list(reference)
    for i in range(3, len(corrupted), 5):       # every 5th proposal is wrong: partial acceptance
        corrupted[i] = (corrupted[i] + 1) % (VOCAB - 1)
    partial = dflash(target, OracleDraft(draft, ids + corrupted), ids, 8, stops=frozenset(), max_tokens=33)
    assert partial.output_ids == reference
    assert any(1 < n < 8 for n in partial.stats.acceptance_lengths)


def test_the_rollback_waits_for_the_next_draft_and_a_reused_slot_stays_exact(hybrids, hybrid_drafts):
    """A verify's rollback (StatePool.select) is issued after the next cycle's draft forward,
    which reads no recurrent state, and before the target forward that does (ModelRunner.
    flush_states); a step that prefills issues it first, because a finished sequence's slot may
    be the new one's. Three requests on two seats, so a slot is handed on while its last
    rollback waits: every output equals its request decoded plainly alone."""
    from helpers import make_engine, make_request, run_alone, run_batch
    from blockspec.cache import StatePool
    from blockspec.engine.model_runner import ModelRunner
    target, draft = hybrids["qwen3_5"][1], hybrid_drafts["qwen3_5"]
    prompts = {"a": HYBRID_PROMPTS["short"], "b": HYBRID_PROMPTS["long"][:40], "c": HYBRID_PROMPTS["long"][40:71]}
    lengths = {"a": 9, "b": 30, "c": 20}

    def requests():
        return [make_request(name, prompt, max_tokens=lengths[name]) for name, prompt in prompts.items()]
    alone = {r.request_id: run_alone(lambda: make_engine(target), r).output_ids for r in requests()}
    order: list[str] = []
    real_select, real_propose, real_forward = StatePool.select, ModelRunner.propose_blocks, ModelRunner.forward

    def select(self, slots, kept, keep_stash=False, rows=None):
        if not keep_stash:                       # the rollback, not a prefix snapshot's copy
            order.append("select")
        return real_select(self, slots, kept, keep_stash, rows)

    def propose(self, blocks):
        order.append("draft")
        return real_propose(self, blocks)

    def forward(self, entries, num_prefill_seqs=0, drafts=None):
        hidden = real_forward(self, entries, num_prefill_seqs, drafts)   # named after: its own flush comes first
        decoding = len(entries) > num_prefill_seqs
        order.append(("mixed" if num_prefill_seqs else "verify") if decoding else "prefill")
        return hidden
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StatePool, "select", select)
        patch.setattr(ModelRunner, "propose_blocks", propose)
        patch.setattr(ModelRunner, "forward", forward)
        engine, runs = run_batch(lambda: make_engine(target, draft, block_size=4, max_num_seqs=2), requests())
    assert {run.request.request_id: run.output_ids for run in runs} == alone
    assert "verify draft select verify" in " ".join(order)      # a decode-only cycle: the draft went first
    forwards = [i for i, what in enumerate(order) if what in ("verify", "mixed", "prefill")]
    for this, after in zip(forwards, forwards[1:]):             # each verify's rollback, before the next forward
        between = order[this + 1: after]
        assert between.count("select") == (order[this] != "prefill"), (this, order[this: after + 1])
    assert order[-1] == "verify" and engine.runner.pending_select is not None   # the last one still waits
    assert "select draft mixed" in " ".join(order)     # a step that prefills: the rollback before anything
