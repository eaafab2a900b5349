"""The draft's one-pass readout (blockspec/kernels/readout.py) under Triton's CPU interpreter:
the argmax exactly torch's (ties to the first column) and the confidence torch's softmax at it
up to fp32 summation order, for vocabularies below, at and across the kernel's block, bf16 and
fp32, and a strided batch of slots; the torch form on CPU is what DraftReadout.of returns."""
from __future__ import annotations

import torch

from blockspec.engine.spec.dflash import DraftReadout, draft_confidence
from tests.helpers import run_interpreted

CHILD = """
import torch
from blockspec.kernels import readout
gen = torch.Generator().manual_seed(0)
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    for rows, vocab in ((1, 5), (3, 2048), (4, 2049), (5, 6001)):
        x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
        x[0, vocab // 2] = x[0].max() + 1
        if vocab > 3:
            x[-1, 1] = x[-1, 3] = x[-1].max() + 2          # a tie: the first column wins
        ids, conf = readout.argmax_confidence_triton(x, True)
        want_ids, want_conf = readout.argmax_confidence_torch(x, True)
        assert ids.dtype == torch.int64 and torch.equal(ids, want_ids), (ids, want_ids)
        assert conf.dtype == torch.float32
        torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-7)
        slots = x.view(rows, 1, vocab).expand(rows, 3, vocab)  # [B, slots, V], a stride-0 view
        ids3, none = readout.argmax_confidence_triton(slots, False)
        assert none is None and ids3.shape == (rows, 3) and torch.equal(ids3, want_ids[:, None].expand(rows, 3))
        checked += 1
print("checked", checked)
"""


def test_interpreted_readout_matches_torch():
    done = run_interpreted(CHILD, timeout=120)
    assert done.returncode == 0 and "checked 8" in done.stdout, (done.stdout[-1500:], done.stderr[-2000:])


def test_the_readout_on_cpu_is_torchs_argmax_and_softmax():
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(1))
    out = DraftReadout.of(logits, True)
    assert torch.equal(out.drafts, logits.argmax(-1))
    torch.testing.assert_close(out.confidence, torch.softmax(logits, -1).gather(-1, out.drafts[..., None])[..., 0])
    torch.testing.assert_close(out.confidence, draft_confidence(logits, out.drafts))
    assert DraftReadout.of(logits, False).confidence is None


def test_first_argmax_is_torchs_argmax():
    """kernels/readout.first_argmax (the CPU's argmax over a vocabulary: chunk maxima, then one
    chunk): the indices torch.argmax gives, for vocabularies divisible by the chunk or with a
    ragged tail, ties inside a chunk, across chunks and in the tail (the first column wins), rows
    all -inf, +inf and NaN (NaN counts as the maximum), bf16 / fp16 / fp32, [B, T, V] and a
    strided view."""
    from blockspec.kernels.readout import ARGMAX_CHUNK, first_argmax
    gen = torch.Generator().manual_seed(0)
    for vocab in (4 * ARGMAX_CHUNK, 6001, 151936):
        tail = vocab - 3                                        # in the ragged tail where there is one
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(9, vocab, generator=gen) * 3).to(dtype)
            x[1, 7] = x[1, ARGMAX_CHUNK + 5] = 50                # across chunks
            x[2, ARGMAX_CHUNK + 1] = x[2, ARGMAX_CHUNK + 2] = 50  # inside one
            x[3, tail] = 50
            x[4, 3 * ARGMAX_CHUNK - 1] = x[4, tail] = 50
            x[5] = float("-inf")
            x[6, 11] = x[6, tail] = float("inf")
            x[7, vocab - 1] = 60
            x[8, 2 * ARGMAX_CHUNK] = float("nan")
            assert torch.equal(first_argmax(x), x.argmax(-1)), (vocab, dtype)  # a NaN row: torch's walk
            assert torch.equal(first_argmax(x[:8]), x[:8].argmax(-1)), (vocab, dtype)   # the chunked form
            batched = x[:8].view(2, 4, vocab)
            assert torch.equal(first_argmax(batched), batched.argmax(-1))
            strided = x[:8].view(8, 1, vocab).expand(8, 3, vocab)[:, 1:]
            assert torch.equal(first_argmax(strided), strided.argmax(-1))
    assert first_argmax(torch.randn(151936)).shape == torch.Size([])
