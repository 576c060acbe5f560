"""Every cost test keeps caches and stores inside its own temporary directory."""

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
