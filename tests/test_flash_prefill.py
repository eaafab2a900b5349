"""Long prefill chunks on FlashAttention (kernels/flash_prefill.py): which sequences are routed,
the keys gathered for them, the bottom-right causal mask, and the split of one ragged step
between the routed sequences and the Triton kernel's tail — each against the torch reference
(layers/attention.py), on CPU in float64. The CUDA kernel itself: tests/gpu/test_attention_kernels.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attention_cases import make_case, reference
from blockspec.kernels import flash_prefill
from blockspec.layers import attention
from blockspec.layers.attention import AttentionMetadata, after_long_prefills, reference_paged_attention

# One ragged step as the runner lays it out: prefill chunks first (a long one, a short one after
# a cached prefix, another long one, then a short chunk after the last long one), then a plain
# decode row and verify blocks of widths 3 and 5, then a padding sequence.
CONTEXT = [900, 90, 600, 20, 9, 33, 40]
WIDTHS = [500, 3, 450, 20, 1, 3, 5]
NUM_PREFILL = 4


def ragged_case(seed: int = 0):
    case = make_case(CONTEXT, max(WIDTHS), num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float64,
                     device="cpu", widths=WIDTHS, num_padding=1, seed=seed)
    case.meta.num_prefill_seqs = NUM_PREFILL
    case.meta.context_lens_host = CONTEXT + [max(WIDTHS)]
    return case


def plan_of(meta, q):
    """long_prefills as a new forward asks it (each forward starts with its shared values cleared)."""
    meta.shared.clear()
    return attention.long_prefills(meta, q)


def test_the_head_ends_at_the_last_long_chunk(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", "flash")       # FlashAttention-2's rows differ by head size
    assert flash_prefill.long_prefill_rows(256) < flash_prefill.long_prefill_rows(128)
    assert flash_prefill.long_prefill_head([flash_prefill.long_prefill_rows(128) - 1], 256) == 1
    monkeypatch.delenv("BLOCKSPEC_PREFILL_ATTENTION")
    assert flash_prefill.backend() == "triton-fa"
    n = flash_prefill.long_prefill_rows(128)
    assert flash_prefill.long_prefill_head([]) == 0
    assert flash_prefill.long_prefill_head([n - 1, 3]) == 0
    assert flash_prefill.long_prefill_head([n]) == 1
    assert flash_prefill.long_prefill_head([n - 1, n + 5, 2]) == 2
    assert flash_prefill.long_prefill_head([n, 1, n, n - 1]) == 3
    assert flash_prefill.long_prefill_head(WIDTHS[:NUM_PREFILL]) == 3


def test_routed_sequences_see_their_own_keys_causally():
    """The plan's slots gather each routed sequence's keys 0 … L − 1 through its shuffled pages,
    and the varlen form's bottom-right mask gives every row the reference's output."""
    case = ragged_case()
    m = case.meta
    head = flash_prefill.long_prefill_head(m.lens[:NUM_PREFILL])
    routed = flash_prefill.plan(head, m.lens, m.context_lens_host, m.starts, m.context_lens, m.block_tables,
                                m.page_size)
    assert routed.num_rows == sum(WIDTHS[:head]) and routed.max_q == max(WIDTHS[:head])
    assert routed.cu_q.tolist() == [0, 500, 503, 953] and routed.cu_k.tolist() == [0, 900, 990, 1590]
    expected_slots = torch.cat([attention.key_slots(m.block_tables[b:b + 1], CONTEXT[b], m.page_size)[0]
                                for b in range(head)])
    assert torch.equal(routed.slots, expected_slots)
    out = flash_prefill.attend(routed, case.q, case.k_pool, case.v_pool, case.scale)
    assert out.shape == (routed.num_rows, 8 * 32)
    torch.testing.assert_close(out, reference(case)[: routed.num_rows], rtol=0, atol=1e-12)


def kernel_as_reference(q, k_pool, v_pool, block_tables, context_lens, positions, query_start, max_query_len,
                        page_size, max_context_len, scale, is_causal, block_kv):
    """The Triton kernel's contract in torch (CI has no Triton): the sequences of query_start,
    their rows written into a fresh [N, H·D] (other rows left as they were allocated)."""
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype)
    starts = query_start.tolist()
    for b in range(len(starts) - 1):
        rows = slice(starts[b], starts[b + 1])
        n = starts[b + 1] - starts[b]
        if not n:
            continue
        assert n <= max_query_len
        one = AttentionMetadata(num_seqs=1, width=n, input_ids=None, positions=positions[rows], slot_mapping=None,
                                block_tables=block_tables[b:b + 1], context_lens=context_lens[b:b + 1],
                                max_context_len=int(context_lens[b]), page_size=page_size, kv=[])
        out[rows] = reference_paged_attention(q[rows], k_pool, v_pool, one, one.context_lens, scale, is_causal)
    return out


def test_a_ragged_step_splits_between_flash_and_the_kernel():
    """Every real row of the step equals the reference: the routed head from the varlen form,
    the tail (a short chunk, a decode row, verify blocks, a padding sequence) from the kernel
    called on query_start's tail; nothing is left unwritten."""
    case = ragged_case(seed=3)
    m = case.meta
    head = flash_prefill.long_prefill_head(m.lens[:NUM_PREFILL])
    routed = flash_prefill.plan(head, m.lens, m.context_lens_host, m.starts, m.context_lens, m.block_tables,
                                m.page_size)
    out = after_long_prefills(routed, case.q, case.k_pool, case.v_pool, m, case.scale, kernel_as_reference)
    real = sum(WIDTHS)
    assert not torch.isnan(out[:real]).any()
    torch.testing.assert_close(out[:real], reference(case)[:real], rtol=0, atol=1e-12)


def test_the_backend_is_read_from_the_environment(monkeypatch):
    for name in flash_prefill.BACKENDS:
        monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", name)
        assert flash_prefill.backend() == name
        assert flash_prefill.enabled() == (name != "triton")
    monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", "nonsense")       # unknown: the default
    assert flash_prefill.backend() == "triton-fa"
    monkeypatch.setattr(flash_prefill, "batch_invariant", lambda: True)
    assert not flash_prefill.enabled()


def test_routing_is_off_where_it_must_be(monkeypatch):
    """No plan for a step without prefill, without host lengths, or where FlashAttention cannot
    run (CPU tensors here), and none with BLOCKSPEC_PREFILL_ATTENTION=triton."""
    case = ragged_case()
    m = case.meta
    assert plan_of(m, case.q) is None                 # a CPU q: FlashAttention cannot run
    monkeypatch.setattr(flash_prefill, "supports", lambda q: True)
    assert plan_of(m, case.q) is not None
    monkeypatch.setenv("BLOCKSPEC_PREFILL_ATTENTION", "triton")
    assert plan_of(m, case.q) is None
    monkeypatch.delenv("BLOCKSPEC_PREFILL_ATTENTION")
    m.context_lens_host = None
    assert plan_of(m, case.q) is None
    m.context_lens_host, m.num_prefill_seqs = CONTEXT + [max(WIDTHS)], 0
    assert plan_of(m, case.q) is None


@pytest.mark.parametrize("num_prefill", [1, 2])
def test_the_runner_keeps_host_key_counts_for_prefill_steps(num_prefill):
    """ModelRunner.prepare: a step with prefill chunks carries context_lens on the host, equal to
    the device's; a decode-only step does not."""
    from blockspec.engine.model_runner import Entry, ModelRunner
    from blockspec.engine.graphs import EAGER, BatchDescriptor, Plan
    from blockspec.engine.memory import dummy_sequence

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.page_size, runner.states, runner.draft, runner.width = torch.device("cpu"), 16, None, None, 1
    runner.config = SimpleNamespace(max_model_len=1000)

    class Target:
        visual = None
    runner.target, runner.target_kv = Target(), type("KV", (), {"layers": []})()
    seqs = [dummy_sequence(4) for _ in range(3)]
    entries = [Entry(seqs[0], 10, [1] * 30), Entry(seqs[1], 0, [2] * 7), Entry(seqs[2], 40, [3])]
    plan = Plan(EAGER, BatchDescriptor(38, 3, True), 4, 41)
    meta = runner.prepare(entries, num_prefill, plan)
    assert meta.context_lens_host == [40, 7, 41]
    assert meta.context_lens.tolist() == meta.context_lens_host
    assert meta.max_gather_keys == 1001                        # one sequence of the longest context (+ a block)
    assert runner.prepare(entries, 0, plan).context_lens_host is None


def test_the_routed_head_shrinks_to_the_gather_room(monkeypatch):
    """max_gather_keys caps the keys the routed sequences gather at once (the pool's sizing holds
    room for one longest sequence): the head is cut back from its end until they fit."""
    monkeypatch.setattr(flash_prefill, "supports", lambda q: True)
    case = ragged_case()
    m = case.meta
    assert plan_of(m, case.q).head == 3                  # 900 + 90 + 600 keys
    assert attention.long_prefills(m, case.q) is attention.long_prefills(m, case.q)   # once per forward
    m.max_gather_keys = 1000
    assert plan_of(m, case.q).head == 2                  # 990 fit
    m.max_gather_keys = 899
    assert plan_of(m, case.q) is None


def test_a_step_of_long_chunks_alone_is_all_flash():
    """Every sequence routed (no decode rows, no short chunk after the last long one): the paged
    kernel is not called and every row comes from the FlashAttention form."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("the paged kernel ran with nothing left to attend")
    widths, context = [300, 20, 500], [700, 20, 500]
    case = make_case(context, max(widths), num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float64,
                     device="cpu", widths=widths, seed=7)
    m = case.meta
    m.num_prefill_seqs, m.context_lens_host = 3, context
    routed = flash_prefill.plan(3, m.lens, context, m.starts, m.context_lens, m.block_tables, m.page_size)
    out = after_long_prefills(routed, case.q, case.k_pool, case.v_pool, m, case.scale, no_kernel)
    torch.testing.assert_close(out, reference(case), rtol=0, atol=1e-12)


def test_flashattention_is_probed_once_per_device():
    """flash_available runs a tiny call; it is asked in every routed layer of every step, so it
    must be answered from its cache after the first time."""
    assert hasattr(flash_prefill.flash_available, "cache_info")
