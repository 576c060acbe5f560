"""Step programs: a lowered step, optimized and compiled once, run every step.

Decides how a :class:`~fuel.runtime.lower.StepGraph` becomes something the engine calls per
step: ``fuel.optimize.optimize_graph`` (fused nodes with no kernel on the backend lowered to
their recipe — arm 0 —, pathfinder arms offered, variants baked by cost, every decision
recorded), then the executor compiles the dispatch order against the binding table and the
bound weights.

With a JIT session (:class:`ProgramOptions`), between lowering and the bake: the session adopts
kernels for the step's unrunnable fused nodes (requests from this very graph), ``offer_arms``
branches each adopted kernel against its recipe, the session measures every arm node the Judge
has no cell for on probe feeds of this step (:func:`probe_feeds`), and ``bake_offered`` bakes
on the refreshed Judge. The session's per-shape gate rides the options: a kernel adoption refused
at this step's shapes (wrong there, or slower) is not offered here, and the offer says why. Adoption happens before the program is compiled, so the engine's
per-digest program cache never holds a program built without it.

A graph that keeps live branches (placement arms: a heavy node that another device can run too)
gets a route picker (:mod:`fuel.runtime.route_picker`): each :meth:`StepProgram.run` resolves
the route from live signals (free memory, load) and runs the program compiled for that route
(one per route taken, compiled the first time it is taken); ``last_route`` says which arms ran
and why.

Invariants:
- A program is built once per (plan digest, step geometry) and reused; building never happens
  inside a step (except a route's program, compiled the first time the picker takes it).
- Derived weights (concatenated projections, RoPE tables) are built once per
  :class:`WeightStore` and shared by every program of an engine; checkpoint tensors are bound
  as they are (no copy).
- ``run`` feeds exactly the step's inputs and returns ``logits`` and ``tokens``; nothing else is
  computed (losing arms are not in the order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fuel.circuit.format import HALF_ROWS
from fuel.graph.branch import lower as lower_order
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Fused, Input
from fuel.graph.registry import RUNTIME_FUSED_BASE, fused_name
from fuel.runtime.lower import (
    LOGIT_ROWS, POSITIONS, SLOTS, TOKENS, DerivedKind, DerivedWeight, StepGraph, block_table_input,
    context_lens_input, rope_table,
)

if TYPE_CHECKING:
    import torch

    from fuel.jit.session import JitSession
    from fuel.kernels.table import KernelBindingTable
    from fuel.optimize.optimize import OptimizedGraph, OptimizeOptions


class WeightStore(Mapping[str, "torch.Tensor"]):
    """Checkpoint tensors by binding path, plus the derived weights programs ask for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._tensors = tensors
        self._derived: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    def derive(self, spec: DerivedWeight) -> None:
        """Build ``spec`` once (a second request for the same name is free)."""
        if spec.name in self._derived:
            return
        import torch

        if spec.kind is DerivedKind.CONCAT:
            value = torch.cat([self._tensors[name] for name in spec.sources], dim=0).contiguous()
        elif spec.kind is DerivedKind.EXPERT_STACK:
            from fuel.runtime.moe import stack_experts

            value = stack_experts(self._tensors, spec.sources, spec.group)
        else:
            # Hugging Face's RoPE (default, or llama3-scaled frequencies), in float32, stored in
            # the model dtype: fuel.runtime.lower.rope_table.
            value = rope_table(spec, self.dtype)
        self._derived[spec.name] = value

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._derived:
            return self._derived[name]
        tensor = self._tensors[name]
        if tensor.dtype.itemsize == 2 and self.format_of(name) in HALF_ROWS:
            import torch

            # A half-precision matrix runs as packed rows of 2-byte elements (its bytes, no copy).
            return tensor.view(torch.uint8)
        return tensor

    def __iter__(self):
        yield from self._tensors
        yield from self._derived

    def __len__(self) -> int:
        return len(self._tensors) + len(self._derived)

    def __contains__(self, name: object) -> bool:
        return name in self._derived or name in self._tensors

    def format_of(self, name: str) -> str | None:
        """The packed format of a checkpoint tensor (``Weights.format_of``), None when plain."""
        format_of = getattr(self._tensors, "format_of", None)
        return format_of(name) if format_of is not None else None


@dataclass(frozen=True, slots=True)
class BakeSummary:
    """What optimize_graph decided for one program, in numbers a report can print."""

    lowered: tuple[tuple[str, int], ...]
    """Fused ops lowered to their recipe (no kernel on the backend), with counts."""
    offers: int
    branches: int
    bakes: int
    jit_requests: int

    def describe(self) -> str:
        lowered = ", ".join(f"{name} x{count}" for name, count in self.lowered) or "none"
        return (f"lowered to recipe: {lowered}; arms offered: {self.offers}; branches: "
                f"{self.branches}; baked to a variant: {self.bakes}; JIT requests: {self.jit_requests}")


@dataclass(slots=True)
class StepProgram:
    """One compiled step: call :meth:`run` with the feeds; ``launches`` is the plan's count,
    ``dispatched`` the kernel calls the executor makes, ``host_calls`` the calls from Python
    (one where the program runs as a native step list)."""

    step: StepGraph
    optimized: OptimizedGraph
    program: Any
    logits_root: int
    tokens_root: int
    routing_roots: tuple[int, ...] = ()
    """The roots holding each MoE layer's chosen expert ids (``step.routing`` order)."""
    routing: Any = None
    """For a graph that keeps live branches (placement arms): a :class:`_Routing` that resolves
    them per step through the route picker with live signals; None when nothing is live."""
    last_route: Any = None
    """The :class:`~fuel.runtime.route_picker.Route` the latest :meth:`run` took (None: no
    live branch)."""
    _launches: int | None = None

    @property
    def digest(self) -> str:
        return self.step.plan.digest

    @property
    def launches(self) -> int:
        """The plan's launch count (counted once: the engine reads it at every step)."""
        if self._launches is None:
            self._launches = self.step.plan.launches()
        return self._launches

    @property
    def dispatched(self) -> int:
        """Kernels one run executes (``Program.kernel_calls``)."""
        return self.program.kernel_calls

    @property
    def host_calls(self) -> int:
        """Calls one run makes from Python (``Program.host_calls``)."""
        return self.program.host_calls

    def bake_summary(self) -> BakeSummary:
        counts: dict[str, int] = {}
        for lowering in self.optimized.lowerings:
            counts[lowering.op] = counts.get(lowering.op, 0) + 1
        return BakeSummary(tuple(sorted(counts.items())), len(self.optimized.offers),
                           len(self.optimized.decisions), self.optimized.bakes,
                           len(self.optimized.jit_requests))

    def run(self, feeds: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        program = self.program
        if self.routing is not None:
            self.last_route = self.routing.picker.route(self.routing.signals)
            program = self.routing.program_for(self.last_route.arms)
        out = program.run(feeds)
        return out[self.logits_root], out[self.tokens_root]

    def run_routed(self, feeds: Mapping[str, Any]
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """:meth:`run`, plus each MoE layer's chosen expert ids ``[rows, k]``."""
        out = self.program.run(feeds)
        return (out[self.logits_root], out[self.tokens_root],
                tuple(out[r] for r in self.routing_roots))

    def runtime_fused_executed(self) -> int:
        """Kernel calls per step served by adopted (runtime fused) kernels."""
        graph = self.step.graph
        return sum(1 for n in self.program.executed
                   if isinstance(graph.node(n).op, Fused)
                   and graph.node(n).op.id >= RUNTIME_FUSED_BASE)

    def branch_decisions(self) -> list[dict[str, Any]]:
        """The bake's decisions grouped by region and outcome: which arm won how often, each
        arm's cost and source (equal regions of every layer share their Judge cells)."""
        graph = self.step.graph
        region_of = {o.branch: fused_name(graph.node(o.node).op.id)
                     if isinstance(graph.node(o.node).op, Fused) else str(graph.node(o.node).op)
                     for o in self.optimized.offers if o.branch is not None}
        grouped: dict[tuple, dict[str, Any]] = {}
        for decision in self.optimized.decisions:
            arms = tuple((a.label, a.cost_ns, a.source.value if a.source else None)
                         for a in decision.arms)
            key = (region_of.get(decision.branch, "?"), decision.winner, decision.reason.value,
                   arms)
            row = grouped.setdefault(key, {
                "region": key[0], "winner": decision.winner, "reason": key[2], "count": 0,
                "arms": [{"arm": a.arm, "label": a.label, "cost_ns": a.cost_ns,
                          "source": a.source.value if a.source else None,
                          "declined": a.declined, "dispatch_ns": a.dispatch_ns}
                         for a in decision.arms]})
            row["count"] += 1
        return list(grouped.values())


@dataclass(frozen=True)
class ProgramOptions:
    """How :func:`build_program` optimizes: ``optimize`` as given, and with ``jit`` a session
    that adopts kernels for the step and measures the offered arms before the bake.
    ``signals`` (a :class:`~fuel.runtime.route_picker.SignalProvider`; default: the system's)
    and ``route_specs`` (a device spec per device, to price arms) feed the route picker of a
    program whose graph keeps placement branches."""

    optimize: OptimizeOptions
    jit: JitSession | None = field(default=None, compare=False)
    signals: Any = field(default=None, compare=False)
    route_specs: Mapping[Any, Any] = field(default_factory=dict, compare=False)


@dataclass
class _Routing:
    """The route picker of one program and a compiled program per route it has taken."""

    picker: Any
    signals: Any
    compile: Any
    programs: dict[tuple, Any] = field(default_factory=dict)

    def program_for(self, arms: Mapping[int, int]) -> Any:
        key = tuple(sorted(arms.items()))
        if key not in self.programs:
            self.programs[key] = self.compile(arms)
        return self.programs[key]


def probe_feeds(step: StepGraph, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Feeds for measuring a step's kernels on valid values: each run's sequences own distinct
    blocks and fill their block table (context = the table's capacity, the width bucket's
    longest), the rows sit at the context's last positions and write their own slots, caches
    hold normal noise (one tensor per shape, shared: their contents do not change the time)."""
    import torch

    shape = step.shape
    generator = torch.Generator().manual_seed(seed)
    capacity = min(shape.max_blocks * shape.block_size, shape.positions)
    feeds: dict[str, Any] = {}
    positions: list[int] = []
    slots: list[int] = []
    first_block = 0
    for run, (k, n) in enumerate(shape.runs):
        table = torch.arange(first_block, first_block + n * shape.max_blocks,
                             dtype=torch.int64).reshape(n, shape.max_blocks)
        first_block += n * shape.max_blocks
        feeds[block_table_input(run)] = table.to(torch.uint32)
        feeds[context_lens_input(run)] = torch.full((n,), capacity, dtype=torch.uint32)
        for sequence in range(n):
            for position in range(capacity - k, capacity):
                positions.append(position)
                block = int(table[sequence, position // shape.block_size])
                slots.append(block * shape.block_size + position % shape.block_size)
    feeds[TOKENS] = torch.zeros(len(positions), dtype=torch.int64)
    feeds[POSITIONS] = torch.tensor(positions, dtype=torch.int64)
    feeds[SLOTS] = torch.tensor(slots, dtype=torch.int64)
    if shape.logit_rows is not None:  # the step's last rows (one sequence's: its last row)
        feeds[LOGIT_ROWS] = torch.arange(len(positions) - shape.logit_rows, len(positions),
                                         dtype=torch.int64)
    from fuel.kernels.torch_kernels import torch_dtype

    noise: dict[tuple[Any, ...], Any] = {}
    graph = step.graph
    for node_id in graph:
        node = graph.node(node_id)
        if isinstance(node.op, Input) and node.op.name not in feeds:
            # each input in its own dtype (a half-precision KV cache), else the step's
            dims = tuple(node.shape.dims)
            held = torch_dtype(node.dtype) if node.dtype.is_float else dtype
            if (dims, held) not in noise:
                noise[dims, held] = torch.randn(dims, generator=generator).to(held)
            feeds[node.op.name] = noise[dims, held]
    return feeds


def _optimize_with_jit(step: StepGraph, store: WeightStore, table: KernelBindingTable,
                       options: OptimizeOptions, session: JitSession) -> OptimizedGraph:
    from fuel.optimize.optimize import bake_offered, offer_arms

    session.adopt_for(step.graph, step.roots)
    # The gate: an adopted kernel is offered only at shapes it was verified and gated at.
    options = replace(options, table=table, runtime=session.registry,
                      runtime_gate=session.gate())
    offered = offer_arms(step.graph, step.roots, options)
    branches = offered.branches()
    if branches:
        session.measure(step.graph, branches, probe_feeds(step, store.dtype), store)
    return bake_offered(step.graph, offered, replace(options, judge=session.judge()))


def build_program(step: StepGraph, store: WeightStore, table: KernelBindingTable,
                  options: OptimizeOptions | ProgramOptions | None = None) -> StepProgram:
    """Optimize ``step``'s graph in place, then compile it against ``table`` and ``store``."""
    from fuel.optimize.optimize import OptimizeOptions, optimize_graph

    for spec in step.derived:
        store.derive(spec)
    session, routed = None, None
    if isinstance(options, ProgramOptions):
        routed = options
        options, session = options.optimize, options.jit
    options = options or OptimizeOptions(table=table)
    if session is not None:
        optimized = _optimize_with_jit(step, store, table, options, session)
    else:
        optimized = optimize_graph(step.graph, step.roots, options)
    backend = options.device.backend if options.device else BackendId.CPU
    return compile_step(step, optimized, store, table, backend, options=options, routed=routed)


def compile_step(step: StepGraph, optimized: OptimizedGraph, store: WeightStore,
                 table: KernelBindingTable, backend: BackendId, *,
                 options: OptimizeOptions | None = None,
                 routed: ProgramOptions | None = None) -> StepProgram:
    """Compile an optimized step against ``table`` and ``store`` (its derived weights built
    first): the last stage of :func:`build_program`, and all a restored program needs
    (:mod:`fuel.runtime.program_cache`). ``options``/``routed`` give a graph that keeps live
    (placement) branches its route picker; without them no branch is resolved live."""
    from fuel.runtime.executor import compile_program

    for spec in step.derived:
        store.derive(spec)
    logits_root, tokens_root, *routing_roots = optimized.roots

    def compile_route(route: Mapping[int, int]):
        lowered = lower_order(step.graph, optimized.roots, route)
        return compile_program(step.graph, lowered, table, backend, store, Device(backend))

    program = compile_route(optimized.route)
    routing = (_routing(step, optimized, options, routed, compile_route)
               if options is not None else None)
    return StepProgram(step, optimized, program, logits_root, tokens_root,
                       routing_roots=tuple(routing_roots), routing=routing)


def _routing(step: StepGraph, optimized: OptimizedGraph, options: OptimizeOptions,
             routed: ProgramOptions | None, compile_route) -> _Routing | None:
    """The route picker for a graph that keeps live branches (placement arms), else None."""
    live = optimized.live_branches()
    if not live:
        return None
    from fuel.optimize.variant_bake import arm_location
    from fuel.runtime.route_picker import PickerPricing, RoutePicker, SystemSignals

    graph = step.graph
    devices = [options.device]
    for decision in live:
        devices += [arm_location(graph, e) for e in graph.node(decision.branch).inputs]
    specs = dict(routed.route_specs) if routed is not None else {}
    if options.device_spec is not None:
        specs.setdefault(options.device, options.device_spec)
    pricing = PickerPricing(specs, options.table, options.judge, options.symbols)
    picker = RoutePicker(optimized, graph, [d for d in devices if d is not None], pricing)
    signals = routed.signals if routed is not None and routed.signals is not None \
        else SystemSignals()
    return _Routing(picker, signals, compile_route)


def dispatch_census(program: StepProgram) -> dict[str, int]:
    """Kernel calls per op name in a program's dispatch order (the stored-format tests check no
    arm-0 matmul stays live beside an adopted quantized kernel)."""
    from fuel.graph.ir import Prim

    graph = program.step.graph
    counts: dict[str, int] = {}
    for node_id in program.program.executed:
        op = graph.node(node_id).op
        name = op.kind.value if isinstance(op, Prim) else str(op) if isinstance(op, Fused) else "?"
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["BakeSummary", "ProgramOptions", "StepProgram", "WeightStore", "build_program",
           "compile_step", "dispatch_census", "probe_feeds"]
