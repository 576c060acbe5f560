"""`fuel devices`: the spec table with sources; cpu-local appears once probed."""

import json

import pytest

from fuel.cli.app import main


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))


def test_devices_table_lists_every_device_with_its_sources(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    for name in ("h100-sxm", "h200-sxm", "b200", "gb10", "mi300x", "m3-max", "rtx-3090"):
        assert name in out
    assert "3,350" in out  # H100 SXM bandwidth, GB/s
    assert "Sources" in out and "with sparsity" in out
    assert "cpu-local: not probed yet" in out


def test_devices_json_after_a_probe_includes_cpu_local(capsys):
    assert main(["devices", "--probe", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    by_name = {entry["name"]: entry for entry in document}
    assert by_name["h100-sxm"]["peak_flops"]["bf16"] == pytest.approx(989.4e12)
    local = by_name["cpu-local"]
    assert local["probed"] is True and local["bandwidth_bytes_per_s"] > 0
