"""Branch arms: building them, collapsing a variant branch, and lowering a picked route.

Decides how competing implementations of one value coexist in the graph and how one of them
is chosen for dispatch.

A branch forks after a ``diverge`` node and rejoins at a ``reconverge_at`` node (the merge).
Each arm is the region computing one candidate value; its *exit* is that value. Arm 0 is the
decomposed correctness oracle, and the merge reads arm 0's exit; the ``Branch`` node (inputs =
the exits) records the alternatives and is never dispatched.

An arm's *interior* is every node pushed after ``diverge`` that its exit reaches through nodes
pushed after ``diverge`` (ancestors-or-self of the exit, the walk stopping at older nodes). Pass
the newest node the arms share as ``diverge`` (for a fused node: the newest ancestor of its
inputs): everything older is shared context, everything newer on the arm's path is the arm's.
The walk stops at shared context, so it costs the arm's size, not the graph's: a node older than
``diverge`` that reads a newer one (a merge rewired to another branch's winner by an earlier
collapse) belongs to that other branch, never to this arm.

Builder rules (:func:`open_branch` → ``add_arm`` → ``finalize``), each a typed error:
1. at least one arm (:class:`NoArms`); one arm emits no branch (``finalize`` returns ``None``);
2. ``reconverge_at`` is a strict descendant of ``diverge`` (:class:`ReconvergeNotDescendant`);
3. every exit has arm 0's shape and dtype (:class:`ArmTypeMismatch`);
4. the merge reads arm 0's exit (:class:`MergeDoesNotReadArm0`);
5. interiors are non-empty (:class:`EmptyArm`), pairwise disjoint (:class:`ArmsOverlap`) and
   read from outside only by the merge, at the exit (:class:`InteriorEscapes`).

:func:`collapse_variant_branch` rewires the merge to the winner's exit and leaves an inert
one-arm branch; the losing arms then have no reader and :func:`lower` never reaches them.
:func:`lower` substitutes the routed arm's exit for arm 0's at each merge without mutating,
and orders what the roots need (Kahn, ready set by lowest id: deterministic).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fuel.errors import FuelError
from fuel.graph.ir import Branch, Graph, Node, NodeId


class BranchError(FuelError):
    """Base of the branch rule violations."""


class NoArms(BranchError):
    def __init__(self, diverge: NodeId):
        self.diverge = diverge
        super().__init__(f"branch at {diverge}: finalized with no arms")


class ReconvergeNotDescendant(BranchError):
    def __init__(self, diverge: NodeId, reconverge_at: NodeId):
        self.diverge, self.reconverge_at = diverge, reconverge_at
        super().__init__(f"branch at {diverge}: reconverge node {reconverge_at} is not a strict "
                         f"descendant of the diverge node")


class ArmTypeMismatch(BranchError):
    def __init__(self, arm: int, exit: NodeId, expected: str, got: str):
        self.arm, self.exit, self.expected, self.got = arm, exit, expected, got
        super().__init__(f"arm {arm} (exit {exit}) yields {got}, arm 0 yields {expected}")


class MergeDoesNotReadArm0(BranchError):
    def __init__(self, reconverge_at: NodeId, arm0_exit: NodeId):
        self.reconverge_at, self.arm0_exit = reconverge_at, arm0_exit
        super().__init__(f"merge {reconverge_at} does not read arm 0's exit {arm0_exit}")


class EmptyArm(BranchError):
    def __init__(self, arm: int, exit: NodeId, diverge: NodeId):
        self.arm, self.exit, self.diverge = arm, exit, diverge
        super().__init__(f"arm {arm} (exit {exit}) has no node after diverge {diverge}")


class ArmsOverlap(BranchError):
    def __init__(self, arm_a: int, arm_b: int, shared: tuple[NodeId, ...]):
        self.arm_a, self.arm_b, self.shared = arm_a, arm_b, shared
        super().__init__(f"arms {arm_a} and {arm_b} share interior nodes {list(shared)}")


class InteriorEscapes(BranchError):
    def __init__(self, arm: int, node: NodeId, reader: NodeId):
        self.arm, self.node, self.reader = arm, node, reader
        super().__init__(f"node {node} inside arm {arm} is read by {reader}, outside the arm "
                         f"and not the merge")


class NotABranch(BranchError):
    def __init__(self, node: NodeId):
        self.node = node
        super().__init__(f"node {node} is not a branch")


class ArmOutOfRange(BranchError):
    def __init__(self, branch: NodeId, arm: int, arms: int):
        self.branch, self.arm, self.arms = branch, arm, arms
        super().__init__(f"branch {branch} has {arms} arm(s); arm {arm} does not exist")


def ancestors(graph: Graph, starts: Iterable[NodeId],
              reads: Mapping[NodeId, tuple[NodeId, ...]] | None = None,
              seen: set[NodeId] | None = None) -> set[NodeId]:
    """Ancestors-or-self of ``starts`` (through ``reads`` where given, else node inputs).
    ``seen``, when given, is a set already closed under ancestors (every ancestor of a member is
    a member): it is extended in place and returned, and the walk stops at its members."""
    seen = set() if seen is None else seen
    stack = list(starts)
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        stack.extend(reads[node_id] if reads is not None and node_id in reads
                     else graph.node(node_id).inputs)
    return seen


def _interior(graph: Graph, exit: NodeId, diverge: NodeId) -> frozenset[NodeId]:
    seen: set[NodeId] = set()
    stack = [exit]
    while stack:
        node_id = stack.pop()
        if node_id <= diverge or node_id in seen:
            continue
        seen.add(node_id)
        stack.extend(graph.node(node_id).inputs)
    return frozenset(seen)


def _reaches(graph: Graph, start: NodeId, target: NodeId) -> bool:
    """Whether ``target`` is an ancestor-or-self of ``start`` (a walk that stops when found)."""
    seen: set[NodeId] = set()
    stack = [start]
    while stack:
        node_id = stack.pop()
        if node_id == target:
            return True
        if node_id in seen:
            continue
        seen.add(node_id)
        stack.extend(graph.node(node_id).inputs)
    return False


def _type_text(node: Node) -> str:
    return f"{node.dtype.value}{node.shape}"


@dataclass(slots=True)
class BranchBuilder:
    """Collects arm exits for one branch; see the module docstring for the rules."""

    graph: Graph
    diverge: NodeId
    exits: list[NodeId]

    def add_arm(self, exit: NodeId) -> int:
        """Add an arm ending at ``exit``; returns its arm index (arm 0 first)."""
        self.exits.append(exit)
        return len(self.exits) - 1

    def finalize(self, reconverge_at: NodeId) -> NodeId | None:
        """Check the rules and push the ``Branch`` node (``None`` for a single arm)."""
        graph, diverge, exits = self.graph, self.diverge, self.exits
        if not exits:
            raise NoArms(diverge)
        if reconverge_at == diverge or not _reaches(graph, reconverge_at, diverge):
            raise ReconvergeNotDescendant(diverge, reconverge_at)
        arm0 = graph.node(exits[0])
        for arm, exit in enumerate(exits):
            node = graph.node(exit)
            if (node.shape, node.dtype) != (arm0.shape, arm0.dtype):
                raise ArmTypeMismatch(arm, exit, _type_text(arm0), _type_text(node))
        if exits[0] not in graph.node(reconverge_at).inputs:
            raise MergeDoesNotReadArm0(reconverge_at, exits[0])
        interiors = [_interior(graph, exit, diverge) for exit in exits]
        for arm, interior in enumerate(interiors):
            if not interior:
                raise EmptyArm(arm, exits[arm], diverge)
        for a in range(len(interiors)):
            for b in range(a + 1, len(interiors)):
                shared = interiors[a] & interiors[b]
                if shared:
                    raise ArmsOverlap(a, b, tuple(sorted(shared)))
        readers = graph.consumers()
        for arm, interior in enumerate(interiors):
            for node_id in sorted(interior):
                for reader in readers[node_id]:
                    allowed = (reader in interior or isinstance(graph.node(reader).op, Branch)
                               or (reader == reconverge_at and node_id == exits[arm]))
                    if not allowed:
                        raise InteriorEscapes(arm, node_id, reader)
        if len(exits) == 1:
            return None
        return graph.push(Node(Branch(reconverge_at, diverge), tuple(exits), arm0.shape, arm0.dtype))


def open_branch(graph: Graph, diverge: NodeId) -> BranchBuilder:
    """Start a branch forking after ``diverge``."""
    graph.node(diverge)  # an unknown id fails here, not at finalize
    return BranchBuilder(graph, diverge, [])


def _branch_node(graph: Graph, branch: NodeId) -> tuple[Branch, tuple[NodeId, ...]]:
    if not 0 <= branch < len(graph) or not isinstance(graph.node(branch).op, Branch):
        raise NotABranch(branch)
    node = graph.node(branch)
    return node.op, node.inputs  # type: ignore[return-value]


def arm_interiors(graph: Graph, branch: NodeId) -> tuple[frozenset[NodeId], ...]:
    """Each arm's interior nodes (see the module docstring), arm 0 first."""
    op, exits = _branch_node(graph, branch)
    return tuple(_interior(graph, exit, op.diverge) for exit in exits)


def collapse_variant_branch(graph: Graph, branch: NodeId, winner: int) -> None:
    """Rewire the merge from arm 0's exit to ``winner``'s and leave an inert one-arm branch."""
    op, exits = _branch_node(graph, branch)
    if not 0 <= winner < len(exits):
        raise ArmOutOfRange(branch, winner, len(exits))
    if winner != 0:
        graph.rewire(op.reconverge_at, exits[0], exits[winner])
    graph.replace_branch(branch, [exits[winner]])


def _branches_by_merge(graph: Graph) -> dict[NodeId, list[NodeId]]:
    by_merge: dict[NodeId, list[NodeId]] = {}
    for node_id in graph:
        op = graph.node(node_id).op
        if isinstance(op, Branch):
            by_merge.setdefault(op.reconverge_at, []).append(node_id)
    return by_merge


def effective_roots(graph: Graph, roots: Iterable[NodeId]) -> tuple[NodeId, ...]:
    """The roots plus every Branch node whose merge they (transitively) need, so a walk from
    the result sees every arm — arm 0 through the merge, the others through their branch."""
    result = set(roots)
    reached = ancestors(graph, result)
    by_merge = _branches_by_merge(graph)
    changed = True
    while changed:
        changed = False
        for merge in sorted(by_merge):
            if merge not in reached:
                continue
            for branch in by_merge[merge]:
                if branch not in result:
                    result.add(branch)
                    ancestors(graph, [branch], seen=reached)  # only what is new is walked
                    changed = True
    return tuple(sorted(result))


def _topo(graph: Graph, nodes: set[NodeId],
          reads: Mapping[NodeId, tuple[NodeId, ...]]) -> list[NodeId]:
    indegree = {n: 0 for n in nodes}
    readers: dict[NodeId, list[NodeId]] = {n: [] for n in nodes}
    for n in nodes:
        for i in dict.fromkeys(reads[n]):
            indegree[n] += 1
            readers[i].append(n)
    ready = [n for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[NodeId] = []
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for reader in readers[n]:
            indegree[reader] -= 1
            if indegree[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) != len(nodes):
        raise BranchError(f"the graph has a cycle among {sorted(set(nodes) - set(order))}")
    return order


def branches_in_topo_order(graph: Graph, roots: Iterable[NodeId]) -> tuple[NodeId, ...]:
    """Every Branch node the roots need (inert ones included), ordered by where its merge sits
    in the graph's topological order (ties by branch id)."""
    everything = effective_roots(graph, roots)
    nodes = ancestors(graph, everything)
    order = _topo(graph, nodes, {n: graph.node(n).inputs for n in nodes})
    position = {n: i for i, n in enumerate(order)}
    branches = [n for n in nodes if isinstance(graph.node(n).op, Branch)]
    return tuple(sorted(branches, key=lambda b: (position[graph.node(b).op.reconverge_at], b)))


@dataclass(frozen=True, slots=True)
class Lowered:
    """A dispatch order: ``order`` lists every node the roots need once, inputs first;
    ``reads[n]`` are the inputs node ``n`` reads under the picked route."""

    roots: tuple[NodeId, ...]
    order: tuple[NodeId, ...]
    reads: Mapping[NodeId, tuple[NodeId, ...]]


def lower(graph: Graph, roots: Iterable[NodeId], route: Mapping[NodeId, int] | None = None) -> Lowered:
    """The dispatch order for ``roots`` with each branch in ``route`` taking the given arm
    (others take arm 0). Arms not chosen are not in the order. Never mutates the graph."""
    roots = tuple(roots)
    substitute: dict[NodeId, tuple[NodeId, NodeId]] = {}
    for branch, arm in sorted((route or {}).items()):
        op, exits = _branch_node(graph, branch)
        if not 0 <= arm < len(exits):
            raise ArmOutOfRange(branch, arm, len(exits))
        if arm:
            substitute[op.reconverge_at] = (exits[0], exits[arm])

    def reads_of(node_id: NodeId) -> tuple[NodeId, ...]:
        inputs = graph.node(node_id).inputs
        if node_id in substitute:
            old, new = substitute[node_id]
            return tuple(new if i == old else i for i in inputs)
        return inputs

    for root in roots:
        if isinstance(graph.node(root).op, Branch):
            raise BranchError(f"root {root} is a branch node; pass the merge or the value instead")
    reads: dict[NodeId, tuple[NodeId, ...]] = {}
    stack = list(roots)
    while stack:
        node_id = stack.pop()
        if node_id not in reads:
            reads[node_id] = reads_of(node_id)
            stack.extend(reads[node_id])
    order = _topo(graph, set(reads), reads)
    return Lowered(roots, tuple(order), MappingProxyType(reads))


def branch_fused_over_recipe(graph: Graph, fused: NodeId, merge: NodeId,
                             runtime=None) -> NodeId | None:
    """Give a fused node read by ``merge`` its decomposed region as arm 0: emits the recipe,
    rewires the merge to it, and branches (arm 0 = recipe, arm 1 = the fused node). Returns the
    Branch id, or ``None`` (graph untouched) when the node has no emittable recipe."""
    from fuel.graph.registry import decompose

    node = graph.node(fused)
    if not node.inputs or fused not in graph.node(merge).inputs:
        return None
    root = decompose(graph, fused, runtime)
    if root == fused:
        return None
    graph.rewire(merge, fused, root)
    builder = open_branch(graph, max(node.inputs))
    builder.add_arm(root)
    builder.add_arm(fused)
    return builder.finalize(merge)
