"""`blockspec train-draft`: the training forward is the decoding forward, training raises real
acceptance, resume and data-parallel runs are exact, and the output is a draft our loader loads."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockspec.loader import load_draft, load_model
from blockspec.train import blockwise, features
from blockspec.train.loop import TrainConfig, train

from tokenizer_fixtures import write_tokenizer_files

VOCAB = 256
MASK_ID = VOCAB - 1


def write_tiny_target(directory: Path, num_layers: int = 1) -> Path:
    """A random Qwen3 target with a small vocabulary: its greedy text is a fixed but non-trivial
    function of the context, which a draft can learn in a few hundred steps."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=VOCAB - 2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)      # clear-cut greedy choices (see fixtures.scale_up_logits)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, "qwen3")
    return directory


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("train") / "target")


def write_greedy_data(target_dir: Path, path: Path, num: int, seed: int) -> Path:
    """Self-distillation data: random 8-token prompts and the target's greedy continuations."""
    target = load_model(str(target_dir)).model
    prompts = torch.randint(0, VOCAB - 2, (num, 8), generator=torch.Generator().manual_seed(seed))
    continuations = features.greedy_continue(target, prompts, 56)
    rows = [{"token_ids": p + c, "prompt_len": 8} for p, c in zip(prompts.tolist(), continuations.tolist())]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_data(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train-data")
    return (write_greedy_data(tiny_target, root / "train.jsonl", 512, seed=1),
            write_greedy_data(tiny_target, root / "eval.jsonl", 16, seed=2))


def config(target: Path, data: Path, out: Path, **overrides) -> TrainConfig:
    settings = dict(target=str(target), out=str(out), data=str(data), num_layers=1, block_size=4, steps=20,
                    batch_size=4, lr=1e-2, seq_len=64, device="cpu", eval_every=0, eval_prompts=0,
                    save_every=10, mask_token_id=MASK_ID, seed=3, show_progress=False)
    return TrainConfig(**{**settings, **overrides})


def decode_time_draft(draft, context: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
    """The draft as the engine drives it for one sequence: context features [C, K·H] appended to
    its paged pool, then one block [T, H] right after them → hidden [T, H]."""
    from blockspec.cache import KVPool
    from blockspec.layers import AttentionMetadata
    c, page, num_context, width = draft.config, 16, context.shape[0], block_embeds.shape[0]
    pool = KVPool(c.num_hidden_layers, 9 * page, c.num_key_value_heads, c.head_dim, torch.float32, torch.device("cpu"))
    table = torch.arange(1, 9)[None]                                          # page 0 is reserved
    positions = torch.arange(num_context)
    draft.append_context(context, positions, table[0, positions // page] * page + positions % page, pool.layers)
    block_positions = torch.arange(num_context, num_context + width)
    meta = AttentionMetadata(num_seqs=1, width=width, input_ids=torch.zeros_like(block_positions),
                             positions=block_positions, slot_mapping=torch.zeros_like(block_positions),
                             block_tables=table, context_lens=torch.tensor([num_context]),
                             max_context_len=num_context + width, page_size=page, kv=pool.layers)
    return draft(block_embeds, block_positions, meta)


def test_training_forward_equals_the_decoding_forward(qwen3_dir, qwen3_draft_dir):
    """Many anchors under the block-sparse mask = one DFlash draft call per anchor."""
    target = load_model(str(qwen3_dir)).model
    draft = load_draft(str(qwen3_draft_dir), target)
    ids = torch.randint(0, 151643, (2, 40), generator=torch.Generator().manual_seed(0))
    anchors, block_size = torch.tensor([[5, 17, 30], [1, 9, 33]]), 4
    context = features.target_features(target, ids, draft.target_layer_ids)
    blocks = torch.full((2, 3, block_size), draft.mask_token_id)
    blocks[..., 0] = torch.gather(ids, 1, anchors)
    mask = blockwise.block_sparse_mask(anchors, 40, block_size)
    hidden = blockwise.draft_hidden(draft, target.embed(blocks.flatten(1)), context,
                                    blockwise.block_positions(anchors, block_size), mask).view(2, 3, block_size, -1)
    for b in range(2):
        for j in range(3):
            anchor = int(anchors[b, j])
            reference = decode_time_draft(draft, context[b, :anchor], target.embed(blocks[b, j]))
            torch.testing.assert_close(hidden[b, j], reference, atol=1e-5, rtol=1e-5)


class DraftSpy:
    """Records, per draft forward of the engine, the block's positions and the draft's logits."""

    def __init__(self, draft) -> None:
        self.positions: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        forward, propose = draft.forward, draft.propose

        def spied_forward(block_embeds, positions, meta):
            self.positions.append(positions.clone())
            return forward(block_embeds, positions, meta)

        def spied_propose(hidden, anchors, lm_head):
            self.logits.append(propose(hidden, anchors, lm_head).clone())
            return self.logits[-1]
        draft.forward, draft.propose = spied_forward, spied_propose


def test_the_trainers_draft_logits_are_the_engines_and_its_labels_what_verify_accepts(tmp_path):
    """train-draft's forward (its own target features, layer ids, mask token, block positions
    and mask) at the anchor of every cycle the engine drafts gives the logits the engine's draft
    gave there, and its labels are what the verify accepts: the cycle at anchor p commits one
    token more than the leading slots whose argmax equals label k = the token at p + k."""
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    from blockspec.train.loop import Ranks, Trainer, run
    target = write_tiny_target(tmp_path / "target", num_layers=4)
    data = write_greedy_data(target, tmp_path / "data.jsonl", 32, seed=1)
    block = 4
    trainer = Trainer(config(target, data, tmp_path / "draft", block_size=block, steps=40, batch_size=8,
                             target_layer_ids=(0, 2), save_every=0), Ranks(0, 1, torch.device("cpu")))
    run(trainer)                                   # a draft that accepts some drafts and not others
    # Fixed: every cycle drafts the whole block, which is what the trainer's block logits are.
    llm = LLM(str(target), draft=str(tmp_path / "draft"), block_size=block, device="cpu", show_progress=False,
              speculation="fixed")
    spy = DraftSpy(llm.engine.runner.draft)
    prompts = torch.randint(0, VOCAB - 2, (3, 8), generator=torch.Generator().manual_seed(5)).tolist()
    cycles = []
    for prompt in prompts:
        first_cycle = len(spy.logits)
        result = llm.generate_ids(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        tokens = prompt + result.token_ids
        ids = torch.tensor([tokens + [0] * (64 - len(tokens))])
        anchors = torch.tensor([[int(p[0]) for p in spy.positions[first_cycle:]]])
        assert anchors[0, 0] == len(prompt)                      # the first draft: right after the prompt
        assert all(torch.equal(p, p[0] + torch.arange(block)) for p in spy.positions[first_cycle:])
        with torch.no_grad():
            trained = trainer.block_logits(ids, anchors)[0]                          # [cycles, bs − 1, V]
            every = trainer.block_logits(ids, torch.arange(len(prompt), len(tokens) - 1)[None])[0]
        torch.testing.assert_close(trained, torch.cat(spy.logits[first_cycle:]), atol=1e-4, rtol=1e-4)
        labels, valid = blockwise.block_labels(ids, torch.tensor([len(tokens)]), anchors,
                                               torch.ones_like(anchors, dtype=torch.bool), block)
        agree = ((trained.argmax(-1) == labels[0]) & valid[0]).long().cumprod(-1).sum(-1)
        remaining = len(tokens) - 1 - anchors[0]
        assert torch.minimum(agree + 1, remaining).tolist() == result.stats.acceptance_lengths
        assert blockwise.replay_greedy(tokens, every.argmax(-1).tolist(), len(prompt)) == result.stats.acceptance_lengths
        cycles += result.stats.acceptance_lengths
    assert 1 in cycles and any(1 < n < block for n in cycles) and max(cycles) == block, cycles


def test_target_labels_are_the_targets_greedy_choices(tiny_target, tiny_data, tmp_path):
    """--labels target: slot k learns what greedy verification accepts, the target's own argmax
    for token a + k given the row (transformers' argmax on the same checkpoint), not a sampled
    row's token. On greedy rows the two labels are the same, so the same run trains the same
    draft bit for bit; on other rows the drafts differ."""
    from transformers import AutoModelForCausalLM
    rows = torch.randint(0, VOCAB - 2, (3, 40), generator=torch.Generator().manual_seed(7))   # any tokens: "sampled"
    _, choices = features.features_and_choices(load_model(str(tiny_target)).model, rows, (0,), chunk=7)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tiny_target).eval()(rows).logits.argmax(-1)
    assert torch.equal(choices[:, 1:], expected[:, :-1]) and torch.equal(choices[:, 0], rows[:, 0])
    assert (choices[:, 1:] != rows[:, 1:]).float().mean() > 0.9

    def trained(data: Path, labels: str) -> dict:
        out = tmp_path / f"{data.stem}-{labels}"
        train(config(tiny_target, data, out, steps=6, save_every=0, labels=labels))
        return load_file(str(out / "model.safetensors"))
    greedy_tokens, greedy_target = trained(tiny_data[0], "tokens"), trained(tiny_data[0], "target")
    assert all(torch.equal(greedy_tokens[k], greedy_target[k]) for k in greedy_tokens)
    sampled = tmp_path / "sampled.jsonl"
    sampled.write_text("".join(json.dumps({"token_ids": r, "prompt_len": 8}) + "\n" for r in
                               torch.randint(0, VOCAB - 2, (32, 64), generator=torch.Generator().manual_seed(8)).tolist()))
    sampled_tokens, sampled_target = trained(sampled, "tokens"), trained(sampled, "target")
    assert not all(torch.equal(sampled_tokens[k], sampled_target[k]) for k in sampled_tokens)
    with pytest.raises(ValueError, match="--labels"):
        config(tiny_target, sampled, tmp_path / "x", labels="soft")


def test_distill_labels_are_the_targets_truncated_distribution(tiny_target, tmp_path, monkeypatch):
    """--labels distill: slot k learns the target's distribution for token a + k given the row
    (transformers' softmax on the same checkpoint, its top tokens renormalised); its loss is the
    cross-entropy against that distribution (the KL divergence up to the target's entropy), and
    at one kept token it is the greedy-choice loss of --labels target."""
    from transformers import AutoModelForCausalLM
    from blockspec.train import loop
    from blockspec.train.loop import Ranks, Trainer
    rows = torch.randint(0, VOCAB - 2, (3, 40), generator=torch.Generator().manual_seed(7))
    model = load_model(str(tiny_target)).model
    _, choices = features.features_and_choices(model, rows, (0,), chunk=7)
    _, top_ids, top_probs = features.features_and_distributions(model, rows, (0,), 5, chunk=7)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tiny_target).eval()(rows).logits.float()
    values, indices = expected[:, :-1].topk(5, dim=-1)
    assert torch.equal(top_ids[:, 1:], indices) and torch.equal(top_ids[:, 1:, 0], choices[:, 1:])
    assert torch.allclose(top_probs[:, 1:], values.softmax(-1), atol=1e-5)
    assert torch.equal(top_ids[:, 0, 0], rows[:, 0]) and torch.equal(top_probs[:, 0, 0], torch.ones(3))
    assert top_probs[:, 0, 1:].abs().sum() == 0

    # the loss against a whole distribution is KL + the target's entropy
    gen = torch.Generator().manual_seed(3)
    logits, target_logits = torch.randn(2, 3, 4, 11, generator=gen), torch.randn(2, 3, 4, 11, generator=gen)
    q, weights = target_logits.softmax(-1), torch.rand(2, 3, 4, generator=gen)
    ids = torch.arange(11).expand(2, 3, 4, 11)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), q, reduction="none").sum(-1)
    entropy = -(q * q.log()).sum(-1)
    assert torch.allclose(blockwise.soft_block_loss(logits, ids, q, weights), ((kl + entropy) * weights).sum(), atol=1e-5)

    # one kept token: --labels target's loss on the same batch
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"token_ids": r, "prompt_len": 8}) + "\n" for r in rows.tolist()))
    monkeypatch.setattr(loop, "DISTILL_TOP", 1)
    losses = {}
    for labels in ("target", "distill"):
        trainer = Trainer(config(tiny_target, data, tmp_path / labels, batch_size=3, labels=labels),
                          Ranks(0, 1, torch.device("cpu")))
        batch, anchors, valid, _ = trainer.batch(0)
        losses[labels] = float(trainer.loss_sum(batch, anchors, valid).detach())
    assert losses["distill"] == pytest.approx(losses["target"], rel=1e-6)


def test_a_distilled_draft_trains_and_resumes(tiny_target, tiny_data, tmp_path):
    """train-draft --labels distill end to end: it learns (the loss falls), saves a draft our
    loader loads, and a run cut short and resumed gives the uninterrupted run's draft bit for bit."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(config(tiny_target, tiny_data[0], whole, steps=8, save_every=4, labels="distill"))
    shutil.copytree(whole / "checkpoints" / "step-00000004", cut / "checkpoints" / "step-00000004")
    train(config(tiny_target, tiny_data[0], cut, steps=8, save_every=4, labels="distill", resume=True))
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (whole / "train_log.jsonl").read_text().splitlines() if "loss" in line]
    assert log[-1]["loss"] < log[0]["loss"]
    load_draft(str(whole), load_model(str(tiny_target)).model)


def test_init_from_starts_from_a_saved_drafts_weights(tiny_target, tiny_data, tmp_path):
    """--init-from: the run's draft starts as the saved one (bf16 weights as saved, now fp32) and
    trains from there; a draft of another shape or layer ids is a one-line error."""
    from blockspec.train.loop import Ranks, Trainer, TrainError
    train(config(tiny_target, tiny_data[0], tmp_path / "first", steps=6, save_every=0))
    saved = load_file(str(tmp_path / "first" / "model.safetensors"))
    trainer = Trainer(config(tiny_target, tiny_data[0], tmp_path / "second", init_from=str(tmp_path / "first"),
                             block_size=8), Ranks(0, 1, torch.device("cpu")))
    mine = trainer.draft.state_dict()
    assert saved.keys() <= mine.keys()
    assert all(torch.equal(mine[k], saved[k].float()) for k in saved)
    fresh = Trainer(config(tiny_target, tiny_data[0], tmp_path / "third"), Ranks(0, 1, torch.device("cpu")))
    assert not torch.equal(fresh.draft.state_dict()["fc.weight"], mine["fc.weight"])
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "first", other)
    saved_config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**saved_config, "intermediate_size": 96}))
    with pytest.raises(TrainError, match="other settings \\(intermediate_size"):
        Trainer(config(tiny_target, tiny_data[0], tmp_path / "fourth", init_from=str(other)),
                Ranks(0, 1, torch.device("cpu")))


def test_init_from_grows_a_shallower_draft_computing_what_it_did(tiny_target, tiny_data, tmp_path):
    """--init-from a 1-layer draft into a 2-layer run: the saved layer first, the new one with
    zero output projections, so every block's logits are the saved draft's exactly; training
    then moves the new layer (its projections' gradients are not zero). A deeper saved draft
    than the run's is a one-line error."""
    from blockspec.train.loop import Ranks, Trainer, TrainError
    cpu = Ranks(0, 1, torch.device("cpu"))
    train(config(tiny_target, tiny_data[0], tmp_path / "first", steps=6, save_every=0))
    same = Trainer(config(tiny_target, tiny_data[0], tmp_path / "same", init_from=str(tmp_path / "first")), cpu)
    grown = Trainer(config(tiny_target, tiny_data[0], tmp_path / "grown", init_from=str(tmp_path / "first"),
                           num_layers=2, target_layer_ids=same.layer_ids), cpu)
    assert len(grown.draft.layers) == 2 and not torch.all(grown.draft.layers[1].self_attn.qkv_proj.weight == 0)
    ids = torch.tensor(json.loads(tiny_data[0].read_text().splitlines()[0])["token_ids"])[None]
    anchors = torch.tensor([[3, 11, 20, 40]])
    expected, logits = same.block_logits(ids, anchors), grown.block_logits(ids, anchors)
    assert torch.equal(logits, expected)
    logits.float().logsumexp(-1).sum().backward()
    layer = grown.draft.layers[1]
    assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0
    train(config(tiny_target, tiny_data[0], tmp_path / "deep", steps=2, save_every=0, num_layers=2,
                 target_layer_ids=same.layer_ids))
    with pytest.raises(TrainError, match="other settings \\(num_hidden_layers"):
        Trainer(config(tiny_target, tiny_data[0], tmp_path / "fourth", init_from=str(tmp_path / "deep")), cpu)


def test_block_sparse_mask_sees_the_past_context_and_its_own_block():
    mask = blockwise.block_sparse_mask(torch.tensor([[2, 5]]), seq_len=6, block_size=2)[0, 0]
    assert mask.shape == (4, 6 + 4)
    assert mask[0, :6].tolist() == [True, True, False, False, False, False]     # anchor 2: positions 0, 1
    assert mask[3, :6].tolist() == [True] * 5 + [False]                          # anchor 5: positions 0 … 4
    assert mask[:, 6:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2
    weights = blockwise.position_weights(8, torch.device("cpu"))
    assert weights[0] == 1 and torch.all(weights[1:] < weights[:-1]) and len(weights) == 7


def test_train_draft_beats_an_untrained_draft(tiny_target, tiny_data, tmp_path):
    """Mean acceptance length on held-out prompts, measured by our engine, before and after."""
    out = tmp_path / "draft"
    summary = train(config(tiny_target, tiny_data[0], out, eval_data=str(tiny_data[1]), steps=200,
                           batch_size=16, eval_every=200, eval_prompts=8, eval_tokens=48, save_every=0))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    untrained, trained = log[0]["acceptance_length"], summary["acceptance_length"]
    assert log[0]["step"] == 0 and untrained < 1.1
    print(f"acceptance length: untrained {untrained:.3f}, trained {trained:.3f}")
    assert trained > untrained + 0.3, (untrained, trained)
    # z-lab's format, loadable by our loader; the target's embedding and head are not in it
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["block_size"] == 4
    assert saved["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0]}
    assert not any("embed" in k or "lm_head" in k for k in load_file(str(out / "model.safetensors")))
    draft = load_draft(str(out), load_model(str(tiny_target)).model)
    assert draft.block_size == 4 and draft.mask_token_id == MASK_ID


def test_resume_continues_bit_for_bit(tiny_target, tiny_data, tmp_path):
    train(config(tiny_target, tiny_data[0], tmp_path / "full"))
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-00000010", resumed / "checkpoints" / "step-00000010")
    train(config(tiny_target, tiny_data[0], resumed, resume=True))
    full, again = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert full.keys() == again.keys()
    assert all(torch.equal(full[k], again[k]) for k in full)
    with pytest.raises(ValueError, match="other settings"):
        train(config(tiny_target, tiny_data[0], resumed, resume=True, lr=1e-3))


def test_a_run_stopped_by_max_seconds_saves_and_resumes_to_the_full_run(tiny_target, tiny_data, tmp_path):
    train(config(tiny_target, tiny_data[0], tmp_path / "full", steps=4, save_every=2))
    cut = tmp_path / "cut"
    summary = train(config(tiny_target, tiny_data[0], cut, steps=4, save_every=2, max_seconds=1e-9))
    assert summary["step"] == 1 and summary["stopped_by_max_seconds"]
    assert (cut / "checkpoints" / "step-00000001").is_dir() and (cut / "model.safetensors").exists()
    assert train(config(tiny_target, tiny_data[0], cut, steps=4, save_every=2, resume=True))["step"] == 4
    full, again = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert all(torch.equal(full[k], again[k]) for k in full)
    with pytest.raises(ValueError, match="--max-seconds"):
        config(tiny_target, tiny_data[0], cut, max_seconds=0)


def test_two_gloo_processes_equal_one(tiny_target, tiny_data, tmp_path):
    """torchrun with 2 CPU processes, global batch 4 = one process with batch 4."""
    one = tmp_path / "one"
    train(config(tiny_target, tiny_data[0], one, steps=6, save_every=0))
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "blockspec",
         "train-draft", "--target", str(tiny_target), "--out", str(two), "--data", str(tiny_data[0]),
         "--num-layers", "1", "--block-size", "4", "--steps", "6", "--batch-size", "4", "--lr", "1e-2",
         "--seq-len", "64", "--device", "cpu", "--eval-every", "0", "--eval-prompts", "0", "--save-every", "0",
         "--mask-token-id", str(MASK_ID), "--seed", "3", "--quiet"],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4)   # up to summation order


def test_prompts_are_answered_by_the_target_through_the_engine(qwen3_dir, tmp_path):
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
                       + json.dumps({"prompt": "def f(x):"}) + "\n")
    out = tmp_path / "draft"
    train(TrainConfig(target=str(qwen3_dir), out=str(out), data=str(prompts), num_layers=1, block_size=4, steps=1,
                      batch_size=2, seq_len=24, device="cpu", eval_prompts=0, save_every=0, show_progress=False))
    rows = [json.loads(line) for line in (out / "data.generated.jsonl").read_text().splitlines()]
    llm = LLM(str(qwen3_dir), device="cpu", show_progress=False)
    chat = llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    for row, prompt in zip(rows, [chat, llm.tokenizer.encode("def f(x):")]):
        expected = llm.generate_ids(prompt, SamplingParams(max_tokens=24 - len(prompt), temperature=0.0)).token_ids
        assert row == {"token_ids": prompt + expected, "prompt_len": len(prompt)}
    # the default mask token of a Qwen3 tokenizer is z-lab's: the first embedding row past it
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == 151669


def test_a_quantized_gguf_target_trains_on_cpu(tmp_path):
    """A GGUF target with Q4_1 / Q8_0 blocks (kept quantized by --dtype auto on CPU, whose packed
    kernels have no derivative) trains a draft on CPU: the loss flows back through its head."""
    from gguf_fixtures import write_llama3_style_gguf
    kinds = {f"blk.0.ffn_{name}.weight": "Q4_1" for name in ("gate", "up", "down")} | {"output.weight": "Q8_0"}
    target, special = write_llama3_style_gguf(tmp_path / "q.gguf", [[72, 105, 33]], quantize=kinds)
    data = tmp_path / "data.jsonl"
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0)).tolist()
    data.write_text("".join(json.dumps({"token_ids": row, "prompt_len": 4}) + "\n" for row in ids))
    summary = train(TrainConfig(target=str(target), out=str(tmp_path / "draft"), data=str(data), num_layers=1,
                                block_size=4, steps=2, batch_size=2, seq_len=24, device="cpu", eval_prompts=0,
                                save_every=0, mask_token_id=special["<|eot_id|>"], show_progress=False))
    assert summary["step"] == 2 and summary["loss"] == summary["loss"] and summary["loss"] > 0


def test_cli_errors_are_one_line(tiny_target, tmp_path, capsys):
    from blockspec.cli import main
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"token_ids": [1, 2, 3]}\nnot json\n')
    cases = [
        (["--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--data", str(bad_json)], "nope"),
        (["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--data", str(tmp_path / "missing.txt")],
         "no such file"),
        (["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--data", str(bad_json)], "bad.jsonl:2"),
        (["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--data", str(bad_json), "--block-size", "1"],
         "--block-size"),
    ]
    for args, needle in cases:
        assert main(["train-draft", *args, "--device", "cpu", "--mask-token-id", str(MASK_ID), "--quiet"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("blockspec train-draft: error:") and needle in lines[0], lines


def test_the_readme_cpu_example_writes_a_draft_generate_loads(tmp_path, capsys):
    """README's CPU example (train-draft on the shipped demo target, then generate with the
    draft), cut to a handful of steps on a few files: the draft written loads in `generate` and
    decodes exactly as plain decoding of the demo target (greedy DFlash is lossless)."""
    import json
    import shutil
    import sysconfig
    from blockspec.cli import main
    data = tmp_path / "data"
    data.mkdir()
    for name in ("bisect.py", "colorsys.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, data / name)
    out = tmp_path / "my-draft"
    assert main(["train-draft", "--out", str(out), "--data", str(data), "--steps", "3", "--batch-size", "2",
                 "--seq-len", "64", "--block-size", "8", "--lr", "3e-3", "--eval-every", "0", "--eval-prompts", "0",
                 "--device", "cpu", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["generate", "--draft", str(out), "--max-tokens", "12", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(["generate", "--max-tokens", "12", "--json", "--draft", str(out), "--block-size", "1"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["stats"]["cycles"] > 0 and spec["stats"]["draft_tokens"] > 0        # the draft was used
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 12
