"""The Judge's store: measured latencies in SQLite, shareable as JSON.

Decided here: how measurements persist and merge.

- Key: (op, dtype, size_class, backend, kernel_source, device_fingerprint, library_versions).
  A measurement is only served back to the same hardware and the same kernel libraries.
- Duplicate keys keep the minimum median (with that sample's spread and count): the fastest
  honest observation of a kernel is its latency; slower ones were disturbed by something else.
- Concurrency: WAL journal, a generous busy timeout, and every write in one ``BEGIN IMMEDIATE``
  transaction, so concurrent writer processes serialize and lose no rows.
- Integrity: opening checks the SQLite header, runs ``PRAGMA quick_check``, and requires the
  ``meta`` table to name this application and ``SCHEMA_VERSION``. A corrupt or truncated file
  raises :class:`StoreCorruptError`; a store of another schema version or another application
  raises :class:`StoreVersionError`. Neither is ever read from or written to — the caller
  reports it, and the Judge then answers "not measured" (see :mod:`fuel.cost.judge`).

JSON export/import (``fuel judge export|import``) merge rules:

1. A row whose key is absent here is added.
2. A row whose key is present replaces it only when its median is strictly lower (the same
   minimum rule as duplicate writes); otherwise the local row is kept.
3. Rows from other device fingerprints or library versions are stored as they are and never
   served on this machine; they travel on when this store is exported again.
4. A file whose format, schema version or any row is malformed is refused as a whole (one
   :class:`~fuel.errors.InputError` naming the file, the row and the field); nothing is merged.
   The format is stated as the pydantic models ``_Export`` and ``_Row`` (:mod:`fuel.schema`).

Export output is deterministic: rows sorted by key, keys sorted, no timestamps.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Iterable, Literal

from pydantic import Field

from fuel.errors import FuelError, InputError
from fuel.schema import Schema, validate

APPLICATION = "fuel-judge"
SCHEMA_VERSION = 1
EXPORT_FORMAT = "fuel-judge-export"
_SQLITE_HEADER = b"SQLite format 3\x00"
_BUSY_TIMEOUT_MS = 120_000

KEY_FIELDS = (
    "op",
    "dtype",
    "size_class",
    "backend",
    "kernel_source",
    "device_fingerprint",
    "library_versions",
)


class JudgeStoreError(FuelError):
    """A Judge store that cannot be used; ``path`` names it."""

    def __init__(self, path: Path, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")


class StoreCorruptError(JudgeStoreError):
    """The file is not a readable SQLite database (truncated, overwritten, damaged). The
    message says how to recover (fuel never deletes it: a mistyped ``--store`` may name any
    file); the measurements are re-taken as runs need them."""

    def __init__(self, path: Path, detail: str):
        super().__init__(path, f"{detail}; move it aside or delete it, and an empty store is "
                               "made in its place (runs measure again what they need)")


class StoreVersionError(JudgeStoreError):
    """The database belongs to another application or another schema version."""

    def __init__(self, path: Path, found: str, expected: str):
        self.found = found
        self.expected = expected
        super().__init__(path, f"judge store is {found}, this fuel reads {expected}; not used")


@dataclass(frozen=True, slots=True)
class StoredMeasurement:
    """One row: the key fields, then the median latency, its spread and the sample count."""

    op: str
    dtype: str
    size_class: str
    backend: str
    kernel_source: str
    device_fingerprint: str
    library_versions: str
    median_ns: int
    spread_ns: int
    samples: int

    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, name) for name in KEY_FIELDS)


@dataclass(frozen=True, slots=True)
class MergeReport:
    """What an import or a batch write did: rows added, rows improved, rows kept as they were."""

    added: int
    improved: int
    kept: int


_CREATE = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS measurement (
        op TEXT NOT NULL, dtype TEXT NOT NULL, size_class TEXT NOT NULL, backend TEXT NOT NULL,
        kernel_source TEXT NOT NULL, device_fingerprint TEXT NOT NULL,
        library_versions TEXT NOT NULL,
        median_ns INTEGER NOT NULL CHECK (median_ns > 0),
        spread_ns INTEGER NOT NULL CHECK (spread_ns >= 0),
        samples INTEGER NOT NULL CHECK (samples > 0),
        PRIMARY KEY (op, dtype, size_class, backend, kernel_source, device_fingerprint,
                     library_versions))""",
)

_UPSERT = f"""INSERT INTO measurement ({', '.join(KEY_FIELDS)}, median_ns, spread_ns, samples)
    VALUES ({', '.join('?' * (len(KEY_FIELDS) + 3))})
    ON CONFLICT ({', '.join(KEY_FIELDS)}) DO UPDATE SET
        median_ns = excluded.median_ns, spread_ns = excluded.spread_ns, samples = excluded.samples
    WHERE excluded.median_ns < measurement.median_ns"""


def _is_resource_error(error: sqlite3.OperationalError) -> bool:
    """A full disk, a read-only file or an I/O failure: the store is fine, the write is not."""
    text = str(error).lower()
    return any(word in text for word in ("full", "readonly", "read-only", "disk i/o", "unable to open"))


def _rollback(connection: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already (it does on a full disk);
    a failed rollback never hides the error that caused it."""
    if connection.in_transaction:
        try:
            connection.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _retry_locked(action, *, attempts: int = 200):
    """Run ``action``; retry briefly on 'database is locked' that escapes the busy handler
    (journal-mode switches and schema creation can race before the handler applies)."""
    for attempt in range(attempts):
        try:
            return action()
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) and "busy" not in str(error):
                raise
            if attempt == attempts - 1:
                raise
            time.sleep(0.01 + 0.002 * attempt)
    raise AssertionError("unreachable")


class JudgeStore:
    """An open, verified Judge store. Use :meth:`open`; close with :meth:`close` or ``with``."""

    def __init__(self, path: Path, connection: sqlite3.Connection, *, read_only: bool = False):
        self.path = path
        self._db = connection
        self.read_only = read_only
        """Opened read-only (the user cannot write the file or its folder): writes are refused."""

    def _write(self, action):
        """Run a write; a read-only store, a full disk or an I/O error is one
        :class:`JudgeStoreError` naming the store (the transaction is rolled back: nothing
        half-written)."""
        if self.read_only:
            raise JudgeStoreError(self.path, "read-only (the file or its folder is not writable); "
                                             "nothing written")
        try:
            return _retry_locked(action)
        except sqlite3.OperationalError as error:
            if _is_resource_error(error):
                raise JudgeStoreError(self.path, f"cannot write: {error}; nothing changed") from None
            raise

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path | str, *, create: bool = True) -> JudgeStore:
        """Open (creating when absent and ``create``) and verify the store at ``path``."""
        from fuel.inputs import os_reason

        path = Path(path)
        if path.is_dir():
            raise JudgeStoreError(path, "is a directory, not a judge store file")
        exists = path.exists() and path.stat().st_size > 0
        if exists:
            try:
                with path.open("rb") as handle:
                    header = handle.read(len(_SQLITE_HEADER))
            except OSError as error:
                raise JudgeStoreError(path, f"cannot read: {os_reason(error)}") from None
            if header != _SQLITE_HEADER:
                raise StoreCorruptError(path, "not a SQLite database (bad header); not used")
        elif not create:
            raise JudgeStoreError(path, "no judge store here")
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                reason = ("a parent in the path is not a directory"
                          if isinstance(error, (FileExistsError, NotADirectoryError)) else os_reason(error))
                raise JudgeStoreError(path, f"cannot create: {reason}") from None
        # A healthy store the user cannot write (a read-only file or folder) is opened read-only:
        # it is served, never reported as damaged; a write to it is refused (see _write).
        read_only = exists and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))
        try:
            if read_only:
                uri = f"{path.resolve().as_uri()}?mode=ro"
                if not os.access(path.parent, os.W_OK):
                    uri += "&immutable=1"  # no -shm/-wal can be made beside it; nobody writes it
                connection = sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_MS / 1000,
                                             isolation_level=None)
            else:
                connection = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.DatabaseError as error:
            raise StoreCorruptError(path, f"cannot open: {error}; not used") from None
        try:
            connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            if read_only:
                cls._verify(path, connection)
            else:
                cls._verify_or_create(path, connection)
                mode = _retry_locked(lambda: connection.execute("PRAGMA journal_mode = WAL").fetchone())
                if mode is None or str(mode[0]).lower() != "wal":
                    raise JudgeStoreError(path, f"cannot switch to WAL journal (got {mode!r})")
        except sqlite3.OperationalError as error:
            connection.close()
            if _is_resource_error(error):
                raise JudgeStoreError(path, f"cannot write: {error}; nothing changed") from None
            raise StoreCorruptError(path, f"damaged database: {error}; not used") from None
        except sqlite3.DatabaseError as error:
            connection.close()
            raise StoreCorruptError(path, f"damaged database: {error}; not used") from None
        except JudgeStoreError:
            connection.close()
            raise
        return cls(path, connection, read_only=read_only)

    @staticmethod
    def _quick_check(path: Path, connection: sqlite3.Connection) -> None:
        check = connection.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            problems = [" ".join(str(row[0]).split()) for row in check]
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise StoreCorruptError(path, f"integrity check failed: {problems[0]}{more}; not used")

    @classmethod
    def _verify(cls, path: Path, connection: sqlite3.Connection) -> None:
        """Read-only: the integrity check and the meta table, nothing created."""
        cls._quick_check(path, connection)
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        cls._check_tables(path, connection, tables)

    @staticmethod
    def _check_tables(path: Path, connection: sqlite3.Connection, tables: set[str]) -> bool:
        """Whether this is fuel's store of this schema (True) or an empty database (False);
        anything else raises."""
        if "meta" in tables:
            meta = dict(connection.execute("SELECT key, value FROM meta").fetchall())
            found = f"{meta.get('application', '?')} schema {meta.get('schema_version', '?')}"
            expected = f"{APPLICATION} schema {SCHEMA_VERSION}"
            if found != expected:
                raise StoreVersionError(path, found, expected)
            if "measurement" not in tables:
                raise StoreCorruptError(path, "meta present but measurement table missing")
            return True
        if tables:
            raise StoreVersionError(
                path, f"a foreign database (tables: {', '.join(sorted(tables))})",
                f"{APPLICATION} schema {SCHEMA_VERSION}",
            )
        return False

    @classmethod
    def _verify_or_create(cls, path: Path, connection: sqlite3.Connection) -> None:
        cls._quick_check(path, connection)

        def create_or_read() -> None:
            connection.execute("BEGIN IMMEDIATE")
            try:
                tables = {
                    row[0]
                    for row in connection.execute(
                        "SELECT name FROM sqlite_master WHERE type = 'table'"
                    )
                }
                if not cls._check_tables(path, connection, tables):
                    for statement in _CREATE:
                        connection.execute(statement)
                    connection.executemany(
                        "INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                        [("application", APPLICATION), ("schema_version", str(SCHEMA_VERSION))],
                    )
                connection.execute("COMMIT")
            except BaseException:
                _rollback(connection)
                raise

        _retry_locked(create_or_read)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> JudgeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def record_many(self, rows: Iterable[StoredMeasurement]) -> MergeReport:
        """Write rows in one transaction under the minimum rule; report what changed."""
        rows = list(rows)
        added = improved = kept = 0

        def write() -> tuple[int, int, int]:
            a = i = k = 0
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for row in rows:
                    before = self._db.execute(
                        "SELECT median_ns FROM measurement WHERE "
                        + " AND ".join(f"{name} = ?" for name in KEY_FIELDS),
                        row.key(),
                    ).fetchone()
                    self._db.execute(_UPSERT, (*row.key(), row.median_ns, row.spread_ns, row.samples))
                    if before is None:
                        a += 1
                    elif row.median_ns < before[0]:
                        i += 1
                    else:
                        k += 1
                self._db.execute("COMMIT")
            except BaseException:
                _rollback(self._db)
                raise
            return a, i, k

        added, improved, kept = self._write(write)
        return MergeReport(added, improved, kept)

    def record(self, row: StoredMeasurement) -> MergeReport:
        return self.record_many([row])

    def clear(self, *, device_fingerprint: str | None = None) -> int:
        """Delete all rows (or one fingerprint's); return how many were removed."""

        def delete() -> int:
            if device_fingerprint is None:
                cursor = self._db.execute("DELETE FROM measurement")
            else:
                cursor = self._db.execute(
                    "DELETE FROM measurement WHERE device_fingerprint = ?", (device_fingerprint,)
                )
            return cursor.rowcount

        return self._write(delete)

    # -- reading ---------------------------------------------------------------------------

    def rows(
        self, *, device_fingerprint: str | None = None, library_versions: str | None = None
    ) -> list[StoredMeasurement]:
        """Rows (optionally of one fingerprint / library set), sorted by key."""
        where, args = [], []
        if device_fingerprint is not None:
            where.append("device_fingerprint = ?")
            args.append(device_fingerprint)
        if library_versions is not None:
            where.append("library_versions = ?")
            args.append(library_versions)
        sql = f"SELECT {', '.join(KEY_FIELDS)}, median_ns, spread_ns, samples FROM measurement"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY " + ", ".join(KEY_FIELDS)
        try:
            return [StoredMeasurement(*row) for row in self._db.execute(sql, args)]
        except sqlite3.DatabaseError as error:
            raise StoreCorruptError(self.path, f"damaged database: {error}; not used") from None

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM measurement").fetchone()[0]

    # -- sharing ---------------------------------------------------------------------------

    def export_json(self) -> str:
        """Every row as a deterministic JSON document (see the module docstring)."""
        document = {
            "format": EXPORT_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "measurements": [asdict(row) for row in self.rows()],
        }
        return json.dumps(document, indent=1, sort_keys=True) + "\n"

    def import_json(self, text: str, *, file: str) -> MergeReport:
        """Merge an exported document under the rules in the module docstring."""
        return self.record_many(parse_export(text, file=file))


_SQLITE_INT_MAX = 2**63 - 1
_Key = Annotated[str, Field(min_length=1)]


class _Row(Schema):
    """One exported row: the key fields non-empty strings, the numbers SQLite integers."""

    op: _Key
    dtype: _Key
    size_class: _Key
    backend: _Key
    kernel_source: _Key
    device_fingerprint: _Key
    library_versions: _Key
    median_ns: Annotated[int, Field(ge=1, le=_SQLITE_INT_MAX)]
    spread_ns: Annotated[int, Field(ge=0, le=_SQLITE_INT_MAX)]
    samples: Annotated[int, Field(ge=1, le=_SQLITE_INT_MAX)]


class _Export(Schema):
    format: Literal["fuel-judge-export"]
    schema_version: Literal[1]
    measurements: list[_Row]


def parse_export(text: str, *, file: str) -> list[StoredMeasurement]:
    """Validate a JSON export as a whole; raise :class:`InputError` naming file, row and field."""
    from fuel.inputs import parse_json

    document = parse_json(text, lambda detail: InputError(file, None, detail))
    if not isinstance(document, dict):
        raise InputError(file, None, "expected a JSON object")
    export = validate(_Export, document, partial(InputError, file))
    return [StoredMeasurement(**row.model_dump()) for row in export.measurements]
