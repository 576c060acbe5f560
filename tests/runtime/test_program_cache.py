"""The on-disk program cache: an engine in a later process restores every program an earlier
one built (no lowering, no adoption, no measurement) and generates the same tokens; a corrupt
or foreign entry is never used; the key changes with everything a build depends on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fuel.circuit import Mode
from fuel.kernels import cpu_table
from fuel.runtime.engine import Engine
from fuel.runtime.generate import generate
from fuel.runtime.model import jit_options
from fuel.runtime.program_cache import ProgramCache, program_key
from fuel.runtime.weights import load_weights

from tests.runtime.conftest import write_tiny_gguf

FAST = {"warmup": 1, "repeats": 3, "min_sample_ns": 20_000}
PROMPT = [3, 4, 5, 7, 8, 9, 10, 11, 3, 4, 6]


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model = write_tiny_gguf(folder / "tiny.gguf")
    return load_weights(model.path, cache=folder / "cache", progress=False)


def engine_for(weights, folder: Path, cache: ProgramCache, numba_cache: Path) -> Engine:
    """A fresh engine as a new process has it: new table, JIT session and registry."""
    from fuel.jit.numba_synth import NumbaSynthesizer

    table = cpu_table()
    options = jit_options(table, store_path=folder / "judge.sqlite",
                          synthesizer=NumbaSynthesizer(cache_dir=numba_cache))
    options.jit.profile_options = dict(FAST)
    return Engine(weights, max_context=64, max_sequences=1, table=table,
                  optimize_options=options, program_cache=cache)


@pytest.fixture(scope="module")
def numba_cache(fuel_cache) -> Path:
    return fuel_cache / "jit" / "numba"  # shared with the other JIT tests: compiled once


@pytest.fixture(scope="module")
def first_run(tiny_weights, tmp_path_factory, numba_cache):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("program-cache")
    cache = ProgramCache(folder / "programs")
    engine = engine_for(tiny_weights, folder, cache, numba_cache)
    tokens = generate(engine, PROMPT, 6, stop=()).tokens
    return folder, engine, cache, tokens, numba_cache


def test_a_later_engine_restores_every_program_and_builds_none(first_run, tiny_weights):
    folder, engine, cache, tokens, numba_cache = first_run
    assert cache.stored == len(engine.programs()) >= 2  # a prefill and a decode program
    later_cache = ProgramCache(folder / "programs")
    later = engine_for(tiny_weights, folder, later_cache, numba_cache)
    assert generate(later, PROMPT, 6, stop=()).tokens == tokens
    assert later_cache.restored == len(later.programs()) == len(engine.programs())
    assert sum(later.stats.restored.values()) == sum(later.stats.builds.values())
    assert later_cache.notes == [] and later_cache.stored == 0
    assert later.optimize_options.jit.events == [], "a restored program adopts nothing anew"
    assert later.optimize_options.jit.measured == [], "and measures nothing"
    for before, after in zip(engine.programs(), later.programs()):
        assert after.dispatched == before.dispatched
        assert after.runtime_fused_executed() == before.runtime_fused_executed()


def test_a_corrupt_entry_is_removed_noted_and_rebuilt(first_run, tiny_weights, tmp_path):
    folder, engine, _, tokens, numba_cache = first_run
    programs = tmp_path / "programs"
    programs.mkdir()
    files = sorted((folder / "programs").glob("*.program"))
    for path in files:
        (programs / path.name).write_bytes(path.read_bytes())
    damaged = programs / files[0].name
    blob = bytearray(damaged.read_bytes())
    blob[-10] ^= 0xFF
    damaged.write_bytes(bytes(blob))
    truncated = programs / files[1].name
    truncated.write_bytes(truncated.read_bytes()[:200])
    cache = ProgramCache(programs)
    later = engine_for(tiny_weights, folder, cache, numba_cache)
    assert generate(later, PROMPT, 6, stop=()).tokens == tokens
    assert len(cache.notes) == 2
    assert all("checksum mismatch" in note and "building afresh" in note for note in cache.notes)
    assert cache.stored == 2 and cache.restored == len(files) - 2
    restored = ProgramCache(programs)
    assert restored._decode(damaged, damaged.read_bytes(), "x") is None  # another key: refused
    assert "holds another program" in restored.notes[0] and not damaged.exists()


def test_the_key_names_everything_a_build_depends_on(tiny_weights, tmp_path):
    engine = Engine(tiny_weights, max_context=64, max_sequences=1)
    plan = engine.plan(Mode.DECODE, 1)
    from fuel.runtime.lower import StepShape

    shape = StepShape(((1, 1),), 16, 4, 1, 64)
    wider = StepShape(((1, 1),), 16, 4, 2, 64)
    base = program_key(plan.digest, shape, torch.float32, None)
    assert base == program_key(plan.digest, shape, torch.float32, None)
    table = cpu_table()
    variants = {
        "shape": program_key(plan.digest, wider, torch.float32, None),
        "dtype": program_key(plan.digest, shape, torch.bfloat16, None),
        "plan": program_key(engine.plan(Mode.PREFILL, 4).digest, shape, torch.float32, None),
        "jit": program_key(plan.digest, shape, torch.float32,
                           jit_options(table, store_path=tmp_path / "judge.sqlite")),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        variants["threads"] = program_key(plan.digest, shape, torch.float32, None)
    finally:
        torch.set_num_threads(threads)
    assert base not in variants.values() and len(set(variants.values())) == len(variants)


def test_the_folder_is_pruned_least_recently_used_first_past_its_limit(tmp_path):
    """Programs stranded by a change of fuel, its libraries or the machine do not pile up: past
    the limit the least recently used go first, down to three quarters of it; a program restored
    since (its file touched) stays; other files in the folder are never touched."""
    import os

    from fuel.runtime.program_cache import prune

    folder = tmp_path / "programs"
    folder.mkdir()
    paths = []
    for age in range(10):  # 10 programs of 100 bytes, the oldest first
        path = folder / f"p{age}.program"
        path.write_bytes(b"x" * 100)
        os.utime(path, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
        paths.append(path)
    (folder / "notes.txt").write_text("not a program")
    assert prune(folder, 1000) == []  # at the limit: nothing goes
    os.utime(paths[0], ns=(2 * 10**18, 2 * 10**18))  # p0 restored just now
    (folder / "p10.program").write_bytes(b"x" * 100)  # 1,100 bytes: past the limit
    os.utime(folder / "p10.program", ns=(10**18 + 20 * 10**9,) * 2)
    removed = prune(folder, 1000)
    assert [p.name for p in removed] == ["p1.program", "p2.program", "p3.program", "p4.program"]
    assert sorted(p.name for p in folder.glob("*.program")) == sorted(
        f"p{i}.program" for i in (0, 5, 6, 7, 8, 9, 10))
    assert (folder / "notes.txt").exists()


def test_a_restore_marks_its_program_used(first_run, tiny_weights, tmp_path):
    import os

    folder, _, _, _, numba_cache = first_run
    programs = tmp_path / "programs"
    programs.mkdir()
    for path in (folder / "programs").glob("*.program"):
        (programs / path.name).write_bytes(path.read_bytes())
        os.utime(programs / path.name, ns=(10**18, 10**18))  # used long ago
    cache = ProgramCache(programs)
    later = engine_for(tiny_weights, folder, cache, numba_cache)
    generate(later, PROMPT, 2, stop=())
    assert cache.restored >= 1
    touched = [p for p in programs.glob("*.program") if p.stat().st_mtime_ns > 10**18]
    assert len(touched) == cache.restored


@pytest.mark.parametrize("collecting", [True, False])
def test_decoding_an_entry_leaves_the_collector_as_it_found_it(tmp_path, collecting):
    """Unpickling runs with the garbage collector off; whatever it meets, the collector is
    as it was afterwards (a program that fails to load included)."""
    import gc
    import hashlib
    import pickle

    from fuel.runtime.program_cache import MAGIC, SCHEMA

    def blob(payload: bytes) -> bytes:
        digest = hashlib.sha256(payload).hexdigest().encode()
        return MAGIC + b" " + str(SCHEMA).encode() + b" " + digest + b"\n" + payload

    cache = ProgramCache(tmp_path / "programs")
    path = tmp_path / "x.program"
    was = gc.isenabled()
    try:
        (gc.enable if collecting else gc.disable)()
        path.write_bytes(b"")
        assert cache._decode(path, blob(b"not a pickle"), "key") is None
        assert gc.isenabled() is collecting
        assert "does not load" in cache.notes[-1]
        path.write_bytes(b"")
        assert cache._decode(path, blob(pickle.dumps(["another", "object"])), "key") is None
        assert gc.isenabled() is collecting
        assert "holds another program" in cache.notes[-1]
    finally:
        (gc.enable if was else gc.disable)()
