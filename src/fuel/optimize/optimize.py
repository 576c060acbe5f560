"""optimize_graph: the pass between lowering a fusion plan and running it.

Decides, in this order (each step sees the previous one's graph):

1. **Stamp** every node the roots need with the pinned device (nodes already stamped keep theirs).
2. **Lower the unrunnable**: a fused node with no kernel on the pinned backend (exact key and the
   capabilities its params require) is replaced by its recipe — arm 0, the decomposed oracle —
   so the executor can run everything; the JIT carrier is asked for a request first, so the
   caller can synthesize a kernel and the next optimize offers it as an arm.
3. **Pathfinders** offer arms (:mod:`fuel.optimize.pathfinders`): the flash-decode arm, runtime
   fused arms, placement forks (each switchable in :class:`OptimizeOptions`).
4. **Bake** same-device variant branches by cost (:mod:`fuel.optimize.variant_bake`), the
   Judge-aware provider when a Judge is given, Layer 1 otherwise.
5. **Residency**: where a live placement arm runs on another device than a value it reads, the
   copy it needs is recorded (value, from, to, bytes) for the route picker to price.

The graph is mutated in place; :class:`OptimizedGraph` carries the roots (a root that was a
lowered fused node is replaced by its region's root), the dispatch order under the default
route, the number of bakes, and every decision with its reason and numbers.

Invariants: pure planning — no files, clock, environment or randomness (the Judge is a frozen
snapshot handed in); deterministic for equal inputs; never raises for an ordinary "no" (a
missing kernel, a declined offer, an unknown cost): those are recorded values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fuel.cost.spec import DeviceSpec
from fuel.graph.branch import ancestors, arm_interiors, effective_roots, lower
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Fused, Graph, NodeId
from fuel.graph.registry import RuntimeFusedRegistry, decompose, fused_name
from fuel.kernels.table import KernelBindingTable, key_dtypes, op_key, required_caps
from fuel.optimize.decisions import BranchKind, Decision, Lowering, Offer, Reason
from fuel.optimize.pathfinders import (
    FlashAdmission, offer_decode_flash_arms, offer_placement_forks, offer_runtime_fused_arms,
)
from fuel.optimize.providers import Pricing, price_arm
from fuel.optimize.variant_bake import ArmDeclined, BakePolicy, arm_location, bake


@dataclass(frozen=True)
class OptimizeOptions:
    """Everything optimize_graph may use. Defaults: the CPU, no pricing spec (no variant arm is
    offered, since none could be priced; existing branches stay as they are), the seed's bake
    policy."""

    device: Device = Device(BackendId.CPU)
    device_spec: DeviceSpec | None = None
    table: KernelBindingTable | None = None
    judge: object | None = None
    """A :class:`~fuel.cost.JudgeOracle` (or anything with ``measured_latency_ns``)."""
    runtime: RuntimeFusedRegistry | None = None
    symbols: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Capacity of each symbolic dim (``k_len`` → the longest context the plan allows)."""
    lower_unrunnable: bool = True
    offer_flash_decode: bool = True
    offer_runtime_fused: bool = True
    placement_devices: tuple[Device, ...] = ()
    """Other devices a heavy node may be forked onto (placement arms); none by default."""
    flash: FlashAdmission = FlashAdmission()
    policy: BakePolicy = BakePolicy()
    price_runtime_fused: bool = False
    """Price runtime fused arms by composing their recipe (the seed leaves them unpriceable)."""
    jit_arch: object | None = None
    """An :class:`~fuel.jit.ArchSku`; with ``jit_budget``, the carrier is asked for requests."""
    jit_budget: object | None = None


@dataclass(frozen=True, slots=True)
class ResidencyCopy:
    """A value a placement arm reads from another device: it must be copied in first."""

    branch: NodeId
    arm: int
    value: NodeId
    source: Device
    target: Device
    bytes: int | None
    """Size of the copy (None when a dim is symbolic without a capacity)."""


@dataclass(frozen=True, slots=True)
class OptimizedGraph:
    roots: tuple[NodeId, ...]
    order: tuple[NodeId, ...]
    """Dispatch order under :attr:`route` (inputs first; branch nodes never appear)."""
    bakes: int
    decisions: tuple[Decision, ...]
    lowerings: tuple[Lowering, ...] = ()
    offers: tuple[Offer, ...] = ()
    residency: tuple[ResidencyCopy, ...] = ()
    route: Mapping[NodeId, int] = field(default_factory=lambda: MappingProxyType({}))
    """Default route: Pareto-retained variant branches at their recorded winner."""

    @property
    def jit_requests(self) -> tuple[object, ...]:
        """The carrier's requests for the fused nodes that had to be lowered."""
        return tuple(low.jit_request for low in self.lowerings if low.jit_request is not None)

    def live_branches(self) -> tuple[Decision, ...]:
        """Branches still live after the bake (placement arms, retained variants)."""
        return tuple(d for d in self.decisions
                     if d.kind is BranchKind.PLACEMENT or d.retained)


def _needed(graph: Graph, roots: Iterable[NodeId]) -> set[NodeId]:
    return ancestors(graph, effective_roots(graph, roots))


def _stamp(graph: Graph, roots: tuple[NodeId, ...], device: Device) -> None:
    for node_id in sorted(_needed(graph, roots)):
        if node_id not in graph.target_backend:
            graph.target_backend[node_id] = device.backend
            graph.placement.setdefault(node_id, device)


def _lower_unrunnable(graph: Graph, roots: tuple[NodeId, ...],
                      options: OptimizeOptions) -> tuple[tuple[NodeId, ...], list[Lowering]]:
    table, backend = options.table, options.device.backend
    lowerings: list[Lowering] = []
    if table is None:
        return roots, lowerings
    carrier = None
    if options.jit_arch is not None and options.jit_budget is not None:
        from fuel.jit import jit_request_for_unplaceable_fused as carrier
    for node_id in lower(graph, roots).order:
        node = graph.node(node_id)
        if not isinstance(node.op, Fused):
            continue
        node_backend = graph.target_backend.get(node_id, backend)
        if table.find(op_key(node.op), key_dtypes(graph, node_id), node_backend,
                      required_caps(node)) is not None:
            continue
        request = (carrier(graph, node_id, node_backend, table, options.jit_arch,
                           options.jit_budget, options.runtime) if carrier is not None else None)
        root = decompose(graph, node_id, options.runtime)
        name = fused_name(node.op.id)
        if root == node_id:
            lowerings.append(Lowering(node_id, name, None, "no kernel and no emittable recipe: "
                                      "the executor will refuse this node", request))
            continue
        for reader, reader_node in enumerate(graph.nodes()):
            if node_id in reader_node.inputs and reader != root:
                graph.rewire(reader, node_id, root)
        roots = tuple(root if r == node_id else r for r in roots)
        lowerings.append(Lowering(node_id, name, root,
                                  f"no {node_backend.value} kernel: lowered to its recipe",
                                  request))
    return roots, lowerings


def _residency(graph: Graph, decisions: Iterable[Decision], symbols: Mapping[str, int]
               ) -> tuple[ResidencyCopy, ...]:
    copies: list[ResidencyCopy] = []
    for decision in decisions:
        if decision.kind is not BranchKind.PLACEMENT:
            continue
        interiors = arm_interiors(graph, decision.branch)
        for arm, interior in enumerate(interiors):
            target = arm_location(graph, graph.node(decision.branch).inputs[arm])
            outside = sorted({i for n in interior for i in graph.node(n).inputs} - interior)
            for value in outside:
                source = arm_location(graph, value)
                if source is None or target is None or source == target:
                    continue
                copies.append(ResidencyCopy(decision.branch, arm, value, source, target,
                                            _bytes(graph, value, symbols)))
    return tuple(copies)


def _bytes(graph: Graph, node_id: NodeId, symbols: Mapping[str, int]) -> int | None:
    node = graph.node(node_id)
    count = 1
    for dim in node.shape.dims:
        if isinstance(dim, str):
            if dim not in symbols:
                return None
            dim = symbols[dim]
        count *= int(dim)
    return node.dtype.storage_bytes(count)


def optimize_graph(graph: Graph, roots: Iterable[NodeId],
                   options: OptimizeOptions = OptimizeOptions()) -> OptimizedGraph:
    """Stamp, lower the unrunnable, offer arms, bake variants, record residency (module docs)."""
    roots = tuple(roots)
    device = options.device
    _stamp(graph, roots, device)
    lowerings: list[Lowering] = []
    if options.lower_unrunnable:
        roots, lowerings = _lower_unrunnable(graph, roots, options)
    offers: list[Offer] = []
    # Variant arms are offered only when they can be priced: an unpriceable offer could never
    # win the bake, and would only leave a live branch behind.
    priced = options.device_spec is not None
    if options.offer_flash_decode and priced:
        offers += offer_decode_flash_arms(graph, roots, options.table, device.backend, options.flash)
    if options.offer_runtime_fused and priced:
        offers += offer_runtime_fused_arms(graph, roots, options.runtime, options.table,
                                           device.backend)
    if options.placement_devices:
        offers += offer_placement_forks(graph, roots, options.table, device,
                                        options.placement_devices)
    _stamp(graph, roots, device)
    if options.device_spec is not None:
        pricing = Pricing(options.device_spec, options.table, options.symbols, options.runtime,
                          options.price_runtime_fused, device.backend)
        judge = options.judge

        def pricer(g: Graph, branch: NodeId, arm: int):
            return price_arm(g, branch, arm, pricing, judge)
    else:
        def pricer(g: Graph, branch: NodeId, arm: int):
            return ArmDeclined(Reason.UNKNOWN_COST, "no device spec to price on")
    outcome = bake(graph, roots, pricer, options.policy)
    route = MappingProxyType({d.branch: d.winner for d in outcome.decisions
                              if d.retained and d.winner})
    lowered = lower(graph, roots, route)
    return OptimizedGraph(
        roots=roots, order=lowered.order, bakes=outcome.baked, decisions=outcome.decisions,
        lowerings=tuple(lowerings), offers=tuple(offers),
        residency=_residency(graph, outcome.decisions, options.symbols), route=route,
    )
