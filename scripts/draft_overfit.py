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

from blockspec.train import blockwise, data, features, loop  # noqa: E402

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


def replayed(trainer: loop.Trainer, rows: list[dict]) -> list[list[int]]:
    """Acceptance lengths per prompt, from train-draft's forward at every anchor of the answer."""
    out = []
    with torch.no_grad():
        for row in rows:
            tokens, first = row["token_ids"], row["prompt_len"]
            ids = torch.tensor([tokens + [0] * (trainer.config.seq_len - len(tokens))])
            anchors = torch.arange(first, len(tokens) - 1)[None]
            drafts = trainer.block_logits(ids, anchors).argmax(-1)[0].tolist()
            out.append(blockwise.replay_greedy(tokens, drafts, first))
    return out


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
    config = loop.TrainConfig(target=args.gguf, out=str(out), data=str(data_path), num_layers=1, block_size=BLOCK,
                              target_layer_ids=LAYER_IDS, mask_token_id=mask_id, steps=args.steps,
                              batch_size=args.batch_size, lr=args.lr, seq_len=args.seq_len, device="cpu",
                              num_anchors=args.num_anchors,
                              eval_every=0, eval_prompts=0, save_every=0, seed=0, show_progress=False)
    return loop.Trainer(replace(config, **overrides), loop.Ranks(0, 1, torch.device("cpu")))


def train(trainer: loop.Trainer) -> list[float]:
    losses = []
    started = time.perf_counter()
    while trainer.step < trainer.config.steps:
        losses.append(trainer.train_step(trainer.step))
        trainer.step += 1
        if trainer.step % 25 == 0:
            log(f"step {trainer.step}: loss {sum(losses[-25:]) / 25:.3f} ({time.perf_counter() - started:.0f} s)")
    return losses


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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stage", choices=("shipped", "overfit"), default="overfit")
    parser.add_argument("--engine", action="store_true", help="also measure with our engine (slower)")
    args = parser.parse_args()
    if args.gguf is None:
        from blockspec import named
        args.gguf = str(named.resolve("smollm2"))
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    chat = greedy_rows(args.gguf, HELD_OUT[: args.prompts], args.tokens, work / "responses.jsonl")
    data_path = work / "responses.jsonl"
    log(f"{len(chat)} chat answers, {sum(len(r['token_ids']) - r['prompt_len'] for r in chat)} answer tokens")
    if args.stage == "shipped":
        from blockspec.loader import load_draft
        own = greedy_rows(args.gguf, train_prompts()[: args.prompts], args.tokens, work / "train-style.jsonl")
        trainer = make_trainer(args, data_path, work / "unused")
        trainer.draft = load_draft(str(SHIPPED), trainer.target).float()
        for name, rows, path in (("chat (HELD_OUT)", chat, data_path), ("training-style", own, work / "train-style.jsonl")):
            result = {"draft": "shipped", "prompts": name, "replayed": round(mean(replayed(trainer, rows)), 3)}
            if args.engine:
                lengths, equal = engine_lengths(args.gguf, SHIPPED, rows, args.tokens)
                result.update(engine=round(mean(lengths), 3), engine_equal_rows=equal)
            record(work, result)
        return 0
    trainer = make_trainer(args, data_path, work / "draft")
    cache_features(trainer)
    log("features cached")
    losses = train(trainer)
    from blockspec.train import checkpoint
    checkpoint.save_draft(trainer.draft, trainer.draft_config, trainer.out, torch.float32)
    result = {"draft": "overfit", "steps": args.steps, "batch": args.batch_size, "lr": args.lr,
              "anchors": args.num_anchors,
              "final_loss": round(sum(losses[-25:]) / 25, 4), "replayed": round(mean(replayed(trainer, chat)), 3)}
    if args.engine:
        lengths, equal = engine_lengths(args.gguf, trainer.out, chat, args.tokens)
        result.update(engine=round(mean(lengths), 3), engine_equal_rows=equal)
    record(work, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
