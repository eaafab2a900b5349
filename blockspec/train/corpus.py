"""The Python standard library's own source as a corpus (every machine with Python has it).

Tests, installed third-party packages and caches are left out; callers may hold out modules.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_test_or_package(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return any(p in SKIPPED_DIRS or p.startswith(".") for p in parts[:-1]) or parts[-1].startswith("test_")


def module_name(path: Path, root: Path) -> str:
    """`json/decoder.py` → json.decoder; `json/__init__.py` → json."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_in(name: str, modules: tuple[str, ...]) -> bool:
    """`name` is one of `modules` or a submodule of one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def stdlib_files(exclude: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> list[Path]:
    """Sorted .py files of the standard library; a module name in `exclude` drops the module
    and its submodules, `only` keeps just those."""
    root = stdlib_dir()
    selected = []
    for path in sorted(root.rglob("*.py")):
        if is_test_or_package(path, root):
            continue
        name = module_name(path, root)
        if is_in(name, exclude) or (only is not None and not is_in(name, only)):
            continue
        selected.append(path)
    return selected


def read_sources(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]
