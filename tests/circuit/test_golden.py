"""Golden plans: every case of the matrix renders byte for byte as checked in.

Regenerate after an intended change with: .venv/bin/python scripts/regen_golden.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuel.circuit.golden import MODELS, cases, render_case
from fuel.circuit.rules import Mode

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = "run `.venv/bin/python scripts/regen_golden.py` to regenerate after an intended change"


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.path)
def test_rendered_plan_matches_golden(case):
    path = GOLDEN / case.path
    assert path.exists(), f"missing golden plan {path}; {REGEN}"
    assert render_case(case) == path.read_text(), f"{case.path} differs from its golden plan; {REGEN}"


def test_the_matrix_covers_four_models_and_every_mode():
    all_cases = cases()
    assert len(MODELS) >= 4
    for model in MODELS:
        modes = {c.mode for c in all_cases if c.model == model}
        assert modes == set(Mode)
        assert {c.rows for c in all_cases if c.model == model and c.mode is Mode.MULTI_SEQ} == {2, 8, 32}
        assert len({c.table for c in all_cases if c.model == model and c.mode is Mode.VERIFY_BATCH}) == 3


def test_no_stale_golden_files():
    named = {GOLDEN / c.path for c in cases()}
    stale = [p for p in GOLDEN.rglob("*.txt") if p not in named]
    assert not stale, f"golden files no case names: {stale}; {REGEN}"
