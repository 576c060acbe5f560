"""Census of one decode step: kernel calls and time by op kind, per step.

Loads the default model (SmolLM2-135M-Instruct), prefills a chat prompt, then runs ``--steps``
decode steps with every node clocked by the executor (``Program.run_timed``) and prints, per op
kind, the calls per step, the share of the step's node time, and the mean time per call. Nodes a
fused op was lowered into (no kernel on the CPU: its recipe, arm 0) are attributed to that op,
shown as ``paged_attn (decomposed)``, so the table says what a fused kernel would replace. The
last lines give the step's node time against its wall time (the difference is the engine's
per-step Python: feeds, block tables) and the matmul share. Usage::

    .venv/bin/python benchmarks/profile_step.py [--dtype f32|bf16] [--steps 16] [--threads N] [--jit]

``--jit`` builds the programs as ``fuel run`` does (adopted numba kernels where the Judge measured
them faster; programs restored from the on-disk program cache when an earlier run built them).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from collections import defaultdict

PROMPT = "Write a short paragraph about the history of the bicycle."


def node_labels(program) -> dict[int, str]:
    """Op label per executed node: its op name, or ``<fused> (decomposed)`` for the nodes of a
    fused op's recipe region (the optimizer emits each region right before its root, after the
    lowered step's own nodes)."""
    from fuel.graph.ir import Fused, Prim

    graph = program.step.graph
    lowered_roots = sorted((low.root, low.op) for low in program.optimized.lowerings
                           if low.root is not None)
    own = max((n for group in program.step.group_nodes for n in group), default=-1)
    labels = {}
    for node_id in program.program.executed:
        op = graph.node(node_id).op
        name = op.kind.value if isinstance(op, Prim) else str(op) if isinstance(op, Fused) else "?"
        if node_id > own and lowered_roots:
            at = bisect.bisect_left(lowered_roots, (node_id, ""))
            if at < len(lowered_roots):
                name = f"{lowered_roots[at][1]} (decomposed)"
        labels[node_id] = name
    return labels


def census(program, timings: list[tuple[float, ...]]) -> list[tuple[str, int, float]]:
    """``(label, calls per step, median seconds per step)`` per label, costliest first."""
    labels = node_labels(program)
    per_label: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(timings))
    calls: dict[str, int] = defaultdict(int)
    for node_id in program.program.executed:
        calls[labels[node_id]] += 1
    for step, seconds in enumerate(timings):
        for node_id, spent in zip(program.program.executed, seconds):
            per_label[labels[node_id]][step] += spent
    rows = [(label, calls[label], statistics.median(per_label[label])) for label in per_label]
    return sorted(rows, key=lambda row: (-row[2], row[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "stored"], default="f32")
    parser.add_argument("--jit", action="store_true", help="adopt numba kernels first (stored formats need them)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from fuel.circuit.rules import Mode
    from fuel.runtime.generate import prefill
    from fuel.runtime.model import load_model, set_threads

    threads = set_threads(args.threads)
    model = load_model(None, dtype=args.dtype, max_context=512, progress=False, jit=args.jit,
                       program_cache=args.jit)
    engine = model.engine
    ids = model.tokenizer.encode(model.tokenizer.format_prompt(PROMPT))
    engine.add_sequence("profile")
    token = prefill(engine, "profile", ids).tokens[-1]
    for _ in range(3):  # builds the decode program, warms the allocator
        token = engine.step(Mode.DECODE, [("profile", [token])]).tokens[-1]
    timings, walls, program = [], [], None
    for _ in range(args.steps):
        started = time.perf_counter()
        result = engine.step(Mode.DECODE, [("profile", [token])], timed=True)
        walls.append(time.perf_counter() - started)
        token, program = result.tokens[-1], result.program
        timings.append(result.node_seconds)
    wall_untimed = []
    for _ in range(args.steps):
        started = time.perf_counter()
        token = engine.step(Mode.DECODE, [("profile", [token])]).tokens[-1]
        wall_untimed.append(time.perf_counter() - started)
    engine.free("profile")

    rows = census(program, timings)
    node_total = sum(seconds for _, _, seconds in rows)
    wall = statistics.median(walls)
    calls_total = sum(calls for _, calls, _ in rows)
    print(f"decode step census: {args.dtype}, {threads} threads, jit {'on' if args.jit else 'off'}, "
          f"prompt {len(ids)} tokens, "
          f"median of {args.steps} timed steps")
    print(f"{'op':<36}{'calls/step':>11}{'share':>8}{'us/call':>10}")
    for label, calls, seconds in rows:
        print(f"{label:<36}{calls:>11}{seconds / node_total:>8.1%}{seconds / calls * 1e6:>10.1f}")
    matmul = sum(s for label, _, s in rows if label in ("fused:fused_linear", "matmul"))
    print(f"{'total':<36}{calls_total:>11}{1:>8.0%}{node_total / calls_total * 1e6:>10.1f}")
    print(f"node time / timed step wall: {node_total / wall:.1%} "
          f"(the rest: engine feeds, block tables, the timing itself)")
    print(f"matmul share of node time: {matmul / node_total:.1%}; "
          f"untimed step: {statistics.median(wall_untimed) * 1e3:.2f} ms "
          f"({1 / statistics.median(wall_untimed):.1f} tokens/s)")


if __name__ == "__main__":
    main()
