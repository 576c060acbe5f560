"""Progress of long library work, told to a listener the caller installs.

Decides the seam between fuel's slow steps — GGUF conversion, program builds, JIT compilation
and verification, Judge measurement, the ``cpu-local`` probe — and whatever shows their
progress. The library opens a :class:`Task` (a description and, where it is known, a total)
on the installed :class:`Listener` and advances it; the CLI installs a listener that draws rich
bars on a terminal's stderr (:mod:`fuel.cli.progress`). Invariants: the library never imports a
drawing library; with no listener installed (tests, benchmarks, library callers) every call is
a no-op, so progress never changes what a run computes or prints on stdout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


class Task:
    """One unit of progress (this base class ignores everything)."""

    def advance(self, steps: int = 1, *, description: str | None = None) -> None:
        """``steps`` more done (and, optionally, a new description)."""

    def update(self, *, completed: int | None = None, total: int | None = None,
               description: str | None = None) -> None:
        """Set how much is done, the total, or the description."""

    def close(self) -> None:
        """The work is over (done or abandoned): the task is no longer shown."""

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Listener:
    """Receives the library's tasks; this base class shows nothing."""

    def task(self, description: str, total: int | None = None) -> Task:
        """Open a task: ``total`` steps (None: unknown)."""
        return Task()


NULL = Listener()
_current: ContextVar[Listener] = ContextVar("fuel_progress_listener", default=NULL)


def current() -> Listener:
    """The installed listener (:data:`NULL` when none is)."""
    return _current.get()


def listener_of(progress: bool | Listener) -> Listener:
    """What a ``progress`` argument means: a listener as given, ``True`` the installed one,
    ``False`` none."""
    if isinstance(progress, Listener):
        return progress
    return current() if progress else NULL


@contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    """Install ``listener`` for the library work done inside the block."""
    token = _current.set(listener)
    try:
        yield listener
    finally:
        _current.reset(token)


__all__ = ["Listener", "NULL", "Task", "current", "listener_of", "listening"]
