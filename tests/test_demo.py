"""The shipped demo pair: a trained target and draft make the lossless checks and the acceptance
figures real (random weights cannot show real acceptance)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from blockspec import demo
from blockspec.demo.measure import held_out_prompts
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from helpers import modelled_cost_tables

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    target, draft = demo.require_built()
    return (LLM(str(target), device="cpu", show_progress=False),
            LLM(str(target), draft=str(draft), device="cpu", show_progress=False))


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    return held_out_prompts(pair[0].tokenizer, 3)


def test_demo_is_small_bf16_and_in_zlab_format():
    from safetensors.torch import load_file
    sizes = sum(f.stat().st_size for d in (demo.TARGET_DIR, demo.DRAFT_DIR) for f in d.iterdir())
    assert sizes <= 24 * 2**20
    for directory in (demo.TARGET_DIR, demo.DRAFT_DIR):
        tensors = load_file(str(directory / "model.safetensors"))
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    draft = json.loads((demo.DRAFT_DIR / "config.json").read_text())
    assert draft["architectures"] == ["DFlashDraftModel"] and draft["block_size"] == 8
    assert draft["dflash_config"]["mask_token_id"] == 3                         # <|mask|>
    target = json.loads((demo.TARGET_DIR / "config.json").read_text())
    assert target["architectures"] == ["Qwen3ForCausalLM"]


def test_demo_plain_greedy_equals_transformers(pair, prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(demo.TARGET_DIR), dtype=torch.float32).eval()
    for prompt in prompts[:2]:
        ours = pair[0].generate_ids(prompt, GREEDY).token_ids
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False,
                                    min_new_tokens=len(ours))[0, len(prompt):].tolist()
        assert ours == theirs


def test_demo_dflash_equals_plain_at_every_block_size(pair, prompts):
    expected = pair[0].generate_ids(prompts[0], GREEDY).token_ids
    for block_size in range(1, 9):
        with modelled_cost_tables(block_size < 8):        # block 8's engine measures (the probes run first)
            dflash = LLM(str(demo.TARGET_DIR), draft=str(demo.DRAFT_DIR), block_size=block_size, device="cpu",
                         show_progress=False)
        assert dflash.generate_ids(prompts[0], GREEDY).token_ids == expected, block_size


def test_demo_acceptance_on_held_out_code_is_real(pair, prompts):
    """Held-out modules, greedy, block size 8: an untrained draft accepts ~nothing (τ ≈ 1)."""
    lengths = []
    for prompt in prompts:
        stats = pair[1].generate_ids(prompt, SamplingParams(max_tokens=96, temperature=0.0)).stats
        # τ of the cycles that verified drafts (adaptive's plain-arm steps and k = 0 rows verify none)
        lengths += [n for n, k in zip(stats.acceptance_lengths, stats.verify_widths) if k]
    assert len(lengths) >= 20 and sum(lengths) / len(lengths) > 3.0


def test_generate_without_model_runs_the_demo_on_cpu():
    out = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--max-tokens", "24", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    from blockspec.tokenizer import Tokenizer
    assert result["prompt_token_ids"] == Tokenizer.from_dir(demo.TARGET_DIR).encode(demo.DEFAULT_PROMPT)
    assert len(result["token_ids"]) == 24 and result["stats"]["mean_acceptance_length"] > 1.5


def test_serve_without_model_answers_with_dflash_statistics(tmp_path):
    """`blockspec serve` with no arguments serves the demo pair: a completion and a chat answer,
    DFlash statistics in meta_info and on /metrics."""
    import httpx
    from test_server import ServerProcess
    server = ServerProcess(tmp_path / "demo.log")
    try:
        server.wait_ready()
        body = {"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "return_meta_info": True}
        completion = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        meta = completion["meta_info"]
        assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] == 48
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.5
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Write a function."}], "max_tokens": 16,
            "temperature": 0}).json()
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] > 0
        metrics = httpx.get(server.url + "/metrics").text
        accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("blockspec_spec_accepted_tokens_total"))
        assert accepted > 0
    finally:
        server.stop()


def test_rounds_at_gives_every_mode_at_least_eight_requests_at_low_concurrency():
    """`bench --demo --compare-speculation` runs max(rounds, ⌈MIN_REQUESTS / c⌉) interleaved
    rounds at concurrency c: at one request eight rounds (best-of-3 at ~0.2 s a round kept the
    noise, and a fresh adaptive engine spent them learning), rounded up, never fewer than asked."""
    from blockspec.demo.measure import MIN_REQUESTS, rounds_at
    assert MIN_REQUESTS == 8
    assert [rounds_at(3, c) for c in (1, 2, 3, 4, 8, 32)] == [8, 4, 3, 3, 3, 3]
    assert [rounds_at(1, c) for c in (1, 3, 5, 7, 8, 9, 64)] == [8, 3, 2, 2, 1, 1, 1]
    assert rounds_at(10, 1) == 10


def test_compare_speculation_runs_each_mode_rounds_at_times_per_concurrency(monkeypatch):
    """Each concurrency's row runs every mode rounds_at(rounds, c) times on its c prompts (after
    one warm-up of two), and says how many; the top-level `rounds` is the one asked for."""
    from types import SimpleNamespace
    from blockspec import llm as llm_module
    from blockspec.demo import measure
    engines: list = []

    class CountingLLM:
        def __init__(self, model, draft=None, **kwargs):
            self.runs: list[int] = []
            self.tokenizer = None
            self.engine = SimpleNamespace(counters=SimpleNamespace(spec_widths={}))
            engines.append(self)

        def generate(self, prompts, params):
            self.runs.append(len(prompts))
            return [SimpleNamespace(token_ids=list(p) * 3, stats=SimpleNamespace(acceptance_lengths=[2]))
                    for p in prompts]
    monkeypatch.setattr(demo, "require_built", lambda: ("target", "draft"))
    monkeypatch.setattr(llm_module, "LLM", CountingLLM)
    monkeypatch.setattr(measure, "held_out_prompts", lambda tokenizer, n: [[i] for i in range(n)])
    result = measure.compare_speculation("cpu", [1, 3, 16], rounds=3, fixed_blocks=(2, 8))
    assert len(engines) == 4                                         # plain, fixed k = 1 and 7, adaptive
    for engine in engines:
        assert engine.runs == [2] + [1] * 8 + [3] * 3 + [16] * 3
    assert result["rounds"] == 3
    assert [result[f"c{c}"]["rounds"] for c in (1, 3, 16)] == [8, 3, 3]
