"""The tensor graph: an append-only arena of nodes, with per-node side tables.

Decides how a computation is represented between the fusion plan and the executor.

Invariants:
- Node ids are ints in push order and are never reused or removed. A node's inputs exist
  before it is pushed, so push order is *a* topological order at push time; rewiring (branch
  collapse) may later point a node at a higher id, so passes that need an order ask
  :func:`fuel.graph.branch.lower` rather than iterating ids.
- Values are frozen: ``Node`` and every ``Op`` are immutable; the only mutation the arena
  allows is replacing a node's inputs (:meth:`Graph.rewire`) and replacing a ``Branch`` node
  (:meth:`Graph.replace_branch`), both used by branch collapse.
- Leaves: ``Input(name)`` is fed at run time (token ids, positions, caches, block tables,
  context lengths), ``Weight(name)`` is bound to a named tensor at execution, ``Const(value)``
  is a tensor of the node's shape filled with ``value``.
- ``Prim(kind, attrs)`` is a primitive (``fuel.graph.ops``); attrs are a name-sorted tuple of
  pairs so equal ops compare and hash equal. ``Fused(id, params)`` is a fused op (static ids
  from ``FusedOps``, runtime ids from 0x8000). ``Branch(reconverge_at)`` records competing
  arms (its inputs are the arm exits); it computes nothing and is never dispatched.
- ``target_backend`` and ``placement`` are side tables keyed by node id; a node without an
  entry has not been stamped.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fuel.graph.dtype import BackendId, Device, DType, Shape
from fuel.graph.ops import OpKind, infer
from fuel.pickling import fast_pickle

NodeId = int


class Op:
    """Base of every op value. ``Op.Prim``, ``Op.Fused`` … name the kinds (seed spelling)."""

    __slots__ = ()

    Prim: type[Prim]
    Input: type[Input]
    Weight: type[Weight]
    Const: type[Const]
    Fused: type[Fused]
    Branch: type[Branch]


@fast_pickle
@dataclass(frozen=True, slots=True)
class Prim(Op):
    """A primitive op with its attributes (a name-sorted tuple of ``(name, value)`` pairs)."""

    kind: OpKind
    attrs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: OpKind, **attrs: Any) -> Prim:
        return cls(kind, tuple(sorted(attrs.items())))

    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={_attr_text(v)}" for k, v in self.attrs)
        return f"{self.kind.value}({inner})" if inner else self.kind.value


@fast_pickle
@dataclass(frozen=True, slots=True)
class Input(Op):
    name: str

    def __str__(self) -> str:
        return f"input({self.name})"


@fast_pickle
@dataclass(frozen=True, slots=True)
class Weight(Op):
    name: str

    def __str__(self) -> str:
        return f"weight({self.name})"


@fast_pickle
@dataclass(frozen=True, slots=True)
class Const(Op):
    value: float = 0.0

    def __str__(self) -> str:
        return f"const({self.value})"


@fast_pickle
@dataclass(frozen=True, slots=True)
class Fused(Op):
    """A fused op: ``id`` is a ``FusedOps`` member (static) or an int >= 0x8000 (runtime);
    ``params`` is that op's frozen params value."""

    id: int
    params: Any

    def __str__(self) -> str:
        from fuel.graph.registry import fused_name

        return f"fused:{fused_name(self.id)}"


@fast_pickle
@dataclass(frozen=True, slots=True)
class Branch(Op):
    """Competing arms; inputs are the arm exits (arm 0 = the decomposed oracle). ``reconverge_at``
    is the merge node, which reads arm 0's exit; ``diverge`` is the newest node the arms share
    (recorded by the builder so arm interiors can be recomputed: see ``fuel.graph.branch``)."""

    reconverge_at: NodeId
    diverge: NodeId

    def __str__(self) -> str:
        return f"branch(reconverge_at={self.reconverge_at}, diverge={self.diverge})"


Op.Prim, Op.Input, Op.Weight, Op.Const, Op.Fused, Op.Branch = Prim, Input, Weight, Const, Fused, Branch


def _attr_text(value: Any) -> str:
    if isinstance(value, DType | OpKind):
        return value.value
    if isinstance(value, tuple):
        return "(" + ", ".join(_attr_text(v) for v in value) + ")"
    if hasattr(value, "value") and hasattr(type(value), "__members__"):
        return str(value.value)
    return repr(value)


@fast_pickle
@dataclass(frozen=True, slots=True)
class Node:
    op: Op
    inputs: tuple[NodeId, ...]
    shape: Shape
    dtype: DType

    def __post_init__(self) -> None:
        # Accept any iterable of ids (the seeds pass lists) but store a tuple.
        if not isinstance(self.inputs, tuple):
            object.__setattr__(self, "inputs", tuple(self.inputs))


class GraphError(Exception):
    """A structural misuse of the arena (an input id that does not exist yet)."""


class Graph:
    """An append-only arena of :class:`Node` with ``target_backend`` / ``placement`` tables."""

    __slots__ = ("_nodes", "target_backend", "placement", "_readers")

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self.target_backend: dict[NodeId, BackendId] = {}
        self.placement: dict[NodeId, Device] = {}
        self._readers: list[list[NodeId]] | None = None
        """:meth:`consumers`, kept up to date by every edit once built (None until asked)."""

    def __getstate__(self) -> dict[str, Any]:
        # The readers index is derived: not stored (a restored graph builds it when asked).
        return {"_nodes": self._nodes, "target_backend": self.target_backend,
                "placement": self.placement}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):  # the default slots state: (None, {slot: value})
            state = state[1]
        self._nodes = state["_nodes"]
        self.target_backend = state["target_backend"]
        self.placement = state["placement"]
        self._readers = None

    # The arena.
    def push(self, node: Node) -> NodeId:
        count = len(self._nodes)
        for input_id in node.inputs:
            if not 0 <= input_id < count:
                raise GraphError(f"node {count} reads {input_id}, which does not exist yet")
        self._nodes.append(node)
        if self._readers is not None:
            self._readers.append([])
            for input_id in dict.fromkeys(node.inputs):
                self._readers[input_id].append(count)  # the newest reader: order kept
        return count

    def node(self, node_id: NodeId) -> Node:
        return self._nodes[node_id]

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self):
        return iter(range(len(self._nodes)))

    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._nodes)

    def consumers(self) -> list[list[NodeId]]:
        """For each node, the nodes that read it (ascending, one entry per reader).

        Built once, then kept current by :meth:`push`, :meth:`rewire` and
        :meth:`replace_branch` (the optimizer asks after every edit: rebuilding it each time
        was a pass over the whole graph per question). The lists are the graph's own: read
        them, never change them."""
        if self._readers is None:
            readers: list[list[NodeId]] = [[] for _ in self._nodes]
            for node_id, node in enumerate(self._nodes):
                for input_id in dict.fromkeys(node.inputs):
                    readers[input_id].append(node_id)
            self._readers = readers
        return self._readers

    def _set_inputs(self, node_id: NodeId, inputs: tuple[NodeId, ...]) -> None:
        """Replace ``node_id``'s inputs, keeping :meth:`consumers` current."""
        node = self._nodes[node_id]
        if self._readers is not None:
            for gone in set(node.inputs) - set(inputs):
                self._readers[gone].remove(node_id)
            for new in set(inputs) - set(node.inputs):
                bisect.insort(self._readers[new], node_id)
        self._nodes[node_id] = Node(node.op, inputs, node.shape, node.dtype)

    def rewire(self, node_id: NodeId, old: NodeId, new: NodeId) -> None:
        """Make ``node_id`` read ``new`` wherever it read ``old``."""
        node = self._nodes[node_id]
        if not 0 <= new < len(self._nodes):
            raise GraphError(f"cannot rewire {node_id} to {new}, which does not exist")
        self._set_inputs(node_id, tuple(new if i == old else i for i in node.inputs))

    def replace_branch(self, node_id: NodeId, arms: Iterable[NodeId]) -> None:
        """Replace the arms of the Branch node ``node_id`` (collapse leaves one)."""
        node = self._nodes[node_id]
        if not isinstance(node.op, Branch):
            raise GraphError(f"node {node_id} is not a branch")
        self._set_inputs(node_id, tuple(arms))

    def relabel_fused(self, ids: Mapping[int, int]) -> int:
        """Give every fused node whose id is a key of ``ids`` the mapped id (params, inputs,
        shape kept): runtime fused ids are handed out per process, so a graph restored in
        another process names its adopted regions by that process's ids. Returns the count."""
        count = 0
        for node_id, node in enumerate(self._nodes):
            if isinstance(node.op, Fused) and node.op.id in ids and ids[node.op.id] != node.op.id:
                self._nodes[node_id] = Node(Fused(ids[node.op.id], node.op.params), node.inputs,
                                            node.shape, node.dtype)
                count += 1
        return count

    # Builders that type their node with the op's rule.
    def input(self, name: str, dims: Iterable[Any], dtype: DType) -> NodeId:
        return self.push(Node(Input(name), (), Shape.from_dims(dims), dtype))

    def weight(self, name: str, dims: Iterable[Any], dtype: DType) -> NodeId:
        return self.push(Node(Weight(name), (), Shape.from_dims(dims), dtype))

    def const(self, value: float, dims: Iterable[Any], dtype: DType) -> NodeId:
        return self.push(Node(Const(value), (), Shape.from_dims(dims), dtype))

    def prim(self, kind: OpKind, *inputs: NodeId, **attrs: Any) -> NodeId:
        """Push a primitive, its shape and dtype inferred (raises ``ShapeError`` if untypable)."""
        nodes = [self._nodes[i] for i in inputs]
        shape, dtype = infer(kind, attrs, [n.shape for n in nodes], [n.dtype for n in nodes])
        return self.push(Node(Prim.of(kind, **attrs), tuple(inputs), shape, dtype))

    def fused(self, fused_id: int, params: Any, *inputs: NodeId) -> NodeId:
        """Push a static fused op, typed by its registry rule (raises ``ShapeError``)."""
        from fuel.graph.registry import infer_fused

        nodes = [self._nodes[i] for i in inputs]
        shape, dtype = infer_fused(fused_id, params, [n.shape for n in nodes],
                                   [n.dtype for n in nodes])
        return self.push(Node(Fused(fused_id, params), tuple(inputs), shape, dtype))

    def value_bytes(self, node_id: NodeId, symbols: Mapping[str, int] | None = None) -> int | None:
        """Bytes of a node's value, symbolic dims bound from ``symbols``; ``None`` when a symbol
        has no binding (its size is unknown, never guessed)."""
        node = self._nodes[node_id]
        count = 1
        for dim in node.shape.dims:
            if isinstance(dim, str):
                if symbols is None or dim not in symbols:
                    return None
                dim = symbols[dim]
            count *= int(dim)
        return node.dtype.storage_bytes(count)

    def describe(self, node_id: NodeId) -> str:
        node = self._nodes[node_id]
        reads = ", ".join(map(str, node.inputs))
        return f"%{node_id} = {node.op}({reads}) : {node.dtype.value}{node.shape}"
