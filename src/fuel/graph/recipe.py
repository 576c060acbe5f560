"""Recipes as data: pattern trees over primitives, emission into a graph, structural matching
and a structural hash.

Decides how a fused op's meaning is written down so every later stage can read it without
running it: the decomposed arm emits it, the JIT hands it to a synthesizer, the pathfinders
match it against graph regions, and the runtime registry deduplicates by its hash.

A region is a tree of :class:`PatternOp` (a primitive ``tag`` with ``operands`` and ``attrs``)
whose leaves are :class:`Bind` (``Bind(i)`` = the fused node's i-th input). Attribute values
are concrete (ints, floats, dtypes, predicates, tuples of them) or expressions resolved at
emission:

- :class:`Slot` ``(name)`` — an open scalar slot, filled from the fused op's params
  (``recipe_for`` fills them) or extracted by :func:`match_region`;
- :class:`DimOf` ``(bind, axis)`` — the extent of a bound input's axis (shape-relative: "the
  last dim" is ``DimOf(0, -1)``);
- :class:`Quot` ``(a, b)`` — exact integer division of two of the above.

Invariants:
- :func:`emit` never leaves a partial region behind: it types every node first and pushes only
  when the whole region typed; on failure it returns an :class:`EmitRefused` value.
- Equal subtrees emit one node (hash-consing), so a tree that mentions ``exp(x - max)`` twice
  computes it once. Primitives are pure, so this never changes a value.
- :func:`structural_hash` is SHA-256 of a canonical text (commutative operands sorted), stable
  across processes and hash seeds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fuel.graph.dtype import DType, Shape
from fuel.graph.ir import Graph, Node, NodeId, Prim
from fuel.graph.ops import OpKind, ShapeError, infer


# Attribute expressions.
@dataclass(frozen=True, slots=True)
class Slot:
    """An open scalar slot named ``name``."""

    name: str


@dataclass(frozen=True, slots=True)
class DimOf:
    """The extent of axis ``axis`` of the input bound to ``Bind(bind)``."""

    bind: int
    axis: int


@dataclass(frozen=True, slots=True)
class Quot:
    """``a // b``, refused unless exact."""

    a: Any
    b: Any


# Pattern nodes.
class PatternNode:
    """A region node: :class:`PatternOp` or :class:`Bind` (``PatternNode.Op`` /
    ``PatternNode.Bind`` in the seeds' spelling)."""

    __slots__ = ()

    Op: type[PatternOp]
    Bind: type[Bind]


@dataclass(frozen=True, slots=True)
class Bind(PatternNode):
    index: int


@dataclass(frozen=True, slots=True)
class PatternOp(PatternNode):
    tag: OpKind
    operands: tuple[PatternNode, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)
    """The node's hash, computed once. A region is a DAG whose nodes the memos of
    :func:`fill_slots`, :func:`emit` and :func:`canonical_text` key by value, and a dataclass
    hash walks every operand below the node again on every lookup: ~1.3 M hash calls (~0.7 s)
    of a cold first token's program builds. Not pickled (a str's hash differs per process)."""

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash((self.tag, self.operands, self.attrs))
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self):
        return PatternOp, (self.tag, self.operands, self.attrs)

    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)


PatternNode.Op, PatternNode.Bind = PatternOp, Bind


def op(tag: OpKind, *operands: PatternNode, **attrs: Any) -> PatternOp:
    """Build a :class:`PatternOp` (attrs sorted by name)."""
    return PatternOp(tag, tuple(operands), tuple(sorted(attrs.items())))


# Walking regions.
def walk(region: PatternNode) -> Iterator[PatternNode]:
    """Every node of the tree, pre-order (shared subtrees visited once per mention)."""
    stack = [region]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, PatternOp):
            stack.extend(reversed(node.operands))


def bind_indices(region: PatternNode) -> tuple[int, ...]:
    return tuple(sorted({n.index for n in walk(region) if isinstance(n, Bind)}))


def _expr_items(value: Any) -> Iterator[Any]:
    if isinstance(value, tuple):
        for item in value:
            yield from _expr_items(item)
    elif isinstance(value, Quot):
        yield value
        yield from _expr_items(value.a)
        yield from _expr_items(value.b)
    else:
        yield value


def fill_slots(region: PatternNode, values: Mapping[str, Any]) -> PatternNode:
    """The region with every ``Slot`` whose name is in ``values`` replaced by its value."""
    memo: dict[PatternNode, PatternNode] = {}

    def fill_value(value: Any) -> Any:
        if isinstance(value, Slot):
            return values.get(value.name, value)
        if isinstance(value, tuple):
            return tuple(fill_value(v) for v in value)
        if isinstance(value, Quot):
            return Quot(fill_value(value.a), fill_value(value.b))
        return value

    def fill(node: PatternNode) -> PatternNode:
        if isinstance(node, Bind):
            return node
        if node not in memo:
            memo[node] = PatternOp(node.tag, tuple(fill(o) for o in node.operands),
                                   tuple((k, fill_value(v)) for k, v in node.attrs))
        return memo[node]

    return fill(region)


# Emission.
@dataclass(frozen=True, slots=True)
class EmitRefused:
    """Why a region could not be emitted (the graph is left untouched)."""

    reason: str


class _Unresolvable(Exception):
    pass


def _resolve(value: Any, bind_shapes: Sequence[Shape], slots: Mapping[str, Any]) -> Any:
    if isinstance(value, Slot):
        if value.name not in slots:
            raise _Unresolvable(f"open slot `{value.name}` has no value")
        return slots[value.name]
    if isinstance(value, DimOf):
        if not 0 <= value.bind < len(bind_shapes):
            raise _Unresolvable(f"DimOf refers to bind {value.bind} of {len(bind_shapes)}")
        dims = bind_shapes[value.bind].dims
        if not -len(dims) <= value.axis < len(dims):
            raise _Unresolvable(f"DimOf axis {value.axis} out of range for {bind_shapes[value.bind]}")
        return dims[value.axis]
    if isinstance(value, Quot):
        a, b = _resolve(value.a, bind_shapes, slots), _resolve(value.b, bind_shapes, slots)
        if not (isinstance(a, int) and isinstance(b, int)) or b == 0 or a % b:
            raise _Unresolvable(f"{a!r} // {b!r} is not an exact integer quotient")
        return a // b
    if isinstance(value, tuple):
        return tuple(_resolve(v, bind_shapes, slots) for v in value)
    return value


def emit(graph: Graph, region: PatternNode, binds: Sequence[NodeId],
         slots: Mapping[str, Any] | None = None,
         expect: tuple[Shape, DType] | None = None) -> NodeId | EmitRefused:
    """Emit ``region`` into ``graph`` with ``Bind(i)`` = ``binds[i]``; returns the root's id.

    Every node is typed before any is pushed; any failure (a bind out of range, an open slot
    without a value, a shape rule refusing) returns :class:`EmitRefused` and leaves the graph
    unchanged. A bare ``Bind`` region returns the bound id without pushing. With ``expect``,
    a root of another shape or dtype is refused too (a recipe must reproduce its node).
    """
    slots = slots or {}
    try:
        bind_nodes = [graph.node(b) for b in binds]
    except IndexError:
        return EmitRefused(f"a bind id in {tuple(binds)} is not in the graph")
    bind_shapes = [n.shape for n in bind_nodes]
    staged: list[Node] = []
    memo: dict[PatternNode, NodeId] = {}
    base = len(graph)

    def typed(node_id: NodeId) -> Node:
        return graph.node(node_id) if node_id < base else staged[node_id - base]

    def visit(node: PatternNode) -> NodeId:
        if isinstance(node, Bind):
            if not 0 <= node.index < len(binds):
                raise _Unresolvable(f"Bind({node.index}) but only {len(binds)} inputs")
            return binds[node.index]
        if not isinstance(node, PatternOp) or not isinstance(node.tag, OpKind):
            raise _Unresolvable(f"{node!r} is not a primitive pattern op")
        if node in memo:
            return memo[node]
        inputs = tuple(visit(o) for o in node.operands)
        attrs = {k: _resolve(v, bind_shapes, slots) for k, v in node.attrs}
        nodes = [typed(i) for i in inputs]
        shape, dtype = infer(node.tag, attrs, [n.shape for n in nodes], [n.dtype for n in nodes])
        staged.append(Node(Prim.of(node.tag, **attrs), inputs, shape, dtype))
        memo[node] = base + len(staged) - 1
        return memo[node]

    try:
        root = visit(region)
    except (_Unresolvable, ShapeError) as refused:
        return EmitRefused(str(refused))
    except RecursionError:
        return EmitRefused("region too deep to emit")
    if expect is not None:
        got = typed(root)
        if (got.shape, got.dtype) != expect:
            return EmitRefused(f"region yields {got.dtype.value}{got.shape}, expected "
                               f"{expect[1].value}{expect[0]}")
    for node in staged:
        graph.push(node)
    return root


# Matching.
@dataclass(frozen=True, slots=True)
class RegionMatch:
    """A structural match: ``binds[i]`` is the node bound to ``Bind(i)``; ``slots`` the open
    slot values read off the graph (sorted by name)."""

    root: NodeId
    binds: tuple[NodeId, ...]
    slots: tuple[tuple[str, Any], ...]

    def slot_dict(self) -> dict[str, Any]:
        return dict(self.slots)


@dataclass(frozen=True, slots=True)
class NoMatch:
    reason: str


@dataclass(slots=True)
class _State:
    binds: dict[int, NodeId] = field(default_factory=dict)
    slots: dict[str, Any] = field(default_factory=dict)
    deferred: list[tuple[Any, Any]] = field(default_factory=list)

    def copy(self) -> _State:
        return _State(dict(self.binds), dict(self.slots), list(self.deferred))


def _unify(pattern: Any, value: Any, state: _State) -> bool:
    if isinstance(pattern, Slot):
        if pattern.name in state.slots:
            return state.slots[pattern.name] == value
        state.slots[pattern.name] = value
        return True
    if isinstance(pattern, DimOf | Quot):
        state.deferred.append((pattern, value))
        return True
    if isinstance(pattern, tuple):
        return (isinstance(value, tuple) and len(value) == len(pattern)
                and all(_unify(p, v, state) for p, v in zip(pattern, value)))
    return type(pattern) is type(value) and pattern == value


def _match(pattern: PatternNode, graph: Graph, node_id: NodeId, state: _State) -> Iterator[_State]:
    if isinstance(pattern, Bind):
        bound = state.binds.get(pattern.index)
        if bound is None:
            state = state.copy()
            state.binds[pattern.index] = node_id
            yield state
        elif bound == node_id:
            yield state
        return
    node = graph.node(node_id)
    if not isinstance(node.op, Prim) or node.op.kind is not pattern.tag:
        return
    if len(node.inputs) != len(pattern.operands):
        return
    node_attrs = node.op.attr_dict()
    if set(node_attrs) != {k for k, _ in pattern.attrs}:
        return
    state = state.copy()
    if not all(_unify(v, node_attrs[k], state) for k, v in pattern.attrs):
        return
    orders = [tuple(range(len(pattern.operands)))]
    if pattern.tag.commutative and len(pattern.operands) == 2:
        orders.append((1, 0))
    for order in orders:
        yield from _match_operands([pattern.operands[i] for i in order], graph, node.inputs, state)


def _match_operands(patterns: Sequence[PatternNode], graph: Graph, inputs: Sequence[NodeId],
                    state: _State) -> Iterator[_State]:
    if not patterns:
        yield state
        return
    for after_first in _match(patterns[0], graph, inputs[0], state):
        yield from _match_operands(patterns[1:], graph, inputs[1:], after_first)


def match_region(pattern: PatternNode, graph: Graph, root: NodeId) -> RegionMatch | NoMatch:
    """Match ``pattern`` against the subgraph rooted at ``root``.

    Commutative ops match with their operands either way round; a ``Bind`` index met twice must
    meet the same node; open slots are extracted; shape-relative attributes are checked against
    the bound inputs' shapes. The first consistent match (operands in written order first) wins.
    """
    for state in _match(pattern, graph, root, _State()):
        indices = sorted(state.binds)
        if indices != list(range(len(indices))):
            return NoMatch(f"pattern binds {indices}: indices must be 0..n-1 without gaps")
        binds = tuple(state.binds[i] for i in indices)
        shapes = [graph.node(b).shape for b in binds]
        try:
            if all(_resolve(p, shapes, state.slots) == v for p, v in state.deferred):
                return RegionMatch(root, binds, tuple(sorted(state.slots.items())))
        except _Unresolvable:
            continue
    return NoMatch(f"no structural match at node {root}")


# Hashing.
def _value_text(value: Any) -> str:
    if isinstance(value, Slot):
        return f"?{value.name}"
    if isinstance(value, DimOf):
        return f"dim(${value.bind},{value.axis})"
    if isinstance(value, Quot):
        return f"({_value_text(value.a)}//{_value_text(value.b)})"
    if isinstance(value, tuple):
        return "(" + ",".join(_value_text(v) for v in value) + ")"
    if isinstance(value, Enum):
        return f"{type(value).__name__}.{value.value}"
    if isinstance(value, float):
        return float.hex(value)  # exact and platform-independent
    return repr(value)


def canonical_text(region: PatternNode) -> str:
    """One-line canonical spelling of a region (commutative operands sorted)."""
    memo: dict[PatternNode, str] = {}

    def text(node: PatternNode) -> str:
        if isinstance(node, Bind):
            return f"${node.index}"
        if node not in memo:
            operands = [text(o) for o in node.operands]
            if node.tag.commutative:
                operands.sort()
            attrs = ",".join(f"{k}={_value_text(v)}" for k, v in node.attrs)
            memo[node] = f"{node.tag.value}[{attrs}](" + ",".join(operands) + ")"
        return memo[node]

    return text(region)


def structural_hash(region: PatternNode) -> str:
    """Lower-case hex SHA-256 of :func:`canonical_text`."""
    return hashlib.sha256(canonical_text(region).encode()).hexdigest()
