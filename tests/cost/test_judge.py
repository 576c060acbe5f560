"""The Judge oracle: this machine's measurements or None, never 0; bad stores are reported."""

from fuel.cost import JudgeOracle, JudgeStore, StoreCorruptError, StoredMeasurement, device_fingerprint, library_versions


def row(median, **overrides):
    values = dict(
        op="softmax", dtype="f32", size_class="e12", backend="cpu", kernel_source="torch",
        device_fingerprint=device_fingerprint("cpu"), library_versions=library_versions(),
        median_ns=median, spread_ns=1, samples=5,
    )
    values.update(overrides)
    return StoredMeasurement(**values)


def test_measured_latency_is_served_for_this_machine(tmp_path):
    path = tmp_path / "j.sqlite"
    with JudgeStore.open(path) as store:
        store.record(row(1234))
    oracle = JudgeOracle.load(path)
    assert oracle.problem is None
    assert oracle.measured_latency_ns("softmax", "f32", "e12", "cpu", "torch") == 1234


def test_unmeasured_is_none_not_zero(tmp_path):
    oracle = JudgeOracle.load(tmp_path / "absent.sqlite")
    assert oracle.measured_latency_ns("softmax", "f32", "e12", "cpu", "torch") is None
    assert len(oracle) == 0


def test_rows_of_other_machines_or_libraries_are_invisible(tmp_path):
    path = tmp_path / "j.sqlite"
    with JudgeStore.open(path) as store:
        store.record_many([
            row(10, device_fingerprint="someone-else"),
            row(20, library_versions="torch=0.1", op="exp"),
        ])
    oracle = JudgeOracle.load(path)
    assert oracle.measured_latency_ns("softmax", "f32", "e12", "cpu", "torch") is None
    assert oracle.measured_latency_ns("exp", "f32", "e12", "cpu", "torch") is None


def test_a_corrupt_store_is_reported_and_never_used(tmp_path):
    path = tmp_path / "j.sqlite"
    path.write_bytes(b"garbage" * 1000)
    oracle = JudgeOracle.load(path)
    assert isinstance(oracle.problem, StoreCorruptError)
    assert oracle.measured_latency_ns("softmax", "f32", "e12", "cpu", "torch") is None
