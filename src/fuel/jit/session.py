"""A JIT session: the seam wired into a real run — adopt kernels for a model's lowered steps,
then measure every offered arm on this machine so the bake compares like with like.

Decides what happens between lowering a step and baking it, when JIT is on:

1. **Requests from the real graph** (:meth:`JitSession.adopt_for`): the carrier is asked about
   every fused node of the lowered step that has no kernel on the backend (on the CPU:
   ``paged_attn`` and ``residual_add_rms_norm``). Requests are grouped by (structure key,
   operand shapes): every layer repeats the same region, so one adoption serves them all; a new
   shape (another block-table width, a prefill chunk) is verified and gated again, because
   that is where the kernel will run. Every outcome is kept per (region, operand shapes):
   :meth:`JitSession.gate` is the :class:`~fuel.optimize.ShapeGate` the optimizer reads, so a
   kernel that failed verification or was measured slower at a shape is never offered (nor
   measured, nor baked) there, and the decision record says why.
2. **Adoption** (:func:`fuel.jit.adopt.adopt`): synthesize (numba; its disk cache makes later
   runs load instead of compile), verify against the recipe, cost-gate, register, bind into the
   session's table. Every outcome — adopted, declined, wrong, slower — is an
   :class:`AdoptionEvent` the run report prints; none stops the run (the step then runs
   decomposed).
3. **Measurement** (:meth:`JitSession.measure`): after ``offer_arms`` built the branches, each
   arm node whose Judge key this machine has no row for is profiled on the step's values
   (:func:`fuel.optimize.judge_arms.measure_branches`) and recorded in the Judge store (keyed by
   device fingerprint and library versions), so a later run finds every cell and measures
   nothing. Arm 0 (the recipe's primitives) and arm 1 (the adopted kernel, under its region's
   stable ``jit:<hash>`` name) are measured by the same routine on the same inputs.
4. :meth:`JitSession.judge` is the snapshot the bake reads (refreshed after new rows).

This module runs compilers, kernels and the clock: an edge, never imported by the planning core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuel.graph.branch import lower
from fuel.graph.dtype import BackendId
from fuel.graph.ir import Fused, Graph, NodeId
from fuel.graph.registry import RuntimeFusedRegistry, fused_name
from fuel.jit.carrier import jit_request_for_unplaceable_fused
from fuel.jit.protocol import ArchSku, JitBudget, JitRequest, Synthesizer

DEFAULT_BUDGET_MS = 120_000
"""Compile budget per kernel in a run: a cold numba compile of the paged template takes seconds;
a cached one loads in milliseconds."""

ARM_PROFILE = {"warmup": 2, "repeats": 9, "min_sample_ns": 100_000, "budget_ns": 300_000_000}
"""How each arm node is timed (median of 9 samples of at least 0.1 ms each; an arm slower than
that budget allows is sampled at least 3 times: ``fuel.cost.profile``)."""


def numba_available() -> bool:
    """Whether the CPU synthesizer can run here (numba importable)."""
    import importlib.util

    return importlib.util.find_spec("numba") is not None


@dataclass(frozen=True, slots=True)
class AdoptionEvent:
    """One adoption attempt for a region of the lowered graph, with how many nodes asked."""

    region: str
    """The fused op the request came from (``paged_attn``, ``residual_add_rms_norm``)."""
    shapes: str
    output: str
    nodes: int
    record: Any
    """The :class:`~fuel.jit.adopt.AdoptionRecord` (outcome, reason, error, times)."""

    def as_dict(self) -> dict[str, Any]:
        r = self.record
        return {"region": self.region, "shapes": self.shapes, "output": self.output,
                "nodes": self.nodes,
                "outcome": r.outcome.value, "reason": r.reason,
                "runtime_id": r.runtime_id, "max_abs_error": r.max_abs_error,
                "kernel_ns": r.kernel_ns, "decomposed_ns": r.decomposed_ns,
                "compile_ms": None if r.compile_ms is None else round(r.compile_ms, 1),
                "from_cache": r.from_cache}


def requests_of(graph: Graph, roots: Iterable[NodeId], table, backend: BackendId,
                arch: ArchSku, budget: JitBudget,
                runtime: RuntimeFusedRegistry | None = None
                ) -> list[tuple[str, JitRequest, list[NodeId]]]:
    """The carrier's requests for a lowered graph, grouped by (structure key, operand shapes):
    ``(region name, request, nodes asking)`` in the graph's dispatch order."""
    grouped: dict[tuple[str, str], tuple[str, JitRequest, list[NodeId]]] = {}
    for node_id in lower(graph, tuple(roots)).order:
        node = graph.node(node_id)
        if not isinstance(node.op, Fused):
            continue
        request = jit_request_for_unplaceable_fused(graph, node_id, backend, table, arch,
                                                    budget, runtime)
        if request is None:
            continue
        key = (request.structure_key(), _shapes(request))
        if key not in grouped:
            grouped[key] = (fused_name(node.op.id), request, [])
        grouped[key][2].append(node_id)
    return list(grouped.values())


def _shapes(request: JitRequest) -> str:
    return ", ".join(str(o) for o in request.operands)


def _gate_key(request: JitRequest) -> tuple[str, tuple]:
    """(the region's stable Judge name, its operand shapes): how the optimizer asks the gate."""
    from fuel.graph.recipe import structural_hash
    from fuel.optimize.providers import runtime_judge_name

    return (runtime_judge_name(structural_hash(request.region)),
            tuple(tuple(o.shape) for o in request.operands))


@dataclass
class JitSession:
    """Adoption and arm measurement for one engine's programs (see the module docs).

    ``table`` is the engine's binding table: adopted kernels are bound into it. ``store_path``
    is the Judge store (default: the user cache). ``profile(key, call)`` times one Judge cell
    (default: :func:`~fuel.cost.profile_kernel` with ``profile_options``; tests force chosen
    keys); ``measure_arms=False`` leaves pricing to whatever the store holds.
    """

    table: Any
    synthesizer: Synthesizer | None = None
    registry: RuntimeFusedRegistry = field(default_factory=RuntimeFusedRegistry)
    store_path: Path | None = None
    budget: JitBudget = JitBudget(DEFAULT_BUDGET_MS)
    arch: ArchSku = ArchSku.CPU
    backend: BackendId = BackendId.CPU
    measure_arms: bool = True
    profile: Callable[..., Any] | None = None
    profile_options: Mapping[str, int] = field(default_factory=lambda: dict(ARM_PROFILE))
    events: list[AdoptionEvent] = field(default_factory=list)
    measured: list[Any] = field(default_factory=list)
    """The Judge rows this session measured and stored."""
    adopted: dict[int, JitRequest] = field(default_factory=dict)
    """The request each adopted runtime fused id was synthesized for (the program cache stores
    it with a program, to bind the same kernel in a later process)."""
    _tried: dict[tuple[str, str], AdoptionEvent] = field(default_factory=dict)
    _verdicts: dict[tuple[str, tuple], str | None] = field(default_factory=dict)
    _names: dict[str, str] = field(default_factory=dict)
    """Judge op name of an adopted region (``jit:<hash>``) -> the region (for progress)."""
    _judge: Any = None
    notes: list[str] = field(default_factory=list)
    """What the session did that a user should know of (Judge cells timed on one thread while
    the pool stalled, kept for this process only)."""
    unstored: list[Any] = field(default_factory=list)
    """Judge rows measured while the pool stalled: priced from in this process, never stored."""

    def __post_init__(self) -> None:
        if self.synthesizer is None:
            from fuel.jit.native_synth import CpuSynthesizer

            self.synthesizer = CpuSynthesizer()

    def adopt_for(self, graph: Graph, roots: Iterable[NodeId]) -> list[AdoptionEvent]:
        """Adopt a kernel for each new (region, shapes) request of the lowered graph."""
        from fuel.jit.adopt import adopt
        from fuel.progress import current

        new: list[AdoptionEvent] = []
        pending = [(region, request, nodes) for region, request, nodes in
                   requests_of(graph, roots, self.table, self.backend, self.arch, self.budget,
                               self.registry)
                   if (request.structure_key(), _shapes(request)) not in self._tried]
        if not pending:
            return new
        with current().task("JIT", total=len(pending)) as task:
            for index, (region, request, nodes) in enumerate(pending):
                task.update(completed=index, description=f"JIT: compiling and verifying "
                                                         f"{region} ({index + 1} of {len(pending)})")
                record = adopt(self.synthesizer, request, self.backend, table=self.table,
                               registry=self.registry)
                event = AdoptionEvent(region, _shapes(request), str(request.output), len(nodes),
                                      record)
                self._tried[(request.structure_key(), _shapes(request))] = event
                self._names[_gate_key(request)[0]] = region
                self._verdicts[_gate_key(request)] = (
                    None if record.adopted else f"{record.outcome.value}: {record.reason}")
                self.events.append(event)
                if record.adopted and record.runtime_id is not None:
                    self.adopted.setdefault(record.runtime_id, request)
                new.append(event)
        return new

    def gate(self):
        """The per-shape admission of this session's adopted kernels (see the module docs)."""
        from types import MappingProxyType

        from fuel.optimize.pathfinders import ShapeGate

        return ShapeGate(MappingProxyType(dict(self._verdicts)))

    def judge(self):
        """The Judge snapshot the bake reads (this machine's rows of the store, and the rows
        this session measured on a stalled pool and did not store)."""
        if self._judge is None:
            from fuel.cost.judge import JudgeOracle

            self._judge = JudgeOracle.load(self.store_path, backends=(self.backend.value,)
                                           ).with_rows(self.unstored)
        return self._judge

    def measure(self, graph: Graph, branches: Iterable[NodeId], feeds: Mapping[str, Any],
                weights: Mapping[str, Any] | None = None) -> list[Any]:
        """Measure the arms' nodes the Judge has no cell for, store them, refresh the snapshot."""
        branches = tuple(branches)
        if not self.measure_arms or not branches:
            return []
        from fuel.cost.paths import default_store_path
        from fuel.cost.store import JudgeStore
        from fuel.optimize.judge_arms import measure_branches
        from fuel.progress import current

        judge = self.judge()
        known = lambda key: key[:5] in judge.measurements  # noqa: E731

        def on_cell(index: int, total: int, key: tuple[str, ...]) -> None:
            task.update(completed=index, total=total,
                        description=f"Judge: timing {self._names.get(key[0], key[0])} "
                                    f"({index + 1} of {total})")

        from contextlib import nullcontext

        import torch

        from fuel.kernels.threads import one_thread, pool_stalled

        pool = torch.get_num_threads()
        stalled = pool_stalled(pool)
        with one_thread() if stalled is not None else nullcontext(), \
                current().task("Judge: looking for unmeasured arm cells") as task:
            rows = measure_branches(graph, branches, feeds, self.table, self.backend,
                                    weights=weights, runtime=self.registry, known=known,
                                    profile=self.profile, on_cell=on_cell, **self.profile_options)
        if not rows:
            return []
        if stalled is None:
            with JudgeStore.open(self.store_path or default_store_path()) as store:
                store.record_many(rows)
        else:
            # Timed on a stalled pool, a kernel that shares its rows over the pool takes a time
            # slice a region (a bf16 GEMV 8 ms against its 14 us) and loses to a recipe that
            # cost the decode its step list; stored, that figure priced every later build. So
            # the cells are timed on one thread, and kept for this process only.
            self.unstored.extend(rows)
            self.notes.append(
                f"Judge: {len(rows)} cells timed on one thread, not stored: the pool of {pool} "
                f"was stalled (an empty parallel region took {stalled * 1e6:.0f} us on average: "
                f"another process holding a core)")
        self.measured.extend(rows)
        self._judge = None
        return rows

    def report(self) -> list[dict[str, Any]]:
        return [event.as_dict() for event in self.events]


__all__ = ["ARM_PROFILE", "AdoptionEvent", "DEFAULT_BUDGET_MS", "JitSession", "numba_available",
           "requests_of"]
