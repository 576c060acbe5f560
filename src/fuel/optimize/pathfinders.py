"""Pathfinders: they find places where another route could compute the same value and offer it
as a branch arm (arm 0 always the decomposed oracle). They decide nothing about which arm runs.

- :func:`offer_decode_flash_arms` — decode attention gets a flash arm. Admissible only when q is
  rank 4 with one query row, the head dim and dtype are ones the flash kernel admits
  (:class:`FlashAdmission`), there is no window/ALiBi (the IR has neither; such attention does not
  match the recipe) and no softcap, and a ``flash_attn`` kernel is bound on the device. Two
  shapes are recognised: a ``flash_attn`` fused node (its recipe becomes arm 0, the node arm 1)
  and a decomposed attention region matching the flash recipe (a fused node is pushed as arm 1).
- :func:`offer_runtime_fused_arms` — a registered runtime fused region (the JIT's adopted
  kernels) matching a subgraph whose interior nodes are read only inside the region gets the
  runtime fused node as arm 1, when its kernel is bound on the device and, under a
  :class:`ShapeGate`, was verified and cost-gated at exactly these operand shapes.
- :func:`offer_placement_forks` — a heavy node (fused or matmul) with a single reader, which
  another backend can run, gets a copy of itself stamped on that backend as arm 1.

Invariants:
- An offer never changes what the graph computes: arm 0 is what was there (or its recipe), and
  the merge keeps reading arm 0 until a bake or a route says otherwise.
- A value that is a root or has several readers has no merge to branch at: declined.
- Nodes already inside a branch arm are never offered again (no nested re-offer).
- A decline is an :class:`~fuel.optimize.decisions.Offer` with ``branch=None`` and the reason;
  a declined offer leaves the graph untouched.
- Deterministic: candidates are visited in the graph's topological order, registered regions
  in id order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from fuel.graph.branch import (
    BranchError, arm_interiors, branch_fused_over_recipe, lower, open_branch,
)
from fuel.graph.dtype import BackendId, Device, DType
from fuel.graph.ir import Branch, Fused, Graph, Node, NodeId, Prim
from fuel.graph.ops import OpKind
from fuel.graph.recipe import NoMatch, PatternOp, match_region
from fuel.graph.registry import (
    SPECS, FlashAttn, FusedOps, RuntimeFusedParams, RuntimeFusedRegistry,
)
from fuel.kernels.table import KernelBindingTable, op_key, required_caps
from fuel.optimize.decisions import Offer
from fuel.optimize.providers import runtime_judge_name

FLASH = "flash-decode"
RUNTIME = "runtime-fused"
PLACEMENT = "placement-fork"


@dataclass(frozen=True, slots=True)
class FlashAdmission:
    """What the flash-decode arm admits. The defaults are FlashAttention-2's published limits
    (head dim up to 256, a multiple of 8) and the float dtypes the bound kernels compute in."""

    max_head_dim: int = 256
    head_dim_multiple: int = 8
    dtypes: tuple[DType, ...] = (DType.BF16, DType.F16, DType.F32)


Shapes = tuple[tuple[int | str, ...], ...]
"""Operand shapes of a fused node: its inputs in bind order, then its output."""


def operand_shapes(graph: Graph, inputs: Sequence[NodeId], output: NodeId) -> Shapes:
    return tuple(tuple(graph.node(n).shape.dims) for n in (*inputs, output))


@dataclass(frozen=True, slots=True)
class ShapeGate:
    """Where adopted (runtime fused) kernels may be offered: per region (its stable
    ``jit:<hash>`` Judge name) and operand shapes, ``None`` when the kernel was verified and
    measured faster there, else the reason it was refused. A kernel is offered only at a shape
    it was admitted at: one refused there (wrong numbers, slower) or never tried there is not,
    and the offer records why. Without a gate (``None`` in the options) every registered kernel
    is offered wherever it matches: the caller vouches for it at every shape."""

    verdicts: Mapping[tuple[str, Shapes], str | None] = field(
        default_factory=lambda: MappingProxyType({}))

    def refusal(self, name: str, shapes: Shapes) -> str | None:
        """Why ``name``'s kernel may not be offered at ``shapes`` (None: it may)."""
        where = "; ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
        if (name, shapes) not in self.verdicts:
            return f"{name}: never verified at {where}: not offered at an unverified shape"
        verdict = self.verdicts[(name, shapes)]
        return None if verdict is None else f"{name}: refused at {where}: {verdict}"


def claimed_nodes(graph: Graph) -> set[NodeId]:
    """Every node inside an arm of a live (multi-arm) branch."""
    claimed: set[NodeId] = set()
    for node_id in range(len(graph)):
        node = graph.node(node_id)
        if isinstance(node.op, Branch) and len(node.inputs) > 1:
            for interior in arm_interiors(graph, node_id):
                claimed |= interior
    return claimed


def _order(graph: Graph, roots: Sequence[NodeId]) -> tuple[NodeId, ...]:
    return lower(graph, roots).order


def _single_reader(graph: Graph, node_id: NodeId, roots: Sequence[NodeId],
                   readers: list[list[NodeId]]) -> NodeId | str:
    if node_id in roots:
        return "the value is a root: no merge to branch at"
    live = [r for r in readers[node_id] if not isinstance(graph.node(r).op, Branch)]
    if len(live) != 1:
        return f"the value has {len(live)} readers: no single merge"
    return live[0]


def _region(graph: Graph, root: NodeId, binds: Sequence[NodeId]) -> set[NodeId]:
    """Nodes between the binds and the root (the root included, the binds excluded)."""
    stop, seen, stack = set(binds), set(), [root]
    while stack:
        node_id = stack.pop()
        if node_id in seen or node_id in stop:
            continue
        seen.add(node_id)
        stack.extend(graph.node(node_id).inputs)
    return seen


def _region_is_private(graph: Graph, region: set[NodeId], root: NodeId, binds: Sequence[NodeId],
                       readers: list[list[NodeId]]) -> str | None:
    """Why the region cannot become an arm (None when it can)."""
    if not binds:
        return "the region reads no outside value"
    newest = max(binds)
    if any(n <= newest for n in region):
        return "part of the region was computed before its inputs were (not a clean arm)"
    for node_id in sorted(region - {root}):
        outside = [r for r in readers[node_id] if r not in region]
        if outside:
            return f"interior node {node_id} is also read by {outside[0]} outside the region"
    return None


def _branch_at(graph: Graph, arm0: NodeId, arm1: NodeId, diverge: NodeId,
               merge: NodeId) -> NodeId | str:
    builder = open_branch(graph, diverge)
    builder.add_arm(arm0)
    builder.add_arm(arm1)
    try:
        branch = builder.finalize(merge)
    except BranchError as error:
        return str(error)
    return branch if branch is not None else "a single arm"


def _flash_admissible(graph: Graph, q: NodeId, params: FlashAttn, admission: FlashAdmission,
                      probe: Node, table: KernelBindingTable | None, backend: BackendId,
                      dtypes: tuple[DType, ...]) -> str | None:
    shape = graph.node(q).shape
    if shape.rank != 4:
        return f"q has rank {shape.rank}, not 4"
    if shape.dims[2] != 1:
        return f"q has {shape.dims[2]} query rows, not 1 (not decode)"
    head_dim = shape.dims[3]
    if not isinstance(head_dim, int) or head_dim > admission.max_head_dim \
            or head_dim % admission.head_dim_multiple:
        return (f"head dim {head_dim} not admitted (<= {admission.max_head_dim}, a multiple of "
                f"{admission.head_dim_multiple})")
    if graph.node(q).dtype not in admission.dtypes:
        return f"dtype {graph.node(q).dtype.value} not admitted"
    if params.softcap is not None:
        return "soft-capped attention has no flash-decode arm"
    if table is None:
        return "no kernel table: cannot tell whether a flash kernel is bound"
    if table.find(FusedOps.FLASH_ATTN, dtypes, backend, required_caps(probe)) is None:
        return f"no flash_attn kernel bound on {backend.value} for these dtypes and capabilities"
    return None


def _flash_patterns() -> tuple[tuple[bool, PatternOp], ...]:
    spec = SPECS[FusedOps.FLASH_ATTN]
    # The slots stay open (softmax_scale is read off the graph by the match).
    return tuple((causal, spec.template(FlashAttn(softmax_scale=1.0, causal=causal)))
                 for causal in (True, False))


def offer_decode_flash_arms(graph: Graph, roots: Sequence[NodeId], table: KernelBindingTable | None,
                            backend: BackendId,
                            admission: FlashAdmission = FlashAdmission()) -> list[Offer]:
    """Offer a flash arm at every decode attention (see the module docstring)."""
    offers: list[Offer] = []
    claimed = claimed_nodes(graph)
    readers = graph.consumers()
    patterns = _flash_patterns()
    for node_id in _order(graph, roots):
        if node_id in claimed:
            continue
        node = graph.node(node_id)
        if isinstance(node.op, Fused) and node.op.id == FusedOps.FLASH_ATTN:
            dtypes = tuple(graph.node(i).dtype for i in node.inputs) + (node.dtype,)
            why = _flash_admissible(graph, node.inputs[0], node.op.params, admission, node, table,
                                    backend, dtypes)
            merge = _single_reader(graph, node_id, roots, readers) if why is None else why
            if isinstance(merge, str):
                offers.append(Offer(FLASH, node_id, None, merge))
                continue
            branch = branch_fused_over_recipe(graph, node_id, merge)
            offers.append(Offer(FLASH, node_id, branch, "flash_attn node: recipe as arm 0"
                                if branch is not None else "flash_attn recipe not emittable"))
            if branch is not None:
                claimed |= set().union(*arm_interiors(graph, branch))
                readers = graph.consumers()
            continue
        if not (isinstance(node.op, Prim) and node.op.kind is OpKind.MATMUL):
            continue
        for causal, pattern in patterns:
            found = match_region(pattern, graph, node_id)
            if isinstance(found, NoMatch):
                continue
            offer = _offer_flash_region(graph, roots, table, backend, admission, readers,
                                        node_id, found.binds, found.slot_dict(), causal)
            offers.append(offer)
            if offer.branch is not None:
                claimed |= set().union(*arm_interiors(graph, offer.branch))
                readers = graph.consumers()
            break
    return offers


def _offer_flash_region(graph, roots, table, backend, admission, readers, root, binds, slots,
                        causal) -> Offer:
    if "softmax_scale" not in slots or len(slots) != 1:
        return Offer(FLASH, root, None, f"attention region with slots {sorted(slots)}: not plain")
    params = FlashAttn(softmax_scale=slots["softmax_scale"], causal=causal)
    root_node = graph.node(root)
    probe = Node(Fused(FusedOps.FLASH_ATTN, params), tuple(binds), root_node.shape, root_node.dtype)
    dtypes = tuple(graph.node(b).dtype for b in binds) + (root_node.dtype,)
    why = _flash_admissible(graph, binds[0], params, admission, probe, table, backend, dtypes)
    if why is not None:
        return Offer(FLASH, root, None, why)
    merge = _single_reader(graph, root, roots, readers)
    if isinstance(merge, str):
        return Offer(FLASH, root, None, merge)
    why = _region_is_private(graph, _region(graph, root, binds), root, binds, readers)
    if why is not None:
        return Offer(FLASH, root, None, why)
    fused = graph.push(probe)
    branch = _branch_at(graph, root, fused, max(binds), merge)
    if isinstance(branch, str):
        return Offer(FLASH, root, None, branch)
    return Offer(FLASH, root, branch, f"decomposed attention region: flash_attn(causal={causal}) "
                                      f"as arm 1")


def offer_runtime_fused_arms(graph: Graph, roots: Sequence[NodeId],
                             runtime: RuntimeFusedRegistry | None,
                             table: KernelBindingTable | None, backend: BackendId,
                             gate: ShapeGate | None = None) -> list[Offer]:
    """Offer each registered runtime region as an arm where it matches (see the module docs)."""
    offers: list[Offer] = []
    if runtime is None or not len(runtime) or table is None:
        return offers
    claimed = claimed_nodes(graph)
    readers = graph.consumers()
    for registered in runtime:
        if not isinstance(registered.region, PatternOp):
            continue
        for node_id in _order(graph, roots):
            node = graph.node(node_id)
            if node_id in claimed or not isinstance(node.op, Prim) \
                    or node.op.kind is not registered.region.tag:
                continue
            found = match_region(registered.region, graph, node_id)
            if isinstance(found, NoMatch):
                continue
            binds = found.binds
            dtypes = tuple(graph.node(b).dtype for b in binds) + (node.dtype,)
            if table.find(registered.id, dtypes, backend) is None:
                offers.append(Offer(RUNTIME, node_id, None,
                                    f"{registered.name}: no kernel bound on {backend.value}"))
                continue
            refused = gate.refusal(runtime_judge_name(registered.hash),
                                   operand_shapes(graph, binds, node_id)) if gate else None
            if refused is not None:
                offers.append(Offer(RUNTIME, node_id, None, refused))
                continue
            merge = _single_reader(graph, node_id, roots, readers)
            why = merge if isinstance(merge, str) else _region_is_private(
                graph, _region(graph, node_id, binds), node_id, binds, readers)
            if why is not None:
                offers.append(Offer(RUNTIME, node_id, None, f"{registered.name}: {why}"))
                continue
            fused = graph.push(Node(Fused(registered.id, RuntimeFusedParams(found.slots)), binds,
                                    node.shape, node.dtype))
            branch = _branch_at(graph, node_id, fused, max(binds), merge)
            if isinstance(branch, str):
                offers.append(Offer(RUNTIME, node_id, None, f"{registered.name}: {branch}"))
                continue
            offers.append(Offer(RUNTIME, node_id, branch, f"{registered.name} as arm 1"))
            claimed |= set().union(*arm_interiors(graph, branch))
            readers = graph.consumers()
    return offers


def _heavy(node: Node) -> bool:
    return isinstance(node.op, Fused) or (isinstance(node.op, Prim) and node.op.kind is OpKind.MATMUL)


def offer_placement_forks(graph: Graph, roots: Sequence[NodeId], table: KernelBindingTable | None,
                          home: Device, others: Sequence[Device]) -> list[Offer]:
    """Fork heavy single-reader nodes onto each other device whose backend can run them."""
    offers: list[Offer] = []
    if table is None or not others:
        return offers
    claimed = claimed_nodes(graph)
    readers = graph.consumers()
    for node_id in _order(graph, roots):
        node = graph.node(node_id)
        if node_id in claimed or not _heavy(node) or not node.inputs:
            continue
        key = op_key(node.op)
        dtypes = tuple(graph.node(i).dtype for i in node.inputs) + (node.dtype,)
        targets = [d for d in others if d != home
                   and table.find(key, dtypes, d.backend, required_caps(node)) is not None]
        if not targets:
            continue
        merge = _single_reader(graph, node_id, roots, readers)
        if isinstance(merge, str):
            offers.append(Offer(PLACEMENT, node_id, None, merge))
            continue
        builder = open_branch(graph, max(node.inputs))
        builder.add_arm(node_id)
        graph.target_backend.setdefault(node_id, home.backend)
        graph.placement.setdefault(node_id, home)
        for device in targets:
            copy = graph.push(Node(node.op, node.inputs, node.shape, node.dtype))
            graph.target_backend[copy] = device.backend
            graph.placement[copy] = device
            builder.add_arm(copy)
        try:
            branch = builder.finalize(merge)
        except BranchError as error:
            offers.append(Offer(PLACEMENT, node_id, None, str(error)))
            continue
        offers.append(Offer(PLACEMENT, node_id, branch,
                            "arms on " + ", ".join(str(d) for d in (home, *targets))))
        claimed |= set().union(*arm_interiors(graph, branch))
        readers = graph.consumers()
    return offers
