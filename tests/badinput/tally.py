"""Run the whole corpus once and print the outcome counts (the issue's clean / traceback /
wrong-success figures): ``python -m tests.badinput.tally [--show KIND]``."""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.badinput.corpus import CASES
from tests.badinput.conftest import make_shared
from tests.badinput.harness import Outcome, run_case


class Hang(BaseException):
    """Raised by the alarm: the case ran past the tally's time limit."""


def _hang(signum, frame):
    raise Hang()


def main(argv: list[str]) -> int:
    limit = int(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 60
    show = set(argv[argv.index("--show") + 1].split(",")) if "--show" in argv else set()
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    # Cases not run (counted as `hazard`): on a build without the checks they would exhaust the
    # machine's memory (e.g. `--batch 10**30` builds a 10**30-long prompt list).
    hazards = set(argv[argv.index("--hazard") + 1].split(",")) if "--hazard" in argv else set()
    with tempfile.TemporaryDirectory() as tmp:
        shared = make_shared(Path(tmp) / "shared")
        counts: Counter[str] = Counter()
        times: list[tuple[float, str]] = []
        started = time.perf_counter()
        for i, case in enumerate(CASES):
            if only and only not in case.id:
                continue
            if case.id in hazards:
                counts["hazard (not run)"] += 1
                continue
            t0 = time.perf_counter()
            signal.signal(signal.SIGALRM, _hang)
            signal.alarm(limit)
            try:
                outcome = run_case(case, Path(tmp) / f"c{i}", shared)
            except Hang:
                outcome = Outcome("hang", f"still running after {limit} s", "")
            finally:
                signal.alarm(0)
            times.append((time.perf_counter() - t0, case.id))
            counts[outcome.kind] += 1
            if outcome.kind in show:
                print(f"{outcome.kind:9} {case.id}: {outcome.detail} | {outcome.stderr.strip()[:300]!r}")
        if "--slow" in argv:
            for seconds, name in sorted(times, reverse=True)[: int(argv[argv.index("--slow") + 1])]:
                print(f"{seconds:6.2f} s  {name}")
        print(f"{sum(counts.values())} cases in {time.perf_counter() - started:.1f} s:",
              ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
