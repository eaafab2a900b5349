"""Training data: text files or JSONL → fixed-length token examples; batch order; anchors.

Accepted `--data`:
- a text file, or a directory of them (read recursively; files that are not UTF-8 text and
  hidden paths are skipped): tokenized, joined with the EOS token, cut into seq_len pieces;
- a .jsonl file, one object per line, each either {"token_ids": [...], "prompt_len": P}
  (used as is), {"messages": [...]} (a chat prompt) or {"prompt": "text"} (a raw prompt). Prompts
  are completed by the target itself through our engine (greedy), as the recipe asks: the draft
  learns what the target would say, not what a dataset says.
Order and anchors are functions of (seed, step) alone, so a resumed or a data-parallel run sees
exactly the batches of an uninterrupted single-process one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from blockspec.tokenizer import Tokenizer

Generate = Callable[[list[list[int]], int], list[list[int]]]   # (prompts, seq_len) → responses


class DataError(ValueError):
    """Training data we cannot use; the message names the file and what is wrong."""


@dataclass
class Examples:
    ids: torch.Tensor           # [N, seq_len] token ids, padded with 0 past `lengths`
    lengths: torch.Tensor       # [N] real tokens per example
    prompt_lens: torch.Tensor   # [N] leading tokens that are prompt (context only, no loss)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take(self, index: torch.Tensor | list[int]) -> "Examples":
        index = torch.as_tensor(index, dtype=torch.long)
        return Examples(self.ids[index], self.lengths[index], self.prompt_lens[index])


def pack(rows: list[tuple[list[int], int]], seq_len: int) -> Examples:
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for i, (tokens, _) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens[:seq_len], dtype=torch.long)
    lengths = torch.tensor([min(len(t), seq_len) for t, _ in rows], dtype=torch.long)
    return Examples(ids, lengths, torch.tensor([p for _, p in rows], dtype=torch.long))


def read_text_files(path: Path) -> list[str]:
    files = [path] if path.is_file() else sorted(
        f for f in path.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts))
    docs = []
    for f in files:
        try:
            docs.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            if path.is_file():
                raise DataError(f"cannot read {f} as UTF-8 text") from None
    if not any(docs):
        raise DataError(f"{path} holds no readable UTF-8 text")
    return docs


def text_examples(docs: list[str], tokenizer: Tokenizer, seq_len: int, eos_id: int | None) -> list[tuple[list[int], int]]:
    """Documents joined by EOS into one stream, cut into seq_len pieces (the tail is dropped)."""
    stream: list[int] = []
    for encoding in tokenizer.backend.encode_batch(docs, add_special_tokens=False):
        stream += encoding.ids + ([eos_id] if eos_id is not None else [])
    if len(stream) < seq_len:
        raise DataError(f"the data has {len(stream)} tokens, fewer than one --seq-len of {seq_len}")
    return [(stream[i: i + seq_len], 0) for i in range(0, len(stream) - seq_len + 1, seq_len)]


def parse_record(line: str, where: str, tokenizer: Tokenizer) -> tuple[list[int], int, bool]:
    """One JSONL line → (token ids, prompt length, needs a response from the target)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object")
    if "token_ids" in record:
        ids = record["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise DataError(f"{where}: token_ids must be a list of integers")
        return ids, int(record.get("prompt_len", 0)), False
    if "messages" in record:
        return tokenizer.encode_chat(record["messages"], add_generation_prompt=True), 0, True
    if "prompt" in record and isinstance(record["prompt"], str):
        return tokenizer.encode(record["prompt"]), 0, True
    raise DataError(f"{where}: a record needs token_ids, messages or prompt")


def jsonl_examples(path: Path, tokenizer: Tokenizer, seq_len: int, generate: Generate | None) -> list[tuple[list[int], int]]:
    rows, prompts = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        ids, prompt_len, needs_response = parse_record(line, f"{path}:{number}", tokenizer)
        if needs_response and len(ids) >= seq_len - 1:
            raise DataError(f"{path}:{number}: the prompt has {len(ids)} tokens, no room left in --seq-len {seq_len}")
        rows.append((ids, prompt_len))
        if needs_response:
            prompts.append(len(rows) - 1)
    if not rows:
        raise DataError(f"{path} has no records")
    if prompts:
        if generate is None:
            raise DataError(f"{path}: prompts need the target to answer them, and no generator was given")
        responses = generate([rows[i][0] for i in prompts], seq_len)
        for i, response in zip(prompts, responses):
            rows[i] = (rows[i][0] + response, len(rows[i][0]))
    return rows


def read_examples(data: str, tokenizer: Tokenizer, seq_len: int, generate: Generate | None = None) -> Examples:
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"--data {data}: no such file or directory")
    try:
        if path.is_file() and path.suffix == ".jsonl":
            return pack(jsonl_examples(path, tokenizer, seq_len, generate), seq_len)
        return pack(text_examples(read_text_files(path), tokenizer, seq_len, tokenizer.eos_token_id), seq_len)
    except OSError as exc:
        raise DataError(f"cannot read --data {data}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DataError(f"cannot read {path} as UTF-8 text") from None


def check_vocab(examples: Examples, vocab_size: int, name: str) -> None:
    top = int(examples.ids.max())
    if top >= vocab_size:
        raise DataError(f"{name}: token id {top} is outside the target's vocabulary of {vocab_size}")


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """The global batch of `step`: consecutive slices of one fresh permutation per epoch.

    Recomputed from (seed, epoch) on demand: nothing to save for a resume."""
    perms: dict[int, torch.Tensor] = {}
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(i, num_examples)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(perms[epoch][offset]))
    return out


def step_generator(seed: int, step: int) -> torch.Generator:
    """The anchors' randomness of one step, the same on every rank and after a resume."""
    return torch.Generator().manual_seed((seed + 1) * 1_000_003 + step)
