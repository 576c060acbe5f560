"""Step programs kept on disk, so a later process builds nothing an earlier one built.

Decides when a built :class:`~fuel.runtime.program.StepProgram` may be reused by another
process, and how it is stored. A build — lowering, optimize_graph, JIT adoption (synthesis,
verification, the cost gate), Judge measurement and the bake — is a function of the plan, the
step geometry, the model dtype, fuel's own code (kernels, synthesizers, rules), the kernel
libraries, this machine and the Judge store it priced on; all of them are in the key
(:func:`program_key`), so an entry is served only where the same build would happen again.

What is stored: the optimized step graph (the bake's decisions already applied), the
optimizer's record (for the run report), and, per adopted runtime kernel the program calls, the
JIT request it was synthesized for under its stable ``jit:<hash>`` name. Restoring binds those
kernels again through the synthesizer (its own disk cache loads the compiled code:
:func:`fuel.jit.adopt.rebind`) under this process's runtime ids, relabels the graph's fused
nodes to them, derives the weights and compiles: no lowering, no verification, no measurement.

Invariants:
- A file is written atomically (temp file + rename) with a header carrying the schema and the
  SHA-256 of its payload; a file that is truncated, fails its checksum, does not unpickle, or
  holds another key is never used: it is removed and recorded in :attr:`ProgramCache.notes`,
  and the program is built afresh.
- A program that calls a runtime kernel with no recorded request is not stored (it could not be
  restored); a kernel the synthesizer no longer builds makes the entry unusable, never a
  silent substitute.
- The folder is ``$FUEL_CACHE_DIR/programs`` (default ``~/.cache/fuel/programs``); deleting it
  is always safe. It is kept under :data:`FOLDER_LIMIT_BYTES`: every change of fuel's code,
  libraries or machine keys new programs and strands the old ones, so a save that takes the
  folder past the limit removes the least recently used programs (a restore marks its file
  used) down to three quarters of it, recorded in :attr:`ProgramCache.notes`.
"""

from __future__ import annotations

import copyreg
import gc
import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fuel.graph.ir import Fused
from fuel.graph.registry import RUNTIME_FUSED_BASE
from fuel.graph.recipe import structural_hash

if TYPE_CHECKING:
    from fuel.runtime.program import StepProgram

SCHEMA = 1
MAGIC = b"fuel-program"
FOLDER_LIMIT_BYTES = 512 * 2**20
"""How much the programs folder may hold (SmolLM2's programs are ~0.3-0.5 MB each; a model's
few programs for one build of fuel are a few MB: the limit only ever removes stale ones)."""


@cache
def code_digest() -> str:
    """SHA-256 over fuel's own source and data files (every kernel, the native kernels' C
    source included, synthesizer, rule and circuit): any change to what fuel would build
    changes every key."""
    import fuel

    root = Path(fuel.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".toml", ".json", ".c") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def _library_versions() -> str:
    from importlib import metadata

    from fuel.cost.fingerprint import library_versions

    try:
        numba = metadata.version("numba")
    except metadata.PackageNotFoundError:
        numba = "absent"
    return f"{library_versions()};numba={numba}"


def options_identity(options: Any) -> str:
    """What of the engine's optimize options changes a build: JIT on or off (and the
    synthesizer, the Judge store it prices on), the device spec priced on."""
    from fuel.runtime.program import ProgramOptions

    if options is None:
        return "optimize=default"
    session = options.jit if isinstance(options, ProgramOptions) else None
    optimize = options.optimize if isinstance(options, ProgramOptions) else options
    spec = getattr(optimize, "device_spec", None)
    parts = [f"spec={getattr(spec, 'name', None)}"]
    if session is not None:
        from fuel.cost.paths import default_store_path

        store = session.store_path or default_store_path()
        parts += [f"jit={getattr(session.synthesizer, 'name', type(session.synthesizer).__name__)}",
                  f"judge={Path(store).resolve()}", f"measure={session.measure_arms}"]
    return ";".join(parts)


def program_key(digest: str, shape: Any, dtype: Any, options: Any,
                layouts: Mapping[str, str] | None = None, kv_dtype: Any = None) -> str:
    """The key of a program: every input its build depends on (module docstring). ``layouts``:
    the packed layout of each weight (``fuel.runtime.lower.packed_layouts``): the same plan over
    Q4_0 and Q4_1 weights, or bf16 and f16 ones, lowers to different programs; ``kv_dtype``: the
    KV caches' element dtype (None: ``dtype``)."""
    import torch

    from fuel.cost.fingerprint import device_fingerprint

    text = "\n".join([
        f"fuel-program-key schema={SCHEMA}",
        f"plan={digest}",
        f"shape={shape!r}",
        f"dtype={dtype}",
        f"kv_dtype={kv_dtype if kv_dtype is not None else dtype}",
        f"layouts={sorted((layouts or {}).items())}",
        f"code={code_digest()}",
        f"libraries={_library_versions()}",
        f"machine={device_fingerprint('cpu')}",
        f"threads={torch.get_num_threads()}",
        f"options={options_identity(options)}",
    ])
    return hashlib.sha256(text.encode()).hexdigest()


def _mapping_view(mapping: dict) -> MappingProxyType:
    return MappingProxyType(mapping)


def _dumps(value: Any) -> bytes:
    """Pickle ``value``; read-only mapping views (the optimizer's routes) as their dict's view."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table[MappingProxyType] = lambda view: (_mapping_view, (dict(view),))
    pickler.dump(value)
    return buffer.getvalue()


@dataclass(frozen=True)
class _Stored:
    key: str
    step: Any
    optimized: Any
    kernels: tuple[tuple[int, str, Any], ...]
    """Per adopted runtime kernel: the id it had when stored, its stable name, its request."""


@dataclass
class ProgramCache:
    """Programs on disk under ``folder`` (default ``$FUEL_CACHE_DIR/programs``)."""

    folder: Path | None = None
    notes: list[str] = field(default_factory=list)
    """Entries found unusable (and removed), and programs not stored, with the reason."""
    restored: int = 0
    stored: int = 0

    @property
    def path(self) -> Path:
        if self.folder is not None:
            return self.folder
        from fuel.cost.paths import cache_dir

        return cache_dir() / "programs"

    def _file(self, key: str) -> Path:
        return self.path / f"{key[:40]}.program"

    def load(self, key: str, store: Any, table: Any, options: Any) -> StepProgram | None:
        """The program stored under ``key``, restored against this process's weights, table
        and JIT session; ``None`` when there is none or it cannot be used (recorded)."""
        path = self._file(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.notes.append(f"{path.name}: unreadable ({error.strerror}); building afresh")
            return None
        stored = self._decode(path, blob, key)
        if stored is None:
            return None
        program = self._restore(path, stored, store, table, options)
        if program is not None:
            self.restored += 1
            try:
                os.utime(path)  # used now: the last to go when the folder is pruned
            except OSError:
                pass  # a read-only folder: restoring needs no write
        return program

    def _decode(self, path: Path, blob: bytes, key: str) -> _Stored | None:
        header, _, payload = blob.partition(b"\n")
        parts = header.split(b" ")
        reason = None
        if len(parts) != 3 or parts[0] != MAGIC or parts[1] != str(SCHEMA).encode():
            reason = "not a fuel program file of this schema"
        elif hashlib.sha256(payload).hexdigest().encode() != parts[2]:
            reason = "checksum mismatch (truncated or corrupt)"
        else:
            # The ~14,000 objects a program holds, made with the collector off: each
            # allocation burst otherwise triggers collections that walk everything the process
            # holds (measured: a decode program's restore in mid-generation 0.014 s of
            # unpickling at 65 tokens of context, 0.195 s at 129, the same objects).
            collecting = gc.isenabled()
            gc.disable()
            try:
                stored = pickle.loads(payload)  # noqa: S301 — our own file, checksummed
            except Exception as error:  # noqa: BLE001 — any unpickling failure: unusable
                stored, reason = None, f"does not load ({type(error).__name__})"
            finally:
                if collecting:
                    gc.enable()
            if reason is None:
                if not isinstance(stored, _Stored) or stored.key != key:
                    reason = "holds another program"
                else:
                    return stored
        self._discard(path, reason)
        return None

    def _discard(self, path: Path, reason: str) -> None:
        self.notes.append(f"{path.name}: {reason}; removed, building afresh")
        path.unlink(missing_ok=True)

    def _restore(self, path: Path, stored: _Stored, store: Any, table: Any,
                 options: Any) -> StepProgram | None:
        from fuel.graph.dtype import BackendId
        from fuel.runtime.program import ProgramOptions, compile_step

        session = options.jit if isinstance(options, ProgramOptions) else None
        ids: dict[int, int] = {}
        if stored.kernels:
            if session is None:
                self._discard(path, "calls adopted kernels but this engine has no JIT session")
                return None
            from fuel.jit.adopt import rebind

            for old, name, request in stored.kernels:
                new = rebind(session.synthesizer, request, name, BackendId.CPU, table=table,
                             registry=session.registry)
                if isinstance(new, str):
                    self._discard(path, f"kernel {name} cannot be restored: {new}")
                    return None
                ids[old] = new
                session.adopted.setdefault(new, request)
        stored.step.graph.relabel_fused(ids)
        return compile_step(stored.step, stored.optimized, store, table, BackendId.CPU)

    def save(self, key: str, program: StepProgram, options: Any) -> bool:
        """Store ``program`` under ``key`` (atomically); False (with a note) when it calls a
        runtime kernel whose request is unknown, or the folder is not writable."""
        from fuel.runtime.program import ProgramOptions

        session = options.jit if isinstance(options, ProgramOptions) else None
        graph = program.step.graph
        kernels = []
        for runtime_id in sorted({graph.node(n).op.id for n in program.program.executed
                                  if isinstance(graph.node(n).op, Fused)
                                  and graph.node(n).op.id >= RUNTIME_FUSED_BASE}):
            request = session.adopted.get(runtime_id) if session is not None else None
            if request is None:
                self.notes.append(f"{program.digest[:12]}: runtime kernel {runtime_id:#06x} has "
                                  "no recorded request; not stored")
                return False
            kernels.append((runtime_id, f"jit:{structural_hash(request.region)[:16]}", request))
        stored = _Stored(key, program.step, program.optimized, tuple(kernels))
        payload = _dumps(stored)
        header = b" ".join([MAGIC, str(SCHEMA).encode(),
                            hashlib.sha256(payload).hexdigest().encode()])
        temp = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
            with os.fdopen(handle, "wb") as out:
                out.write(header + b"\n" + payload)
            os.replace(temp, self._file(key))
        except OSError as error:
            if temp is not None:
                Path(temp).unlink(missing_ok=True)
            self.notes.append(f"{program.digest[:12]}: not stored ({error.strerror})")
            return False
        self.stored += 1
        removed = prune(self.path, FOLDER_LIMIT_BYTES)
        if removed:
            self.notes.append(f"{len(removed)} least recently used program(s) removed: the folder "
                              f"had passed {FOLDER_LIMIT_BYTES // 2**20} MB")
        return True

    def report(self) -> dict[str, Any]:
        return {"folder": str(self.path), "restored": self.restored, "stored": self.stored,
                "notes": list(self.notes)}


def prune(folder: Path, limit: int) -> list[Path]:
    """Remove the least recently used ``*.program`` files of ``folder`` (by modification time,
    which a restore refreshes) until they hold at most three quarters of ``limit`` bytes, when
    they hold more than ``limit``; return the files removed. A file that vanishes or cannot be
    removed meanwhile (another process) is skipped."""
    entries = []
    for path in folder.glob("*.program"):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return []
    removed = []
    for _, size, path in sorted(entries):
        if total <= limit * 3 // 4:
            break
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        removed.append(path)
    return removed


__all__ = ["FOLDER_LIMIT_BYTES", "ProgramCache", "SCHEMA", "code_digest", "options_identity",
           "program_key", "prune"]
