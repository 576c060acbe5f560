"""One numba kernel cache per test session, the session cache's own (compiles cost seconds; the
runtime and CLI tests' JIT runs load what these compiled and the other way round; tests that
need a cold cache make their own folder)."""

from __future__ import annotations

import pytest

from fuel.jit.numba_synth import NumbaSynthesizer


@pytest.fixture(scope="session")
def jit_cache(fuel_cache):
    return fuel_cache / "jit" / "numba"  # where NumbaSynthesizer() puts them by default


@pytest.fixture
def numba_synth(jit_cache) -> NumbaSynthesizer:
    return NumbaSynthesizer(cache_dir=jit_cache)
