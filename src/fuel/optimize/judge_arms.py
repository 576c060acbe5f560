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
from fuel.cost.profile import RACE_MARGIN, Measurement, profile_cells, profile_kernel
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

    With the default profiler the cells are timed in rounds (:func:`~fuel.cost.profile_cells`):
    every cell sampled once a round, so a stretch of interference from other work spreads over
    all of them instead of landing on one arm's burst (a bf16 GEMV timed alone at 8 ms, its
    14 us, once kept a recipe and cost a decode step its native step list).

    A table's *variant arm* cells (``KernelEntry.variant_arm``: torch's int4pack kernel) are
    timed last, racing the arms measured before them: with the default profiler, a variant
    whose second call alone takes more than :data:`RACE_MARGIN` times the cheapest other arm
    of a branch it sits in is recorded from that one call (``profile_kernel(ceiling_ns=...)``)
    instead of sampled (a 64-row int4pack product here is 50-80x the recipe: sampling it cost
    ~1.4 s of a cold first token). The other cells race the same way inside the rounds: a
    cell whose calibration call already takes more than that margin over the cheapest other arm
    of its branch (those arms' cells timed by their own calibration calls) is recorded from
    that call and sampled no further (``profile_cells(retire=...)``) — a cell of recipes (arm 0)
    only: noise only adds time, so a kernel's cell seen slow is sampled in full (its early loss
    could hand a branch to a recipe and cost a decode step its native step list). An injected
    ``profile`` is always consulted in full.
    """
    fingerprint, libraries = device_fingerprint(backend.value), library_versions()
    wanted: dict[tuple[str, ...], NodeId] = {}
    keys: dict[NodeId, tuple[str, ...] | None] = {}  # every arm node's cell (None: not one)
    arms = {branch: arm_interiors(graph, branch) for branch in branches}
    for interiors in arms.values():
        for interior in interiors:
            for node_id in sorted(interior):
                if node_id not in keys:
                    keys[node_id] = _key(graph, node_id, symbols, runtime, table, backend)
                key = keys[node_id]
                if key is not None and key not in wanted and not known(key):
                    wanted[key] = node_id
    if not wanted:
        return []
    needed = tuple(sorted({i for node_id in wanted.values() for i in graph.node(node_id).inputs}))
    values = _values(graph, needed, table, backend, feeds, weights)
    rows = []
    racing = profile is None
    if profile is None:
        def profile(key, call, ceiling_ns=None):
            return profile_kernel(call, ceiling_ns=ceiling_ns, **profile_options)

    def entry_of(node_id):
        node = graph.node(node_id)
        return table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                            required_caps(node))

    variant = {key for key, node_id in wanted.items() if entry_of(node_id).variant_arm}
    order = sorted(wanted, key=lambda key: (key in variant, key))  # variant arms race last
    calls = {}
    for key in order:
        node = graph.node(wanted[key])
        calls[key] = _bound_call(entry_of(wanted[key]).kernel(node),
                                 [values[i] for i in node.inputs])
    measured: dict[tuple[str, ...], Measurement] = {}
    plain = [key for key in order if key not in variant]
    race = _Race(arms, keys)
    if racing:
        # The cells in rounds, so interference from other work spreads over all of them; a
        # cell whose calibration call already loses by RACE_MARGIN is not sampled further.
        def retire(alone: list[float]) -> list[int]:
            estimates = dict(zip(plain, alone))
            return [index for index, key in enumerate(plain)
                    if race.recipe_only(key)
                    and (ceiling := race.ceiling(key, estimates)) is not None
                    and alone[index] > ceiling]

        cells = profile_cells(
            [calls[key] for key in plain], **profile_options, retire=retire,
            on_call=None if on_cell is None else lambda i: on_cell(i, len(wanted), plain[i]))
        measured.update(zip(plain, cells))
    else:
        for index, key in enumerate(plain):
            if on_cell is not None:
                on_cell(index, len(wanted), key)
            measured[key] = profile(key, calls[key])
    medians = {key: m.median_ns for key, m in measured.items()}
    for index, key in enumerate(order[len(plain):], start=len(plain)):
        if on_cell is not None:
            on_cell(index, len(wanted), key)
        ceiling = race.ceiling(key, medians) if racing else None
        if ceiling is None:
            measured[key] = profile(key, calls[key])
        else:
            measured[key] = profile(key, calls[key], ceiling_ns=ceiling)
        medians[key] = measured[key].median_ns
    for key in order:
        op, dtype, size_class, _, source = key
        result = measured[key]
        rows.append(StoredMeasurement(
            op=op, dtype=dtype, size_class=size_class, backend=backend.value,
            kernel_source=source, device_fingerprint=fingerprint, library_versions=libraries,
            median_ns=result.median_ns, spread_ns=result.spread_ns,
            samples=result.samples))
    return rows


def _bound_call(kernel, args) -> Callable[[], object]:
    """``kernel(*args)`` as a call of no arguments (one per cell: a loop's lambda would bind
    the last cell's)."""
    return lambda: kernel(*args)


class _Race:
    """The races of one :func:`measure_branches` pass over ``arms`` (each branch's arm
    interiors; ``keys``: each arm node's cell), which arms hold which cells indexed once (a race
    asks for every cell)."""

    def __init__(self, arms, keys):
        self._arms = arms
        self._cells_of: dict[tuple, list] = {}  # (branch, arm) -> its cells
        self._holders: dict[tuple[str, ...], set] = {}  # cell -> the (branch, arm)s holding it
        for branch, interiors in arms.items():
            for arm, interior in enumerate(interiors):
                cells = [keys[n] for n in interior if keys[n] is not None]
                self._cells_of[branch, arm] = cells
                for cell in cells:
                    self._holders.setdefault(cell, set()).add((branch, arm))

    def recipe_only(self, key: tuple[str, ...]) -> bool:
        """Whether ``key`` is a cell of recipes (arm 0) alone: retiring it early can only make
        a recipe lose (by more than the margin), never take a kernel's win away."""
        return all(arm == 0 for _, arm in self._holders.get(key, ()))

    def ceiling(self, key: tuple[str, ...], medians: Mapping) -> float | None:
        """:data:`RACE_MARGIN` times the cheapest arm (every interior cell in ``medians``)
        among the branches where ``key`` is a cell of another arm; None when no such arm is
        fully in ``medians``."""
        best = None
        holding = self._holders.get(key, set())
        for branch in {b for b, _ in holding}:
            for arm in range(len(self._arms[branch])):
                if (branch, arm) in holding:
                    continue
                cells = self._cells_of[branch, arm]
                if cells and all(cell in medians for cell in cells):
                    total = sum(medians[cell] for cell in cells)
                    best = total if best is None else min(best, total)
        return None if best is None else RACE_MARGIN * best


def _key(graph: Graph, node_id: NodeId, symbols, runtime, table: KernelBindingTable,
         backend: BackendId) -> tuple[str, ...] | None:
    """The Judge key :func:`measure_branches` measures ``node_id`` under (None: not a cell)."""
    node = graph.node(node_id)
    if not isinstance(node.op, Prim | Fused):
        return None
    cell = judge_key(graph, node_id, symbols=symbols, runtime=runtime)
    if cell is None:
        return None
    entry = table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                         required_caps(node))
    return (cell[0], node.dtype.value, cell[1], backend.value, entry.kernel_source)


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
