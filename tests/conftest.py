"""Shared fixtures: one fuel cache folder per test session, the real SmolLM2 weights (converted
once per session), its tokenizer and transformers oracle, and copies of the tiny test circuit
that a test can break one key of.

The session's cache folder is ``$FUEL_CACHE_DIR`` when set (so repeated runs reuse it), else a
temporary folder made before the xdist workers start (they inherit the variable, so both share
it) and removed at the end. Everything that defaults to the user cache (converted weights, the
Judge store, stored programs, the JIT's compiled kernels, the cpu probe) lands there: a kernel
compiled or a model converted by one test is reused by the next, and no test writes to
``~/.cache/fuel``. A test that needs an empty cache points ``FUEL_CACHE_DIR`` at its own folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CIRCUIT_DATA = Path(__file__).parent / "circuit" / "data"
_MADE_CACHE = "_FUEL_TEST_SESSION_CACHE"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: an OpenMP thread that spins after its region (fuel picks a long
    # spin when it is imported on an idle machine: fuel.kernels.threads) holds a core the other
    # worker needs, and a real-model fixture took 92 s instead of 15. Short spins, as fuel picks
    # on a busy machine; set before any test imports torch (its OpenMP runtime reads it once).
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("FUEL_CACHE_DIR"):
        return
    # Only the controller (or a run without xdist) gets here with no folder: workers inherit it.
    folder = tempfile.mkdtemp(prefix="fuel-test-cache-")
    os.environ["FUEL_CACHE_DIR"] = folder
    os.environ[_MADE_CACHE] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.get(_MADE_CACHE)
    if folder and not hasattr(config, "workerinput"):  # the controller made it; it removes it
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with real-model or long-measurement tests (``slow``) first, most such tests first,
    then files with module-scoped fixtures, each file's tests in their own order. scripts/test.sh runs ``--dist loadfile
    --no-loadscope-reorder``: a file runs whole on one worker (its module fixtures, a built
    engine or a JIT run, are built once, and the programs it stores in the session cache are
    restored by its later tests), and the files are handed out in this order, so the long ones
    start first and the many short ones fill the end on both workers."""
    slow: dict[str, int] = {}
    shared: set[str] = set()  # files with a module-scoped fixture (a built engine, a subprocess)
    for item in items:
        path = item.nodeid.split("::")[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(defs and defs[-1].scope == "module"
                                    for defs in info.name2fixturedefs.values()):
            shared.add(path)
    first_seen = {path: index for index, path in enumerate(dict.fromkeys(slow))}

    def order(item: pytest.Item) -> tuple[int, bool, int]:
        path = item.nodeid.split("::")[0]
        return -slow[path], path not in shared, first_seen[path]

    items.sort(key=order)


@pytest.fixture(scope="session")
def fuel_cache() -> Path:
    """The session's cache folder (see the module docs)."""
    return Path(os.environ["FUEL_CACHE_DIR"])


@pytest.fixture
def cache_sharing_kernels(tmp_path: Path, fuel_cache: Path, monkeypatch) -> Path:
    """``FUEL_CACHE_DIR`` set to an empty folder (no Judge rows, programs or probe) whose
    ``jit`` folder is the session's: compiled kernels are shared, nothing else."""
    folder = tmp_path / "cache"
    folder.mkdir()
    (fuel_cache / "jit").mkdir(parents=True, exist_ok=True)
    (folder / "jit").symlink_to(fuel_cache / "jit", target_is_directory=True)
    monkeypatch.setenv("FUEL_CACHE_DIR", str(folder))
    return folder


@contextlib.contextmanager
def cache_lock(cache: Path, name: str) -> Iterator[None]:
    """One xdist worker at a time fills ``name`` in the shared cache; the other then finds it."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".test-{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def smollm2_weights(fuel_cache: Path):
    from fuel.runtime.weights import load_weights

    with cache_lock(fuel_cache, "smollm2-f32"):
        return load_weights(cache=fuel_cache, progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_weights):
    from fuel.runtime.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_weights.source.folder)


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_weights):
    """transformers' SmolLM2, whose greedy continuations are remembered for the session.

    A greedy continuation is computed one token at a time from the prompt alone, so the first
    ``n`` tokens of a longer stop-less run are exactly what ``greedy(prompt, n)`` computes, and
    a ``stop`` list only ends it after the first stop token: every call is answered from the
    longest run computed so far for its prompt (and a longer one is computed when needed)."""
    from fuel.runtime.oracle import oracle_for

    oracle = oracle_for(smollm2_weights)
    if "greedy" not in vars(oracle):
        computed, runs = oracle.greedy, {}

        def greedy(prompt, max_new_tokens, *, stop=()):
            key = tuple(prompt)
            if len(runs.get(key, ())) < max_new_tokens:
                runs[key] = computed(prompt, max_new_tokens)
            produced = []
            for token in runs[key][:max_new_tokens]:
                produced.append(token)
                if token in stop:
                    break
            return produced

        oracle.greedy = greedy
    return oracle


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_weights):
    """One f32 SmolLM2 engine (no JIT, context 256) for the modules that generate with it: a
    program one builds (a prefill chunk, a decode or verify geometry) serves the others. Tests
    free the sequences they add."""
    import torch

    from fuel.runtime.engine import Engine

    torch.set_num_threads(2)
    return Engine(smollm2_weights, max_context=256)


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




@pytest.fixture(autouse=True)
def _one_torch_thread_per_xdist_worker():
    """Under ``-n 2`` each worker owns one core: torch's pool starts each test at one thread
    (two workers with two threads each oversubscribe a 2-core machine, and a parallel region
    then waits a time slice for its second thread). A test that needs more sets them itself."""
    import sys

    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def native_lib():
    """The native kernels this machine builds (``fuel.kernels.native``): a test that needs them
    fails, never skips, when they do not build (the machines fuel tests on have gcc)."""
    from fuel.kernels import native

    loaded = native.load()
    if isinstance(loaded, native.Unavailable):
        pytest.fail(f"the native kernels must build on this machine (gcc is installed): {loaded.reason}")
    return loaded


def build_native_variant(target: Path, isa: tuple[str, ...]):
    """The native library built without ``-march=native`` but with ``isa`` (e.g. ``-mavx2``):
    the paths this machine's own build skips. Returns it loaded (``NativeKernels``)."""
    import ctypes
    import shutil
    import subprocess

    from fuel.kernels import native

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    openmp = native._torch_openmp()
    # The native build needs both (the `native_lib` fixture fails without them): so does this.
    assert compiler is not None and openmp is not None
    flags = [f for f in native.FLAGS if not f.startswith("-march")] + list(isa)
    link = [f"-L{openmp.parent}", f"-l:{openmp.name}", f"-Wl,-rpath,{openmp.parent}"]
    done = subprocess.run([compiler, *flags, *map(str, native.SOURCES), "-o", str(target), *link],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return native.NativeKernels(ctypes.CDLL(str(target)), target, compiler)
