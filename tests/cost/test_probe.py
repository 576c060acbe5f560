"""The cpu-local probe: positive numbers, cached under FUEL_CACHE_DIR, re-probed on request."""

import json

import pytest

from fuel.cost import PeakClass, device
from fuel.cost import probe


def test_probe_yields_positive_numbers_and_is_cached(isolated_cache):
    spec = device("cpu-local")
    assert spec.probed and spec.name == "cpu-local"
    for rate in (*spec.peak_flops.values(), spec.vector_flops, spec.bandwidth_bytes_per_s):
        assert rate > 0
    assert set(spec.peak_flops) == {PeakClass.FP32, PeakClass.BF16, PeakClass.FP16}
    assert spec.launch_overhead_ns >= 1 and spec.memory_bytes > 0
    path = probe.cache_path()
    assert path.is_relative_to(isolated_cache) and path.exists()
    assert "probed on this machine" in spec.sources["bandwidth"]


def test_cached_numbers_are_used_without_measuring(isolated_cache, monkeypatch):
    first = device("cpu-local")
    monkeypatch.setattr(probe, "measure_cpu_local", lambda: pytest.fail("should use the cache"))
    assert device("cpu-local") == first


def test_reprobe_measures_again_and_rewrites_the_cache(isolated_cache, monkeypatch):
    device("cpu-local")
    fake = {
        "fp32_flops": 1e9, "bf16_flops": 2e9, "fp16_flops": 3e9, "vector_flops": 4e9,
        "bandwidth_bytes_per_s": 5e9, "launch_overhead_ns": 6, "memory_bytes": 7, "torch_threads": 1,
    }
    monkeypatch.setattr(probe, "measure_cpu_local", lambda: dict(fake))
    spec = device("cpu-local", reprobe=True)
    assert (spec.bandwidth_bytes_per_s, spec.launch_overhead_ns) == (5e9, 6)
    assert json.loads(probe.cache_path().read_text())["numbers"] == fake


def test_an_unreadable_cache_is_reported_then_replaced(isolated_cache, monkeypatch):
    device("cpu-local")
    probe.cache_path().write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cpu-local probe cache"):
        spec = device("cpu-local")
    assert spec.bandwidth_bytes_per_s > 0
    json.loads(probe.cache_path().read_text())
