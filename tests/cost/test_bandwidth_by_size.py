"""Bandwidth by the size of the weight a call streams: a small matrix reads slower than a large
one (each call's read starts cold), and a 16-bit weight's kernel has its own curve."""

from __future__ import annotations

import pytest

from fuel.cost import probe
from fuel.cost.spec import DeviceKind, DeviceSpec

MIB = 1 << 20


def _spec(**curves) -> DeviceSpec:
    return DeviceSpec("test-cpu", "test", DeviceKind.CPU, {}, 1e9, 40e9, 1 << 34, 1000, **curves)


def test_a_weight_is_priced_at_the_bandwidth_measured_at_its_size():
    spec = _spec(bandwidth_by_bytes=((1 * MIB, 20e9), (64 * MIB, 40e9)))
    assert spec.bandwidth_at(1 * MIB) == 20e9
    assert spec.bandwidth_at(512 * 1024) == 20e9, "below the smallest size: its rate, no lower"
    assert spec.bandwidth_at(8 * MIB) == pytest.approx(30e9)  # halfway in log2 from 1 to 64 MiB
    assert spec.bandwidth_at(1 << 30) == 40e9
    assert _spec().bandwidth_at(1 * MIB) == 40e9, "no curve: the one bandwidth"


def test_sixteen_bit_weights_read_at_their_own_curve_where_measured():
    spec = _spec(bandwidth_by_bytes=((1 * MIB, 20e9),), half_bandwidth_by_bytes=((1 * MIB, 15e9),))
    assert spec.bandwidth_at(1 * MIB, half=True) == 15e9
    assert spec.bandwidth_at(1 * MIB) == 20e9
    assert _spec(bandwidth_by_bytes=((1 * MIB, 20e9),)).bandwidth_at(1 * MIB, half=True) == 20e9


def test_the_probe_streams_each_size_and_never_reports_a_small_weight_faster_than_the_slices(
        monkeypatch):
    import torch

    monkeypatch.setattr(probe, "_STREAM_MIN_BYTES", 32 * MIB)
    kernel = probe._linear_kernel(torch, torch.float32)
    points = probe._stream_by_size(torch, kernel, 0, (64 * MIB, 1e9))
    assert [size for size, _ in points] == [rows * 1024 * 4 for rows in probe._SIZED_STREAMS] + [64 * MIB]
    assert all(0 < rate <= 1e9 for _, rate in points), "capped at the large slices' rate"
    half = probe._stream_by_size(torch, probe._linear_kernel(torch, torch.bfloat16), 0,
                                 dtype=torch.bfloat16)
    assert [size for size, _ in half] == [rows * 1024 * 2 for rows in probe._SIZED_STREAMS]
    assert all(rate > 0 for _, rate in half)
