"""DFlash decoding: lossless at every block size, exact bookkeeping at every edge."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, chi2_contingency

from blockspec.engine.plain import generate_plain
from blockspec.engine.request import Request
from blockspec.engine.speculative import generate_dflash
from blockspec.loader import LoadError, load_draft, load_model
from blockspec.models.dflash import default_target_layer_ids, draft_mask
from blockspec.sampling import SamplingParams, rejection_sample

import fixtures

STOPS = frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID})
SHORT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
LONG = [int(t) for t in torch.randint(0, 151643, (270,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def pairs(qwen3_dir, qwen3_draft_dir, llama_dir, llama_draft_dir):
    out = {}
    for kind, (t, d) in {"qwen3": (qwen3_dir, qwen3_draft_dir), "llama": (llama_dir, llama_draft_dir)}.items():
        target = load_model(str(t)).model
        out[kind] = (target, load_draft(str(d), target))
    return out


def run(events) -> tuple[list[int], list]:
    tokens, all_events = [], []
    for event in events:
        tokens += event.token_ids
        all_events.append(event)
    return tokens, all_events


def make_request(prompt, stops=STOPS, **params) -> Request:
    params.setdefault("max_tokens", 40)
    return Request("r", prompt, SamplingParams(**params), stops, 4096)


def plain(target, prompt, **params) -> Request:
    request = make_request(prompt, **params)
    run(generate_plain(target, request))
    return request


def dflash(target, draft, prompt, block_size=None, **params) -> Request:
    request = make_request(prompt, **params)
    tokens, events = run(generate_dflash(target, draft, request, block_size))
    assert tokens == request.output_ids
    assert [e.finish_reason for e in events].count(None) == len(events) - 1
    return request


class OracleDraft(torch.nn.Module):
    """A stand-in draft that proposes the target's own greedy continuation (known in advance),
    so every draft is right: the bookkeeping must then accept whole blocks."""

    def __init__(self, real_draft, prompt: list[int], continuation: list[int], sharpness: float = 50.0):
        super().__init__()
        self.real = real_draft
        self.sequence = prompt + continuation
        self.sharpness = sharpness
        self.calls = 0
        self._next_start = 0

    block_size = property(lambda self: self.real.block_size)
    mask_token_id = property(lambda self: self.real.mask_token_id)
    target_layer_ids = property(lambda self: self.real.target_layer_ids)

    def make_cache(self, max_len):
        return self.real.make_cache(max_len)

    def forward(self, block_embeds, new_features, cache):
        hidden = self.real(block_embeds, new_features, cache)
        self.calls += 1
        self._next_start = cache.length        # position of the anchor
        return hidden

    def read_logits(self, hidden, lm_head):
        num = hidden.shape[0]
        logits = torch.zeros(num, lm_head.weight.shape[0])
        for i in range(num):
            position = self._next_start + 1 + i
            token = self.sequence[position] if position < len(self.sequence) else 0
            logits[i, token] = self.sharpness
        return logits


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
    oracle = OracleDraft(draft, LONG, reference)
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
    assert oracle.calls == sum(1 for n in lengths if n > 1)


@pytest.mark.parametrize("stop_at", [1, 3, 6, 7, 8, 13])
def test_stop_id_inside_an_accepted_block_ends_right_after_it(pairs, stop_at):
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=30).output_ids
    stop_token = reference[stop_at]
    first = reference.index(stop_token)        # the first occurrence ends generation
    stops = STOPS | {stop_token}
    expected = reference[: first + 1]
    for drafter in (draft, OracleDraft(draft, SHORT, reference)):
        request = dflash(target, drafter, SHORT, 8, max_tokens=30, stops=stops)
        assert request.output_ids == expected
        assert request.finish_reason == "stop"
        assert request.stats.output_tokens == len(expected)
        assert sum(request.stats.acceptance_lengths) == len(expected) - 1
    plain_request = plain(target, SHORT, max_tokens=30, stops=stops)
    assert plain_request.output_ids == expected and plain_request.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 8, 9])
def test_max_tokens_is_exact(pairs, max_tokens):
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=20).output_ids
    oracle = OracleDraft(draft, SHORT, reference)
    for drafter in (draft, oracle):
        request = dflash(target, drafter, SHORT, 8, max_tokens=max_tokens)
        assert request.output_ids == reference[:max_tokens]
        assert request.finish_reason == "length"
        assert all(n <= 8 for n in request.stats.acceptance_lengths)


def test_context_limit_ends_the_request(pairs):
    target, draft = pairs["qwen3"]
    limit = len(SHORT) + 11
    request = Request("r", SHORT, SamplingParams(max_tokens=100), STOPS, limit)
    run(generate_dflash(target, draft, request, 8))
    assert len(request.output_ids) == 11 and request.finish_reason == "length"
    assert request.output_ids == plain(target, SHORT, max_tokens=11).output_ids


def test_block_size_cannot_exceed_the_drafts(pairs):
    target, draft = pairs["qwen3"]
    request = dflash(target, draft, SHORT, 64, max_tokens=40)
    assert max(request.stats.acceptance_lengths) <= draft.block_size
    assert request.stats.draft_tokens <= (draft.block_size - 1) * request.stats.cycles


class ForwardCounter:
    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def test_closing_the_iterator_stops_compute_and_the_next_request_is_exact(pairs):
    target, draft = pairs["qwen3"]
    reference = plain(target, LONG, max_tokens=40).output_ids
    counter_t, counter_d = ForwardCounter(target), ForwardCounter(draft)
    try:
        request = make_request(SHORT, max_tokens=200)
        events = generate_dflash(target, draft, request, 4)
        for _ in range(3):
            next(events)
        before = (counter_t.count, counter_d.count)
        events.close()                              # the consumer goes away
        assert (counter_t.count, counter_d.count) == before
        with pytest.raises(StopIteration):
            next(events)
        assert (counter_t.count, counter_d.count) == before
    finally:
        counter_t.handle.remove(), counter_d.handle.remove()
    assert dflash(target, draft, LONG, 4, max_tokens=40).output_ids == reference


def test_abort_flag_stops_within_one_cycle(pairs):
    target, draft = pairs["qwen3"]
    counter = ForwardCounter(target)
    try:
        request = make_request(SHORT, max_tokens=200)
        events = generate_dflash(target, draft, request, 4)
        next(events), next(events)
        request.abort()
        before = counter.count
        rest = list(events)
        assert counter.count == before               # no verify after the flag was seen
        assert rest[-1].finish_reason == "abort" and request.finish_reason == "abort"
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
    """At temperature 1 (top-k 4), DFlash's tokens at positions 1-3 follow plain sampling's."""
    target, draft = pairs["qwen3"]
    reference = plain(target, SHORT, max_tokens=4).output_ids
    oracle = OracleDraft(draft, SHORT, reference, sharpness=2.0)   # right often, not always
    params = dict(max_tokens=4, temperature=1.0, top_k=4)
    runs = 160
    plain_out = [tuple(plain(target, SHORT, seed=s, **params).output_ids[1:3]) for s in range(runs)]
    spec_out = [tuple(dflash(target, oracle, SHORT, 4, seed=10_000 + s, **params).output_ids[1:3]) for s in range(runs)]
    for position in (0, 1):
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


def test_draft_forward_matches_the_published_architecture(pairs, qwen3_draft_dir):
    from safetensors.torch import load_file
    target, draft = pairs["qwen3"]
    weights = load_file(str(qwen3_draft_dir / "model.safetensors"))
    config = json.loads((qwen3_draft_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(30, 2 * 64, generator=gen)
    block = torch.tensor([[77091] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7])
    with torch.no_grad():
        embeds = target.embed(block)
        cache = draft.make_cache(64)
        # context arrives in two parts (prefill, then one verify), as in decoding
        draft(embeds, features[None, :20], cache)
        got = draft(embeds, features[None, 20:], cache)[0]
        expected = reference_draft_forward(weights, config, features, embeds[0])
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.length == 30                      # context K/V kept, block K/V dropped


def test_draft_config_is_read_as_zlab_writes_it(qwen3_draft_dir, pairs):
    target, draft = pairs["qwen3"]
    assert draft.mask_token_id == 151669
    assert draft.target_layer_ids == (0, 2)
    assert draft.block_size == 16
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]      # Qwen3-8B's published ids
    assert default_target_layer_ids(28, 1) == [14]


def test_sliding_window_draft_layers_are_causal_and_windowed(tmp_path, qwen3_dir, pairs):
    target, _ = pairs["qwen3"]
    path = fixtures.write_dflash_draft(tmp_path / "swa", qwen3_dir, num_layers=2,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    draft = load_draft(str(path), target)
    assert draft.layers[0].self_attn.is_causal and draft.layers[0].self_attn.window == 4
    assert not draft.layers[1].self_attn.is_causal and draft.layers[1].self_attn.window is None
    # Causal first layer: changing a later block slot must not change an earlier slot's layer-0 output.
    block = torch.tensor([[100, 200, 300, 400]])
    other = torch.tensor([[100, 200, 300, 999]])
    feats = torch.randn(1, 10, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = []
        for ids in (block, other):
            cache = draft.make_cache(32)
            h = target.embed(ids)
            layer0 = draft.layers[0]
            context_start = cache.advance(10)
            pos = torch.arange(0, 14)
            cos, sin = draft.rotary_emb(pos[None], h.dtype)
            ctx = draft.hidden_norm(draft.fc(feats))
            masks = {(True, 4): draft_mask(pos[10:], pos, None, True, 4)}
            outs.append(layer0(h, ctx, (cos[..., 10:, :], sin[..., 10:, :]), (cos[..., :10, :], sin[..., :10, :]),
                               cache.layers[0], context_start, masks))
    assert torch.equal(outs[0][:, :3], outs[1][:, :3]) and not torch.equal(outs[0][:, 3], outs[1][:, 3])
    reference = plain(target, SHORT).output_ids
    assert dflash(target, draft, SHORT, 8).output_ids == reference


def test_draft_that_does_not_fit_the_target_is_refused(tmp_path, qwen3_dir, pairs):
    target, _ = pairs["qwen3"]
    path = fixtures.write_dflash_draft(tmp_path / "bad", qwen3_dir, target_layer_ids=[0, 9])
    with pytest.raises(LoadError, match="target_layer_ids"):
        load_draft(str(path), target)


def test_static_runners_equal_eager(pairs):
    """The graph-capturable runners (positions on the device, padded draft context, persistent
    caches) decode exactly like the eager models; on CUDA the same path is replayed as graphs."""
    from blockspec.engine.cuda_graphs import StaticDraft, StaticTarget
    target, draft = pairs["qwen3"]
    reference = plain(target, LONG, max_tokens=30).output_ids
    static_target = StaticTarget(target, 4096, 8, draft.target_layer_ids, use_graphs=False)
    static_draft = StaticDraft(draft, 4096, 8, use_graphs=False)
    assert plain(static_target, LONG, max_tokens=30).output_ids == reference
    with torch.no_grad():   # a prefill through the static path computes only the logits asked for
        out = static_target(torch.tensor([LONG]), static_target.make_cache(4096), num_logits=1)
    assert out.logits.shape[1] == 1
    for block_size in (2, 8):
        oracle = OracleDraft(static_draft, LONG, reference)
        request = dflash(static_target, oracle, LONG, block_size, max_tokens=30)
        assert request.output_ids == reference
        assert set(request.stats.acceptance_lengths[:-1]) == {block_size}
        assert dflash(static_target, static_draft, LONG, block_size, max_tokens=30).output_ids == reference


def test_static_draft_equals_eager_draft(pairs):
    from blockspec.engine.cuda_graphs import StaticDraft
    target, draft = pairs["qwen3"]
    static = StaticDraft(draft, 256, 8, use_graphs=False)
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randn(1, n, 128, generator=gen) for n in (20, 3, 1, 8, 5)]
    block = target.embed(torch.tensor([[77091] + [fixtures.QWEN3_MASK_TOKEN_ID] * 7]))
    with torch.no_grad():
        eager_cache, static_cache = draft.make_cache(256), static.make_cache(256)
        for context in contexts:
            expected = draft(block, context, eager_cache)
            got = static(block, context, static_cache)
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        assert static_cache.length == eager_cache.length == 37


def test_context_features_are_transformers_hidden_states_of_the_layer_ids(pairs, qwen3_dir):
    """target_layer_ids mean "output of decoder layer l" = transformers' hidden_states[l + 1];
    an off-by-one here silently lowers acceptance while staying lossless, so pin it."""
    from transformers import AutoModelForCausalLM
    target, draft = pairs["qwen3"]
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    ids = torch.tensor([LONG[:40]])
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states
        ours = target(ids, target.make_cache(64), capture_layers=draft.target_layer_ids).features
    expected = torch.cat([hidden[layer + 1] for layer in draft.target_layer_ids], dim=-1)
    assert draft.target_layer_ids == (0, 2)
    assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-4)
