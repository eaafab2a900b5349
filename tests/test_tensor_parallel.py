"""Tensor parallelism on CPU: two ranks over gloo (rank 0 here, one spawned worker), fp32.

TP2 greedy output equals transformers' (and so TP1's and plain decoding's) for dense, hybrid and
MoE targets, plain, DFlash and DFlash 2; each rank loads only its slices of the checkpoint, in
every layout; a killed worker ends the process with one line; SIGTERM drains a TP2 server and
stops its worker. One worker process serves the whole module (LLM.close between models).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fixtures
from servers import ServerProcess, wait_until
from blockspec.config import ConfigError
from blockspec.distributed.group import TPGroup
from blockspec.distributed.launch import stop_leader
from blockspec.distributed.loading import ReadLog, load_sharded_model
from blockspec.distributed.shard import rank_slice
from blockspec.llm import LLM
from blockspec.loader import LoadError, load_model
from blockspec.sampling import SamplingParams
from blockspec.tokenizer import Tokenizer

PROMPTS = [[11, 42, 7, 99, 3], [5, 17, 200, 31, 64, 2, 90, 13]]
MAX_TOKENS = 10
VOCAB = 256
ATTENTION = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def hf_model(kind: str) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    if kind == "dense":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**ATTENTION, tie_word_embeddings=True))   # one tensor, two vocab-parallel uses
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**ATTENTION, **EXPERTS, mlp_only_layers=[2]))
    if kind == "qwen3_next":          # fused GDN projections, a shared expert, sparse every second layer
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**ATTENTION, **LINEAR, **EXPERTS,
                                                          shared_expert_intermediate_size=24, decoder_sparse_step=2))
    raise ValueError(kind)


def write_target(directory: Path, kind: str, tokenizer_dir: Path) -> torch.nn.Module:
    """A tiny random target (every weight off its init, sharp logits), as test_moe writes them."""
    model = hf_model(kind)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
        model.get_decoder().norm.weight.add_(8.0)
    model.save_pretrained(directory)
    copy_tokenizer(tokenizer_dir, directory)
    return model.eval()


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


def transformers_greedy(model: torch.nn.Module) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
        out.append(tokens[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """kind → (checkpoint, transformers' greedy continuations of PROMPTS); drafts beside them."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("tp")
    fixtures.write_hybrid_checkpoint(root / "hybrid")
    hybrid = AutoModelForCausalLM.from_pretrained(root / "hybrid", dtype=torch.float32).eval()
    out = {"hybrid": (root / "hybrid", transformers_greedy(hybrid))}
    for kind in ("dense", "qwen3_moe", "qwen3_next"):
        out[kind] = (root / kind, transformers_greedy(write_target(root / kind, kind, root / "hybrid")))
    for kind in out:
        fixtures.write_dflash_draft(root / f"{kind}-dflash", root / kind, block_size=4, mask_token_id=VOCAB - 1)
    for kind in ("dense", "hybrid"):
        fixtures.write_dflash2_draft(root / f"{kind}-dflash2", root / kind, block_size=4, mask_token_id=VOCAB - 1)
    return out


@pytest.fixture(scope="module", autouse=True)
def worker_group():
    """The workers this module's LLMs start live until its end, not the whole session's."""
    yield
    stop_leader()


@pytest.fixture(scope="module")
def one_tokenizer(targets):
    """Every checkpoint carries the same tokenizer files: read once (most of an LLM's load)."""
    shared = Tokenizer.from_dir(targets["hybrid"][0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tokenizer, "from_dir", staticmethod(lambda path: shared))
        yield


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(PROMPTS, params)]


CASES = [("dense", None, False), ("dense", "dflash", False), ("dense", "dflash2", False), ("hybrid", None, False),
         ("hybrid", "dflash", False), ("hybrid", "dflash2", False), ("qwen3_moe", None, False),
         ("qwen3_moe", "dflash", False), ("qwen3_next", None, False), ("qwen3_next", "dflash", False),
         ("qwen3_moe", None, True), ("qwen3_next", "dflash", True)]


@pytest.mark.parametrize("kind,draft,expert_parallel", CASES)
def test_tp2_greedy_equals_transformers_and_tp1(targets, one_tokenizer, kind, draft, expert_parallel):
    path, expected = targets[kind]
    draft_path = str(path.parent / f"{kind}-{draft}") if draft else None
    llm = LLM(str(path), draft=draft_path, tensor_parallel_size=2, expert_parallel=expert_parallel,
              max_model_len=128, max_num_seqs=4, show_progress=False)
    try:
        assert llm.tp.size == 2 and llm.target.lm_head.weight.shape[0] == VOCAB // 2
        assert greedy(llm) == expected
    finally:
        llm.close()
    if draft is None and not expert_parallel:               # TP1 on the same checkpoint: the same tokens
        assert greedy(LLM(str(path), max_model_len=128, max_num_seqs=4, show_progress=False)) == expected





def test_tp2_batch_and_prefix_cache_agree_with_alone(targets, one_tokenizer):
    """A request in a TP2 batch equals it alone; a repeated prompt hits the prefix cache, still
    exact (the hybrid's recurrent-state snapshots are per rank too)."""
    path, expected = targets["hybrid"]
    llm = LLM(str(path), draft=str(path.parent / "hybrid-dflash"), tensor_parallel_size=2, max_model_len=128,
              max_num_seqs=4, show_progress=False)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        long_prompt = PROMPTS[1] * 3
        first = llm.generate([long_prompt], params)[0].token_ids
        again = llm.generate([long_prompt, PROMPTS[0]], params)
        assert again[0].token_ids == first and again[0].stats.cached_tokens > 0
        assert again[1].token_ids == expected[0]
    finally:
        llm.close()


# ── loading by rank slices ──────────────────────────────────────────────────────────────────────

def fuse_experts(src: Path, dst: Path) -> Path:
    """The same checkpoint with each layer's experts as two 3-D tensors (the fused layout)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    pattern = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    layers: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in tensors if pattern.fullmatch(n)]:
        prefix, index, proj = pattern.fullmatch(name).groups()
        layers.setdefault(prefix, {})[int(index), proj] = tensors.pop(name)
    for prefix, pieces in layers.items():
        experts = range(1 + max(e for e, _ in pieces))
        tensors[prefix + ".gate_up_proj"] = torch.stack([torch.cat((pieces[e, "gate_proj"], pieces[e, "up_proj"]))
                                                         for e in experts])
        tensors[prefix + ".down_proj"] = torch.stack([pieces[e, "down_proj"] for e in experts])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def layouts(targets, tmp_path) -> dict[str, tuple[Path, bool]]:
    """name → (checkpoint, expert parallel)."""
    fused = fuse_experts(targets["qwen3_moe"][0], tmp_path / "fused")
    return {"dense": (targets["dense"][0], False), "hybrid": (targets["hybrid"][0], False),
            "qwen3_moe": (targets["qwen3_moe"][0], False), "qwen3_moe_fused": (fused, False),
            "qwen3_next": (targets["qwen3_next"][0], False), "qwen3_moe_ep": (targets["qwen3_moe"][0], True),
            "qwen3_moe_fused_ep": (fused, True), "qwen3_next_ep": (targets["qwen3_next"][0], True)}


def test_each_rank_reads_only_its_slices(targets, tmp_path):
    """Every layout: each rank's parameters have its share's shapes and put together give the
    whole model's; it read half of every split tensor, all of the replicated ones, its own
    experts whole under expert parallelism and nothing of the other rank's."""
    for layout, (path, ep) in layouts(targets, tmp_path).items():
        whole_model = load_model(str(path)).model
        whole, config = dict(whole_model.named_parameters()), whole_model.config
        shards = []
        for rank in range(2):
            log = ReadLog()
            model = load_sharded_model(str(path), TPGroup(rank, 2, None, None), log=log, expert_parallel=ep).model
            shards.append(dict(model.named_parameters()))
            for name, (shape, read) in log.reads.items():
                split = rank_slice(name, shape, config, 2, rank, ep) is not None
                assert read == (torch.Size(shape).numel() // 2 if split else torch.Size(shape).numel()), (layout, name)
            experts_read = {int(m[1]) for m in map(EXPERT.search, log.reads) if m}
            assert experts_read == experts_to_read(layout, ep, rank), layout
            assert sum(r for _, r in log.reads.values()) < sum(torch.Size(s).numel() for s, _ in log.reads.values())
        for name, param in whole.items():
            assert_rank_pieces(layout, name, param, [shard[name] for shard in shards], ep)


EXPERT = re.compile(r"\.experts\.(\d+)\.")


def experts_to_read(layout: str, ep: bool, rank: int) -> set[int]:
    """The per-expert tensors' expert ids a rank reads (8 experts; none in a dense or fused layout)."""
    if layout in ("dense", "hybrid") or "fused" in layout:
        return set()
    return set(range(4 * rank, 4 * rank + 4)) if ep else set(range(8))


def assert_rank_pieces(layout: str, name: str, whole: torch.Tensor, pieces: list[torch.Tensor], ep: bool) -> None:
    """The two ranks' pieces put together give the whole parameter back (each in its layout)."""
    if pieces[0].shape == whole.shape:                       # replicated: the same on both ranks
        assert all(torch.equal(p, whole) for p in pieces), (layout, name)
        return
    if ep and re.search(r"experts\.(gate_up|down)_proj$", name):         # rank r: experts 4r … 4r + 3
        assert torch.equal(torch.cat(pieces, dim=0), whole), (layout, name)
    elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")) and whole.dim() == 2:
        assert torch.equal(torch.cat(pieces, dim=1), whole), (layout, name)
    elif name.endswith("experts.down_proj"):
        assert torch.equal(torch.cat(pieces, dim=2), whole), (layout, name)
    elif name.endswith(("gate_up_proj.weight", "experts.gate_up_proj", "qkv_proj.weight", "qkv_proj.bias",
                        "in_proj.weight", "conv1d.weight")):
        # fused parts ([q | k | v], [gate | up], GDN's projections): each part split by rows
        dim = 1 if name.endswith("experts.gate_up_proj") else 0
        assert whole.shape[dim] == sum(p.shape[dim] for p in pieces)
        assert torch.equal(torch.sort(torch.cat(pieces, dim=dim).flatten())[0], torch.sort(whole.flatten())[0]), \
            (layout, name)
    else:
        assert torch.equal(torch.cat(pieces, dim=0), whole), (layout, name)


def test_indivisible_shapes_are_one_line_errors(targets):
    with pytest.raises(LoadError, match="num_attention_heads 4 is not a multiple of 3"):
        load_sharded_model(str(targets["dense"][0]), TPGroup(0, 3, None, None))
    with pytest.raises(ConfigError, match="--speculation adaptive runs on one device only"):
        LLM(str(targets["dense"][0]), tensor_parallel_size=2, speculation="adaptive")


# ── faults and shutdown ─────────────────────────────────────────────────────────────────────────

def workers_of(pid: int) -> list[int]:
    """The worker processes among pid's children."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"blockspec.distributed.launch" in Path(f"/proc/{c}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tp2_args(targets) -> list[str]:
    path = targets["hybrid"][0]
    return ["--model", str(path), "--draft", str(path.parent / "hybrid-dflash"), "--tensor-parallel-size", "2",
            "--max-model-len", "256", "--log-stats-interval", "0"]


def test_a_killed_worker_ends_the_server_with_one_line(tp2_args, tmp_path):
    server = ServerProcess(tmp_path / "serve.log", *tp2_args)
    try:
        server.wait_ready()
        [worker] = workers_of(server.process.pid)
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        server.process.wait(15)
        assert time.monotonic() - started < 10
        assert server.process.returncode == 1
        last = server.log().strip().splitlines()[-1]
        assert last == f"blockspec: tensor-parallel worker rank 1 (pid {worker}) died (killed by SIGKILL); stopping"
    finally:
        server.stop()


def test_sigterm_drains_the_server_and_stops_its_worker(targets, tp2_args, tmp_path):
    import httpx
    server = ServerProcess(tmp_path / "serve.log", *tp2_args)
    try:
        server.wait_ready()
        [worker] = workers_of(server.process.pid)
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        assert wait_until(lambda: not alive(worker), timeout=10)
    finally:
        server.stop()
