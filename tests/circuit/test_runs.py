"""Row tables and runs (§A6): text round-trip, every check, resolve_runs, per-run counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.circuit.runs import (
    KernelId,
    RowTable,
    RowTableError,
    RunLaunch,
    RunLaunches,
    RunSelect,
    Times,
    VerifyRun,
    resolve_runs,
)

K = KernelId("fa", "verify")


def test_parse_reads_runs_fragments_and_uncarried():
    table = RowTable.parse("uncarried: 4x3 3x1! 2x2")
    assert table.runs == (VerifyRun(4, 3, True), VerifyRun(3, 1, False), VerifyRun(2, 2, True))
    assert not table.carried
    assert table.rows() == 4 * 3 + 3 + 2 * 2 and table.seqs() == 6
    assert table.text() == "uncarried: 4x3 3x1! 2x2"


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "at least one run"),
    ("4x3 4x2", "adjacent runs of equal k"),
    ("3x1", "a run of one sequence is never batched"),
    ("0x2", "no rows or no sequences"),
    ("2x0!", "no rows or no sequences"),
    ("4by3", "is not `<k>x<n>`"),
    ("4x-3", "is not `<k>x<n>`"),
])
def test_malformed_tables_are_refused(text, fragment):
    with pytest.raises(RowTableError, match=fragment) as caught:
        RowTable.parse(text)
    assert caught.value.text == text or fragment == "no rows or no sequences"


runs_strategy = st.lists(st.tuples(st.integers(1, 16), st.integers(1, 64), st.booleans()),
                         min_size=1, max_size=6)


@given(runs_strategy, st.booleans())
def test_text_round_trips(raw, carried):
    runs = []
    for k, n, contiguous in raw:
        if runs and runs[-1].k == k:
            continue  # adjacent equal k would be one run
        runs.append(VerifyRun(k, n, contiguous and n > 1))
    table = RowTable(tuple(runs), carried)
    assert RowTable.parse(table.text()) == table


def test_from_seqs_forms_maximal_runs():
    table = RowTable.from_seqs([4, 4, 4, 3, 2, 2], contiguous=lambda first, count: first != 4)
    assert table.runs == (VerifyRun(4, 3, True), VerifyRun(3, 1, False), VerifyRun(2, 2, False))
    with pytest.raises(RowTableError, match="no rows"):
        RowTable.from_seqs([2, 0])


def test_times_count_within_a_run():
    run = VerifyRun(4, 3, True)
    assert [t.count(run) for t in Times] == [1, 3, 12, 9]


def select(k, n, times=Times.ONCE, contiguous=None, carried=None, copies=None):
    return RunSelect(k, n, contiguous, carried, (RunLaunch(K, times),), copies)


def test_resolve_takes_the_first_serving_selector_in_file_order():
    table = RowTable.parse("4x3 2x1!")
    batched = select((1, 8), (2, 64), contiguous=True)
    per_seq = select((1, 8), (1, 64), Times.PER_SEQ, copies=Times.PER_SEQ_ROW_BUT_LAST)
    resolved = resolve_runs(table, [batched, per_seq])
    assert resolved == (RunLaunches(VerifyRun(4, 3, True), batched.launches, None),
                        RunLaunches(VerifyRun(2, 1, False), per_seq.launches, Times.PER_SEQ_ROW_BUT_LAST))
    assert [r.launch_count() for r in resolved] == [1, 1]
    assert [r.copy_count() for r in resolved] == [0, 1]
    # Reversed order: the per-sequence selector serves both runs.
    assert resolve_runs(table, [per_seq, batched])[0].launches == per_seq.launches


def test_resolve_declines_when_any_run_is_unserved():
    assert resolve_runs(RowTable.parse("4x3 17x2"), [select((1, 16), (1, 64))]) is None
    assert resolve_runs(RowTable.parse("uncarried: 4x3"), [select((1, 16), (1, 64), carried=True)]) is None
    assert resolve_runs(RowTable.parse("4x3!"), [select((1, 16), (1, 64), contiguous=True)]) is None
