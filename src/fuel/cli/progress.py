"""The progress bar shown while the engine builds (or restores) step programs.

Decides what a user watching a terminal sees during a build: one transient line per program
being built — its mode, rows and block-table width, a spinner and the elapsed time — on stderr,
so ``--json`` output and the streamed text on stdout are untouched. Invariants: nothing is drawn
when stderr is not a terminal (pipes, CI logs, tests); the bar is gone once no build runs.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class BuildProgress:
    """An engine ``on_build`` listener drawing a rich progress line per program build."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                  TimeElapsedColumn(), console=self.console, transient=True)
        self._tasks: dict[str, int] = {}
        self.seen: list[tuple[str, str]] = []
        """Every ``(program, outcome)`` reported, drawn or not (for the report and tests)."""

    def __call__(self, what: str, event: str) -> None:
        self.seen.append((what, event))
        if not self.enabled:
            return
        if event == "start":
            if not self._tasks:
                self._progress.start()
            self._tasks[what] = self._progress.add_task(
                f"building program {what}: lower, JIT adoption, Judge measurement, bake "
                "(once per machine: later runs restore it from disk)", total=None)
            return
        task = self._tasks.pop(what, None)
        if task is not None:
            self._progress.remove_task(task)
        if not self._tasks:
            self._progress.stop()


__all__ = ["BuildProgress"]
