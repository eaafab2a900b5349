"""Progress bars (tqdm) on a terminal only: a log file or a pipe gets no bar lines, so a failure
stays one line on stderr and a captured log stays readable."""
from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")


def on_terminal() -> bool:
    return sys.stderr.isatty()


def bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar on stderr, disabled (a no-op with the same methods) off a terminal."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not (enabled and on_terminal()), leave=False,
                dynamic_ncols=True, **kwargs)


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it", enabled: bool = True
          ) -> Iterator[T]:
    """`items`, with a bar on a terminal."""
    with bar(total, desc, unit, enabled) as progress:
        for item in items:
            yield item
            progress.update(1)
