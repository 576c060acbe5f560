"""The progress bars the CLI draws while fuel works: GGUF conversion, program builds, JIT
compilation and verification, Judge measurement, the ``cpu-local`` probe.

Decides what a user watching a terminal sees while a run prepares: one transient line per task
the library opens (:mod:`fuel.progress`) — a spinner, its description (which kernel is compiling,
which Judge cell is timed, "N of M" where the total is known), a bar and the elapsed time — and
one line per program being built (its mode, rows and block-table width). Everything goes to
stderr, so ``--json`` output and the streamed text on stdout are untouched. Invariants: nothing
is drawn when stderr is not a terminal (pipes, CI logs, tests) or when the caller turns it off
(``--json``); all tasks share one rich live display, started with the first task and stopped
(gone from the screen) once none is open.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from fuel.progress import Listener, Task


class _RichTask(Task):
    def __init__(self, owner: TerminalProgress, task_id: int | None):
        self._owner = owner
        self._id = task_id

    def advance(self, steps: int = 1, *, description: str | None = None) -> None:
        if self._id is not None:
            fields = {} if description is None else {"description": description}
            self._owner._progress.update(self._id, advance=steps, **fields)

    def update(self, *, completed: int | None = None, total: int | None = None,
               description: str | None = None) -> None:
        if self._id is None:
            return
        fields = {key: value for key, value in (("completed", completed), ("total", total),
                                                 ("description", description))
                  if value is not None}
        self._owner._progress.update(self._id, **fields)

    def close(self) -> None:
        if self._id is not None:
            self._owner._close(self._id)
            self._id = None


class TerminalProgress(Listener):
    """A :class:`fuel.progress.Listener` drawing rich progress lines on a terminal's stderr."""

    def __init__(self, console: Console | None = None, *, enabled: bool = True):
        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                  BarColumn(bar_width=20), TimeElapsedColumn(),
                                  console=self.console, transient=True,
                                  redirect_stdout=False, redirect_stderr=False)
        self._open: set[int] = set()
        self.partial_column: Callable[[], int] | None = None
        """Where the text streamed on the same terminal stands on its unfinished line (0: at a
        line start, or not on this terminal). A bar drawn mid-line would erase that line: the
        bars open one line below it, and the cursor goes back to the column when they close."""
        self._resume = 0
        self.opened: list[str] = []
        """Every task's first description, drawn or not (for tests)."""

    def task(self, description: str, total: int | None = None) -> Task:
        self.opened.append(description)
        if not self.enabled:
            return _RichTask(self, None)
        if not self._open:
            self._resume = self.partial_column() if self.partial_column is not None else 0
            if self._resume:
                self.console.file.write("\n")
                self.console.file.flush()
            self._progress.start()
        task_id = self._progress.add_task(description, total=total)
        self._open.add(task_id)
        return _RichTask(self, task_id)

    def _close(self, task_id: int) -> None:
        self._open.discard(task_id)
        self._progress.remove_task(task_id)
        if not self._open:
            self._progress.stop()
            if self._resume:
                # The transient bars left the cursor at the start of their first line: back up
                # to the streamed line's end.
                self.console.file.write(f"\x1b[1A\x1b[{self._resume}C")
                self.console.file.flush()
                self._resume = 0


class BuildProgress(TerminalProgress):
    """Also the engine's ``on_build`` listener: a line per program while it is built."""

    def __init__(self, console: Console | None = None, *, enabled: bool = True):
        super().__init__(console, enabled=enabled)
        self._builds: dict[str, Task] = {}
        self.seen: list[tuple[str, str]] = []
        """Every ``(program, outcome)`` reported, drawn or not (for the report and tests)."""

    def __call__(self, what: str, event: str) -> None:
        self.seen.append((what, event))
        if event == "start":
            self._builds[what] = self.task(f"building program {what} (stored for later runs)")
            return
        task = self._builds.pop(what, None)
        if task is not None:
            task.close()


__all__ = ["BuildProgress", "TerminalProgress"]
