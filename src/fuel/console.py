"""The ``fuel`` console script: the CLI, with Python's cyclic garbage collector held off while the
process starts.

Decides when the collector runs in a ``fuel`` process. Starting a run creates a few hundred
thousand long-lived objects (torch's and fuel's modules and classes, the restored programs) and
CPython's collector rescans all of them at every full collection while they are being made:
~0.4-0.5 s of a warm ``fuel demo``'s ~2 s to its first token on this project's 2-core machine
(measured there: ``import torch`` 0.86 s with the collector off against 1.18 s on; a warm demo's
first token at 1.42 s against 1.9-2.1 s). So :func:`main` disables the collector from its
first line until :func:`startup_done`: when a command that loads a model (``run``, ``demo``,
``serve``) has loaded it, or, for every other command, before the command runs. ``startup_done``
then freezes everything alive (``gc.freeze``: a permanent generation later collections skip)
and re-enables the collector, so a long-lived server collects as usual, without rescanning its
start-up objects.

Invariants:
- Only a process that entered through :func:`main` (or called :func:`hold`) has its collector
  touched; importing fuel as a library, or calling :func:`fuel.cli.app.main` in-process (the
  tests), changes nothing.
- :func:`startup_done` is idempotent and runs, at the latest, when :func:`main` returns or
  raises; reference counting frees every acyclic object meanwhile.
"""

from __future__ import annotations

import gc
import sys
import warnings

LOADS_A_MODEL = frozenset({"run", "demo", "serve"})
"""Commands whose start-up ends when their model is loaded (they call :func:`startup_done`; a
``run --tp N`` calls it before it starts its ranks, which load the model themselves)."""

_held = False


def main() -> int:
    """The console script: run the CLI with the collector held off until start-up ends."""
    hold()
    warnings.formatwarning = _warning_line
    try:
        from fuel.cli.app import main as cli_main

        args = sys.argv[1:]
        if not args or args[0] not in LOADS_A_MODEL:
            startup_done()
        return cli_main(args)
    finally:
        startup_done()


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the CLI prints it: one line naming what to fix (fuel's warnings name the
    file and the reason), not Python's two (the source line that raised it)."""
    return f"warning: {message}\n"


def hold() -> None:
    """Start-up begins: hold the collector off until :func:`startup_done` (the console script's
    first step; a benchmark's worker process that measures what a ``fuel`` user sees calls it
    too). A no-op when the collector is already off."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def startup_done() -> None:
    """End start-up: freeze the objects alive now and re-enable the collector, if :func:`main`
    held it off (a no-op otherwise, and on every later call)."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()


__all__ = ["LOADS_A_MODEL", "hold", "main", "startup_done"]
