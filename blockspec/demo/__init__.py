"""The demo pair shipped inside the package: a small Qwen3-architecture target trained on the
Python standard library's source and its DFlash draft, both built by scripts/build_demo.py.

`blockspec generate` / `serve` with no --model use them (on CPU unless --device says otherwise).
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
TARGET_DIR = ROOT / "target"
DRAFT_DIR = ROOT / "draft"
# Standard-library modules the demo never trains on (tokenizer, target or draft): acceptance
# is measured on them. All exist in Python 3.10 … 3.13.
HELD_OUT_MODULES = ("textwrap", "shlex", "fractions", "graphlib", "heapq", "calendar")
# What `blockspec generate` continues with no --model and no prompt: code, not a chat turn (a
# model this small writes plausible code but no useful chat answers). It ends mid-line: a prompt
# ending in whitespace would cut a BPE token (newline + indentation) in half.
DEFAULT_PROMPT = 'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n    result'


def is_built() -> bool:
    return (TARGET_DIR / "model.safetensors").is_file() and (DRAFT_DIR / "model.safetensors").is_file()


def require_built() -> tuple[Path, Path]:
    if not is_built():
        raise FileNotFoundError(f"the demo checkpoints are missing under {ROOT}; rebuild them with "
                                "`python scripts/build_demo.py` or pass --model")
    return TARGET_DIR, DRAFT_DIR
