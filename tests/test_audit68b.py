"""Audit 68b: the models' building blocks held to transformers' own modules bit for bit where the
arithmetic is the same (bf16 norms, M-RoPE's interleaved sections at real models' sizes), the
reference attention's rows and a bucket's padding rows, the training data and checkpoint
bookkeeping held to exact counts, and a fused experts checkpoint's tensor-parallel slices (the
mutants of group audit68b in scripts/mutation_check.py). Unit tests on small tensors; no model
is built."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from blockspec.config import ModelConfig, RopeConfig
from blockspec.distributed.shard import rank_slice
from blockspec.layers.common import RMSNorm, RotaryEmbedding
from blockspec.models.dflash import DraftConfig
from blockspec.train import checkpoint, data


# ---- norms in bf16: where the reference rounds ---------------------------------------------------

def bf16_rows(seed: int, shape=(16, 512), scale: float = 3.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).bfloat16()


def test_rms_norm_in_bf16_rounds_where_transformers_does():
    """Qwen3 / Llama: the normed row is rounded to bf16, then multiplied by the bf16 weight
    (one more rounding). Multiplying in fp32 and rounding once gives other bits."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    x = bf16_rows(0)
    ours, ref = RMSNorm(x.shape[-1], eps=1e-6), Qwen3RMSNorm(x.shape[-1], eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.7 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1)))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.bfloat16(), ref.bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        out, total = ours.add(x, bf16_rows(2))
        assert torch.equal(total, x + bf16_rows(2)) and torch.equal(out, ref(x + bf16_rows(2)))


def test_zero_centred_rms_norm_in_bf16_rounds_once_like_transformers():
    """Qwen3.5: (1 + w) · norm(x) all in fp32, rounded to bf16 once at the end."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    x = bf16_rows(3)
    ours, ref = RMSNorm(x.shape[-1], eps=1e-6, zero_centred=True), Qwen3_5RMSNorm(x.shape[-1], eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(0.7 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(4)))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.bfloat16(), ref.bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_gated_output_norm_in_bf16_takes_silu_of_the_gate_in_fp32():
    """Qwen3.5's GatedDeltaNet output norm: w · norm(x) in bf16, times silu(gate) in fp32,
    rounded once: a bf16 silu rounds the gate's factor first."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    from blockspec.models.qwen3_5 import GatedRMSNorm
    x, gate = bf16_rows(5, (16, 64)), bf16_rows(6, (16, 64))
    ours, ref = GatedRMSNorm(64, eps=1e-6), Qwen3_5RMSNormGated(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.7 * torch.randn(64, generator=torch.Generator().manual_seed(7)))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.bfloat16(), ref.bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x, gate), ref(x, gate))


# ---- M-RoPE: the interleaved sections at real models' sizes ---------------------------------------

def mrope_positions(n: int) -> torch.Tensor:
    """[3, n] (t, h, w) positions of an image's rows after some text: all three differ."""
    t = torch.full((n,), 7)
    h = 7 + torch.arange(n) // 4
    w = 7 + torch.arange(n) % 4
    return torch.stack((t, h, w))


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_mrope_sections_equal_transformers_where_the_temporal_section_is_the_longest(kind):
    """Qwen3-VL's (24, 20, 20) over 64 frequencies and Qwen3.5's (11, 11, 10) over 32 (a quarter
    of a 256 head): frequency i takes the height angle for i ≡ 1 (mod 3) and the width angle for
    i ≡ 2 only below 3 × their section; past that the temporal one. The test fixtures' sections
    cover every frequency, so only these sizes tell a bounded section from an unbounded one."""
    if kind == "qwen3_vl":
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Reference
        head_dim, partial, section, theta = 128, 1.0, (24, 20, 20), 5_000_000.0
        config = Qwen3VLTextConfig(head_dim=head_dim, hidden_size=256, num_attention_heads=2,
                                   rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                    "mrope_section": list(section), "mrope_interleaved": True})
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding as Reference
        head_dim, partial, section, theta = 256, 0.25, (11, 11, 10), 10_000_000.0
        config = Qwen3_5TextConfig(head_dim=head_dim, hidden_size=256, num_attention_heads=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                    "partial_rotary_factor": partial,
                                                    "mrope_section": list(section), "mrope_interleaved": True})
    positions = mrope_positions(24)
    ours = RotaryEmbedding(RopeConfig(theta=theta, partial_rotary_factor=partial, mrope_section=section), head_dim)
    cos, sin = ours(positions, torch.float32, sections=True)                        # [N, 1, rot]
    ref_cos, ref_sin = Reference(config)(torch.zeros(1, dtype=torch.float32), positions[:, None])   # [1, N, rot]
    assert cos.shape[-1] == int(head_dim * partial)
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin[:, 0], ref_sin[0])


# ---- attention: the reference kernel's rows ------------------------------------------------------

def one_sequence(positions: list[int], context_len: int, page_size: int = 16):
    from blockspec.layers.attention import AttentionMetadata
    n = len(positions)
    return AttentionMetadata(num_seqs=1, width=n, input_ids=torch.zeros(n, dtype=torch.long),
                             positions=torch.tensor(positions), slot_mapping=torch.tensor(positions),
                             block_tables=torch.tensor([[2, 0, 3, 1]]), context_lens=torch.tensor([context_len]),
                             max_context_len=4 * page_size, page_size=page_size, kv=[])


def test_a_verify_rows_attention_has_the_bits_of_the_row_decoded_alone():
    """fp32 on CPU: each row of an 8-row verify block (GQA, keys on scattered pages) equals the
    same row attended alone, bit for bit. fp32 SDPA on CPU sums otherwise for 8 queries than
    for 1 (last-bit differences), which the reference avoids by attending in float64; those bits
    are what keeps DFlash equal to plain decoding on the bf16-rounding quantized path."""
    from blockspec.layers.attention import reference_paged_attention
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    q = torch.randn(8, 4, 16, generator=gen)
    positions = list(range(32, 40))
    block = one_sequence(positions, 40)
    verify = reference_paged_attention(q, k_pool, v_pool, block, block.context_lens, 0.25)
    assert verify.dtype == torch.float32
    for row, position in enumerate(positions):
        alone = one_sequence([position], position + 1)
        assert torch.equal(reference_paged_attention(q[row:row + 1], k_pool, v_pool, alone, alone.context_lens, 0.25),
                           verify[row:row + 1]), row


def test_padding_rows_of_an_eager_bucket_come_out_of_a_mixer_zero():
    """padding_zeroed where the host knows the lengths (a padded bucket run eagerly or in a
    PIECEWISE graph): rows past the sequences' own tokens are zero whatever they held, whether
    the core returned them (NaN here) or returned only the real rows; the real rows untouched."""
    from blockspec.layers.attention import padding_zeroed
    for rows, real in ((2, 1), (8, 5)):
        meta = SimpleNamespace(bounded=False, num_tokens=real, shared={})
        x = torch.full((rows, 3), float("nan"))
        x[:real] = torch.arange(3 * real, dtype=torch.float32).view(real, 3)
        expect = torch.cat((x[:real], torch.zeros(rows - real, 3)))
        assert torch.equal(padding_zeroed(x.clone(), meta, rows), expect), rows
        assert torch.equal(padding_zeroed(x[:real].clone(), meta, rows), expect), rows
    full = torch.ones(4, 3)
    assert torch.equal(padding_zeroed(full.clone(), SimpleNamespace(bounded=False, num_tokens=4, shared={}), 4), full)


# ---- training data ----------------------------------------------------------------------------------

class StubTokenizer:
    """Each character's code point is its token (no special tokens)."""

    def __init__(self) -> None:
        self.backend = SimpleNamespace(encode_batch=lambda docs, add_special_tokens: [
            SimpleNamespace(ids=[ord(c) for c in doc]) for doc in docs])

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_text_is_cut_into_every_whole_piece_and_only_those():
    """Documents joined by EOS, cut into seq_len pieces: a stream of exactly N pieces gives all N
    (the last one ends at the stream's last token), a shorter tail is dropped."""
    tok = StubTokenizer()
    stream = [97, 98, 99, 0, 100, 101, 102, 103, 0]                      # "abc" EOS "defg" EOS
    assert data.text_examples(["abc", "defg"], tok, 3, eos_id=0) == [(stream[i:i + 3], 0) for i in (0, 3, 6)]
    assert data.text_examples(["abc", "defg"], tok, 9, eos_id=0) == [(stream, 0)]
    assert data.text_examples(["abc", "defg"], tok, 4, eos_id=0) == [(stream[:4], 0), (stream[4:8], 0)]
    with pytest.raises(data.DataError):
        data.text_examples(["abc", "defg"], tok, 10, eos_id=0)


# ---- checkpoints ----------------------------------------------------------------------------------

def saved(tmp_path, steps: list[int]) -> list[str]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in steps:
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, {"block_size": 4}, {"seed": 1}, torch.float32)
    return sorted(d.name for d in (tmp_path / "checkpoints").iterdir())


def test_the_last_three_checkpoints_are_kept_each_whole(tmp_path):
    """KEEP_CHECKPOINTS = 3: after five saves the three newest remain, each with its weights,
    config and training state (the step and the run's arguments as saved)."""
    assert checkpoint.KEEP_CHECKPOINTS == 3
    assert saved(tmp_path, [1, 2]) == ["step-00000001", "step-00000002"]
    assert saved(tmp_path, [3, 4, 5]) == ["step-00000003", "step-00000004", "step-00000005"]
    for step in (3, 4, 5):
        directory = tmp_path / "checkpoints" / f"step-{step:08d}"
        assert {f.name for f in directory.iterdir()} == {"config.json", "model.safetensors", checkpoint.STATE_FILE}
        state = checkpoint.load_state(directory, torch.device("cpu"))
        assert state["step"] == step and state["run_args"] == {"seed": 1}


def test_resume_takes_the_newest_checkpoint_whose_state_was_written(tmp_path):
    """A checkpoint directory whose train_state.pt never landed (a run killed mid-save) is not
    resumed from: the newest complete one is; none at all gives None."""
    (tmp_path / "checkpoints").mkdir()
    assert checkpoint.latest_checkpoint(tmp_path) is None
    saved(tmp_path, [1, 2])
    half = tmp_path / "checkpoints" / "step-00000003"
    half.mkdir()
    (half / "config.json").write_text("{}")
    (half / (checkpoint.STATE_FILE + ".tmp")).write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000002"


def test_a_drafts_config_carries_the_targets_llama3_rope_exactly(llama_dir):
    """train-draft copies the target's RoPE into the draft's config.json: read back, the draft's
    RopeConfig is the target's, every llama3 field in its place."""
    d = json.loads((llama_dir / "config.json").read_text())
    target = ModelConfig.from_hf(d, "LlamaForCausalLM")
    assert target.rope.rope_type == "llama3" and target.rope.low_freq_factor != target.rope.high_freq_factor
    draft = DraftConfig.from_hf(checkpoint.draft_config_dict(target, 1, 4, [0], 5))
    assert draft.rope == target.rope


# ---- tensor parallel: a fused experts checkpoint's rank slices ---------------------------------

def test_each_rank_reads_its_share_of_gate_and_of_up_from_fused_experts():
    """experts.gate_up_proj [E, 2I, H] holds each expert's gate rows, then its up rows. Rank r of
    tp reads the r-th share of the gate rows and the r-th share of the up rows, so its local
    [E, 2I / tp, H] is again [gate | up] (what silu_mul splits in halves); reading the r-th
    contiguous share of all 2I rows would hand rank 0 gates only and rank 1 ups only."""
    from blockspec.distributed.loading import read_slice
    num_experts, inter, hidden, tp = 3, 8, 5, 2
    whole = torch.randn(num_experts, 2 * inter, hidden, generator=torch.Generator().manual_seed(0))
    gate, up = whole[:, :inter], whole[:, inter:]
    config = SimpleNamespace(num_key_value_heads=2)
    share = inter // tp
    for rank in range(tp):
        where = rank_slice("model.layers.1.mlp.experts.gate_up_proj", tuple(whole.shape), config, tp, rank)
        local = read_slice(whole, tuple(whole.shape), where)
        assert local.shape == (num_experts, 2 * share, hidden)
        assert torch.equal(local[:, :share], gate[:, rank * share:(rank + 1) * share]), rank
        assert torch.equal(local[:, share:], up[:, rank * share:(rank + 1) * share]), rank
        down = torch.randn(num_experts, hidden, inter, generator=torch.Generator().manual_seed(1))
        where = rank_slice("model.layers.1.mlp.experts.down_proj", tuple(down.shape), config, tp, rank)
        assert torch.equal(read_slice(down, tuple(down.shape), where), down[..., rank * share:(rank + 1) * share])
