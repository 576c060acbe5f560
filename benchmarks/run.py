"""Run fuel's benchmarks: every ``bench_*.py`` in this folder, or the ones named.

Usage: .venv/bin/python benchmarks/run.py [NAME ...]     (NAME: fuser, executor, threads, cost, bake, jit, plan, run, serve)

Each benchmark measures fuel against a peer in the same run (the direct torch calls, the Judge's
measurement, the decomposed region, transformers' ``generate``) and prints ratios: these
machines are noisy, so a lone absolute time means little. Each runs in its own process, in the
order below (cheap first); the exit status is non-zero if any benchmark failed to run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("fuser", "executor", "threads", "cost", "bake", "jit", "plan", "run", "serve")


def main(argv: list[str]) -> int:
    names = argv or list(ORDER)
    unknown = [n for n in names if not (HERE / f"bench_{n}.py").exists()]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(ORDER)}",
              file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"\n=== bench_{name} ===", flush=True)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(HERE / f"bench_{name}.py")])
        print(f"--- bench_{name}: exit {done.returncode}, {time.perf_counter() - start:.0f} s wall",
              flush=True)
        if done.returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
