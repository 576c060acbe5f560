"""Executor overhead per node on the CPU.

Runs a chain of 1,000 small ops (tanh, x*s, x+s, neg on a 16-element f32 tensor) through the
executor and the same torch calls written directly, and prints both and their ratio (target
<= 1.3x). Usage::

    .venv/bin/python benchmarks/bench_executor.py [--nodes 1000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fuel.graph import DType, Graph, OpKind, lower
from fuel.kernels import cpu_table
from fuel.runtime import compile_program

CYCLE = 4  # tanh, mul_scalar, add_scalar, neg


def build_chain(nodes: int) -> tuple[Graph, int]:
    g = Graph()
    x = g.input("x", [16], DType.F32)
    for i in range(nodes):
        step = i % CYCLE
        if step == 0:
            x = g.prim(OpKind.TANH, x)
        elif step == 1:
            x = g.prim(OpKind.MUL_SCALAR, x, value=1.001)
        elif step == 2:
            x = g.prim(OpKind.ADD_SCALAR, x, value=0.001)
        else:
            x = g.prim(OpKind.NEG, x)
    return g, x


def direct(x: torch.Tensor, nodes: int) -> torch.Tensor:
    for _ in range(nodes // CYCLE):
        x = torch.tanh(x)
        x = x * 1.001
        x = x + 0.001
        x = torch.neg(x)
    return x


def median_seconds(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    nodes = args.nodes - args.nodes % CYCLE
    torch.set_num_threads(1)

    g, root = build_chain(nodes)
    program = compile_program(g, lower(g, [root]), cpu_table())
    x = torch.randn(16)
    torch.testing.assert_close(program.run({"x": x})[root], direct(x, nodes))
    assert program.executed_nodes == nodes

    executor_s = median_seconds(lambda: program.run({"x": x}), args.repeats)
    direct_s = median_seconds(lambda: direct(x, nodes), args.repeats)
    print(f"chain of {nodes} ops on a [16] f32 tensor, median of {args.repeats} runs")
    print(f"  direct torch calls : {direct_s * 1e3:8.3f} ms  ({direct_s / nodes * 1e9:7.0f} ns/op)")
    print(f"  executor           : {executor_s * 1e3:8.3f} ms  ({executor_s / nodes * 1e9:7.0f} ns/op)")
    print(f"  overhead per node  : {(executor_s - direct_s) / nodes * 1e9:7.0f} ns")
    print(f"  ratio              : {executor_s / direct_s:.3f}x  (target <= 1.3x)")


if __name__ == "__main__":
    main()
