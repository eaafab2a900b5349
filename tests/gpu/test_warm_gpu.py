"""No Triton compilation after startup: an engine's warm-up (engine/warm.py, the graph capture)
compiles every kernel variant its steps can choose, so a request mix run after it — a cold
prompt chunked over the budget, the same prompt again (the prefix cache's hit path: a short
chunk over a long cached context, split-K), prompts of unequal lengths together, a long-context
decode, arrivals while others decode — compiles nothing (Triton's jit_post_compile_hook fires
on every in-process compile, a disk-cache load included). Demo pair (bf16) plain and DFlash; a
random hybrid (the fixtures' shape, bf16) with DFlash. The CPU analogue: tests/test_warm.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

from blockspec.loader import load_draft, load_model
from helpers import make_engine, make_request, run_batch
from test_warm import tiny_hybrid

DEMO = Path(__file__).parents[2] / "blockspec" / "demo"


class Compilations:
    """The kernels (with their specialisation and constexprs) Triton compiles while installed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self) -> "Compilations":
        self.previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = self.hook
        return self

    def hook(self, *args, **kwargs) -> None:
        compiled = kwargs.get("compile", {})
        self.names.append(f"{kwargs.get('repr')} constants {compiled.get('constants')} "
                          f"attrs {compiled.get('configs')}")

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_post_compile_hook = self.previous


MAX_MODEL_LEN = 2048


def mix(vocab: int) -> tuple[list, dict]:
    gen = torch.Generator().manual_seed(5)
    words = lambda n: torch.randint(0, vocab - 1, (n,), generator=gen).tolist()     # noqa: E731
    request = lambda name, prompt, n: make_request(name, prompt, max_tokens=n, max_model_len=MAX_MODEL_LEN)  # noqa: E731
    cold = words(700)
    first = [request("cold", cold, 16), request("long", words(1500), 48)]
    later = {6: [request("hit", cold + words(9), 16)],
             9: [request(f"burst{i}", words(n), 24) for i, n in enumerate((3, 17, 64, 130, 5, 300))]}
    return first, later


def check_no_compilation(target, draft, vocab: int, **config) -> None:
    engines = []

    def build():
        engines.append(make_engine(target, draft, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
                                   **({"block_size": 8} if draft is not None else {}), **config))
        return engines[-1]
    first, later = mix(vocab)
    build()                                  # startup (warm-up and graph capture) outside the count
    with Compilations() as compiled:
        _, runs = run_batch(lambda: engines[0], first, later)
    assert all(run.request.is_finished for run in runs)
    assert next(r for r in runs if r.request.request_id == "hit").request.stats.cached_tokens >= 688
    if compiled.names:                       # whole: the types and alignments say which argument differed
        pytest.fail("compiled after startup:\n" + "\n".join(compiled.names), pytrace=False)


@pytest.fixture(scope="module")
def demo():
    target = load_model(str(DEMO / "target"), device="cuda", dtype="bfloat16").model
    return target, load_draft(str(DEMO / "draft"), target)


@pytest.mark.parametrize("speculation", ["plain", "dflash"])
def test_demo_pair_compiles_nothing_after_startup(demo, speculation):
    target, draft = demo
    check_no_compilation(target, draft if speculation == "dflash" else None, target.config.vocab_size)


def test_hybrid_compiles_nothing_after_startup(tmp_path):
    target, draft = tiny_hybrid(tmp_path)
    target, draft = target.to("cuda", torch.bfloat16), draft.to("cuda", torch.bfloat16)
    check_no_compilation(target, draft, target.config.vocab_size)
