"""Row tables of a batched verify and the per-run launches a ``per_run`` rule selects (SPEC §A6).

A ``verify_batch`` step checks several sequences at once, sequence ``i`` with ``k_i`` rows,
sequence-major. Adjacent sequences with equal ``k`` form a *run*; batched kernels launch once per
run. A run is *contiguous* when its sequences' state slots are consecutive (what the batched
kernels need). A table is *carried* when the verify carries its recurrent state.

Text form: ``"4x3 3x1! 2x2"`` (``k x n`` per run, ``!`` marking a fragmented run), optionally
prefixed ``uncarried: ``.

Invariants:
- A row table has at least one run; every run has ``k >= 1`` and ``n >= 1``; adjacent runs
  differ in ``k`` (runs are maximal); a one-sequence run is never contiguous (it must carry ``!``).
- ``RowTable.parse(table.text()) == table``.
- ``k`` and ``n`` are written in ASCII digits (``str.isdigit`` also accepts superscripts and
  other scripts' digits, which ``int`` then refuses or reads as another number) and are at
  most :data:`MAX_RUN`; anything else is a :class:`RowTableError`, never another exception.
- ``resolve_runs`` gives each run the first selector (file order) that serves it, or ``None``
  when some run has none: a per-run rule applies only when every run is served.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from fuel.errors import FuelError

MAX_RUN = 1 << 16
"""The largest ``k`` or ``n`` of a run (far above any verify batch)."""

_RUN = re.compile(r"([0-9]+)x([0-9]+)(!?)", re.ASCII)

UNCARRIED = "uncarried: "
"""Text prefix of a table whose verify does not carry state."""


class RowTableError(FuelError):
    """A row table that is empty, malformed, or not made of maximal runs. ``text`` is the table
    as given (or rendered) and ``reason`` the bare cause."""

    def __init__(self, text: str, reason: str):
        self.text = text
        self.reason = reason
        super().__init__(f"row table `{text}`: {reason}")


@dataclass(frozen=True, slots=True, order=True)
class VerifyRun:
    """One run: ``n`` adjacent sequences verifying ``k`` rows each."""

    k: int
    n: int
    contiguous: bool

    def text(self) -> str:
        return f"{self.k}x{self.n}{'' if self.contiguous else '!'}"


@dataclass(frozen=True, slots=True)
class RowTable:
    """The runs of a batched verify, in batch order. Construct with :meth:`parse` or
    :meth:`from_seqs`; direct construction is checked too."""

    runs: tuple[VerifyRun, ...]
    carried: bool = True

    def __post_init__(self) -> None:
        text = self.text()
        if not self.runs:
            raise RowTableError(text, "a row table needs at least one run")
        if any(r.k < 1 or r.n < 1 for r in self.runs):
            raise RowTableError(text, "a run with no rows or no sequences")
        if any(r.n == 1 and r.contiguous for r in self.runs):
            raise RowTableError(text, "a run of one sequence is never batched; mark it `!`")
        if any(a.k == b.k for a, b in zip(self.runs, self.runs[1:])):
            raise RowTableError(text, "adjacent runs of equal k are one run")

    @classmethod
    def parse(cls, text: str) -> RowTable:
        body = text.strip()
        carried = not body.startswith(UNCARRIED.strip())
        if not carried:
            body = body[len(UNCARRIED.strip()):]
        runs = []
        for token in body.split():
            match = _RUN.fullmatch(token)
            if match is None:
                raise RowTableError(text, f"`{token}` is not `<k>x<n>` in ASCII digits (`!` marks "
                                          "a fragmented run)")
            k, n = int(match[1]), int(match[2])
            if k > MAX_RUN or n > MAX_RUN:
                raise RowTableError(text, f"`{token}`: k and n are at most {MAX_RUN}")
            runs.append(VerifyRun(k, n, not match[3]))
        return cls(tuple(runs), carried)

    @classmethod
    def from_seqs(cls, ks: Sequence[int], carried: bool = True,
                  contiguous: Callable[[int, int], bool] = lambda first, count: True) -> RowTable:
        """The table of sequences with ``ks`` rows each, in batch order; ``contiguous(first,
        count)`` says whether a run's state slots are consecutive."""
        if not ks:
            raise RowTableError("", "a row table needs at least one sequence")
        if any(k < 1 for k in ks):
            raise RowTableError(" ".join(map(str, ks)), "a sequence with no rows")
        runs = []
        start = 0
        while start < len(ks):
            end = start
            while end < len(ks) and ks[end] == ks[start]:
                end += 1
            count = end - start
            runs.append(VerifyRun(ks[start], count, count > 1 and contiguous(start, count)))
            start = end
        return cls(tuple(runs), carried)

    def rows(self) -> int:
        """Rows of the step, ``Σ k·n``."""
        return sum(r.k * r.n for r in self.runs)

    def seqs(self) -> int:
        return sum(r.n for r in self.runs)

    def text(self) -> str:
        body = " ".join(r.text() for r in self.runs)
        return body if self.carried else UNCARRIED + body

    def __str__(self) -> str:
        return self.text()


class Times(Enum):
    """How often a per-run launch (or copy) happens within its run."""

    ONCE = "once"
    PER_SEQ = "per_seq"
    PER_ROW = "per_row"
    PER_SEQ_ROW_BUT_LAST = "per_seq_row_but_last"

    def count(self, run: VerifyRun) -> int:
        match self:
            case Times.ONCE:
                return 1
            case Times.PER_SEQ:
                return run.n
            case Times.PER_ROW:
                return run.k * run.n
            case Times.PER_SEQ_ROW_BUT_LAST:
                return max(run.k - 1, 0) * run.n
        raise AssertionError(self)


@dataclass(frozen=True, slots=True, order=True)
class KernelId:
    """A kernel entry point: the module that provides it and the function."""

    module: str
    func: str

    def __str__(self) -> str:
        return f"{self.module}::{self.func}"


@dataclass(frozen=True, slots=True)
class RunLaunch:
    kernel: KernelId
    times: Times

    def text(self) -> str:
        return f"{self.kernel}*{self.times.value}"


@dataclass(frozen=True, slots=True)
class RunSelect:
    """One ``[[rule.run]]`` selector: the runs it serves (inclusive ``k`` and ``n`` ranges,
    optional contiguity and carried conditions) and what it launches for one."""

    k: tuple[int, int]
    n: tuple[int, int]
    contiguous: bool | None
    carried: bool | None
    launches: tuple[RunLaunch, ...]
    copies: Times | None = None

    def serves(self, run: VerifyRun, carried: bool) -> bool:
        return (self.k[0] <= run.k <= self.k[1]
                and self.n[0] <= run.n <= self.n[1]
                and (self.contiguous is None or self.contiguous == run.contiguous)
                and (self.carried is None or self.carried == carried))


@dataclass(frozen=True, slots=True)
class RunLaunches:
    """The launches one run of a per-run group makes."""

    run: VerifyRun
    launches: tuple[RunLaunch, ...]
    copies: Times | None

    def launch_count(self) -> int:
        return sum(launch.times.count(self.run) for launch in self.launches)

    def copy_count(self) -> int:
        return 0 if self.copies is None else self.copies.count(self.run)


def resolve_runs(table: RowTable, selects: Sequence[RunSelect]) -> tuple[RunLaunches, ...] | None:
    """Each run of ``table`` with the first selector (file order) that serves it; ``None`` when
    some run has none (the rule does not apply to this table)."""
    resolved = []
    for run in table.runs:
        select = next((s for s in selects if s.serves(run, table.carried)), None)
        if select is None:
            return None
        resolved.append(RunLaunches(run, select.launches, select.copies))
    return tuple(resolved)
