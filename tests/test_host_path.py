"""The runner's host-side builders (vectorised with numpy) equal the list-based ones they replaced,
on ragged batches: prefill chunks, verify rows of mixed k including k = 0, padding sequences."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from blockspec.engine.model_runner import Entry, ModelRunner, padded_verify_rows


def old_pack(entries, rows, cols, num_tokens, pad_width):
    ids, starts, tables, context_lens, state_slots = [], [0], [], [], []
    for entry in entries:
        ids += entry.tokens
        starts.append(starts[-1] + len(entry.tokens))
        tables += entry.seq.block_table + [0] * (cols - len(entry.seq.block_table))
        context_lens.append(entry.start + len(entry.tokens))
        state_slots.append(entry.seq.state_slot or 0)
    offsets = [0] * len(entries)
    num_padding = rows - len(entries)
    starts += [starts[-1] + pad_width * (i + 1) for i in range(num_padding)]
    ids += [0] * (num_tokens - len(ids))
    tables += [0] * (num_padding * cols)
    context_lens += [pad_width] * num_padding
    state_slots += [0] * num_padding
    offsets += [0] * num_padding
    return ids + [0] * (3 * len(ids)) + starts + tables + context_lens + state_slots + offsets


def old_place_index(num_drafts, at):
    dst, src_row, src_col = [], [], []
    for b, k in enumerate(num_drafts):
        dst += range(at + 1, at + 1 + k)
        src_row += [b] * k
        src_col += range(k)
        at += k + 1
    return [dst, src_row, src_col]


def old_logit_rows(prefill, first, num_drafts):
    rows, at = [], 0
    for (_, n), samples in zip(prefill, first):
        at += n
        if samples:
            rows.append(at - 1)
    for k in num_drafts:
        rows += range(at, at + k + 1)
        at += k + 1
    return rows


def ragged(rng: random.Random, cols: int):
    """Prefill chunks, then decode entries [anchor, 0 × k] with k in 0 … 15 (zeros included)."""
    def seq():
        pages = rng.randint(0, cols)
        return SimpleNamespace(block_table=[rng.randint(1, 999) for _ in range(pages)],
                               state_slot=rng.choice([None, rng.randint(1, 9)]))
    prefill = [Entry(seq(), rng.randint(0, 50), [rng.randint(1, 99) for _ in range(rng.randint(1, 40))])
               for _ in range(rng.randint(0, 3))]
    ks = [rng.choice([0, 0, 3, 15, rng.randint(0, 15)]) for _ in range(rng.randint(0, 9))]
    decode = [Entry(seq(), rng.randint(0, 90), [rng.randint(1, 99)] + [0] * k) for k in ks]
    return prefill, decode, ks


def fake_runner():
    return SimpleNamespace(target=SimpleNamespace(visual=None), device=torch.device("cpu"),
                           device_ints=lambda values: ModelRunner.device_ints(SimpleNamespace(device=torch.device("cpu")), values))


@pytest.mark.parametrize("seed", range(40))
def test_pack_equals_the_list_based_packing(seed):
    rng = random.Random(seed)
    cols = rng.randint(1, 6)
    prefill, decode, _ = ragged(rng, cols)
    entries = prefill + decode
    if not entries:
        entries = [Entry(SimpleNamespace(block_table=[], state_slot=None), 0, [5])]
    num_tokens = sum(len(e.tokens) for e in entries) + rng.randint(0, 20)
    pad_width = rng.choice([0, len(entries[0].tokens)])
    rows = len(entries) + rng.randint(0, 4)
    new = ModelRunner.pack(fake_runner(), entries, rows, cols, num_tokens, pad_width)
    assert new.tolist() == old_pack(entries, rows, cols, num_tokens, pad_width)


@pytest.mark.parametrize("seed", range(40))
def test_draft_placement_and_logit_rows_equal_the_list_based_ones(seed):
    rng = random.Random(seed)
    prefill, decode, ks = ragged(rng, 4)
    at = sum(len(e.tokens) for e in prefill)
    runner = fake_runner()
    # place_drafts: the index it writes with, read back through a recording input_ids
    drafts = torch.arange(len(ks) * 16).view(len(ks), 16) + 1000
    meta = SimpleNamespace(input_ids=torch.zeros(at + sum(k + 1 for k in ks) + 3, dtype=torch.long))
    ModelRunner.place_drafts(runner, meta, SimpleNamespace(drafts=drafts), ks, at)
    expected = torch.zeros_like(meta.input_ids)
    dst, row, col = old_place_index(ks, at)
    expected[torch.tensor(dst, dtype=torch.long)] = drafts[torch.tensor(row, dtype=torch.long),
                                                           torch.tensor(col, dtype=torch.long)]
    assert torch.equal(meta.input_ids, expected)
    # logit rows: a batch's prefill chunk ends (some sampling their first token), then verify rows
    batch = SimpleNamespace(prefill=[(e.seq, len(e.tokens)) for e in prefill], num_drafts=ks)
    first = [rng.random() < 0.5 for _ in prefill]
    hidden = torch.arange(at + sum(k + 1 for k in ks) + 5)
    rows = old_logit_rows(batch.prefill, first, ks)
    if rows:
        assert ModelRunner.logit_hidden(runner, hidden, batch, first).tolist() == rows
    if ks:
        width = max(ks) + 1
        offsets = [sum(k + 1 for k in ks[:b]) for b in range(len(ks))]
        old = [[offset + min(j, k) for j in range(width)] for offset, k in zip(offsets, ks)]
        assert padded_verify_rows(ks, width).tolist() == old
