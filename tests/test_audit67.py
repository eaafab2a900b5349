"""Audit 67: invariants of sampling and the logits processors, train-draft's labels, anchors,
batch order and schedule, the CPU quantized matmul's row limit, the
pool's size and the adaptive policy's cost table that no earlier test held exactly (the mutants
of group audit67 in scripts/mutation_check.py). Every test is a unit test on tiny tensors."""
from __future__ import annotations

import pytest
import torch

from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.logits import LogitsProcessor
from blockspec.engine.memory import PoolSize, check_one_sequence_fits
from blockspec.engine.request import Request
from blockspec.engine.spec.costs import cost_table
from blockspec.kernels import native
from blockspec.layers import quant
from blockspec.sampling import SamplingParams, make_generator, probs_from_logits, sample
from blockspec.train import blockwise, data
from blockspec.train.loop import lr_at

LOGITS = torch.tensor([3.0, 2.6, 2.2, 1.5, 1.0, 0.4, -0.5, -2.0])


# ---- sampling --------------------------------------------------------------------------------

def test_min_p_of_one_keeps_exactly_the_most_probable_tokens():
    """min_p = 1 (its edge value) keeps the tokens at the maximum probability, ties included:
    a filter that drops what equals the floor would leave nothing (NaN probabilities)."""
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, min_p=1.0))
    assert probs.tolist() == [1.0] + [0.0] * 7
    tied = probs_from_logits(torch.tensor([2.0, 0.0, 2.0, 1.0]), SamplingParams(temperature=0.5, min_p=1.0))
    assert tied.tolist() == [0.5, 0.0, 0.5, 0.0]


def test_seed_zero_is_a_seed():
    """seed=0 is a fixed seed like any other: two requests with it draw the same tokens (a
    falsy-seed check would hand it a random one)."""
    params = SamplingParams(temperature=1.0, seed=0)
    logits = torch.zeros(64, 1000)
    first = sample(logits, params, make_generator(params, torch.device("cpu")))
    torch.manual_seed(123)                               # whatever ran before does not matter
    second = sample(logits, params, make_generator(params, torch.device("cpu")))
    assert torch.equal(first, second)
    assert not torch.equal(first, sample(logits, params, make_generator(SamplingParams(temperature=1.0, seed=1),
                                                                         torch.device("cpu"))))


# ---- penalties --------------------------------------------------------------------------------

def processed_row(params: SamplingParams, prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
    req = Request("r", prompt, params, frozenset(), 100)
    req.commit(output)
    return LogitsProcessor(req, logits.shape[-1], torch.device("cpu")).rows(logits[None], [])[0]


def test_presence_and_frequency_penalties_count_the_output_only():
    """vLLM's rules: presence subtracts p once for a token the output holds, however often;
    frequency subtracts f per occurrence in the output; neither looks at the prompt (token 1
    here, never in the output, keeps its logit)."""
    logits = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.0, 3.0])
    presence = processed_row(SamplingParams(max_tokens=8, presence_penalty=1.5), [1, 1, 4], [2, 2, 2, 5], logits)
    assert presence.tolist() == [0.5, 1.0, 0.5, -1.0, 0.0, 1.5]
    frequency = processed_row(SamplingParams(max_tokens=8, frequency_penalty=0.5), [1, 1, 4], [2, 2, 2, 5], logits)
    assert frequency.tolist() == [0.5, 1.0, 0.5, -1.0, 0.0, 2.5]


# ---- train-draft ---------------------------------------------------------------------------------

def test_labels_stop_at_the_sequences_end_and_anchors_leave_one():
    """A block at anchor a labels tokens a + 1 … a + B − 1 that exist (positions < length);
    anchors run from the prompt's end (at least 1) to length − 2, so each has a label."""
    ids = torch.arange(10)[None] + 100
    labels, valid = blockwise.block_labels(ids, torch.tensor([6]), torch.tensor([[3, 1]]), torch.tensor([[True, True]]),
                                           block_size=4)
    assert valid.tolist() == [[[True, True, False], [True, True, True]]]
    assert labels[0, 0, :2].tolist() == [104, 105] and labels[0, 1].tolist() == [102, 103, 104]
    assert blockwise.num_anchor_candidates(10, 3) == (3, 8) and blockwise.num_anchor_candidates(10, 0) == (1, 8)
    lengths, prompts = torch.tensor([7, 12, 5]), torch.tensor([2, 0, 4])
    anchors, anchor_valid = blockwise.sample_anchors(lengths, prompts, 8, torch.Generator().manual_seed(0))
    _, label_valid = blockwise.block_labels(torch.zeros(3, 12, dtype=torch.long), lengths, anchors, anchor_valid, 4)
    assert torch.equal(label_valid[..., 0], anchor_valid)          # every anchor has its first label
    assert anchor_valid.sum(1).tolist() == [4, 8, 0]               # 2 … 5; 1 … 10 (8 of 10); none past 4 of 5


def test_every_epoch_visits_every_example_once_in_its_own_order():
    """A step's batch is a slice of its epoch's permutation; epochs are reshuffled."""
    epochs = [[i for step in range(e * 3, e * 3 + 3) for i in data.batch_indices(step, 4, 12, seed=5)]
              for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert data.batch_indices(4, 4, 12, seed=5) == epochs[1][4:8]          # recomputed the same on demand


def test_the_learning_rate_warms_up_to_the_peak_and_never_passes_it():
    steps, peak = 100, 1e-3
    rates = [lr_at(step, steps, peak) for step in range(steps + 1)]
    assert rates[:5] == pytest.approx([peak * (s + 1) / 5 for s in range(5)])
    assert rates[4] == pytest.approx(peak) and rates[5] == pytest.approx(peak)
    assert max(rates) <= peak * (1 + 1e-12)
    assert rates[-1] == pytest.approx(0.1 * peak) and rates[50] < rates[20]


# ---- the CPU quantized matmul ------------------------------------------------------------------

@pytest.mark.skipif(not native.available(), reason="the CPU kernels are not built here")
def test_a_row_of_the_kernels_full_width_runs_on_it():
    """Rows of up to 1024 blocks (32768 weights, the kernel's MAX_BLOCKS) take the q8 kernel and
    compute its reference; one block more is left to int4pack."""
    gen = torch.Generator().manual_seed(0)
    n, k = 3, 1024 * quant.GROUP
    d = (torch.rand(n, k // quant.GROUP, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // quant.GROUP, generator=gen) * 0.1).half().float()
    blocks = quant.q4_blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, m)
    layer = quant.QuantLinear(blocks)
    assert layer.kernel == "q8"
    x = torch.randn(2, k, generator=gen)
    ref = quant.reference_linear(x, blocks, kernel="q8")
    assert torch.allclose(layer(x), ref, rtol=1e-4, atol=1e-3 * float(ref.abs().max()))
    wider = quant.Blocks(torch.zeros(n, k + quant.GROUP, dtype=torch.uint8), torch.ones(n, 1025), torch.zeros(n, 1025))
    assert not quant.native_fits(wider) and quant.default_kernel(wider) == "int4pack"


# ---- the pool and the cost table -----------------------------------------------------------------

def test_a_pool_of_exactly_one_sequence_is_enough():
    config = EngineConfig(max_model_len=256, block_size=4, max_num_seqs=4)
    fits = PoolSize(config.pages_per_seq + 1, 1024, "kv-cache-memory")          # + the padding page
    check_one_sequence_fits(config, fits)
    with pytest.raises(ConfigError, match="less than one sequence"):
        check_one_sequence_fits(config, PoolSize(config.pages_per_seq, 1024, "kv-cache-memory"))


def test_the_measured_table_is_monotone_in_every_curve_and_keeps_its_padding():
    measured = {"verify": {1: 2.0, 8: 1.0, 32: 5.0}, "draft": {1: 1.0, 4: 3.0},
                "narrow": {4: {1: 2.0, 4: 1.0}}}
    table = cost_table(measured, padded=True)
    assert table.target_ms == (1.5, 1.5, 5.0) and table.draft_ms == (1.0, 3.0)
    assert table.narrow == ((4, (1.5, 1.5)),)
    assert table.padded and table.target_ms_of(9) == 5.0 and table.draft_ms_of(2) == 3.0   # the next bucket's
    eager = cost_table(measured, padded=False)
    assert not eager.padded and eager.draft_ms_of(2) == pytest.approx(1.0 + 2.0 / 3.0)



def test_a_verify_never_accepts_past_the_drafts_a_sequence_verified():
    """judge over a ragged batch: sequence b verified k_b drafts (rows past k_b repeat its last
    row, and its block may hold drafts past k_b, drafted for a wider neighbour). Even where every
    draft equals the target's token, b accepts at most k_b: a draft past k_b was never verified,
    and the token after it would be a copy of row k_b's."""
    from types import SimpleNamespace

    from blockspec.engine.spec.dflash import Proposal, judge
    from blockspec.sampling import SamplingParams
    width, vocab = 4, 11
    target = torch.tensor([[3, 5, 7, 9], [2, 4, 6, 8], [1, 2, 3, 4]])           # each row's argmax
    logits = torch.full((3, width, vocab), -5.0).scatter(2, target[..., None], 5.0)
    drafts = target[:, :-1].clone()                                              # every draft agrees
    seqs = [SimpleNamespace(request=SimpleNamespace(params=SamplingParams(temperature=0.0)))] * 3
    verdict = judge(seqs, Proposal(drafts, [None] * 3), logits, num_drafts=[1, 3, 0])
    assert verdict.accepted.flatten().tolist() == [1, 3, 0]
    assert torch.equal(verdict.target_ids, target)


def test_a_buckets_padding_rows_come_out_of_a_mixer_zero_and_a_one_token_bucket_has_none():
    """padding_zeroed under a FULL graph's bounded batch: rows past the sequences' own come out
    zero whatever they held (NaN here), the real rows untouched; the one-token bucket's row is
    always a sequence's, so it is returned as it is (no mask launched)."""
    from types import SimpleNamespace

    from blockspec.layers.attention import padding_zeroed
    for rows, real in ((2, 1), (4, 3), (8, 1)):
        meta = SimpleNamespace(bounded=True, shared={}, starts=torch.tensor([0, real]))
        x = torch.full((rows, 3), float("nan"))
        x[:real] = 1.0
        out = padding_zeroed(x, meta, rows)
        assert torch.equal(out[:real], x[:real]) and torch.equal(out[real:], torch.zeros(rows - real, 3)), rows
    one = torch.ones(1, 3)
    assert padding_zeroed(one, SimpleNamespace(bounded=True, shared={}, starts=torch.tensor([0, 1])), 1) is one
