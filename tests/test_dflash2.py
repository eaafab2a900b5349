"""DFlash 2 drafts: z-lab's checkpoint format loads, the forward and the selector equal a
reference written here from the architecture alone, decoding stays lossless (greedy: equal to
plain decoding at every block size, dense and hybrid, alone and batched; sampling: the target's
distribution with the candidate-restricted q)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from scipy.stats import chi2_contingency, chisquare
from torch import nn

from blockspec.cache import KVPool
from blockspec.engine.engine import Engine
from blockspec.engine.spec.dflash import sample_walk
from blockspec.layers import AttentionMetadata
from blockspec.llm import LLM
from blockspec.loader import LoadError, load_draft
from blockspec.models.dflash2 import CandidateWalk, DFlash2DraftModel, greedy_walk
from blockspec.sampling import SamplingParams, rejection_sample

import fixtures
from helpers import modelled_cost_tables

PROMPTS = [[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
           [int(t) for t in torch.randint(0, 151643, (37,), generator=torch.Generator().manual_seed(3))],
           [9707, 11, 1879]]
HYBRID_PROMPTS = [[5, 17, 99, 3, 42, 7, 200],
                  [int(t) for t in torch.randint(0, 255, (41,), generator=torch.Generator().manual_seed(8))],
                  [3, 4, 5]]


# ── an independent reference, from the architecture description alone ────────────────────────

class FakeTarget(nn.Module):
    """What load_draft checks of a target: hidden size, layer count and the head (vocabulary)."""

    def __init__(self, hidden: int, num_layers: int, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.hidden_size, self.num_layers = hidden, num_layers
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(3 * torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE on x [N, heads, D] at positions [N]."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions[:, None].double() * freq                                       # [N, D/2]
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def reference_conv(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """out[t] = Σ_j (base[j] + c[t, j] per group) · x[t − j], nothing before the block's start."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(base.shape[0]):
            if t - j >= 0:
                out[t] += (base[j] + coefficients[t, j].repeat_interleave(group)) * x[t - j]
    return out


class Reference:
    """One sequence's draft forward and selector, from a checkpoint's config and weights."""

    def __init__(self, directory: Path) -> None:
        self.c = json.loads((directory / "config.json").read_text())
        self.w = {k.removesuffix(".weight") if "codebook" in k else k: v
                  for k, v in load_file(str(directory / "model.safetensors")).items()}
        self.d = self.c["dflash_config"]
        self.eps = self.c["rms_norm_eps"]
        self.theta = (self.c.get("rope_parameters") or {}).get("rope_theta", self.c.get("rope_theta"))

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name + ".weight"].T

    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        """features [C, K·H] of positions 0..C−1 (C = start), block_embeds [T, H] → hidden [T, H]."""
        context = rms(self.linear("fc", features), self.w["hidden_norm.weight"], self.eps)
        x = block_embeds * self.d.get("input_embedding_scale", 1.0)
        for i in range(self.c["num_hidden_layers"]):
            p = f"layers.{i}."
            h = rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            h, finish = self.conv_prepare(p + "attention_conv", h)
            x = x + self.conv_finish(p + "attention_conv", self.attention(i, h, context, start), finish)
            h = rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            h, finish = self.conv_prepare(p + "mlp_conv", h)
            mlp = self.linear(p + "mlp.down_proj",
                              F.silu(self.linear(p + "mlp.gate_proj", h)) * self.linear(p + "mlp.up_proj", h))
            x = x + self.conv_finish(p + "mlp_conv", mlp, finish)
        return rms(x, self.w["norm.weight"], self.eps)

    def conv_prepare(self, name: str, h: torch.Tensor):
        if name + ".base_kernel" not in self.w:                           # a DFlash 1 draft
            return h, None
        taps, group = self.d["conv_kernel_size"], self.d["conv_group_size"]
        c = self.linear(name + ".kernel_projection", h).view(h.shape[0], 2, taps, h.shape[1] // group)
        return reference_conv(h, c[:, 0], self.w[name + ".base_kernel"][0], group), c[:, 1]

    def conv_finish(self, name: str, h: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        if c is None:
            return h
        return reference_conv(h, c, self.w[name + ".base_kernel"][1], self.d["conv_group_size"])

    def attention(self, i: int, h: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        p, c = f"layers.{i}.self_attn.", self.c
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        width = h.shape[0]
        q_pos = torch.arange(start, start + width)
        k_pos = torch.arange(start + width)
        both = torch.cat((context, h))
        q = rotate(rms(self.linear(p + "q_proj", h).view(width, heads, dim), self.w[p + "q_norm.weight"], self.eps),
                   q_pos, self.theta)
        k = rotate(rms(self.linear(p + "k_proj", both).view(-1, kv_heads, dim), self.w[p + "k_norm.weight"], self.eps),
                   k_pos, self.theta)
        v = self.linear(p + "v_proj", both).view(-1, kv_heads, dim)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        sliding = (c.get("layer_types") or ["full_attention"] * 99)[i] == "sliding_attention"
        causal = sliding if c.get("is_causal") is None else c["is_causal"]
        distance = q_pos[:, None] - k_pos[None, :]
        visible = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            visible &= distance >= 0
        if sliding:
            visible &= distance.abs() < c["sliding_window"] if not causal else distance < c["sliding_window"]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(width, heads * dim)
        return self.linear(p + "o_proj", out)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        logits = hidden @ lm_head.T * self.d.get("output_multiplier", 1.0)
        cap = self.d.get("final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap else logits

    def select(self, hidden: torch.Tensor, anchor: int, lm_head: torch.Tensor) -> list[int]:
        """Greedy walk over each slot's top-k candidates: argmax of unary + pairwise score."""
        logits = self.logits(hidden[1:], lm_head)
        projected = self.linear("candidate_selector.hidden_projection", hidden[1:])
        previous, chosen = anchor, []
        for i in range(logits.shape[0]):
            candidates = logits[i].topk(self.d["selector_top_k"]).indices.tolist()
            score = {t: float(logits[i, t] + (self.w["candidate_selector.predecessor_codebook"][previous]
                                              * projected[i] * self.w["candidate_selector.successor_codebook"][t]).sum())
                     for t in candidates}
            previous = max(score, key=score.get)
            chosen.append(previous)
        return chosen


def run_ours(draft, features: list[torch.Tensor], blocks: list[torch.Tensor], width: int):
    """Our draft over B sequences (context features [C_b, K·H], block embeddings [T, H]) through
    its paged pool, as the runner drives it → hidden [B, T, H]."""
    page, pages = 16, 8
    c = draft.config
    pool = KVPool(c.num_hidden_layers, (len(blocks) * pages + 1) * page, c.num_key_value_heads, c.head_dim,
                  torch.float32, torch.device("cpu"))
    tables = torch.tensor([[1 + b * pages + j for j in range(pages)] for b in range(len(blocks))])
    starts = [f.shape[0] for f in features]
    for b, f in enumerate(features):
        pos = torch.arange(f.shape[0])
        draft.append_context(f, pos, tables[b, pos // page] * page + pos % page, pool.layers)
    positions = torch.cat([torch.arange(s, s + width) for s in starts])
    meta = AttentionMetadata(num_seqs=len(blocks), width=width, input_ids=torch.zeros_like(positions),
                             positions=positions, slot_mapping=torch.zeros_like(positions), block_tables=tables,
                             context_lens=torch.tensor(starts), max_context_len=max(starts) + width,
                             page_size=page, kv=pool.layers)
    return draft(torch.cat(blocks), positions, meta).view(len(blocks), width, -1)


@pytest.fixture(scope="module")
def small_target_dir(tmp_path_factory) -> Path:
    """A config.json standing for a target with a small vocabulary (the drafts read its shape)."""
    directory = tmp_path_factory.mktemp("small-target")
    (directory / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 6, "vocab_size": 300}))
    return directory


def small_draft(directory: Path, small_target_dir: Path, **kwargs) -> Path:
    return fixtures.write_dflash2_draft(directory, small_target_dir, mask_token_id=299, **kwargs)


def reference_case(directory: Path, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    config = json.loads((directory / "config.json").read_text())
    hidden, num_features = config["hidden_size"], len(config["dflash_config"]["target_layer_ids"])
    target = FakeTarget(hidden, 6, config["vocab_size"])
    features = [torch.randn(n, num_features * hidden, generator=gen) for n in (5, 23)]
    blocks = [torch.randn(width, hidden, generator=gen) for _ in features]
    return target, features, blocks


@pytest.mark.parametrize("width", [2, 3, 5, 16])
def test_draft_forward_and_selector_equal_the_reference(tmp_path, small_target_dir, width):
    """Taps 4 against blocks of 2 and 3 (the convolution sees zeros before the block), a
    sliding layer seeing the block both ways (is_causal false), two context lengths."""
    directory = small_draft(tmp_path / "d2", small_target_dir, conv_kernel_size=4, selector_top_k=6,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                            input_embedding_scale=1.5)
    target, features, blocks = reference_case(directory, width, seed=width)
    draft = load_draft(str(directory), target)
    assert isinstance(draft, DFlash2DraftModel)
    ref = Reference(directory)
    anchors = torch.tensor([7, 123])
    with torch.no_grad():
        ours = run_ours(draft, features, blocks, width)
        walk = draft.propose(ours, anchors, target.lm_head)
        for b in range(2):
            expected = ref.forward(features[b], blocks[b], features[b].shape[0])
            torch.testing.assert_close(ours[b], expected, atol=2e-5, rtol=2e-5)
            assert walk.drafts[b].tolist() == ref.select(expected, int(anchors[b]), target.lm_head.weight)


def test_the_pairwise_term_changes_the_walk(tmp_path, small_target_dir):
    """Guard on the fixture: its codebooks move some choices off the per-slot argmax, so the
    tests above test the selector, not the logits."""
    directory = small_draft(tmp_path / "d2", small_target_dir, selector_top_k=6)
    target, features, blocks = reference_case(directory, 16, seed=0)
    draft = load_draft(str(directory), target)
    with torch.no_grad():
        hidden = run_ours(draft, features, blocks, 16)
        walk = draft.propose(hidden, torch.tensor([7, 123]), target.lm_head)
        argmax = draft.read_logits(hidden[:, 1:], target.lm_head).argmax(-1)
    assert (walk.drafts != argmax).any() and (walk.drafts == argmax).any()


def test_dflash1_honours_multiplier_softcap_embedding_scale_and_sliding_layers(tmp_path, small_target_dir):
    """The keys DFlash 1 drafts share with DFlash 2 (sliding layers causal without is_causal)."""
    directory = fixtures.write_dflash_draft(tmp_path / "d1", small_target_dir, layer_types=["sliding_attention",
                                            "full_attention"], sliding_window=6, mask_token_id=299)
    config = json.loads((directory / "config.json").read_text())
    config["dflash_config"].update(output_multiplier=0.3, final_logit_softcapping=5.0, input_embedding_scale=0.7)
    (directory / "config.json").write_text(json.dumps(config))
    target, features, blocks = reference_case(directory, 8, seed=1)
    draft = load_draft(str(directory), target)
    ref = Reference(directory)
    with torch.no_grad():
        ours = run_ours(draft, features, blocks, 8)
        logits = draft.propose(ours, torch.tensor([1, 2]), target.lm_head)
        for b in range(2):
            expected = ref.forward(features[b], blocks[b], features[b].shape[0])
            torch.testing.assert_close(ours[b], expected, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(logits[b], ref.logits(expected[1:], target.lm_head.weight), atol=1e-4, rtol=1e-5)
    assert logits.abs().max() <= 5.0


# ── z-lab's checkpoint format ───────────────────────────────────────────────────────────────

def test_zlab_names_and_config_keys_load(tmp_path, small_target_dir):
    plain = small_draft(tmp_path / "a", small_target_dir)
    suffixed = small_draft(tmp_path / "b", small_target_dir, codebook_keys_with_weight=True)
    target = FakeTarget(64, 6, 300)
    a, b = load_draft(str(plain), target), load_draft(str(suffixed), target)
    assert torch.equal(a.candidate_selector.predecessor_codebook, b.candidate_selector.predecessor_codebook)
    c = a.config
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (3, 16, 8, 4)
    assert (c.output_multiplier, c.final_logit_softcapping, c.block_size) == (0.25, 20.0, 16)
    assert a.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 3 * 4, 64)
    assert a.config.layer_is_causal == (False, False)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["dflash_config"].pop("selector_top_k"), "needs selector_top_k"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "does not divide"),
    (lambda c: c.update(vocab_size=301), "vocab_size 301"),
    (lambda c: c.update(architectures=["DFlash3DraftModel"]), "DFlash2DraftModel"),
])
def test_a_dflash2_config_that_cannot_work_is_refused(tmp_path, small_target_dir, change, message):
    directory = small_draft(tmp_path / "d2", small_target_dir)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=message):
        load_draft(str(directory), FakeTarget(64, 6, 300))


# ── greedy: lossless at every block size, dense and hybrid, alone and batched ────────────────

def install_oracle(draft: DFlash2DraftModel, continuations: list[list[int]], bonus: float = 30.0) -> None:
    """Raise the unary logit of the target's own next tokens after each anchor, so blocks are
    often accepted in part or whole; the selector still walks (its pairwise term overrides the
    bonus now and then), so acceptance lengths vary."""
    following: dict[int, list[int]] = {}
    for tokens in continuations:
        for j, token in enumerate(tokens):
            following.setdefault(token, tokens[j + 1:])

    def propose(hidden, anchors, lm_head):
        slots = hidden[:, 1:]
        logits = draft.read_logits(slots, lm_head).clone()
        for b, anchor in enumerate(anchors.tolist()):
            for i, token in enumerate(following.get(anchor, [])[: logits.shape[1]]):
                logits[b, i, token] += bonus
        return draft.candidate_selector(slots, logits, anchors)
    draft.propose = propose


def block_size_engines(llm: LLM, block_sizes, padded: bool = False):
    """The loaded target and draft, one engine per block size (loading once keeps CI fast). The
    largest block's unpadded engine measures its cost table (the probes run, then decoding must
    still equal plain); the others take `modelled_costs` (the measurement is the same code each
    time, and its probes took 70% of these tests' time)."""
    for block_size in block_sizes:
        llm.config = dataclasses.replace(llm.config, block_size=block_size)
        measured = not padded and block_size == max(block_sizes)
        with modelled_cost_tables(not measured):
            llm.engine = Engine(llm.target, llm.draft, llm.config)
        assert llm.engine.runner.speculation.costs is not None           # adaptive, with its table
        if padded:       # the CUDA-graph path (fixed shapes, padding rows), run eagerly
            llm.engine.runner.graphs = llm.engine.runner.make_graphs(capture=False)
        yield block_size


def check_lossless(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_tokens: int,
                   block_sizes, alone_sizes, padded_sizes) -> None:
    plain = LLM(str(target_dir), max_model_len=256, max_num_seqs=4, show_progress=False)
    params = SamplingParams(max_tokens=max_tokens)
    reference = [r.token_ids for r in plain.generate(prompts, params)]
    assert all(len(set(r)) > 3 for r in reference)
    spec = LLM(str(target_dir), draft=str(draft_dir), max_model_len=256, max_num_seqs=4, show_progress=False)
    install_oracle(spec.draft, [p + r for p, r in zip(prompts, reference)])
    lengths = []
    for block_size in block_size_engines(spec, block_sizes):
        batch = spec.generate(prompts, params)
        assert [r.token_ids for r in batch] == reference, block_size
        if block_size in alone_sizes:
            assert spec.generate_ids(prompts[1], params).token_ids == reference[1], block_size
        lengths += [n for r in batch for n in r.stats.acceptance_lengths]
    for block_size in block_size_engines(spec, padded_sizes, padded=True):
        assert [r.token_ids for r in spec.generate(prompts, params)] == reference, block_size
    assert max(lengths) >= 8 and any(1 < n < max(lengths) for n in lengths)


@pytest.fixture(scope="module")
def qwen3_draft2_dir(qwen3_dir, tmp_path_factory) -> Path:
    return fixtures.write_dflash2_draft(tmp_path_factory.mktemp("draft2") / "qwen3-dflash2", qwen3_dir)


def test_greedy_equals_plain_on_a_dense_target(qwen3_dir, qwen3_draft2_dir):
    check_lossless(qwen3_dir, qwen3_draft2_dir, PROMPTS, 24, range(2, 17), (2, 3, 7, 16), (2, 5, 16))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return fixtures.write_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen3_5")


def test_greedy_equals_plain_on_a_hybrid_target(hybrid_dir, tmp_path):
    draft_dir = fixtures.write_dflash2_draft(tmp_path / "d2", hybrid_dir, target_layer_ids=[0, 2],
                                             mask_token_id=fixtures.HYBRID_VOCAB - 1, conv_group_size=8)
    check_lossless(hybrid_dir, draft_dir, HYBRID_PROMPTS, 24, range(2, 17), (2, 3, 7, 16), (3, 16))


def test_short_final_block(qwen3_dir, qwen3_draft2_dir):
    """The allowance left for the last block is shorter than the block (down to 1–2 drafts):
    the output is plain decoding's, cut at exactly max_tokens."""
    plain = LLM(str(qwen3_dir), max_model_len=256, max_num_seqs=4, show_progress=False)
    full = plain.generate_ids(PROMPTS[0], SamplingParams(max_tokens=17)).token_ids
    spec = LLM(str(qwen3_dir), draft=str(qwen3_draft2_dir), block_size=8, max_model_len=256, max_num_seqs=4,
               show_progress=False)
    install_oracle(spec.draft, [PROMPTS[0] + full])
    for max_tokens in (1, 2, 3, 10, 11, 17):
        result = spec.generate_ids(PROMPTS[0], SamplingParams(max_tokens=max_tokens))
        assert result.token_ids == full[:max_tokens], max_tokens
        assert sum(result.stats.acceptance_lengths) == max_tokens - 1


# ── sampling: lossless with the candidate-restricted q ──────────────────────────────────────

def test_sampled_walk_with_restricted_q_keeps_the_target_distribution():
    """A Markov target on 5 tokens (p(next | previous) = table[previous]); the draft offers 3
    candidates per slot (tokens outside them have q = 0; token 3 is never offered) and walks
    with edge scores that depend on the predecessor. The first two emitted tokens, cycle after
    cycle until two exist, must be distributed as the chain: chi-square over the 25 pairs,
    p-value > 1e-3."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, slots, anchor = 5, 3, 2, 0
    table = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)
    candidates = torch.tensor([[1, 2, 4], [0, 2, 4]])                               # [L, k]
    edges = 1.5 * torch.randn(slots, k, k, generator=gen)
    walk = CandidateWalk(candidates[None], edges[None], candidates[None, :, 0], vocab)
    counts = np.zeros((vocab, vocab))
    draws = 8_000
    for _ in range(draws):
        emitted, previous = [], anchor
        while len(emitted) < 2:
            drafts, q = sample_walk(walk, 0, 1.0, gen)
            p = table[torch.tensor([previous] + drafts.tolist())]                 # [L + 1, V]
            a, bonus = rejection_sample(drafts, p, q, gen)
            emitted += drafts[:a].tolist() + [bonus]
            previous = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    expected = (table[anchor][:, None] * table).double().numpy().ravel()
    assert chisquare(counts.ravel(), expected / expected.sum() * draws).pvalue > 1e-3
    assert counts[3].sum() > 0 and counts[:, 3].sum() > 0          # a token no slot offers is still emitted


def test_sampled_walk_q_is_the_softmax_over_candidates():
    gen = torch.Generator().manual_seed(1)
    candidates = torch.tensor([[[4, 1, 7], [2, 4, 0]]])
    edges = torch.randn(1, 2, 3, 3, generator=gen)
    walk = CandidateWalk(candidates, edges, candidates[:, :, 0], 9)
    drafts, q = sample_walk(walk, 0, 0.7, gen)
    first = torch.softmax(edges[0, 0, 0] / 0.7, -1)
    assert torch.allclose(q[0, [4, 1, 7]], first) and q[0].sum().item() == pytest.approx(1.0)
    index = candidates[0, 0].tolist().index(int(drafts[0]))
    assert torch.allclose(q[1, [2, 4, 0]], torch.softmax(edges[0, 1, index] / 0.7, -1))
    assert q[0, [0, 2, 3, 5, 6, 8]].abs().sum() == 0


def test_greedy_walk_follows_the_chosen_row():
    edges = torch.zeros(1, 3, 2, 2)
    edges[0, 0, 0] = torch.tensor([0.0, 1.0])         # slot 0 (anchor row 0): pick 1
    edges[0, 1, 1] = torch.tensor([2.0, 0.0])         # slot 1 from index 1: pick 0
    edges[0, 1, 0] = torch.tensor([0.0, 9.0])         # (a row the walk must not read)
    edges[0, 2, 0] = torch.tensor([0.0, 3.0])         # slot 2 from index 0: pick 1
    assert greedy_walk(edges).tolist() == [[1, 0, 1]]


def test_sampled_dflash2_matches_plain_token_distribution(qwen3_dir, qwen3_draft2_dir):
    """Through the engine at temperature 1 (top-k 4): the tokens at positions 1 and 2 under a
    DFlash 2 draft (the oracle bonus gets drafts accepted often, not always) follow plain
    sampling's; chi-square contingency p-value > 1e-3 per position."""
    runs, max_tokens = 96, 3
    plain = LLM(str(qwen3_dir), max_model_len=64, max_num_seqs=32, show_progress=False)
    greedy = plain.generate_ids(PROMPTS[0], SamplingParams(max_tokens=8)).token_ids
    spec = LLM(str(qwen3_dir), draft=str(qwen3_draft2_dir), block_size=4, max_model_len=64, max_num_seqs=32,
               show_progress=False)
    install_oracle(spec.draft, [PROMPTS[0] + greedy])
    outputs = []
    for llm, offset in ((plain, 0), (spec, 10_000)):
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=4, seed=offset + s) for s in range(runs)]
        outputs.append([r.token_ids for r in llm.generate([PROMPTS[0]] * runs, params)])
    accepted = sum(r.stats.accepted_tokens for r in spec.generate([PROMPTS[0]] * 8, SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_k=4, seed=1)))
    assert accepted > 0
    for position in (1, 2):
        a, b = ([o[position] for o in out] for out in outputs)
        support = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in support], [b.count(t) for t in support]])
        assert chi2_contingency(table[:, table.sum(0) >= 5]).pvalue > 1e-3


def test_sampling_with_a_dflash2_draft_is_seeded_and_batch_independent(qwen3_dir, qwen3_draft2_dir):
    spec = LLM(str(qwen3_dir), draft=str(qwen3_draft2_dir), block_size=4, max_model_len=256, max_num_seqs=4,
               show_progress=False)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=s) for s in (1, 1, 2)]
    batch = [r.token_ids for r in spec.generate([PROMPTS[0]] * 3, params)]
    alone = spec.generate_ids(PROMPTS[0], params[0]).token_ids
    assert batch[0] == batch[1] == alone and batch[2] != batch[0]
