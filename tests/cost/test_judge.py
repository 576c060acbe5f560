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


def test_a_changed_kernel_source_in_c_or_python_changes_the_library_versions(tmp_path):
    # Why: a Judge cell stands only for the code it measured. fuel's own kernels (the native
    # C library, the torch bindings and weight conversions, the synthesizers' runners) are keyed
    # by their sources, so a changed kernel is measured again; other code is not a kernel.
    from fuel.cost.fingerprint import kernel_sources_digest

    def tree(**files):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, text in {"kernels/table.py": "a", "kernels/native/gemv.c": "b",
                           "jit/adopt.py": "c", "cli/app.py": "d", **files}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return kernel_sources_digest(str(root))

    base = tree()
    assert tree() == base
    assert tree(**{"kernels/native/gemv.c": "b2"}) != base
    assert tree(**{"jit/adopt.py": "c2"}) != base
    assert tree(**{"kernels/int8pack.py": "new"}) != base
    assert tree(**{"cli/app.py": "d2"}) == base
    assert "fuel-kernels=" in library_versions()
