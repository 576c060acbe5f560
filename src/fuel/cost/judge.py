"""The Judge (Layer 2): measured latencies served to the planner.

Decided here: what "measured" means to a cost provider. ``measured_latency_ns(op, dtype,
size_class, backend, kernel_source)`` returns the stored median for this machine (device
fingerprint of ``backend``) and these kernel libraries, or ``None`` when nothing was measured.
``None`` is "unknown", never 0 — a provider falls back to Layer 1 for it.

Invariants:

- An oracle is a frozen snapshot: it reads the store once when built, so answers inside one
  optimize pass never change under it (and lookups are pure dictionary reads).
- A store that is corrupt or of another schema version is never used: :meth:`JudgeOracle.load`
  returns an empty oracle whose ``problem`` says why, for the caller to report.
- Rows from other fingerprints or library versions are invisible to the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from fuel.cost.fingerprint import device_fingerprint, library_versions
from fuel.cost.paths import default_store_path
from fuel.cost.store import JudgeStore, JudgeStoreError, StoredMeasurement

LookupKey = tuple[str, str, str, str, str]  # (op, dtype, size_class, backend, kernel_source)


def _key(row: StoredMeasurement) -> LookupKey:
    return (row.op, row.dtype, row.size_class, row.backend, row.kernel_source)


@dataclass(frozen=True)
class JudgeOracle:
    """Measured latencies for this machine, keyed by (op, dtype, size_class, backend, source)."""

    measurements: Mapping[LookupKey, StoredMeasurement] = field(
        default_factory=lambda: MappingProxyType({})
    )
    problem: JudgeStoreError | None = None

    def measured_latency_ns(
        self, op: str, dtype: str, size_class: str, backend: str, kernel_source: str
    ) -> int | None:
        row = self.measurements.get((op, dtype, size_class, backend, kernel_source))
        return row.median_ns if row is not None else None

    def __len__(self) -> int:
        return len(self.measurements)

    def with_rows(self, rows: list[StoredMeasurement]) -> JudgeOracle:
        """This snapshot with ``rows`` (measured here, in this process) over its own."""
        if not rows:
            return self
        return JudgeOracle(MappingProxyType({**self.measurements, **{_key(r): r for r in rows}}),
                           self.problem)

    @classmethod
    def from_rows(
        cls, rows: list[StoredMeasurement], *, fingerprints: Mapping[str, str], libraries: str
    ) -> JudgeOracle:
        """Keep the rows measured on this machine: ``fingerprints`` maps a backend to its
        device fingerprint here; rows of other fingerprints or libraries are dropped."""
        kept: dict[LookupKey, StoredMeasurement] = {}
        for row in rows:
            if row.library_versions != libraries:
                continue
            if fingerprints.get(row.backend) != row.device_fingerprint:
                continue
            key = _key(row)
            previous = kept.get(key)
            if previous is None or row.median_ns < previous.median_ns:
                kept[key] = row
        return cls(MappingProxyType(kept))

    @classmethod
    def load(cls, path: Path | None = None, *, backends: tuple[str, ...] = ("cpu",)) -> JudgeOracle:
        """Snapshot the store at ``path`` (default: the user cache) for this machine.

        A missing store gives an empty oracle; a corrupt or foreign-version one gives an empty
        oracle carrying the ``problem``.
        """
        path = Path(path) if path is not None else default_store_path()
        if not path.exists():
            return cls()
        try:
            with JudgeStore.open(path, create=False) as store:
                rows = store.rows()
        except JudgeStoreError as error:
            return cls(problem=error)
        fingerprints = {backend: device_fingerprint(backend) for backend in backends}
        return cls.from_rows(rows, fingerprints=fingerprints, libraries=library_versions())
