"""Mixture-of-experts targets (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): agreement with transformers in
both checkpoint layouts, DFlash lossless on them, the experts kernels, loading and its errors.

Checkpoints are tiny random models written by transformers' own save_pretrained (per-expert
tensors); the fused layout (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) is the
same weights rewritten by the test. fp32, CPU.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fixtures
from helpers import run_interpreted
from blockspec.cache import CacheManager
from blockspec.config import ConfigError, EngineConfig, MoeConfig
from blockspec.engine.model_runner import Entry, ModelRunner
from blockspec.engine.request import Request
from blockspec.engine.sequence import Sequence
from blockspec.kernels import moe as moe_kernels
from blockspec.layers.moe import (gathered_experts, grouped_experts, reference_experts, route,
                                  select_experts_kernel)
from blockspec.llm import LLM
from blockspec.loader import LoadError, load_model
from blockspec.sampling import SamplingParams
from blockspec.tokenizer import Tokenizer

VOCAB = 256
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
ATTENTION = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
KINDS = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_mm"]


def hf_model(kind: str) -> torch.nn.Module:
    """Layer 2 of Qwen3-MoE is dense (mlp_only_layers), Qwen3-Next is sparse every second layer
    (decoder_sparse_step): both sparsity rules are exercised, and both router normalisations."""
    import transformers as tf
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**ATTENTION, **EXPERTS, mlp_only_layers=[2]))
    hybrid = dict(**ATTENTION, **LINEAR, **EXPERTS, shared_expert_intermediate_size=24)
    if kind == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**hybrid, decoder_sparse_step=2))
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**hybrid))
    return tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=hybrid, vision_config=VISION))


def randomise(model: torch.nn.Module) -> None:
    """Every weight off its init (routers start near zero, zero-centred norms at 0) and sharp
    logits, so greedy choices are clear-cut."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
        model.get_decoder().norm.weight.add_(8.0)


def fuse_experts(src: Path, dst: Path) -> None:
    """The same checkpoint with each layer's experts as two 3-D tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    pattern = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in tensors if pattern.fullmatch(n)]:
        prefix, index, proj = pattern.fullmatch(name).groups()
        pieces.setdefault(prefix, {})[int(index), proj] = tensors.pop(name)
    for prefix, layer in pieces.items():
        num_experts = 1 + max(e for e, _ in layer)
        tensors[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat((layer[e, "gate_proj"], layer[e, "up_proj"])) for e in range(num_experts)])   # [E, 2I, H]
        tensors[prefix + ".down_proj"] = torch.stack([layer[e, "down_proj"] for e in range(num_experts)])  # [E, H, I]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path, Path]]:
    """kind → (transformers model, its per-expert checkpoint, the fused rewrite)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for kind in KINDS:
        ref = hf_model(kind)
        randomise(ref)
        ref.save_pretrained(root / kind)
        fixtures.write_tokenizer_files(root / kind, "qwen3")
        fuse_experts(root / kind, root / f"{kind}-fused")
        out[kind] = (ref.eval(), root / kind, root / f"{kind}-fused")
    return out


@pytest.fixture(scope="module")
def one_tokenizer(moe):
    """Every checkpoint here carries the same tokenizer files: read them once (most of an LLM's
    construction time), so the tests can build one LLM per configuration."""
    shared = Tokenizer.from_dir(moe["qwen3_moe"][1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tokenizer, "from_dir", staticmethod(lambda path: shared))
        yield


def our_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """One prefill forward of the whole prompt through a model runner's target → logits [T, V]."""
    target = load_model(str(path)).model
    runner = ModelRunner(target, None, EngineConfig(max_model_len=256, max_num_seqs=1))
    seq = Sequence(Request("logits", ids, SamplingParams(max_tokens=1), frozenset(), 256), runner.device)
    cache = CacheManager(EngineConfig(max_model_len=256, max_num_seqs=1).total_pages, 16, 1 if runner.is_hybrid else 0)
    cache.grow(seq, len(ids))
    cache.claim_state_slot(seq)
    with torch.inference_mode():
        return target.compute_logits(runner.forward([Entry(seq, 0, ids)], num_prefill_seqs=1))


@pytest.fixture(scope="module")
def expected_greedy(moe) -> dict[str, list[list[int]]]:
    """transformers' greedy continuations of GREEDY_PROMPTS, per kind (computed once)."""
    out = {}
    for kind in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        ref = moe[kind][0]
        out[kind] = []
        for prompt in GREEDY_PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
            out[kind].append(tokens[0, len(prompt):].tolist())
    return out


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


PROMPT = [int(t) for t in torch.randint(0, VOCAB - 1, (48,), generator=torch.Generator().manual_seed(1))]
GREEDY_PROMPTS = [PROMPT[:5], PROMPT]


# ── agreement with transformers ────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_logits_equal_transformers(moe, kind, layout):
    ref, per_expert, fused = moe[kind]
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    assert relative_error(our_logits(per_expert if layout == "per_expert" else fused, PROMPT), expected) < 1e-4


def test_sparse_layers_follow_the_config(moe):
    def kinds(kind: str) -> list[str]:
        return [type(layer.mlp).__name__ for layer in load_model(str(moe[kind][1])).model.model.layers]
    assert kinds("qwen3_moe") == ["SparseMoE", "SparseMoE", "MLP", "SparseMoE"]          # mlp_only_layers=[2]
    assert kinds("qwen3_next") == ["MLP", "SparseMoE", "MLP", "SparseMoE"]               # decoder_sparse_step=2
    assert kinds("qwen3_5_moe") == ["SparseMoE"] * 4


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_greedy_equals_transformers_generate(moe, one_tokenizer, expected_greedy, kind, layout):
    _, per_expert, fused = moe[kind]
    llm = LLM(str(per_expert if layout == "per_expert" else fused), max_model_len=256, show_progress=False)
    for prompt, expected in zip(GREEDY_PROMPTS, expected_greedy[kind], strict=True):
        assert llm.generate_ids(prompt, SamplingParams(max_tokens=24)).token_ids == expected, len(prompt)


# ── DFlash on MoE targets ──────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_dflash_equals_plain_alone_and_in_a_batch(moe, one_tokenizer, kind, tmp_path):
    _, target_dir, _ = moe[kind]
    draft_dir = fixtures.write_dflash_draft(tmp_path / "draft", target_dir, target_layer_ids=[0, 2],
                                            mask_token_id=VOCAB - 1)
    prompts = [PROMPT[:7], PROMPT[20:40], PROMPT[10:13]]
    params = SamplingParams(max_tokens=20)
    plain = LLM(str(target_dir), max_model_len=256, show_progress=False)
    reference = [plain.generate_ids(p, params).token_ids for p in prompts]
    assert all(len(set(tokens)) > 3 for tokens in reference)
    for block_size in (1, 4, 8, 16):
        llm = LLM(str(target_dir), draft=str(draft_dir), block_size=block_size, max_model_len=256,
                  show_progress=False)
        assert [llm.generate_ids(p, params).token_ids for p in prompts] == reference, block_size
        assert [r.token_ids for r in llm.generate(prompts, params)] == reference, block_size


def oracle_drafts(references: dict[tuple[int, ...], list[int]], wrong_every: int):
    """A stand-in for spec.dflash.propose that proposes each sequence's plain continuation, with every
    `wrong_every`-th output position wrong: whole blocks and partial ones get accepted."""
    from blockspec.engine.spec.dflash import Proposal

    def propose(out, seqs: list[Sequence], confidence: bool = False) -> Proposal:
        logits = out.logits                             # the forward's DraftReadout
        rows = []
        for seq in seqs:
            reference = references[tuple(seq.request.prompt_ids)] + [0] * logits.shape[1]
            start = len(seq.request.output_ids)                 # output[-1] is the anchor x
            rows.append([(t + 1) % (VOCAB - 1) if (start + i) % wrong_every == wrong_every - 1 else t
                         for i, t in enumerate(reference[start: start + logits.shape[1]])])
        return Proposal(torch.tensor(rows, device=logits.device), [None] * len(seqs))
    return propose


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_partial_acceptance_rolls_back_exactly(moe, one_tokenizer, kind, tmp_path, monkeypatch):
    """Drafts right for a few tokens then wrong: every partial rollback (K/V by length, the
    recurrent state picked at a_b) leaves the output equal to plain decoding, alone and batched."""
    from blockspec.engine import model_runner
    _, target_dir, _ = moe[kind]
    draft_dir = fixtures.write_dflash_draft(tmp_path / "draft", target_dir, target_layer_ids=[0, 2],
                                            mask_token_id=VOCAB - 1)
    prompts = [PROMPT[:7], PROMPT[20:40]]
    params = SamplingParams(max_tokens=30)
    plain = LLM(str(target_dir), max_model_len=256, show_progress=False)
    references = {tuple(p): plain.generate_ids(p, params).token_ids for p in prompts}
    monkeypatch.setattr(model_runner, "propose", oracle_drafts(references, wrong_every=5))
    llm = LLM(str(target_dir), draft=str(draft_dir), block_size=8, max_model_len=256, show_progress=False)
    alone = [llm.generate_ids(p, params) for p in prompts]
    assert [r.token_ids for r in alone] == list(references.values())
    # Partial blocks wherever drafts were verified (the plain arm's steps verify none: policy.Arms)
    drafting = [n for r in alone for n, k in zip(r.stats.acceptance_lengths[1:], r.stats.verify_widths[1:]) if k]
    assert len(drafting) >= 4 and all(1 < n < 8 for n in drafting)
    assert [r.token_ids for r in llm.generate(prompts, params)] == list(references.values())


# ── the experts kernels ────────────────────────────────────────────────────────────────────────

def test_the_cost_probe_routes_its_rows_as_text_does(moe, one_tokenizer, monkeypatch):
    """The adaptive policy's cost table times each verify bucket on padding rows
    (ModelRunner.probe). A MoE verify's cost grows with the experts its rows read, so those rows
    must route as distinct tokens do: rows of one token are one hidden state in every layer and
    pick one expert set, and the table priced a 16-row verify like one row's."""
    from blockspec.layers import moe as moe_layers
    _, target_dir, _ = moe["qwen3_moe"]
    runner = LLM(str(target_dir), max_model_len=256, show_progress=False).engine.runner
    routed: list[torch.Tensor] = []
    real_route = moe_layers.route

    def route_spy(logits, top_k, normalize):
        weights, experts = real_route(logits, top_k, normalize)
        routed.append(experts)
        return weights, experts
    monkeypatch.setattr(moe_layers, "route", route_spy)
    runner.probe("verify", 16)
    assert len(routed) == 3                                         # the sparse layers (layer 2 is dense)
    for experts in routed:
        assert experts.shape == (16, EXPERTS["num_experts_per_tok"])
        assert len({tuple(sorted(row)) for row in experts.tolist()}) > 1       # rows route apart
        assert len(experts.unique()) > EXPERTS["num_experts_per_tok"]


def random_experts(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_experts, hidden, inter = 8, 32, 16
    x = torch.randn(num_tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return x, x @ router.T, gate_up, down


@pytest.mark.parametrize("kernel", [grouped_experts, gathered_experts])
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64])
def test_fixed_shape_kernels_equal_the_reference(kernel, num_tokens):
    x, logits, gate_up, down = random_experts(num_tokens)
    weights, experts = route(logits, 3, normalize=True)
    expected = reference_experts(x, weights, experts, gate_up, down)
    assert (kernel(x, weights, experts, gate_up, down) - expected).abs().max() < 1e-5


def test_reference_experts_follow_the_stated_math():
    """Token by token: Σ_k w_k · down_e(silu(gate_e x) · up_e x) over its top-k experts."""
    x, logits, gate_up, down = random_experts(4, seed=1)
    weights, experts = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, dim=-1)
    out = reference_experts(x, weights, experts, gate_up, down)
    for t in range(4):
        chosen = probs[t].argsort(descending=True)[:2]
        expected = sum(probs[t, e] * down[e] @ (F.silu(gate_up[e, :16] @ x[t]) * (gate_up[e, 16:] @ x[t]))
                       for e in chosen.tolist())
        assert torch.allclose(out[t], expected, atol=1e-5)
    normalised, _ = route(logits, 2, normalize=True)
    assert torch.allclose(normalised.sum(-1), torch.ones(4))


def test_cpu_uses_the_reference_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_experts_kernel(cpu, torch.float32) is select_experts_kernel(cpu, torch.bfloat16) is reference_experts
    if moe_kernels.is_available():
        assert select_experts_kernel(cuda, torch.bfloat16) is select_experts_kernel(cuda, torch.float32) \
            is moe_kernels.fused_experts
    else:
        assert select_experts_kernel(cuda, torch.bfloat16) is grouped_experts
        assert select_experts_kernel(cuda, torch.float32) is gathered_experts


def test_the_arrivals_are_on_and_the_k_split_off_unless_the_environment_says(monkeypatch):
    """BLOCKSPEC_MOE_ARRIVALS: on unless "0" (round 68, after its GPU run); BLOCKSPEC_MOE_SPLIT_K:
    unsplit unless a whole number of parts is given (opt-in until a GPU run measures it)."""
    for value, on in ((None, True), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv("BLOCKSPEC_MOE_ARRIVALS", raising=False)
        else:
            monkeypatch.setenv("BLOCKSPEC_MOE_ARRIVALS", value)
        assert moe_kernels.arrivals_from_env() is on, value
    for value, parts in ((None, 1), ("4", 4), ("0", 1), ("two", 1), ("", 1)):
        if value is None:
            monkeypatch.delenv("BLOCKSPEC_MOE_SPLIT_K", raising=False)
        else:
            monkeypatch.setenv("BLOCKSPEC_MOE_SPLIT_K", value)
        assert moe_kernels.split_k_from_env() == parts, value


INTERPRETED_KERNEL_CHECK = """
import torch
from blockspec.kernels import moe as K
from blockspec.layers.moe import reference_experts, route
gen = torch.Generator().manual_seed(0)
# Every buffer the kernels allocate starts poisoned (NaN, or -7 for ids), never with an earlier
# call's values: a row read before it is written shows.
real_empty = torch.empty
def poisoned(*args, **kwargs):
    t = real_empty(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else -7)
torch.empty = poisoned
# (experts, tokens, top-k, skewed): both tile sets, both aligners (one program / torch past 256 pairs)
for num_experts, num_tokens, top_k, skewed in [(8, 1, 2, False), (16, 5, 4, False), (16, 40, 8, False),
                                               (128, 3, 8, False), (16, 33, 8, True)]:
    hidden, inter = 32, 16
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skewed:                                   # every token chooses the same experts
        logits[:, :top_k] += 100.0
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, experts = route(logits, top_k, normalize=True)
    flat = experts.flatten()
    length = K.max_padded_pairs(flat.numel(), num_experts, 16)
    if flat.numel() <= K.MAX_PAIRS_ONE_PROGRAM:
        for ours, ref in zip(K.align(flat, num_experts, 16, length), K.align_torch(flat, num_experts, 16, length)):
            assert torch.equal(ours, ref), (ours, ref)
    ours = K.fused_experts(x, weights, experts, gate_up, down)
    error = (ours - reference_experts(x, weights, experts, gate_up, down)).abs().max().item()
    assert error < 1e-5, (num_experts, num_tokens, top_k, skewed, error)
    fused_weights, fused_experts, none = K.route_fused(logits, x, top_k, True, None)
    assert torch.equal(fused_experts.long(), experts) and (fused_weights - weights).abs().max() < 1e-6
    assert none is None
    # the arrivals: the slot sum taken by the down launch is torch's sum over the slots, bit for bit
    assert torch.equal(K.fused_experts(x, weights, experts, gate_up, down, slot_sum=True), ours)
    if flat.numel() <= K.MAX_PAIRS_ONE_PROGRAM:
        # routing and alignment in one launch: the same ids, weights and alignment as two launches
        plan = K.align_plan(flat.numel(), num_experts, False)
        w2, e2, routing = K.route_fused(logits, x, top_k, True, None, plan)
        assert torch.equal(w2, fused_weights) and torch.equal(e2, fused_experts)
        for got, want in zip(routing, K.align(e2.flatten(), num_experts, plan.block_m, plan.sorted_len)):
            assert torch.equal(got, want), (got, want)
        assert torch.equal(K.fused_experts(x, w2, e2, gate_up, down, routing=routing, slot_sum=True),
                           K.fused_experts(x, w2, e2, gate_up, down))
        assert int(K.arrival_counters(x.device).abs().sum()) == 0       # every count put back to 0

# the gate/up GEMM's K in parts (BLOCKSPEC_MOE_SPLIT_K): each part's fp32 sums stored, the last part of a
# tile adding them in part order (the same sums to rounding), every count back at 0; K of 2, 3 and 3 tiles
# (the last part ragged), so every split really runs parts
real_parts, splits = K.k_split, []
K.k_split = lambda *args: splits.append(real_parts(*args)) or splits[-1]
for num_experts, num_tokens, top_k, hidden, split in [(8, 1, 2, 256, 2), (16, 3, 4, 320, 4), (8, 2, 2, 300, 8)]:
    inter = 16
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, experts = route(logits, top_k, normalize=True)
    K.SPLIT_K = 1
    whole = K.fused_experts(x, weights, experts, gate_up, down)
    K.SPLIT_K, splits[:] = split, []
    parted = K.fused_experts(x, weights, experts, gate_up, down)
    K.SPLIT_K = 1
    assert max(parts for parts, _ in splits) == min(split, -(-hidden // 128)), (split, splits)
    reference = reference_experts(x, weights, experts, gate_up, down)
    assert (parted - reference).abs().max() < 1e-5 and (parted - whole).abs().max() < 1e-5, split
    assert int(K.arrival_counters(x.device).abs().sum()) == 0
K.k_split = real_parts

# the whole sparse block (SparseMoE.fused_forward): router in one launch, shared expert as a slot
# (its intermediate size = the experts'), or added densely (another size)
from blockspec.config import MoeConfig
from blockspec.layers.moe import SparseMoE
for shared_size, normalize in [(16, True), (24, False), (0, True)]:
    config = MoeConfig(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, normalize=normalize,
                       shared_expert_intermediate_size=shared_size)
    layer = SparseMoE(32, config)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    x = torch.randn(6, 32, generator=gen)
    layer.kernel = reference_experts
    expected = layer(x)
    layer.kernel = K.fused_experts
    K.ARRIVALS = False                           # the separate launches first (ARRIVALS is on by default)
    fused = layer(x)
    error = (fused - expected).abs().max().item()
    assert error < 1e-5, (shared_size, error)
    K.ARRIVALS = True                            # BLOCKSPEC_MOE_ARRIVALS=1: the same bits in fewer launches
    calls, real_experts, real_align = [], K.fused_experts, K.align
    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_experts(*args, **kwargs)
    def no_align(*args, **kwargs):
        raise AssertionError("the pairs aligned in a launch of their own")
    K.fused_experts, K.align, layer.kernel = spy, no_align, spy     # the layer's kernel is the module's
    assert torch.equal(layer(x), fused), shared_size
    assert calls and calls[-1]["slot_sum"] and calls[-1]["routing"] is not None, calls
    K.fused_experts, K.align, K.ARRIVALS = real_experts, real_align, False
print("ok")
"""


def test_triton_kernel_equals_the_reference_in_the_interpreter():
    """The Triton MoE kernel, run by Triton's CPU interpreter (a fresh process: the interpreter is
    chosen when the kernels are defined), on tiny shapes; on the GPU: tests/gpu/test_moe_kernel.py."""
    pytest.importorskip("triton")
    done = run_interpreted(INTERPRETED_KERNEL_CHECK)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ── loading ────────────────────────────────────────────────────────────────────────────────────

def test_sharded_checkpoint_with_index_loads(moe, tmp_path):
    ref, per_expert, _ = moe["qwen3_5_moe_mm"]
    ref.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_model(str(tmp_path)).model.state_dict()
    whole = load_model(str(per_expert)).model.state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[name], whole[name]) for name in whole)


def rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


EXPERT_0 = "model.layers.0.mlp.experts.0.gate_proj.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__(EXPERT_0.replace(".0.gate", ".8.gate"), t.pop(EXPERT_0)),
     "names expert 8, but the config has 8"),
    (lambda t: t.__setitem__(EXPERT_0.replace("gate_proj", "gate"), t.pop(EXPERT_0)), "has no place"),
    (lambda t: t.pop(EXPERT_0), "lacks 1 tensors, first: 'model.layers.0.mlp.experts.gate_up_proj' "
                                "\\(some of its experts are missing\\)"),
    (lambda t: t.__setitem__(EXPERT_0, t[EXPERT_0][:, :8].contiguous()),
     r"has shape \(16, 8\), the model expects \(16, 32\)"),
])
def test_bad_expert_tensors_are_clear_errors(moe, tmp_path, edit, message):
    path = rewrite(moe["qwen3_moe"][1], tmp_path / "bad", edit)
    with pytest.raises(LoadError, match=message):
        load_model(str(path))


def test_an_expert_given_twice_is_an_error(moe, tmp_path):
    _, per_expert, fused = moe["qwen3_moe"]
    fused_layer_0 = {name: tensor for name, tensor in load_file(str(fused / "model.safetensors")).items()
                     if name.startswith("model.layers.0.mlp.experts.gate_up")}
    both = rewrite(per_expert, tmp_path / "both", lambda tensors: tensors.update(fused_layer_0))
    with pytest.raises(LoadError, match="'model.layers.0.mlp.experts.gate_up_proj' is given twice"):
        load_model(str(both))


# ── configs we do not serve ────────────────────────────────────────────────────────────────────

def moe_config(**overrides) -> dict:
    return {**ATTENTION, **EXPERTS, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **overrides}


@pytest.mark.parametrize("overrides, message", [
    (dict(scoring_func="sigmoid"), "router with scoring_func='sigmoid' is not supported"),
    (dict(n_group=8, topk_group=4), "router with n_group=8 is not supported"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be in 1..num_experts"),
    (dict(model_type="mixtral", architectures=["Qwen3ForCausalLM"]), "mixture-of-experts is supported for"),
])
def test_unsupported_moe_variants_are_one_line_errors(tmp_path, overrides, message):
    config = moe_config(**overrides)
    with pytest.raises(ConfigError, match=message):
        MoeConfig.from_hf(config, config["architectures"][0])
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=message) as error:
        load_model(str(tmp_path))
    assert "\n" not in str(error.value)


def test_all_sparse_configs_need_no_dense_intermediate_size():
    config = {k: v for k, v in moe_config().items() if k != "intermediate_size"}
    assert MoeConfig.from_hf(config, "Qwen3MoeForCausalLM").num_experts == 8
    from blockspec.config import ModelConfig
    assert ModelConfig.from_hf(config, "Qwen3MoeForCausalLM").moe.normalize is False
    with pytest.raises(ConfigError, match="intermediate_size is missing"):
        ModelConfig.from_hf({**config, "mlp_only_layers": [1]}, "Qwen3MoeForCausalLM")
