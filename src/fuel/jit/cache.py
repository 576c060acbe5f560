"""Where synthesized kernels live on disk: one folder per synthesizer, one file per structure key.

Decides the layout of the JIT's disk cache: ``$FUEL_CACHE_DIR/jit/<synthesizer>/`` (default
``~/.cache/fuel``; tests point it at a temporary folder). A kernel's generated source is written
to ``k_<key prefix>.py`` there; numba's own compiled-object cache sits beside it in
``__pycache__``, so a second process loads the compiled kernel instead of compiling it.

Invariants: a source file is written atomically (temp file + rename), so concurrent processes
never import a half-written kernel; a file whose text differs from the generated source (a
different fuel version wrote it) is replaced, never trusted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from fuel.cost.paths import cache_dir

KEY_PREFIX = 32
"""Hex digits of the structure key in a file name (128 bits: collisions are not a concern)."""


def jit_cache_dir(synthesizer: str) -> Path:
    return cache_dir() / "jit" / synthesizer


def module_name(structure_key: str) -> str:
    return f"k_{structure_key[:KEY_PREFIX]}"


def write_source(folder: Path, structure_key: str, source: str) -> Path:
    """Write ``source`` as the kernel module for ``structure_key`` (if not already identical)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module_name(structure_key)}.py"
    if path.exists() and path.read_text() == source:
        return path
    handle, temp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        out.write(source)
    os.replace(temp, path)
    return path


def has_compiled(path: Path) -> bool:
    """Whether numba has cached compiled objects for the module at ``path``."""
    return any((path.parent / "__pycache__").glob(f"{path.stem}.*.nbi"))


def drop_compiled(path: Path) -> None:
    """Remove numba's cached objects for the module at ``path`` (they failed to load)."""
    for stale in (path.parent / "__pycache__").glob(f"{path.stem}.*.nb[ic]"):
        stale.unlink(missing_ok=True)


def import_module(path: Path) -> ModuleType:
    """Import the kernel module at ``path`` under a name unique to its folder and key."""
    folder = hashlib.sha256(str(path.parent).encode()).hexdigest()[:12]
    name = f"fuel_jit_{folder}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before running: numba's cache resolves the kernel's globals by module name.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
