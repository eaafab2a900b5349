"""Issue 32's overfit diagnostic: does a draft trained on a handful of the target's own answers
accept close to the block size on exactly those answers? (CPU, fp32, SmolLM2.)

    python scripts/draft_overfit.py --work WORK [--prompts 32 --tokens 80 --steps 300]

1. responses  greedy answers of the target to the first --prompts HELD_OUT chat prompts (our
              engine, fp32, one batch); WORK/responses.jsonl, kept between runs
2. features   the target's features of those sequences, computed once (train-draft would run
              the frozen target on every step: the same tensors, minutes of CPU each time)
3. train      train-draft's own Trainer (its batches, anchors, forward and loss) on those rows
4. measure    acceptance two ways on the same prompts: replayed from train-draft's forward at
              every anchor (blockwise.replay_greedy), and measured by our engine's DFlash
              decoding; equal when training and inference agree. The shipped draft too.
--variant picks a training objective (see VARIANTS); results go to WORK/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from smollm2_prompts import HELD_OUT, train_prompts  # noqa: E402

from blockspec.train import blockwise, features, loop  # noqa: E402

BLOCK = 8
LAYER_IDS = (1, 10, 19, 27)
MASK_TOKEN = "<empty_output>"
SHIPPED = REPO / "blockspec" / "demo" / "smollm2-draft"


def log(message: str) -> None:
    print(f"[overfit {time.strftime('%H:%M:%S')}] {message}", flush=True)


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def greedy_rows(gguf: str, texts: list[str], tokens: int, path: Path) -> list[dict]:
    """{"token_ids": prompt + the target's greedy answer, "prompt_len"} per prompt (cached)."""
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()]
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    llm = LLM(gguf, device="cpu", dtype="float32", max_num_seqs=len(texts), max_model_len=512, show_progress=False)
    prompts = chat_prompts(llm.tokenizer, texts)
    results = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
    rows = [{"token_ids": p + r.token_ids, "prompt_len": len(p)} for p, r in zip(prompts, results)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def cache_features(trainer: loop.Trainer) -> None:
    """train-draft's target_features, looked up: every batch row is one of the fixed examples."""
    rows = trainer.train_data.ids
    computed = torch.cat([features.target_features(trainer.target, rows[i: i + 4], trainer.layer_ids)
                          for i in range(0, len(rows), 4)])
    table = {tuple(r.tolist()): f for r, f in zip(rows, computed)}
    original = features.target_features

    def lookup(target, input_ids, layer_ids):
        if tuple(layer_ids) != trainer.layer_ids:
            return original(target, input_ids, layer_ids)
        return torch.stack([table[tuple(r.tolist())] for r in input_ids])
    features.target_features = lookup


def replayed(trainer: loop.Trainer, rows: list[dict]) -> tuple[list[list[int]], list[float]]:
    """Acceptance lengths per prompt, from train-draft's forward at every anchor of the answer,
    and each slot's top-1 accuracy over all those anchors (teacher-forced)."""
    out, hits, counts = [], torch.zeros(BLOCK - 1), torch.zeros(BLOCK - 1)
    with torch.no_grad():
        for row in rows:
            tokens, first = row["token_ids"], row["prompt_len"]
            ids = torch.tensor([tokens + [0] * (trainer.config.seq_len - len(tokens))])
            anchors = torch.arange(first, len(tokens) - 1)[None]
            drafts = trainer.block_logits(ids, anchors).argmax(-1)[0]
            out.append(blockwise.replay_greedy(tokens, drafts.tolist(), first))
            labels, valid = blockwise.block_labels(ids, torch.tensor([len(tokens)]), anchors,
                                                   torch.ones_like(anchors, dtype=torch.bool), BLOCK)
            hits += ((drafts == labels[0]) & valid[0]).sum(0)
            counts += valid[0].sum(0)
    return out, [round(float(h / max(c, 1)), 3) for h, c in zip(hits, counts)]


def engine_lengths(gguf: str, draft: Path, rows: list[dict], tokens: int) -> tuple[list[list[int]], int]:
    """Acceptance lengths per prompt from our engine's DFlash decoding (fp32, one batch), and
    how many outputs equal the rows' greedy answers."""
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    llm = LLM(gguf, draft=str(draft), block_size=BLOCK, device="cpu", dtype="float32", max_num_seqs=len(rows),
              max_model_len=512, show_progress=False)
    prompts = [r["token_ids"][: r["prompt_len"]] for r in rows]
    results = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
    equal = sum(p + r.token_ids == row["token_ids"] for p, r, row in zip(prompts, results, rows))
    return [r.stats.acceptance_lengths for r in results], equal


def mean(lengths: list[list[int]]) -> float:
    flat = [n for per in lengths for n in per]
    return sum(flat) / max(1, len(flat))


def make_trainer(args, data_path: Path, out: Path, **overrides) -> loop.Trainer:
    from blockspec.loader import load_tokenizer
    mask_id = load_tokenizer(Path(args.gguf)).token_to_id(MASK_TOKEN)
    config = loop.TrainConfig(target=args.gguf, out=str(out), data=str(data_path), num_layers=args.num_layers,
                              block_size=BLOCK,
                              target_layer_ids=tuple(int(i) for i in args.layer_ids.split(",")),
                              mask_token_id=mask_id, steps=args.steps,
                              batch_size=args.batch_size, lr=args.lr, seq_len=args.seq_len, device="cpu",
                              num_anchors=args.num_anchors,
                              eval_every=0, eval_prompts=0, save_every=0, seed=0, show_progress=False)
    return loop.Trainer(replace(config, **overrides), loop.Ranks(0, 1, torch.device("cpu")))


def target_top(trainer: loop.Trainer, top: int) -> tuple[dict, dict]:
    """Per example (its token tuple): the target's top-`top` next-token ids and renormalised
    probabilities at every position [L, top]."""
    ids_of, probs_of = {}, {}
    for row in trainer.train_data.ids:
        with torch.no_grad():
            from blockspec.engine.oneshot import forward_sequences
            hidden = forward_sequences(trainer.target, row[None]).hidden[0]
            values, index = trainer.target.compute_logits(hidden).float().log_softmax(-1).topk(top, dim=-1)
        key = tuple(row.tolist())
        ids_of[key], probs_of[key] = index, values.softmax(-1)
    return ids_of, probs_of


def distill_loss(trainer: loop.Trainer, top: tuple[dict, dict]):
    """Trainer.loss_sum with soft labels: Σ weight · Σ_v p_target(v) · −log q(v) over the target's
    top tokens at position a + k − 1 (the distribution of token a + k)."""
    ids_of, probs_of = top
    bs = trainer.config.block_size

    def loss_sum(batch, anchors, valid):
        logits = trainer.block_logits(batch.ids, anchors).float().log_softmax(-1)      # [b, N, bs − 1, V]
        _, label_valid = blockwise.block_labels(batch.ids, batch.lengths, anchors, valid, bs)
        where = (anchors[..., None] + torch.arange(bs - 1)).clamp(max=batch.ids.shape[1] - 1)   # a + k − 1
        keys = [tuple(r.tolist()) for r in batch.ids]
        index = torch.stack([ids_of[k][w] for k, w in zip(keys, where.flatten(1))]).view(*where.shape, -1)
        probs = torch.stack([probs_of[k][w] for k, w in zip(keys, where.flatten(1))]).view(*where.shape, -1)
        ce = -(logits.gather(-1, index) * probs).sum(-1)
        return (ce * label_valid * trainer.weights).sum()
    trainer.loss_sum = loss_sum


def train(trainer: loop.Trainer) -> list[float]:
    losses = []
    started = time.perf_counter()
    while trainer.step < trainer.config.steps:
        losses.append(trainer.train_step(trainer.step))
        trainer.step += 1
        if trainer.step % 25 == 0:
            log(f"step {trainer.step}: loss {sum(losses[-25:]) / 25:.3f} ({time.perf_counter() - started:.0f} s)")
    return losses


def start(args, prompts: int) -> tuple[Path, list[dict]]:
    """args.gguf resolved (default: --model smollm2's file), torch's threads set, WORK made, and
    the target's greedy answers to the first `prompts` HELD_OUT chat prompts (cached there)."""
    if args.gguf is None:
        from blockspec import named
        args.gguf = str(named.resolve("smollm2"))
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return work, greedy_rows(args.gguf, HELD_OUT[:prompts], args.tokens, work / "responses.jsonl")


def record(work: Path, result: dict) -> None:
    log(json.dumps(result))
    with (work / "results.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: --model smollm2's file")
    parser.add_argument("--work", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seq-len", type=int, default=192)
    parser.add_argument("--num-anchors", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decay", type=float, default=None, help="γ of the slot weights (default the DFlash paper's)")
    parser.add_argument("--distill", type=int, default=0,
                        help="soft labels: the target's top-N distribution of each labelled token (0: hard labels)")
    parser.add_argument("--layer-ids", default=",".join(map(str, LAYER_IDS)))
    parser.add_argument("--norm-from-target", action="store_true",
                        help="start the draft's final norm at the target's (the head's input scale)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--stage", choices=("shipped", "overfit"), default="overfit")
    parser.add_argument("--draft", default=str(SHIPPED), help="the draft --stage shipped measures")
    parser.add_argument("--engine", action="store_true", help="also measure with our engine (slower)")
    args = parser.parse_args()
    work, chat = start(args, args.prompts)
    data_path = work / "responses.jsonl"
    log(f"{len(chat)} chat answers, {sum(len(r['token_ids']) - r['prompt_len'] for r in chat)} answer tokens")
    if args.stage == "shipped":
        from blockspec.loader import load_draft
        own = greedy_rows(args.gguf, train_prompts()[: args.prompts], args.tokens, work / "train-style.jsonl")
        trainer = make_trainer(args, data_path, work / "unused")
        trainer.draft = load_draft(args.draft, trainer.target).float()
        for name, rows, path in (("chat (HELD_OUT)", chat, data_path), ("training-style", own, work / "train-style.jsonl")):
            lengths, accuracy = replayed(trainer, rows)
            result = {"draft": args.draft, "prompts": name, "replayed": round(mean(lengths), 3), "slot_accuracy": accuracy}
            if args.engine:
                lengths, equal = engine_lengths(args.gguf, Path(args.draft), rows, args.tokens)
                result.update(engine=round(mean(lengths), 3), engine_equal_rows=equal)
            record(work, result)
        return 0
    trainer = make_trainer(args, data_path, work / f"draft{args.tag}")
    if args.decay is not None:
        trainer.weights = blockwise.position_weights(BLOCK, trainer.device, args.decay)
    if args.norm_from_target:
        with torch.no_grad():
            trainer.draft.norm.weight.copy_(trainer.target.model.norm.weight)
    if args.distill:
        distill_loss(trainer, target_top(trainer, args.distill))
    cache_features(trainer)
    log("features cached")
    losses = train(trainer)
    from blockspec.train import checkpoint
    checkpoint.save_draft(trainer.draft, trainer.draft_config, trainer.out, torch.float32)
    result = {"draft": "overfit", "steps": args.steps, "batch": args.batch_size, "lr": args.lr,
              "anchors": args.num_anchors, "num_layers": args.num_layers, "decay": args.decay, "distill": args.distill,
              "layer_ids": args.layer_ids, "norm_from_target": args.norm_from_target,
              "final_loss": round(sum(losses[-25:]) / 25, 4)}
    lengths, accuracy = replayed(trainer, chat)
    result.update(replayed=round(mean(lengths), 3), slot_accuracy=accuracy, tag=args.tag)
    if args.engine:
        lengths, equal = engine_lengths(args.gguf, trainer.out, chat, args.tokens)
        result.update(engine=round(mean(lengths), 3), engine_equal_rows=equal)
    record(work, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
