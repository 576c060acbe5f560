"""Regenerate the golden plans under tests/circuit/golden/ (see README, "Golden plans").

Usage: .venv/bin/python scripts/regen_golden.py
Writes every case of fuel.circuit.golden.cases() and removes files no case names.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fuel.circuit.golden import cases, render_case

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "circuit" / "golden"


def main() -> int:
    wanted = set()
    changed = 0
    for case in cases():
        path = GOLDEN / case.path
        wanted.add(path)
        text = render_case(case)
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed += 1
    stale = [p for p in GOLDEN.rglob("*.txt") if p not in wanted]
    for path in stale:
        path.unlink()
    print(f"{len(wanted)} golden plans, {changed} written, {len(stale)} stale removed ({GOLDEN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
