"""Measuring a branch's arms for the Judge: every interior node's kernel, timed on the values it
really reads.

Decides how the bake's Judge-aware provider gets honest cells for a branch: each dispatchable
node of each arm is resolved through the binding table exactly as the executor would
(``lookup`` on its key and required capabilities), its input values are computed by running the
graph up to it on the given feeds, and the kernel alone is profiled
(:func:`fuel.cost.profile_kernel`). The row is keyed as the profiler keys every row (op name,
output dtype, the shared size class, backend, kernel source, this machine's fingerprint and
library versions), so ``decode_arm_composite_ns_judged`` finds it; an adopted kernel under its
region's stable name (``providers.judge_key``), so a later process finds it too.

This module reads the clock and runs kernels: an edge. It is not imported by
``fuel.optimize``'s planning modules; torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fuel.cost.fingerprint import device_fingerprint, library_versions
from fuel.cost.judge import JudgeOracle
from fuel.cost.profile import Measurement, profile_kernel
from fuel.cost.store import StoredMeasurement
from fuel.graph.branch import arm_interiors, lower
from fuel.graph.dtype import BackendId
from fuel.graph.ir import Fused, Graph, NodeId, Prim
from fuel.graph.registry import RuntimeFusedRegistry
from fuel.kernels.table import KernelBindingTable, key_dtypes, op_key, required_caps
from fuel.optimize.providers import judge_key


def _values(graph: Graph, nodes: tuple[NodeId, ...], table: KernelBindingTable,
            backend: BackendId, feeds: Mapping[str, Any], weights) -> dict[NodeId, Any]:
    from fuel.runtime.executor import compile_program

    program = compile_program(graph, lower(graph, nodes), table, backend, weights)
    return program.run(feeds)


def measure_branch(graph: Graph, branch: NodeId, feeds: Mapping[str, Any],
                   table: KernelBindingTable, backend: BackendId = BackendId.CPU, *,
                   weights=None, symbols: Mapping[str, int] | None = None,
                   runtime: RuntimeFusedRegistry | None = None,
                   **profile_options) -> list[StoredMeasurement]:
    """One row per distinct Judge key among the arms' interior nodes (the fastest if a key
    repeats, as the store keeps it)."""
    return measure_branches(graph, (branch,), feeds, table, backend, weights=weights,
                            symbols=symbols, runtime=runtime, **profile_options)


def measure_branches(graph: Graph, branches: Iterable[NodeId], feeds: Mapping[str, Any],
                     table: KernelBindingTable, backend: BackendId = BackendId.CPU, *,
                     weights=None, symbols: Mapping[str, int] | None = None,
                     runtime: RuntimeFusedRegistry | None = None,
                     known: Callable[[tuple[str, ...]], bool] = lambda key: False,
                     profile: Callable[[tuple[str, ...], Callable[[], object]], Measurement]
                     | None = None,
                     on_cell: Callable[[int, int, tuple[str, ...]], object] | None = None,
                     **profile_options) -> list[StoredMeasurement]:
    """Measure every arm node of ``branches`` whose Judge key is not ``known`` yet.

    The values the measured nodes read are computed by one run of the graph up to them (arm 0
    routes), then each node's kernel is profiled alone on them. Nodes sharing a Judge key are
    measured once (the first in id order: every layer of a model repeats the same regions).
    ``runtime`` keys adopted kernels by their region (``providers.judge_key``); ``profile(key,
    call)`` times one cell (default :func:`~fuel.cost.profile_kernel` with ``profile_options``;
    tests inject a forced measurement for chosen keys). ``on_cell(index, total, key)`` is told
    before each cell is timed (the CLI's progress bar).
    """
    fingerprint, libraries = device_fingerprint(backend.value), library_versions()
    wanted: dict[tuple[str, ...], tuple[NodeId, str, str]] = {}
    for branch in branches:
        for interior in arm_interiors(graph, branch):
            for node_id in sorted(interior):
                node = graph.node(node_id)
                if not isinstance(node.op, Prim | Fused):
                    continue
                cell = judge_key(graph, node_id, symbols=symbols, runtime=runtime)
                if cell is None:
                    continue
                entry = table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                                     required_caps(node))
                key = (cell[0], node.dtype.value, cell[1], backend.value, entry.kernel_source)
                if key not in wanted and not known(key):
                    wanted[key] = (node_id, cell[1], entry.kernel_source)
    if not wanted:
        return []
    needed = tuple(sorted({i for node_id, _, _ in wanted.values()
                           for i in graph.node(node_id).inputs}))
    values = _values(graph, needed, table, backend, feeds, weights)
    rows = []
    if profile is None:
        def profile(key, call):
            return profile_kernel(call, **profile_options)
    for index, (key, (node_id, _, _)) in enumerate(sorted(wanted.items())):
        if on_cell is not None:
            on_cell(index, len(wanted), key)
        op, dtype, size_class, _, source = key
        node = graph.node(node_id)
        entry = table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                             required_caps(node))
        args = [values[i] for i in node.inputs]
        kernel = entry.kernel(node)
        measured = profile(key, lambda: kernel(*args))
        rows.append(StoredMeasurement(
            op=op, dtype=dtype, size_class=size_class, backend=backend.value,
            kernel_source=source, device_fingerprint=fingerprint, library_versions=libraries,
            median_ns=measured.median_ns, spread_ns=measured.spread_ns,
            samples=measured.samples))
    return rows


def oracle_from(rows: list[StoredMeasurement], backend: BackendId = BackendId.CPU) -> JudgeOracle:
    """A Judge snapshot holding ``rows`` for this machine."""
    return JudgeOracle.from_rows(rows, fingerprints={backend.value: device_fingerprint(backend.value)},
                                 libraries=library_versions())


def measure_arm(graph: Graph, branch: NodeId, arm: int, feeds: Mapping[str, Any],
                table: KernelBindingTable, backend: BackendId = BackendId.CPU, *, weights=None,
                **profile_options) -> Measurement:
    """The arm end to end: its interior's kernels in dispatch order, on the values it reads
    (computed once beforehand), timed as one call."""
    exits = graph.node(branch).inputs
    interior = arm_interiors(graph, branch)[arm]
    order = [n for n in lower(graph, [exits[arm]]).order if n in interior]
    outside = tuple(sorted({i for n in order for i in graph.node(n).inputs} - interior))
    values = _values(graph, outside, table, backend, feeds, weights)
    steps = []
    for node_id in order:
        node = graph.node(node_id)
        entry = table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                             required_caps(node))
        steps.append((node_id, entry.kernel(node), node.inputs))

    def run() -> None:
        local = dict(values)
        for node_id, kernel, inputs in steps:
            local[node_id] = kernel(*[local[i] for i in inputs])

    return profile_kernel(run, **profile_options)
