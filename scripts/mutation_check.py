"""Mutation check (issue 16): plant each named mutant, one at a time, in a scratch copy of the
repository and run the CPU tests that should catch it; every mutant must be killed.

    OMP_NUM_THREADS=1 python scripts/mutation_check.py            # all mutants
    OMP_NUM_THREADS=1 python scripts/mutation_check.py bonus-p-n-1 # some, by name

Not part of the default test run (it runs the targeted tests once per mutant). A mutant whose
`old` text is missing from its file is an error, not a kill: the list must track the code.
Exit status 0 only when every mutant is killed and the unmutated copy passes the same tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = "blockspec/sampling.py"
TIMEOUT_S = 900                                  # per pytest run


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("bonus-p-n-1", SAMPLING,
           "return n, int(sample_from_probs(p[n], generator))",
           "return n, int(sample_from_probs(p[n - 1], generator))",
           ("tests/test_acceptance.py",)),
    Mutant("accept-no-cumprod", "blockspec/engine/spec/dflash.py",
           "accepted = agree.cumprod(1).sum(1, keepdim=True)",
           "accepted = agree.sum(1, keepdim=True)",
           ("tests/test_acceptance.py", "tests/test_dflash.py")),
    Mutant("top-p-off", SAMPLING,
           "if params.top_p < 1.0:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("min-p-off", SAMPLING,
           "if params.min_p > 0.0:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("top-k-off", SAMPLING,
           "if params.top_k > 0 and params.top_k < scores.shape[-1]:", "if False:",
           ("tests/test_acceptance.py",)),
    Mutant("abort-check-removed", "blockspec/engine/engine.py",
           "            if seq.request.is_aborted:\n                self._end(seq, \"abort\")",
           "            if False:\n                self._end(seq, \"abort\")",
           ("tests/test_acceptance.py", "tests/test_dflash.py", "tests/test_engine.py")),
    Mutant("rollback-off-by-one", "blockspec/engine/scheduler.py",
           "seq.num_cached += num_accepted + 1",
           "seq.num_cached += num_accepted + 2",
           ("tests/test_acceptance.py", "tests/test_dflash.py")),
    Mutant("state-select-num-kept", "blockspec/cache/state_pool.py",
           "step_states[rows, num_kept - 1]",
           "step_states[rows, (num_kept).clamp_max(step_states.shape[1] - 1)]",
           ("tests/test_hybrid.py",)),
    Mutant("stop-cut-removed", "blockspec/engine/request.py",
           "                allowed = allowed[: i + 1]\n",
           "",
           ("tests/test_dflash.py",)),
    Mutant("draft-context-off-by-one", "blockspec/engine/model_runner.py",
           "context_lens=meta.context_lens - width",
           "context_lens=meta.context_lens - width + 1",
           ("tests/test_dflash.py",)),
]


def ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in {".git", "__pycache__", ".pytest_cache", ".venv", "out"}}


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[bool, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:            # a hang is a detected change, not a pass
        return False, time.perf_counter() - start
    return proc.returncode == 0, time.perf_counter() - start


def main(names: list[str]) -> int:
    chosen = [m for m in MUTANTS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {sorted(unknown)}", file=sys.stderr)
        return 2
    start, rows, ok = time.perf_counter(), [], True
    with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
        copy = Path(scratch) / "repo"
        shutil.copytree(ROOT, copy, ignore=ignore)
        baseline_tests = tuple(sorted({t for m in chosen for t in m.tests}))
        passed, seconds = run_tests(copy, baseline_tests)
        print(f"{'(unmutated)':26} {'pass' if passed else 'FAIL':9} {seconds:6.1f} s")
        if not passed:
            print("the unmutated copy fails its tests: no mutant can be judged", file=sys.stderr)
            return 1
        for mutant in chosen:
            target = copy / mutant.path
            original = target.read_text()
            if original.count(mutant.old) != 1:
                rows.append((mutant.name, "NOT FOUND", 0.0))
                ok = False
                continue
            target.write_text(original.replace(mutant.old, mutant.new))
            try:
                passed, seconds = run_tests(copy, mutant.tests)
            finally:
                target.write_text(original)
            rows.append((mutant.name, "SURVIVED" if passed else "killed", seconds))
            ok &= not passed
            print(f"{mutant.name:26} {rows[-1][1]:9} {seconds:6.1f} s  {' '.join(mutant.tests)}", flush=True)
    killed = sum(r[1] == "killed" for r in rows)
    print(f"\n{killed}/{len(rows)} mutants killed in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
