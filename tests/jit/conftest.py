"""One numba kernel cache per test session (compiles cost seconds; tests that need a cold cache
make their own folder)."""

from __future__ import annotations

import pytest

from fuel.jit.numba_synth import NumbaSynthesizer


@pytest.fixture(scope="session")
def jit_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jit-cache")


@pytest.fixture
def numba_synth(jit_cache) -> NumbaSynthesizer:
    return NumbaSynthesizer(cache_dir=jit_cache)
