"""Issue 32: how far could verifying several candidates per slot take a draft's acceptance? (CPU, fp32.)

DFlash drafts a block's slots in parallel, each slot's distribution conditioned on the anchor only.
A tree verify (EAGLE-2, SpecInfer) would check several candidates per slot at once; its best case,
whatever the tree's shape, is the lattice of every slot's top-k: a cycle at anchor p keeps slot k
while the target's token p + k is among that slot's k best, so its acceptance is an upper bound on
any tree whose slot j holds at most k candidates (the tree's node count, up to k^(block − 1), is
what a real verify would pay). Replayed, teacher-forced, at every anchor of the target's greedy
answers to the HELD_OUT chat prompts, as `scripts/draft_overfit.py --stage shipped` replays
top-1 (the engine's chain).

    python scripts/draft_lattice_bound.py --work /tmp/lattice [--draft DIR] [--prompts 32 --tokens 128]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from draft_overfit import SHIPPED, log, make_trainer, start  # noqa: E402

TOPS = (1, 2, 3, 4, 8, 16)


def lattice_lengths(tokens: list[int], ranks: torch.Tensor, first: int, top: int) -> list[int]:
    """Tokens committed per cycle while greedy decoding writes tokens[first + 1:], slot k of the
    block at anchor p kept while the target's token p + k ranks < top in the draft's slot k
    (ranks [anchors, slots]: that token's rank), plus the bonus token, as replay_greedy counts."""
    lengths, anchor = [], first
    while anchor < len(tokens) - 1:
        remaining = len(tokens) - 1 - anchor
        row = ranks[anchor - first][:remaining].tolist()
        accepted = next((k for k, r in enumerate(row) if r >= top), len(row))
        committed = min(accepted + 1, remaining)
        lengths.append(committed)
        anchor += committed
    return lengths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: --model smollm2's file")
    parser.add_argument("--work", required=True)
    parser.add_argument("--draft", default=str(SHIPPED))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    work, chat = start(args, args.prompts)
    from blockspec.loader import load_draft
    config = json.loads((Path(args.draft) / "config.json").read_text())
    block = config["block_size"]
    layer_ids = ",".join(map(str, config["dflash_config"]["target_layer_ids"]))
    trainer = make_trainer(argparse.Namespace(**vars(args), num_layers=config["num_hidden_layers"], layer_ids=layer_ids,
                                              steps=1, batch_size=1, lr=1e-3, num_anchors=1),
                           work / "responses.jsonl", work / "unused", block_size=block)
    trainer.draft = load_draft(args.draft, trainer.target).float()
    lengths: dict[int, list[int]] = {top: [] for top in TOPS}
    with torch.no_grad():
        for row in chat:
            tokens, first = row["token_ids"], row["prompt_len"]
            ids = torch.tensor([tokens + [0] * (trainer.config.seq_len - len(tokens))])
            anchors = torch.arange(first, len(tokens) - 1)[None]
            logits = trainer.block_logits(ids, anchors)[0].float()                     # [anchors, slots, V]
            where = (anchors[0, :, None] + 1 + torch.arange(block - 1)).clamp(max=len(tokens) - 1)
            truth = torch.tensor(tokens)[where]                                       # the target's token p + k
            # how many the draft puts above the target's token (ties broken as argmax breaks them: the
            # lower id first), so top-1 is exactly the chain the engine verifies
            score = logits.gather(-1, truth[..., None])
            ids = torch.arange(logits.shape[-1])
            ranks = ((logits > score) | ((logits == score) & (ids < truth[..., None]))).sum(-1)
            for top in TOPS:
                lengths[top] += lattice_lengths(tokens, ranks, first, top)
    result = {"draft": args.draft, "block": block, "prompts": len(chat),
              "tau_by_top": {top: round(sum(v) / len(v), 3) for top, v in lengths.items()}}
    log(json.dumps(result))
    (work / "lattice.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
