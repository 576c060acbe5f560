"""Fuser benchmark: every mode x row tier for Llama-3.1-70B (80 layers) on both built-in rule sets.

Usage: .venv/bin/python benchmarks/bench_fuser.py [--repeat N]

Targets (issue 3): the whole matrix under 1 s, and decode at n=1 under 50 ms, on this machine.
Each figure is the median of N runs (default 5); the circuit is instantiated once, outside the
timing (fuse builds its per-circuit index once per call, never per rule).
"""

from __future__ import annotations

import argparse
import statistics
import time

from fuel.circuit import zoo
from fuel.circuit.fuser import AvailableKernels, fuse, fuse_table
from fuel.circuit.policy import build_policy
from fuel.circuit.rules import Mode, load_builtin_rules
from fuel.circuit.runs import RowTable

MATRIX_TARGET_S = 1.0
DECODE_TARGET_S = 0.050
TABLES = ("4x3 3x1!", "2x8", "uncarried: 3x2 1x4 2x1!")


def matrix(policy) -> list[tuple[Mode, int | None, RowTable | None]]:
    tiers = [int(t) for t in policy.settings["row_tiers"].split(",")]
    cases: list[tuple[Mode, int | None, RowTable | None]] = [(Mode.DECODE, 1, None), (Mode.DRAFT, 1, None)]
    cases += [(Mode.MULTI_SEQ, t, None) for t in tiers]
    cases += [(Mode.VERIFY, k, None) for k in (2, 3, 4, 8)]
    cases += [(Mode.PREFILL, r, None) for r in (512, 4096, 32768)]
    cases += [(Mode.VERIFY_BATCH, None, RowTable.parse(t)) for t in TABLES]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    circuit = zoo.load("llama-3.1-70b")
    policy = build_policy()
    print(f"llama-3.1-70b: {len(circuit.nodes)} nodes, {len(circuit.edges)} edges")
    total_matrix = 0.0
    worst_decode = 0.0
    for name in ("cpu", "cuda"):
        rules = load_builtin_rules(name)
        available = AvailableKernels.all_named_by(rules)
        cases = matrix(policy)

        def run_case(mode, rows, table):
            if table is not None:
                return fuse_table(circuit, rules, available, policy, table)
            return fuse(circuit, rules, available, policy, mode, rows)

        decode_times, matrix_times = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            run_case(Mode.DECODE, 1, None)
            decode_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            plans = [run_case(*case) for case in cases]
            matrix_times.append(time.perf_counter() - start)
        decode, whole = statistics.median(decode_times), statistics.median(matrix_times)
        total_matrix += whole
        worst_decode = max(worst_decode, decode)
        launches = plans[0].launches()
        print(f"[{name}] {len(cases)} plans  decode n=1: {decode * 1e3:.1f} ms ({launches} launches)  "
              f"matrix: {whole * 1e3:.0f} ms")
    print(f"both rule sets: matrix {total_matrix * 1e3:.0f} ms = {total_matrix / MATRIX_TARGET_S:.2f} x target "
          f"({MATRIX_TARGET_S * 1e3:.0f} ms); decode n=1 worst {worst_decode * 1e3:.1f} ms = "
          f"{worst_decode / DECODE_TARGET_S:.2f} x target ({DECODE_TARGET_S * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
