"""The Judge's SQLite store: minimum-wins merges, concurrent writers, corruption and version
checks, JSON sharing."""

import json
import multiprocessing
import sqlite3

import pytest

from fuel.cost import JudgeStore, StoreCorruptError, StoredMeasurement, StoreVersionError
from fuel.cost.store import parse_export
from fuel.errors import InputError


def row(op="add", median=100, fingerprint="fp-a", **overrides):
    values = dict(
        op=op, dtype="f32", size_class="e10", backend="cpu", kernel_source="torch",
        device_fingerprint=fingerprint, library_versions="torch=1", median_ns=median,
        spread_ns=5, samples=9,
    )
    values.update(overrides)
    return StoredMeasurement(**values)


def test_duplicate_keys_keep_the_minimum(tmp_path):
    with JudgeStore.open(tmp_path / "j.sqlite") as store:
        assert store.record(row(median=100)).added == 1
        report = store.record_many([row(median=150, spread_ns=1), row(median=80, spread_ns=2)])
        assert (report.added, report.improved, report.kept) == (0, 1, 1)
        (stored,) = store.rows()
        assert (stored.median_ns, stored.spread_ns) == (80, 2)


def test_rows_come_back_sorted_and_filtered(tmp_path):
    with JudgeStore.open(tmp_path / "j.sqlite") as store:
        store.record_many([row(op="mul"), row(op="add"), row(op="add", fingerprint="fp-b")])
        assert [r.op for r in store.rows()] == ["add", "add", "mul"]
        assert [r.op for r in store.rows(device_fingerprint="fp-a")] == ["add", "mul"]
        assert store.clear(device_fingerprint="fp-b") == 1
        assert store.clear() == 2 and store.count() == 0


def _writer(path, worker, count):
    with JudgeStore.open(path) as store:
        for index in range(count):
            store.record(row(op=f"op{worker}_{index}", median=1000 + index))
            # every worker also races on one shared key; the minimum must survive
            store.record(row(op="shared", median=500 + worker))


def test_eight_concurrent_writer_processes_lose_no_rows(tmp_path):
    path = tmp_path / "j.sqlite"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(path, w, 40)) for w in range(8)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
        assert process.exitcode == 0
    with JudgeStore.open(path) as store:
        rows = store.rows()
    assert len(rows) == 8 * 40 + 1
    assert [r.median_ns for r in rows if r.op == "shared"] == [500]


def test_a_truncated_store_is_detected(tmp_path):
    path = tmp_path / "j.sqlite"
    with JudgeStore.open(path) as store:
        store.record_many([row(op=f"op{i}", kernel_source="x" * 200) for i in range(300)])
    data = path.read_bytes()
    assert len(data) > 8192
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreCorruptError) as raised:
        with JudgeStore.open(path) as store:
            store.rows()
    assert str(path) in str(raised.value)


def test_a_file_that_is_not_sqlite_is_detected(tmp_path):
    path = tmp_path / "j.sqlite"
    path.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(StoreCorruptError, match="not a SQLite database") as raised:
        JudgeStore.open(path)
    assert path.read_bytes().startswith(b"this is not")  # never overwritten
    # ... and the one error line says how to recover (fuel never deletes a file it cannot read)
    assert "move it aside or delete it" in str(raised.value)


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "j.sqlite"
    JudgeStore.open(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreVersionError) as raised:
        JudgeStore.open(path)
    assert raised.value.found == "fuel-judge schema 99"
    assert "schema 1" in str(raised.value)


def test_a_foreign_sqlite_database_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE photos (id INTEGER)")
    with pytest.raises(StoreVersionError, match="foreign"):
        JudgeStore.open(path)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("photos",)]


def test_export_then_import_merges_under_the_minimum_rule(tmp_path):
    with JudgeStore.open(tmp_path / "a.sqlite") as a:
        a.record_many([row(op="add", median=100), row(op="mul", median=300)])
        exported = a.export_json()
    assert exported == a_export_again(tmp_path)  # deterministic
    with JudgeStore.open(tmp_path / "b.sqlite") as b:
        b.record_many([row(op="add", median=90), row(op="mul", median=400), row(op="exp", median=7)])
        report = b.import_json(exported, file="team.json")
        assert (report.added, report.improved, report.kept) == (0, 1, 1)
        assert {r.op: r.median_ns for r in b.rows()} == {"add": 90, "mul": 300, "exp": 7}


def a_export_again(tmp_path):
    with JudgeStore.open(tmp_path / "a.sqlite") as a:
        return a.export_json()


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["measurements"][0].update(median_ns=0), "measurements[0].median_ns"),
        (lambda d: d["measurements"][0].pop("op"), "measurements[0].op"),
        (lambda d: d["measurements"][0].update(colour="red"), "measurements[0].colour"),
    ],
)
def test_a_malformed_export_is_refused_whole_naming_file_and_field(tmp_path, mutate, key):
    with JudgeStore.open(tmp_path / "a.sqlite") as a:
        a.record(row())
        document = json.loads(a.export_json())
    mutate(document)
    with pytest.raises(InputError) as raised:
        parse_export(json.dumps(document), file="team.json")
    assert raised.value.file == "team.json" and raised.value.key == key
