"""The Judge store and the files fuel writes survive faults: a read-only store is read, a
store damaged between runs is refused in one line and left untouched, a full disk during an
import or an export changes nothing and leaves no 0-byte file, concurrent writers lose nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from fuel.cli.app import main
from fuel.cost.store import JudgeStore, StoredMeasurement


def _row(i: int) -> StoredMeasurement:
    return StoredMeasurement(f"op{i}", "f32", "s", "cpu", "k", "d", "l", 100 + i, 1, 3)


def _store(path: Path, rows: int = 50) -> Path:
    with JudgeStore.open(path) as judge:
        judge.record_many(_row(i) for i in range(rows))
    return path


def _cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, [line for line in captured.err.splitlines() if line.strip()], captured.out


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file()}


def test_a_read_only_healthy_store_is_readable_not_damaged(small_fs, capsys):
    store = _store(small_fs.path / "judge.sqlite")
    small_fs.make_read_only()
    with JudgeStore.open(store) as judge:
        assert judge.read_only and judge.count() == 50
    status, err, out = _cli(capsys, "judge", "show", "--all", "--store", str(store))
    assert status == 0 and err == [] and "50 measurement(s)" in out


def test_writing_a_read_only_store_is_refused_in_one_line(tmp_path, small_fs, capsys):
    store = _store(small_fs.path / "judge.sqlite")
    export = tmp_path / "in.json"
    export.write_text(json.dumps({"format": "fuel-judge-export", "schema_version": 1,
                                  "measurements": [asdict(_row(99))]}))
    small_fs.make_read_only()
    status, err, _ = _cli(capsys, "judge", "import", str(export), "--store", str(store))
    assert status == 2 and len(err) == 1 and "read-only" in err[0] and "judge.sqlite" in err[0]


def test_a_store_damaged_between_runs_is_refused_in_one_line_and_left_untouched(tmp_path, capsys):
    store = _store(tmp_path / "judge.sqlite", rows=400)
    with JudgeStore.open(store) as judge:
        judge._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for extra in ("-wal", "-shm"):
        Path(str(store) + extra).unlink(missing_ok=True)
    data = bytearray(store.read_bytes())
    data[4096 * 2: 4096 * 2 + 2000] = bytes(2000)  # a b-tree page zeroed
    store.write_bytes(bytes(data))
    before = _digest(tmp_path)
    for argv in (["judge", "show", "--store", str(store)],
                 ["judge", "export", str(tmp_path / "out.json"), "--store", str(store)],
                 ["judge", "clear", "--yes", "--store", str(store)]):
        status, err, _ = _cli(capsys, *argv)
        assert status == 2 and len(err) == 1, (argv, err)
        assert "judge.sqlite" in err[0] and ("damaged" in err[0] or "integrity" in err[0]), err[0]
        assert _digest(tmp_path) == before, argv  # not repaired, not exported, nothing created


def test_a_full_disk_during_import_changes_nothing_and_says_so(tmp_path, small_fs, capsys):
    store = _store(small_fs.path / "judge.sqlite", rows=5)
    rows = [asdict(_row(i)) for i in range(5, 3000)]
    export = tmp_path / "big.json"
    export.write_text(json.dumps({"format": "fuel-judge-export", "schema_version": 1, "measurements": rows}))
    with small_fs.full():
        status, err, _ = _cli(capsys, "judge", "import", str(export), "--store", str(store))
    assert status == 2 and len(err) == 1, err
    assert "judge.sqlite" in err[0] and "cannot write" in err[0] and "rollback" not in err[0]
    with JudgeStore.open(store) as judge:
        assert judge.count() == 5


@pytest.mark.parametrize("argv", [
    ["judge", "export", "{fs}/out.json", "--store", "{tmp}/judge.sqlite"],
    ["plan", "smollm2-135m", "--html", "{fs}/out.html"],
])
def test_a_full_disk_leaves_no_output_and_no_temp_file(argv, tmp_path, small_fs, capsys):
    _store(tmp_path / "judge.sqlite", rows=400)
    args = [a.format(fs=small_fs.path, tmp=tmp_path) for a in argv]
    with small_fs.full():
        status, err, _ = _cli(capsys, *args)
    assert status == 2 and len(err) == 1 and "cannot write" in err[0], err
    assert [p.name for p in small_fs.path.iterdir() if p.name != ".filler"] == []


def test_concurrent_judge_writers_lose_nothing_through_the_cli(tmp_path):
    import os
    import subprocess
    import sys

    store = tmp_path / "judge.sqlite"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    files = []
    for w in range(3):
        rows = [asdict(_row(1000 * w + i)) for i in range(200)]
        path = tmp_path / f"w{w}.json"
        path.write_text(json.dumps({"format": "fuel-judge-export", "schema_version": 1, "measurements": rows}))
        files.append(path)
    script = "import sys; from fuel.cli import main; sys.exit(main())"
    procs = [subprocess.Popen([sys.executable, "-c", script, "judge", "import", str(f), "--store", str(store)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for f in files]
    assert [p.wait(300) for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    with JudgeStore.open(store) as judge:
        assert judge.count() == 600


_FAKE_PROBE = {
    "fp32_flops": 1e9, "bf16_flops": 2e9, "fp16_flops": 3e9, "vector_flops": 4e9,
    "fp32_gemv_flops": 1e8, "bf16_gemv_flops": 2e8, "fp16_gemv_flops": 3e8, "copy_bytes_per_s": 4e9,
    "bandwidth_bytes_per_s": 5e9, "launch_overhead_ns": 6, "memory_bytes": 7, "torch_threads": 1,
    "cache_bytes": 8, "cache_bandwidth_bytes_per_s": 9e9, "cache_note": "fake",
    "hot_call_ns": 1, "stream_note": "fake",
    **{f"{name}_gemm_rows_{what}": None for name in ("bf16", "fp16") for what in ("flops", "fit")},
    "half_bandwidth_by_bytes": [],
}


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_probe_that_cannot_be_cached_is_still_used(fault, small_fs, monkeypatch):
    from fuel.cost import probe

    monkeypatch.setenv("FUEL_CACHE_DIR", str(small_fs.path))
    monkeypatch.setattr(probe, "measure_cpu_local", lambda *a: dict(_FAKE_PROBE))
    if fault == "read-only":
        small_fs.make_read_only()
    with small_fs.full() if fault == "full" else contextlib.nullcontext():
        with pytest.warns(UserWarning, match="probe not cached"):
            spec = probe.cpu_local_spec(reprobe=True)
    assert spec.bandwidth_bytes_per_s == 5e9
    assert [p.name for p in small_fs.path.rglob("*") if p.name != ".filler" and p.is_file()] == []
