"""The draft's one-pass readout (blockspec/kernels/readout.py) on the GPU at the real vocabulary:
argmax exactly torch's, confidence torch's softmax at it to fp32 summation order, at the row
counts the draft graphs use (1 … 256 sequences × 15 slots), inside a captured graph too."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels import readout

VOCAB = 151_936


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seqs", [1, 8, 64, 256])
def test_readout_matches_torch(dtype, seqs):
    gen = torch.Generator(device="cuda").manual_seed(seqs)
    logits = (torch.randn(seqs, 15, VOCAB, device="cuda", generator=gen) * 3).to(dtype)
    logits[0, 0, 7] = logits[0, 0, 9] = logits[0, 0].max() + 1            # a tie: the first column
    ids, conf = readout.argmax_confidence(logits, True)
    want_ids, want_conf = readout.argmax_confidence_torch(logits, True)
    assert ids[0, 0].item() == 7
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(conf, want_conf, rtol=1e-4, atol=1e-7)


def test_readout_replays_in_a_graph():
    logits = torch.randn(8, 15, VOCAB, device="cuda", dtype=torch.bfloat16)
    readout.argmax_confidence(logits, True)                                    # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, conf = readout.argmax_confidence(logits, True)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want_ids, want_conf = readout.argmax_confidence_torch(logits, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(conf, want_conf, rtol=1e-4, atol=1e-7)
