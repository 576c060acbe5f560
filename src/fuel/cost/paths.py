"""Where the cost stage keeps what it measures: one user cache directory.

``$FUEL_CACHE_DIR`` when set (tests point it into a temporary directory), else ``~/.cache/fuel``.
The ``cpu-local`` probe cache lives under ``devices/``; the Judge's store is ``judge.sqlite``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    override = os.environ.get("FUEL_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "fuel"


def default_store_path() -> Path:
    return cache_dir() / "judge.sqlite"
