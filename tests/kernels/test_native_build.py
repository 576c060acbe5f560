"""The native library as an install step: ``python -m fuel.kernels.native`` builds it beside the
sources, a first run loads that build instead of compiling, and a build that does not load (or
was made for other sources) is never used."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuel.kernels import native



def _loaded() -> Path:
    """The library this session loaded (a machine with a C compiler: fuel's set-up needs one)."""
    lib = native.load()
    assert isinstance(lib, native.NativeKernels), lib
    return lib.path


def _copy_built(compiler, openmp, folder: Path, target: Path):
    """A stand-in compiler: the library this session already loaded, copied (the compile itself
    runs whenever a session has no build)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(_loaded(), target)


@pytest.fixture
def places(tmp_path, monkeypatch):
    installed, cache = tmp_path / "installed", tmp_path / "cache"
    monkeypatch.setattr(native, "INSTALLED", installed)
    monkeypatch.setenv("FUEL_CACHE_DIR", str(cache))
    key = native._build_key().key
    return installed / key / native.LIBRARY, cache / "native" / key / native.LIBRARY


def test_the_install_step_builds_the_library_a_first_run_then_loads_without_compiling(
        places, monkeypatch):
    installed, cached = places
    monkeypatch.setattr(native, "_compile", _copy_built)
    assert native.build_installed() == installed and installed.exists()

    def no_compiler(*args):
        raise AssertionError("a first run after the install step must not compile")

    monkeypatch.setattr(native, "_compile", no_compiler)
    loaded = native._build_and_load()
    assert isinstance(loaded, native.NativeKernels) and loaded.path == installed
    assert not cached.exists()


def test_an_install_build_that_does_not_load_is_passed_over_for_the_cache(places, monkeypatch):
    installed, cached = places
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"not a shared object")
    compiled = []
    monkeypatch.setattr(native, "_compile", lambda *a: (compiled.append(a), _copy_built(*a))[1])
    loaded = native._build_and_load()
    assert isinstance(loaded, native.NativeKernels) and loaded.path == cached
    assert len(compiled) == 1


def test_a_build_for_other_sources_is_never_loaded(places, monkeypatch):
    installed, cached = places
    other = installed.parent.parent / ("0" * 24) / native.LIBRARY
    other.parent.mkdir(parents=True)
    shutil.copy(_loaded(), other)
    monkeypatch.setattr(native, "_compile", _copy_built)
    assert native._build_and_load().path == cached


def test_the_install_command_says_where_it_built(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fuel.kernels.native"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    built = Path(done.stdout.split(": ", 1)[1].rsplit(" (", 1)[0])
    assert built.exists() and built.parent.parent == native.INSTALLED
