"""`fuel judge show|export|import|clear`: the store through the command line."""

import json

import pytest

from fuel.cli.app import main
from fuel.cost import JudgeStore, StoredMeasurement, device_fingerprint, library_versions


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))


def seed(path, op="softmax", median=2500):
    with JudgeStore.open(path) as store:
        store.record(StoredMeasurement(
            op=op, dtype="f32", size_class="e12", backend="cpu", kernel_source="torch",
            device_fingerprint=device_fingerprint("cpu"), library_versions=library_versions(),
            median_ns=median, spread_ns=100, samples=15,
        ))


def test_show_lists_this_machines_measurements(tmp_path, capsys):
    store = tmp_path / "j.sqlite"
    seed(store)
    assert main(["judge", "show", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "softmax" in out and "2.50" in out and "1 measurement(s)" in out


def test_export_import_round_trip_keeps_the_minimum(tmp_path, capsys):
    a, b, shared = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "team.json"
    seed(a, median=2000)
    seed(b, median=3000)
    assert main(["judge", "export", str(shared), "--store", str(a)]) == 0
    assert json.loads(shared.read_text())["measurements"][0]["median_ns"] == 2000
    assert main(["judge", "import", str(shared), "--store", str(b)]) == 0
    assert "0 added, 1 improved, 0 kept" in capsys.readouterr().out
    with JudgeStore.open(b) as store:
        assert [r.median_ns for r in store.rows()] == [2000]


def test_a_corrupt_store_is_one_error_line_not_a_traceback(tmp_path, capsys):
    store = tmp_path / "j.sqlite"
    store.write_bytes(b"\x00garbage" * 500)
    assert main(["judge", "show", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "not a SQLite database" in err and "Traceback" not in err


def test_a_malformed_import_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "fuel-judge-export", "schema_version": 1, "measurements": [{"op": 1}]}))
    assert main(["judge", "import", str(bad), "--store", str(tmp_path / "j.sqlite")]) == 2
    assert "measurements[0]" in capsys.readouterr().err


def test_clear_empties_the_store(tmp_path, capsys):
    store = tmp_path / "j.sqlite"
    seed(store)
    seed(store, op="exp")
    assert main(["judge", "clear", "--yes", "--store", str(store)]) == 0
    assert "cleared 2 measurement(s)" in capsys.readouterr().out


def test_profile_measures_the_chosen_families_into_the_store(tmp_path, capsys):
    store = tmp_path / "j.sqlite"
    assert main(["judge", "profile", "smollm2-135m", "--ops", "add", "--threads", "1", "--store", str(store)]) == 0
    assert "measured 3 kernel(s)" in capsys.readouterr().out
    with JudgeStore.open(store) as judge:
        assert {r.op for r in judge.rows()} == {"add"}


def test_profile_refuses_an_unknown_family(tmp_path, capsys):
    assert main(["judge", "profile", "--ops", "teleport", "--store", str(tmp_path / "j.sqlite")]) == 2
    assert "teleport" in capsys.readouterr().err
