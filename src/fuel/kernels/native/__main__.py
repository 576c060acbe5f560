"""``python -m fuel.kernels.native``: build this machine's native library as an install step.

``scripts/setup.sh`` runs it after ``pip install``, so the C compiler runs while fuel is set
up, not during a user's first run (the first token would wait for it). A machine without a
compiler is told why and still runs fuel (the torch and numba arms stand): the exit status is 0
either way, the reason printed."""

from __future__ import annotations

import sys
import time

from fuel.kernels.native import Unavailable, build_installed


def main() -> int:
    started = time.perf_counter()
    built = build_installed()
    if isinstance(built, Unavailable):
        print(f"fuel native kernels: not built ({built.reason}); fuel runs without them",
              file=sys.stderr)
        return 0
    print(f"fuel native kernels: {built} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
