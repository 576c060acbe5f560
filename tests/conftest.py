"""Shared fixtures: copies of the tiny test circuit that a test can break one key of."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

CIRCUIT_DATA = Path(__file__).parent / "circuit" / "data"


@pytest.fixture
def tiny_circuit(tmp_path: Path) -> Callable[..., Path]:
    """``tiny_circuit(old, new, lib=(old, new))`` writes tiny.toml (and its library) to a temp
    folder with ``old`` replaced by ``new`` once, and returns the circuit file's path."""

    def write(old: str = "", new: str = "", *, lib: tuple[str, str] | None = None) -> Path:
        text = (CIRCUIT_DATA / "tiny.toml").read_text()
        if old:
            assert text.count(old) >= 1, f"`{old}` is not in tiny.toml"
            text = text.replace(old, new, 1)
        library = (CIRCUIT_DATA / "tiny_lib.toml").read_text()
        if lib:
            assert lib[0] in library
            library = library.replace(lib[0], lib[1], 1)
        (tmp_path / "tiny_lib.toml").write_text(library)
        path = tmp_path / "tiny.toml"
        path.write_text(text)
        return path

    return write


@pytest.fixture
def write_json(tmp_path: Path) -> Callable[[str, object], Path]:
    import json

    def write(name: str, data: object) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return write


