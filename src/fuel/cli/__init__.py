"""The ``fuel`` command line.

Each command group lives in its own module and is registered in :mod:`fuel.cli.app`. Commands
import heavy libraries (torch) inside their bodies, so ``fuel --help`` and the planning commands
start fast.
"""

from fuel.cli.app import main

__all__ = ["main"]
