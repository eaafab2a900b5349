"""The graph dispatcher's graphs on the GPU (fp32): captured at startup, their replay decodes what
the eager step decodes for every descriptor kind — FULL graphs of decode rows and of ragged
verify widths (random per sequence and cycle), PIECEWISE graphs of steps with prefill chunks —
for dense, hybrid and MoE targets, plain, DFlash and DFlash 2. The CPU analogue (the same
shapes, uncaptured): tests/test_graphs.py."""
from __future__ import annotations

import pytest

from test_graphs import CASES, build_models, check_against_eager


@pytest.fixture(scope="module")
def models(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    built = {}

    def get(kind: str) -> dict:
        if kind not in built:
            built[kind] = build_models(kind, tmp_path_factory.mktemp(f"gpu-graphs-{kind}"), "cuda",
                                       dense_dirs=(qwen3_dir, qwen3_draft_dir))
        return built[kind]
    return get


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_graph_replay_decodes_like_the_eager_step(models, kind, name):
    check_against_eager(models(kind), name, "captured")
