"""optimize_graph: the pass between lowering a fusion plan and running it.

Decides, in this order (each step sees the previous one's graph):

1. **Stamp** every node the roots need with the pinned device (nodes already stamped keep theirs).
2. **Lower the unrunnable**: a fused node with no kernel on the pinned backend (exact key and the
   capabilities its params require) is replaced by its recipe — arm 0, the decomposed oracle —
   so the executor can run everything; the JIT carrier is asked for a request first, so the
   caller can synthesize a kernel and the next optimize offers it as an arm. When the runtime
   registry already holds a region structurally equal to that recipe (an adopted kernel) with a
   kernel bound on the backend, and the options' :class:`ShapeGate` (when given) admits it at
   this node's operand shapes, the branch is built right there: arm 0 the recipe, arm 1 the
   runtime fused node over the same inputs. The merge is the node's single reader; a value
   with several readers (residual_add_rms_norm's two selects) or a root gets an identity merge
   (a same-shape reshape) that every reader reads, spliced out again once the bake collapses
   the branch, so the baked graph carries no extra node.
   A node whose only table kernels are *variant arms* (``KernelEntry.variant_arm``: torch's
   int4pack kernel for a Q4_0/Q4_1/Q4_K ``quant_linear``) is lowered and asked about the same
   way — "no kernel" means no kernel of its own — and its variant is offered in the same branch
   (arm 0 the recipe, then the table's variant, then the adopted kernel), priced only by the
   Judge's measurement (``optimize.providers``), so the bake keeps whichever the Judge measured
   fastest and records every arm's cost.
3. **Pathfinders** offer arms (:mod:`fuel.optimize.pathfinders`): the flash-decode arm, runtime
   fused arms, placement forks (each switchable in :class:`OptimizeOptions`).
4. **Bake** same-device variant branches by cost (:mod:`fuel.optimize.variant_bake`), the
   Judge-aware provider when a Judge is given, Layer 1 otherwise.
5. **Residency**: where a live placement arm runs on another device than a value it reads, the
   copy it needs is recorded (value, from, to, bytes) for the route picker to price.

Steps 1–3 are :func:`offer_arms`, steps 4–5 :func:`bake_offered`; :func:`optimize_graph` is
both. The split lets a caller at the edge measure the offered arms for the Judge (they exist
only after step 3) before the bake reads its snapshot.

The graph is mutated in place; :class:`OptimizedGraph` carries the roots (a root that was a
lowered fused node is replaced by its region's root), the dispatch order under the default
route, the number of bakes, and every decision with its reason and numbers.

Invariants: pure planning — no files, clock, environment or randomness (the Judge is a frozen
snapshot handed in); deterministic for equal inputs; never raises for an ordinary "no" (a
missing kernel, a declined offer, an unknown cost): those are recorded values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from fuel.cost.spec import DeviceSpec
from fuel.graph.branch import (
    BranchError, ancestors, arm_interiors, branches_in_topo_order, effective_roots, lower,
    open_branch,
)
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Branch, Fused, Graph, GraphError, Input, Node, NodeId, Prim, Weight
from fuel.graph.ops import OpKind
from fuel.graph.recipe import structural_hash
from fuel.graph.registry import (
    RuntimeFusedParams, RuntimeFusedRegistry, decompose, fused_name, recipe_for,
)
from fuel.kernels.table import KernelBindingTable, key_dtypes, op_key, required_caps
from fuel.optimize.decisions import BranchKind, Decision, Lowering, Offer, Reason
from fuel.optimize.pathfinders import (
    FlashAdmission, ShapeGate, offer_decode_flash_arms, offer_placement_forks,
    offer_runtime_fused_arms, operand_shapes,
)
from fuel.optimize.providers import Pricing, price_arm, runtime_judge_name
from fuel.optimize.variant_bake import (
    ArmDeclined, ArmPrice, BakePolicy, arm_location, bake,
)


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
    runtime_gate: ShapeGate | None = None
    """Per-shape admission of the runtime registry's kernels (a JIT session's adoption
    outcomes); None: every registered kernel is offered wherever it matches."""
    symbols: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Capacity of each symbolic dim (``k_len`` → the longest context the plan allows)."""
    lower_unrunnable: bool = True
    offer_flash_decode: bool = True
    offer_runtime_fused: bool = True
    offer_table_variants: bool = True
    """Offer a lowered node's variant-arm table kernels as arms (priced only by the Judge)."""
    placement_devices: tuple[Device, ...] = ()
    """Other devices a heavy node may be forked onto (placement arms); none by default."""
    flash: FlashAdmission = FlashAdmission()
    policy: BakePolicy = BakePolicy()
    price_runtime_fused: bool = False
    """Price runtime fused arms by composing their recipe (the seed leaves them unpriceable)."""
    jit_arch: object | None = None
    """An :class:`~fuel.jit.ArchSku`; with ``jit_budget``, the carrier is asked for requests."""
    jit_budget: object | None = None
    steppable: Callable[[Graph, NodeId], bool] | None = None
    """Whether a node can run inside the backend's one-call step list (the CPU runtime's
    ``native_steps.steppable``); with it, an arm that would cost the whole program its step
    list is charged the host calls the program would make instead (:func:`dispatch_charges`).
    None: arms are priced alone."""


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


ADOPTED = "adopted-kernel"
"""The pathfinder name of the branches built at lowering for adopted runtime kernels."""

TABLE_VARIANT = "table-variant"
"""The pathfinder name of a branch built at lowering that offers a table's variant-arm kernel
(and no adopted kernel)."""


@dataclass(frozen=True, slots=True)
class Offered:
    """What :func:`offer_arms` left for the bake: the roots (lowered fused roots replaced), the
    lowerings and offers it recorded, and the identity merges it built for adopted arms."""

    roots: tuple[NodeId, ...]
    lowerings: tuple[Lowering, ...] = ()
    offers: tuple[Offer, ...] = ()
    merges: frozenset[NodeId] = frozenset()

    def branches(self) -> tuple[NodeId, ...]:
        """The branches the offers built, in offer order."""
        return tuple(o.branch for o in self.offers if o.branch is not None)


def _adopted_kernel(graph: Graph, node_id: NodeId, backend: BackendId,
                    options: OptimizeOptions) -> tuple[int, str] | str | None:
    """The runtime id (and its Judge name) of an adopted kernel computing exactly this node's
    recipe on ``backend``; a reason when one is registered but cannot serve; None when none."""
    runtime, table = options.runtime, options.table
    if runtime is None or not len(runtime) or table is None:
        return None
    region = recipe_for(graph, node_id)
    if region is None:
        return None
    digest = structural_hash(region)
    runtime_id = runtime.find_by_hash(digest)
    if runtime_id is None:
        return None
    if table.find(runtime_id, key_dtypes(graph, node_id), backend) is None:
        return (f"{runtime_judge_name(digest)} is registered but has no {backend.value} kernel "
                f"for [{', '.join(d.value for d in key_dtypes(graph, node_id))}]")
    if options.runtime_gate is not None:
        node = graph.node(node_id)
        refused = options.runtime_gate.refusal(runtime_judge_name(digest),
                                               operand_shapes(graph, node.inputs, node_id))
        if refused is not None:
            return refused
    return runtime_id, runtime_judge_name(digest)


@dataclass(frozen=True, slots=True)
class _Arm:
    """A kernel offered beside a lowered node's recipe: the op its arm node carries (over the
    node's own inputs), what the offer calls it, and which pathfinder it belongs to."""

    op: Fused
    name: str
    pathfinder: str


def _newest_ancestors(graph: Graph) -> Callable[[Iterable[NodeId]], NodeId]:
    """``newest(starts)``: the largest node id among the ancestors-or-self of ``starts``
    (``max(ancestors(graph, starts))``), memoized over one :func:`_lower_unrunnable` pass.

    A walk from every offered node covered the whole model above it again (1,500 walks of a
    SmolLM2 prefill build: ~0.4 s). The memo stays true through the pass: it visits the fused
    nodes in a topological order of the graph it started from, and the only inputs a pass
    changes are those of the readers of the node being lowered (rewired to its recipe or a
    merge), which lie downstream of it. A reader is in the memo only if a node downstream of
    it was offered already, which the order rules out; every node a pass adds (recipes, arms,
    merges) keeps the inputs it was created with until the pass reaches a node it reads."""
    memo: dict[NodeId, NodeId] = {}

    def newest(starts: Iterable[NodeId]) -> NodeId:
        best = -1
        for start in starts:
            stack = [(start, False)]
            while stack:
                node_id, expanded = stack.pop()
                if node_id in memo:
                    continue
                inputs = graph.node(node_id).inputs
                if expanded:
                    memo[node_id] = max([node_id, *(memo[i] for i in inputs)])
                else:
                    stack.append((node_id, True))
                    stack.extend((i, False) for i in inputs if i not in memo)
            best = max(best, memo[start])
        return best

    return newest


def _branch_kernels(graph: Graph, node_id: NodeId, root: NodeId, roots: tuple[NodeId, ...],
                    arms: list[_Arm], newest: Callable[[Iterable[NodeId]], NodeId]
                    ) -> tuple[Offer, NodeId | None]:
    """Rewire the fused node's readers to its recipe through a merge and branch there (arm 0
    the recipe, then one arm per kernel in ``arms``). Returns the offer and the identity merge
    built (None when the single reader serves as the merge). The graph computes what it did
    either way."""
    node = graph.node(node_id)
    pathfinder = ADOPTED if any(a.pathfinder == ADOPTED for a in arms) else arms[0].pathfinder
    names = ", ".join(a.name for a in arms)
    readers = [r for r in graph.consumers()[node_id]
               if r != root and not isinstance(graph.node(r).op, Branch)]
    merge: NodeId
    identity: NodeId | None = None
    # A fused reader may itself be lowered to its recipe later, and that recipe would read the
    # arm-0 root directly, keeping the losing arm alive: such a reader gets an identity merge.
    if len(readers) == 1 and node_id not in roots and not isinstance(graph.node(readers[0]).op, Fused):
        merge = readers[0]
        graph.rewire(merge, node_id, root)
    elif all(isinstance(d, int) for d in node.shape.dims):
        identity = merge = graph.push(Node(Prim.of(OpKind.RESHAPE, shape=node.shape.dims),
                                           (root,), node.shape, node.dtype))
        for reader in readers:
            graph.rewire(reader, node_id, merge)
    else:
        for reader in readers:
            graph.rewire(reader, node_id, root)
        return Offer(pathfinder, node_id, None, f"{names}: {len(readers)} readers and a "
                     "symbolic shape: no identity merge to branch at"), None
    exits = [graph.push(Node(arm.op, node.inputs, node.shape, node.dtype)) for arm in arms]
    # Diverge after everything the inputs depend on, not after the newest input: an earlier
    # lowering appended its recipe at the end of the arena, so an older input may read newer
    # nodes, and those must stay shared context rather than part of both arms.
    builder = open_branch(graph, newest(node.inputs))
    builder.add_arm(root)
    for exit in exits:
        builder.add_arm(exit)
    try:
        branch = builder.finalize(merge)
    except BranchError as error:
        return Offer(pathfinder, node_id, None, f"{names}: {error}"), identity
    where = "its reader" if identity is None else f"an identity merge for {len(readers)} readers"
    offered = ", ".join(f"{arm.name} as arm {index}" for index, arm in enumerate(arms, start=1))
    return Offer(pathfinder, node_id, branch, f"{offered}, merged at {where}"), identity


def _lower_unrunnable(graph: Graph, roots: tuple[NodeId, ...], options: OptimizeOptions
                      ) -> tuple[tuple[NodeId, ...], list[Lowering], list[Offer], set[NodeId]]:
    table, backend = options.table, options.device.backend
    lowerings: list[Lowering] = []
    offers: list[Offer] = []
    merges: set[NodeId] = set()
    if table is None:
        return roots, lowerings, offers, merges
    carrier = None
    if options.jit_arch is not None and options.jit_budget is not None:
        from fuel.jit import jit_request_for_unplaceable_fused as carrier
    # Adopted and variant arms are offered only when they can be priced (as the pathfinders'
    # arms are).
    priced = options.device_spec is not None
    adopt_arms = options.offer_runtime_fused and priced
    variant_arms = options.offer_table_variants and priced
    newest = _newest_ancestors(graph)
    for node_id in lower(graph, roots).order:
        node = graph.node(node_id)
        if not isinstance(node.op, Fused):
            continue
        node_backend = graph.target_backend.get(node_id, backend)
        key, dtypes, caps = op_key(node.op), key_dtypes(graph, node_id), required_caps(node)
        if table.find_default(key, dtypes, node_backend, caps) is not None:
            continue
        # Whatever the table still finds is a variant arm (find_default found no other).
        variant = table.find(key, dtypes, node_backend, caps)
        request = (carrier(graph, node_id, node_backend, table, options.jit_arch,
                           options.jit_budget, options.runtime) if carrier is not None else None)
        adopted = _adopted_kernel(graph, node_id, node_backend, options) if adopt_arms else None
        root = decompose(graph, node_id, options.runtime)
        name = fused_name(node.op.id)
        if root == node_id:
            lowerings.append(Lowering(node_id, name, None, "no kernel and no emittable recipe: "
                                      "the executor will refuse this node", request))
            continue
        reason = f"no {node_backend.value} kernel: lowered to its recipe"
        if variant is not None:
            reason = (f"no {node_backend.value} kernel of its own (the {variant.kernel_source} "
                      f"kernel is a variant arm): lowered to its recipe")
        lowerings.append(Lowering(node_id, name, root, reason, request))
        arms: list[_Arm] = []
        if variant is not None and variant_arms:
            arms.append(_Arm(node.op, f"{name} ({variant.kernel_source}, table kernel)",
                             TABLE_VARIANT))
        if isinstance(adopted, tuple):
            runtime_id, judge_name = adopted
            arms.append(_Arm(Fused(runtime_id, RuntimeFusedParams()),
                             f"{judge_name} (adopted kernel)", ADOPTED))
        elif isinstance(adopted, str):
            offers.append(Offer(ADOPTED, node_id, None, adopted))
        if arms:
            offer, identity = _branch_kernels(graph, node_id, root, roots, arms, newest)
            offers.append(offer)
            if identity is not None:
                merges.add(identity)
                roots = tuple(identity if r == node_id else r for r in roots)
            else:
                roots = tuple(root if r == node_id else r for r in roots)
            continue
        for reader, reader_node in enumerate(graph.nodes()):
            if node_id in reader_node.inputs and reader != root:
                graph.rewire(reader, node_id, root)
        roots = tuple(root if r == node_id else r for r in roots)
    return roots, lowerings, offers, merges


def _splice_merges(graph: Graph, roots: tuple[NodeId, ...], merges: frozenset[NodeId]
                   ) -> tuple[NodeId, ...]:
    """Read each collapsed identity merge's input directly (the merge then has no reader)."""
    live = {graph.node(n).op.reconverge_at for n in graph
            if isinstance(graph.node(n).op, Branch) and len(graph.node(n).inputs) > 1}
    spliced = sorted(merges - live)
    if not spliced:
        return roots
    readers = graph.consumers()
    for merge in spliced:
        source = graph.node(merge).inputs[0]
        for reader in list(readers[merge]):
            if not isinstance(graph.node(reader).op, Branch):
                graph.rewire(reader, merge, source)
    return tuple(graph.node(r).inputs[0] if r in spliced else r for r in roots)


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
                                            graph.value_bytes(value, symbols)))
    return tuple(copies)



def offer_arms(graph: Graph, roots: Iterable[NodeId],
               options: OptimizeOptions = OptimizeOptions()) -> Offered:
    """Stamp, lower the unrunnable (branching adopted kernels), run the pathfinders."""
    roots = tuple(roots)
    device = options.device
    _stamp(graph, roots, device)
    lowerings: list[Lowering] = []
    offers: list[Offer] = []
    merges: set[NodeId] = set()
    if options.lower_unrunnable:
        roots, lowerings, offers, merges = _lower_unrunnable(graph, roots, options)
    # Variant arms are offered only when they can be priced: an unpriceable offer could never
    # win the bake, and would only leave a live branch behind.
    priced = options.device_spec is not None
    if options.offer_flash_decode and priced:
        offers += offer_decode_flash_arms(graph, roots, options.table, device.backend, options.flash)
    if options.offer_runtime_fused and priced:
        offers += offer_runtime_fused_arms(graph, roots, options.runtime, options.table,
                                           device.backend, options.runtime_gate)
    if options.placement_devices:
        offers += offer_placement_forks(graph, roots, options.table, device,
                                        options.placement_devices)
    _stamp(graph, roots, device)
    return Offered(roots, tuple(lowerings), tuple(offers), frozenset(merges))


def dispatch_charges(graph: Graph, roots: Iterable[NodeId], options: OptimizeOptions
                     ) -> dict[tuple[NodeId, int], int]:
    """What each arm that would cost the program its one-call step list is charged: the host
    calls the program makes when it runs node by node instead, at the spec's ``host_call_ns``.

    Arms are priced one branch at a time, but the step list is the whole program's: one node
    without a native step (a recipe's ``pow``, torch's int4pack kernel) and every node of the
    step goes back to one Python call each (~1.6 us apiece here, ~800 nodes a SmolLM2 decode
    step: more than any one site's arms differ by). So where the program could run as a step
    list (every node outside the variant branches can, and every branch has an arm that can),
    an arm with a node that cannot is charged ``host_call_ns`` for every node the program would
    dispatch (those outside the branches and its own interior): it wins only by saving more on
    its own than that. Nothing is charged when the program could not be a step list anyway,
    without ``options.steppable``, a spec or a host-call price, or when a branch is a placement
    branch (the route picker's program is compiled per route). Deterministic: the predicate
    reads only the graph and the table.
    """
    spec = options.device_spec
    if options.steppable is None or spec is None or spec.host_call_ns <= 0:
        return {}
    roots = tuple(roots)
    try:
        branches = branches_in_topo_order(graph, roots)
    except (BranchError, GraphError, IndexError):
        return {}
    interiors: dict[NodeId, tuple[frozenset[NodeId], ...]] = {}
    for branch in branches:
        exits = graph.node(branch).inputs
        locations = {arm_location(graph, exit) for exit in exits}
        if len(locations) > 1 or None in locations:
            return {}
        interiors[branch] = arm_interiors(graph, branch)
    inside = set().union(*(set().union(*arms) for arms in interiors.values())) if interiors else set()
    outside = [n for n in sorted(_needed(graph, roots) - inside)
               if not isinstance(graph.node(n).op, Input | Weight | Branch)]
    steppable = options.steppable
    if not all(steppable(graph, n) for n in outside):
        return {}
    charges: dict[tuple[NodeId, int], int] = {}
    for branch, arms in interiors.items():
        fits = [all(steppable(graph, n) for n in sorted(arm)) for arm in arms]
        if len(arms) < 2 and not fits[0] or not any(fits):
            return {}  # the program runs node by node whatever this branch keeps
        for arm, (interior, fit) in enumerate(zip(arms, fits)):
            if not fit:
                charges[(branch, arm)] = spec.host_call_ns * (len(outside) + len(interior))
    return charges


def bake_offered(graph: Graph, offered: Offered,
                 options: OptimizeOptions = OptimizeOptions()) -> OptimizedGraph:
    """Bake the offered graph's variant branches by cost and record residency (module docs)."""
    device = options.device
    if options.device_spec is not None:
        pricing = Pricing(options.device_spec, options.table, options.symbols, options.runtime,
                          options.price_runtime_fused, device.backend)
        judge = options.judge

        charges = dispatch_charges(graph, offered.roots, options)

        def pricer(g: Graph, branch: NodeId, arm: int):
            price = price_arm(g, branch, arm, pricing, judge)
            charge = charges.get((branch, arm), 0)
            if charge and isinstance(price, ArmPrice):
                return replace(price, ns=price.ns + charge, dispatch_ns=charge)
            return price
    else:
        def pricer(g: Graph, branch: NodeId, arm: int):
            return ArmDeclined(Reason.UNKNOWN_COST, "no device spec to price on")
    outcome = bake(graph, offered.roots, pricer, options.policy)
    roots = _splice_merges(graph, offered.roots, offered.merges)
    route = MappingProxyType({d.branch: d.winner for d in outcome.decisions
                              if d.retained and d.winner})
    lowered = lower(graph, roots, route)
    return OptimizedGraph(
        roots=roots, order=lowered.order, bakes=outcome.baked, decisions=outcome.decisions,
        lowerings=offered.lowerings, offers=offered.offers,
        residency=_residency(graph, outcome.decisions, options.symbols), route=route,
    )


def optimize_graph(graph: Graph, roots: Iterable[NodeId],
                   options: OptimizeOptions = OptimizeOptions()) -> OptimizedGraph:
    """Stamp, lower the unrunnable, offer arms, bake variants, record residency (module docs)."""
    return bake_offered(graph, offer_arms(graph, roots, options), options)
