"""Session-wide tiny checkpoints (built once per test session)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import fixtures  # noqa: E402

# GPU checks run on the device machine; CI has no GPU, so there they are not collected at all.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]


@pytest.fixture(autouse=True)
def _steady_pace(request, monkeypatch):
    """The adaptive policy's pace (policy.Pace) follows this machine's timing: a test asserting
    what the policy does pins it at stride 1 (its work every step, as before the pace), so the
    assertion does not depend on how loaded the CI machine is. Tests marked `pace` keep the
    real one (or set a stride of their own)."""
    if request.node.get_closest_marker("pace") is None:
        from blockspec.engine.spec import policy
        monkeypatch.setattr(policy.Pace, "choose", lambda self: 1)


@pytest.fixture(scope="session", autouse=True)
def _modelled_costs() -> Iterator[None]:
    """Adaptive's cost table, measured at every engine's startup (~2-4 s of probes for each set
    of models and sizes, ~100 s of the CPU suite), is what few tests check: engines take
    helpers.modelled_costs (the tiny Qwen3 pair's measured times as a line) instead, from session
    fixtures on, except in tests marked `measured_costs` (_measured_costs) and within
    modelled_cost_tables(False). Subprocesses (the CLI, served engines) still measure. Where CUDA
    is (tests/gpu), every engine measures, on the device it prices."""
    if torch.cuda.is_available():
        yield
        return
    from helpers import modelled_cost_tables
    with modelled_cost_tables():
        yield


@pytest.fixture(autouse=True)
def _measured_costs(request, _modelled_costs) -> Iterator[None]:
    """A test marked `measured_costs` builds its engines as serving does, measuring the table."""
    if request.node.get_closest_marker("measured_costs") is None:
        yield
        return
    from helpers import modelled_cost_tables
    with modelled_cost_tables(False):
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Dense targets by kind, written lazily and cached for the session."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, kind: str) -> Path:
            cache[kind] = fixtures.write_dense_checkpoint(root / kind, kind)
            self[kind] = cache[kind]
            return cache[kind]

    return Lazy()


@pytest.fixture(scope="session")
def qwen3_dir(checkpoints) -> Path:
    return checkpoints["qwen3"]


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def qwen3_draft_dir(tmp_path_factory, qwen3_dir) -> Path:
    return fixtures.write_dflash_draft(tmp_path_factory.mktemp("draft") / "qwen3-dflash", qwen3_dir)


@pytest.fixture(scope="session")
def llama_draft_dir(tmp_path_factory, llama_dir) -> Path:
    return fixtures.write_dflash_draft(tmp_path_factory.mktemp("draft") / "llama-dflash", llama_dir)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "soak: the full soak (tests/test_soak.py); run with -m soak")
    config.addinivalue_line("markers", "measured_costs: engines measure adaptive's cost table (else modelled: "
                                       "_modelled_costs)")
    config.addinivalue_line("markers", "pace: keeps the adaptive policy's real pace (else pinned at stride 1)")
    config.addinivalue_line("markers", "smollm2: the real SmolLM2 GGUF (fetched once); in the default run, "
                                       "-m 'not smollm2' leaves it out")
    # xdist's scheduler (in the controller, which collects nothing) keeps the workers' collection
    # order, heaviest files first (heaviest_files_first), unless asked for its own reorder.
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


# Seconds each of the heaviest files takes on one worker of the 2-core run, estimated from round
# 64's `--durations` (its 80 slowest tests, the interpreted ones as tests/fast_interpreter.py left
# them) plus DEFAULT_TEST_SECONDS for each other test; any file not listed counts
# DEFAULT_TEST_SECONDS a test. Only the order matters (heaviest_files_first): refresh the table
# when a file's weight moves by much.
FILE_SECONDS = {
    "test_gguf.py": 205, "test_gdn_interpreter.py": 82, "test_dflash2.py": 60, "test_cli.py": 97,
    "test_adaptive.py": 80, "test_dflash.py": 90, "test_server.py": 85, "test_train.py": 85,
    "test_attention_interpreter.py": 70, "test_demo.py": 55, "test_fp8_targets.py": 70,
    "test_tensor_parallel.py": 50, "test_moe.py": 35, "test_prefix_engine.py": 45, "test_api.py": 27,
    "test_soak.py": 40, "test_reliability.py": 38, "test_warm.py": 27, "test_clients.py": 16,
    "test_cpu_kernels.py": 22, "test_playground.py": 20, "test_early_draft.py": 17,
    "test_prefill_kernel.py": 17, "test_prefix_server.py": 7, "test_ragged.py": 17,
}
DEFAULT_TEST_SECONDS = 0.5


def heaviest_files_first(config, items) -> None:
    """Orders the files by their weight, heaviest first, each file's tests in their own order.
    With --dist loadfile a worker takes the next file whenever it is nearly done with its last,
    so the long files start at once and the short ones fill in at the end, and the two workers
    finish together instead of one running a long file alone. xdist would otherwise put the
    files with the most tests first (--loadscope-reorder, its default); this order is the one
    it then keeps (pytest_configure turns the reorder off)."""
    counts: dict[Path, int] = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
    weight = {path: FILE_SECONDS.get(path.name, DEFAULT_TEST_SECONDS * n) for path, n in counts.items()}
    items.sort(key=lambda item: -weight[item.path])             # stable: a file's tests keep their order


def pytest_collection_modifyitems(config, items) -> None:
    """Soak runs only when asked for by -m (not skipped: left out of the default run). Then the
    heaviest files first (heaviest_files_first)."""
    if "soak" not in (config.option.markexpr or ""):
        kept = [item for item in items if item.get_closest_marker("soak") is None]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
            items[:] = kept
    heaviest_files_first(config, items)


@pytest.fixture(scope="session")
def scripted_dirs(tmp_path_factory, qwen3_dir) -> tuple[Path, Path]:
    """A target whose greedy chat answer is reasoning and a tool call (tests/chain_script.py),
    and a DFlash draft for it."""
    from chain_script import write_scripted_pair
    return write_scripted_pair(tmp_path_factory.mktemp("scripted"), qwen3_dir)


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    """The tiny Qwen3 target served in-process (tests/api_server.py), one per test module that
    asks (modules needing other settings define their own `plain`)."""
    from api_server import LiveServer, load_llm
    with LiveServer(load_llm(qwen3_dir), "qwen3") as server:
        yield server

