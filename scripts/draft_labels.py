"""Issue 32: what a recipe's responses teach a draft. For rows of each kind of a responses.jsonl
(greedy, follow-up, sampled at T = 0.7), teacher-forced on CPU in fp32:

- how often the row's next token is the target's own greedy choice there (a sampled row's label
  is often not what greedy decoding, the acceptance the issue measures, would verify);
- each draft slot's top-1 accuracy against the row's tokens and against the target's greedy
  choice at the same position;
- with --finetune-kinds, a short fine-tune of the draft on only those kinds (train-draft's
  Trainer), and the same figures and held-out chat acceptance (replayed) before and after.

    python scripts/draft_labels.py --data W/responses.jsonl --draft W/d1b8 [--rows 24] \
        [--finetune-kinds greedy,follow-up --steps 150 --lr 5e-4]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from draft_overfit import BLOCK, log, make_trainer, mean, replayed, start  # noqa: E402

from blockspec.engine.oneshot import forward_sequences  # noqa: E402
from blockspec.train import blockwise  # noqa: E402


def rows_by_kind(path: Path, per_kind: int, seed: int, seq_len: int) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if len(row["token_ids"]) <= seq_len and len(row["token_ids"]) - row["prompt_len"] > BLOCK:
            by_kind[row.get("kind", "?")].append(row)
    rng = random.Random(seed)
    return {kind: rng.sample(rows, min(per_kind, len(rows))) for kind, rows in sorted(by_kind.items())}


def label_figures(trainer, rows: list[dict]) -> dict:
    """Agreement of the rows' tokens with the target's argmax, and slot accuracies both ways."""
    agree = total = 0
    hits_data, hits_greedy, counts = torch.zeros(BLOCK - 1), torch.zeros(BLOCK - 1), torch.zeros(BLOCK - 1)
    with torch.no_grad():
        for row in rows:
            tokens, first = row["token_ids"], row["prompt_len"]
            ids = torch.tensor([tokens])
            hidden = forward_sequences(trainer.target, ids).hidden[0]
            greedy = trainer.target.compute_logits(hidden).argmax(-1)          # [L]: the choice for t + 1
            agree += int((greedy[first - 1:-1] == ids[0, first:]).sum())
            total += len(tokens) - first
            padded = torch.tensor([tokens + [0] * (trainer.config.seq_len - len(tokens))])
            anchors = torch.arange(first, len(tokens) - 1)[None]
            drafts = trainer.block_logits(padded, anchors).argmax(-1)[0]       # [N, bs − 1]
            labels, valid = blockwise.block_labels(padded, torch.tensor([len(tokens)]), anchors,
                                                   torch.ones_like(anchors, dtype=torch.bool), BLOCK)
            where = (anchors[0, :, None] + torch.arange(BLOCK - 1)).clamp(max=len(tokens) - 1)   # a + k − 1
            hits_data += ((drafts == labels[0]) & valid[0]).sum(0)
            hits_greedy += ((drafts == greedy[where]) & valid[0]).sum(0)
            counts += valid[0].sum(0)
    return {"rows": len(rows), "tokens_equal_target_greedy": round(agree / max(total, 1), 3),
            "slot_acc_vs_tokens": [round(float(h / max(c, 1)), 3) for h, c in zip(hits_data, counts)],
            "slot_acc_vs_greedy": [round(float(h / max(c, 1)), 3) for h, c in zip(hits_greedy, counts)]}


def report(trainer, sets: dict[str, list[dict]], chat: list[dict], tag: str) -> dict:
    result = {"tag": tag, "chat_replayed": round(mean(replayed(trainer, chat)[0]), 3)}
    for kind, rows in sets.items():
        result[kind] = label_figures(trainer, rows)
    log(json.dumps(result))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--data", required=True, help="a recipe's responses.jsonl")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--work", default="/tmp/draft_labels")
    parser.add_argument("--rows", type=int, default=24, help="rows of each kind")
    parser.add_argument("--chat-prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--finetune-kinds", default="", help="e.g. greedy,follow-up")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--num-anchors", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="where the fine-tuned draft is saved")
    args = parser.parse_args()
    work, chat = start(args, args.chat_prompts)
    sets = rows_by_kind(Path(args.data), args.rows, 0, args.seq_len)
    kinds = [k for k in args.finetune_kinds.split(",") if k]
    train_path = work / "finetune.jsonl"
    if kinds:   # the fine-tune's data: rows of those kinds not among the measured ones
        measured = {tuple(r["token_ids"]) for rows in sets.values() for r in rows}
        with train_path.open("w") as f:
            for line in Path(args.data).read_text().splitlines():
                row = json.loads(line)
                if row.get("kind") in kinds and tuple(row["token_ids"]) not in measured:
                    f.write(line + "\n")
    from blockspec.loader import load_draft
    config = json.loads((Path(args.draft) / "config.json").read_text())
    layer_ids = ",".join(map(str, config["dflash_config"]["target_layer_ids"]))
    trainer = make_trainer(argparse.Namespace(**vars(args), num_layers=config["num_hidden_layers"], layer_ids=layer_ids),
                           train_path if kinds else work / "responses.jsonl", Path(args.out or work / "finetuned"))
    draft = load_draft(args.draft, trainer.target)
    trainer.draft.load_state_dict(draft.float().state_dict())
    results = [report(trainer, sets, chat, "before")]
    if kinds:
        started, losses = time.perf_counter(), []
        while trainer.step < args.steps:
            losses.append(trainer.train_step(trainer.step))
            trainer.step += 1
            if trainer.step % 25 == 0:
                log(f"step {trainer.step}: loss {sum(losses[-25:]) / 25:.3f} ({time.perf_counter() - started:.0f} s)")
        from blockspec.train import checkpoint
        checkpoint.save_draft(trainer.draft, trainer.draft_config, trainer.out, torch.float32)
        results.append(report(trainer, sets, chat, f"after {args.steps} steps on {args.finetune_kinds}"))
    (work / "labels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
