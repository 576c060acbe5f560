"""The executor: runs a lowered graph on one backend.

Decides nothing about *what* runs — the lowering (``fuel.graph.lower``) fixed the order and the
route, the table fixed what is bound. It resolves every node once, at compile time, and then
runs a flat list of steps.

Invariants:
- Every ``Prim``/``Fused`` node in the order resolves through the binding table under its exact
  key (input dtypes in order, then output dtype; the backend) and the capabilities its params
  require. A missing kernel raises :class:`~fuel.kernels.KernelMissing` naming op, dtypes and
  backend at compile time — a fused node is never silently decomposed, a dtype never widened.
- Leaves need no kernel: ``Input(name)`` is fed per run (checked against the node's dtype and
  concrete dims), ``Weight(name)`` is bound once at compile time, ``Const(value)`` is
  materialized once. ``Branch`` nodes are never in a lowered order.
- A run executes exactly the compiled steps, in order; ``executed`` lists their node ids and
  ``executed_nodes`` counts the steps the last run completed (tests prove a losing arm never
  runs with it).
- A node that computes what an earlier node already computed (equal op and params, the same
  inputs — for ``iota``/``size``, inputs of the same shape —, dtype and shape) is not run again: its readers read the earlier value (``merged``
  counts them). Values a step mutates in place (a ``kv_cache_write``'s cache) and everything
  computed from them are never merged. So the index arithmetic every layer's decomposed paged
  attention repeats over the same block table runs once per step.
- A ``slice`` that takes back exactly one operand of a ``concat`` reads that operand, and a
  ``concat`` no step reads any more is not run (a packed projection's parts, joined by the
  lowering and split again by SwiGLU, are read directly: no copy, no views).
- Per-node work at run time is one call: the kernels are resolved once and the steps are
  generated as straight-line Python (``Program.source``), each value released after its last
  reader.
- A CPU program whose every step has a native kernel is also laid out as a native step list
  (``fuel.runtime.native_steps``): :meth:`Program.run` then makes one call for the whole program,
  with the per-node path's results; ``run_timed`` always runs node by node (it clocks each).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuel.errors import FuelError
from fuel.graph.branch import Lowered, lower
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Const, Fused, Graph, Input, NodeId, Prim, Weight
from fuel.graph.ops import OpKind
from fuel.kernels.table import KernelBindingTable, KernelMissing, op_key, required_caps


class ExecutorError(FuelError):
    """Base of the executor's errors."""


class MissingFeed(ExecutorError):
    def __init__(self, name: str, node: NodeId):
        self.name, self.node = name, node
        super().__init__(f"input `{name}` (node {node}) was not fed")


class FeedMismatch(ExecutorError):
    def __init__(self, name: str, expected: str, got: str):
        self.name, self.expected, self.got = name, expected, got
        super().__init__(f"input `{name}`: expected {expected}, got {got}")


class MissingWeight(ExecutorError):
    def __init__(self, name: str, node: NodeId):
        self.name, self.node = name, node
        super().__init__(f"weight `{name}` (node {node}) is not bound")


class NotExecutable(ExecutorError):
    def __init__(self, node: NodeId, op: str):
        self.node, self.op = node, op
        super().__init__(f"node {node} ({op}) cannot be executed")


@dataclass(frozen=True, slots=True)
class _Feed:
    name: str
    node: NodeId
    dtype: Any
    dims: tuple[Any, ...]
    label: str


class Program:
    """A compiled dispatch order: call :meth:`run` with the feeds for each step.

    The steps are straight-line Python (``source``, inspectable): one local per value, one call
    per node, each value released after its last reader. That keeps the per-node cost at a
    single call, which is what the executor benchmark measures. A program laid out as a step
    list generates and compiles that source only when it first needs it (a run the step list
    hands back, a timed run): ~20 ms of every decode program's build or restore otherwise.
    """

    __slots__ = ("roots", "executed", "executed_nodes", "device", "_run", "_kernels", "_checked",
                 "_constants", "_feeds", "_generate", "_timed_run", "merged", "native",
                 "_steps")

    def __init__(self, roots, executed, generate, kernels, constants, feeds, device,
                 merged=0, native=None):
        self.roots: tuple[NodeId, ...] = roots
        self.executed: tuple[NodeId, ...] = executed
        self.executed_nodes = 0
        self.device = device
        self._generate = generate  # timed -> the straight-line source (see _generate)
        self._run = None
        self._kernels = kernels
        self._constants = constants
        self._feeds = feeds
        self._checked: list[Any] = [None] * len(feeds)
        """The tensor each feed was last given and checked (a step feeds the same KV caches every
        time: checked once, not at every step)."""
        self._timed_run = None
        self.merged: int = merged
        """Nodes not run because an earlier node computes the same value (same op, same
        inputs): e.g. the block-table index arithmetic every layer's attention repeats."""
        self.native = native
        """The program laid out as one native call (``fuel.runtime.native_steps.NativeSteps``),
        or why not (``Declined``), or None (not a CPU program)."""
        from fuel.runtime.native_steps import NativeSteps

        self._steps = native if isinstance(native, NativeSteps) else None
        if self._steps is None:
            self._run = self._compiled(timed=False)  # every run takes the per-node path

    @property
    def source(self) -> str:
        """The per-node path as straight-line Python."""
        return self._generate(False)

    def _compiled(self, timed: bool):
        namespace: dict[str, Any] = {}
        name = "<fuel timed program>" if timed else "<fuel program>"
        exec(compile(self._generate(timed), name, "exec"), namespace)  # noqa: S102 — our own source
        return namespace["run"]

    @property
    def host_calls(self) -> int:
        """Calls a plain run makes from Python: a step list's (one a native segment, one a host
        step), else one per step."""
        return self._steps.host_calls if self._steps is not None else len(self.executed)

    @property
    def last_threads(self) -> int | None:
        """The thread count the step list's last run took (``NativeSteps.last_threads``), None
        for a program that runs node by node."""
        return self._steps.last_threads if self._steps is not None else None

    @property
    def kernel_calls(self) -> int:
        """Kernels a plain run executes: a step list's (its views are offsets and run nothing),
        else one per step."""
        return self._steps.kernels if self._steps is not None else len(self.executed)

    def _fed(self, feeds: Mapping[str, Any]) -> list[Any]:
        fed = []
        checked = self._checked
        for index, feed in enumerate(self._feeds):
            tensor = feeds.get(feed.name)
            if tensor is None:
                raise MissingFeed(feed.name, feed.node)
            if tensor is checked[index]:  # the same tensor object as last time, already moved
                fed.append(tensor)
                continue
            if tensor.dtype != feed.dtype or tensor.dim() != len(feed.dims) or any(
                    isinstance(d, int) and d != actual for d, actual in zip(feed.dims, tensor.shape)):
                raise FeedMismatch(feed.name, feed.label, f"{tensor.dtype}{list(tensor.shape)}")
            moved = tensor.to(self.device)
            checked[index] = tensor if moved is tensor else None
            fed.append(moved)
        return fed

    def run(self, feeds: Mapping[str, Any]) -> dict[NodeId, Any]:
        """Run every step; returns ``{root id: tensor}``."""
        fed = self._fed(feeds)
        self.executed_nodes = 0
        results = self._steps.run(fed) if self._steps is not None else None
        if results is None:
            if self._run is None:
                self._run = self._compiled(timed=False)
            results = self._run(self._kernels, self._constants, fed)
        self.executed_nodes = len(self.executed)
        return dict(zip(self.roots, results))

    def run_timed(self, feeds: Mapping[str, Any]) -> tuple[dict[NodeId, Any], tuple[float, ...]]:
        """Run every step as :meth:`run` does, and return each step's wall seconds too (in the
        order of ``executed``). The timed source is the same straight-line code with a clock
        read after each call, compiled on first use so plain runs never pay for it."""
        import time

        if self._timed_run is None:
            self._timed_run = self._compiled(timed=True)
        fed = self._fed(feeds)
        self.executed_nodes = 0
        results, stamps = self._timed_run(self._kernels, self._constants, fed, time.perf_counter)
        self.executed_nodes = len(self.executed)
        return dict(zip(self.roots, results)), tuple(b - a for a, b in zip(stamps, stamps[1:]))

    def __len__(self) -> int:
        return len(self.executed)


def _generate(leaves: dict[NodeId, str], steps: list[tuple[NodeId, tuple[NodeId, ...]]],
              roots: tuple[NodeId, ...], *, timed: bool = False) -> str:
    """Straight-line source for the steps; ``leaves`` maps a leaf to its binding expression.
    ``timed`` takes a clock argument and appends a stamp before the first step and after each
    one (returned beside the roots)."""
    last_read: dict[NodeId, int] = {}
    for index, (_, reads) in enumerate(steps):
        for read in reads:
            last_read[read] = index
    keep = set(roots)
    lines = ["def run(kernels, constants, fed, clock):" if timed else "def run(kernels, constants, fed):"]
    kernel_names = [f"k{node}" for node, _ in steps]
    if kernel_names:
        lines.append(f"    {', '.join(kernel_names)}{',' if len(kernel_names) == 1 else ''} = kernels")
    lines.extend(f"    v{node} = {expression}" for node, expression in leaves.items())
    if timed:
        lines.append("    stamps = [clock()]")
    for index, (node, reads) in enumerate(steps):
        lines.append(f"    v{node} = k{node}({', '.join(f'v{r}' for r in reads)})")
        if timed:
            lines.append("    stamps.append(clock())")
        dead = sorted({r for r in reads if last_read[r] == index and r not in keep})
        if dead:
            lines.append(f"    del {', '.join(f'v{r}' for r in dead)}")
    values = f"({''.join(f'v{r}, ' for r in roots)})"
    lines.append(f"    return {values}, stamps" if timed else f"    return {values}")
    return "\n".join(lines) + "\n"


def compile_program(graph: Graph, lowered: Lowered, table: KernelBindingTable,
                    backend: BackendId = BackendId.CPU,
                    weights: Mapping[str, Any] | None = None,
                    device: Device | None = None) -> Program:
    """Resolve every node of ``lowered`` through ``table`` for ``backend`` and bind weights.

    Raises :class:`KernelMissing` for the first node without a kernel, :class:`MissingWeight`
    for an unbound weight, :class:`NotExecutable` for a branch node in the order.
    """
    import torch

    from fuel.kernels.torch_kernels import torch_dtype

    weights = weights or {}
    device = device or Device(backend)
    torch_device = torch.device(str(device))
    leaves: dict[NodeId, str] = {}
    leaf_slots: dict[NodeId, tuple[str, int]] = {}  # the same, as (kind, index): the step list's
    constants: list[Any] = []
    feeds: list[_Feed] = []
    kernels: list[Any] = []
    entries: list[Any] = []
    steps: list[tuple[NodeId, tuple[NodeId, ...]]] = []
    unmergeable = _unmergeable(graph, lowered)
    same: dict[NodeId, NodeId] = {}  # a node computed again → the node already computing it
    seen: dict[tuple[Any, ...], NodeId] = {}
    for node_id in lowered.order:
        node = graph.node(node_id)
        op = node.op
        part = _sliced_part(graph, node_id, lowered, same, unmergeable)
        if part is not None:
            same[node_id] = part
            continue
        if isinstance(op, Prim | Fused) and node_id not in unmergeable:
            reads = tuple(same.get(r, r) for r in lowered.reads[node_id])
            if isinstance(op, Prim) and op.kind in _SHAPE_ONLY:
                # Only the operand's shape matters: iota over any layer's [B, L] tensor is one value.
                reads = tuple(graph.node(r).shape for r in reads)
            try:
                key = (op, reads, node.dtype, node.shape)
                earlier = seen.setdefault(key, node_id)
            except TypeError:  # an unhashable attribute: never merged, still run
                earlier = node_id
            if earlier != node_id:
                same[node_id] = earlier
                continue
        if isinstance(op, Input):
            leaves[node_id] = f"fed[{len(feeds)}]"
            leaf_slots[node_id] = ("fed", len(feeds))
            feeds.append(_Feed(op.name, node_id, torch_dtype(node.dtype), node.shape.dims,
                               f"{node.dtype.value}{node.shape}"))
        elif isinstance(op, Weight):
            if op.name not in weights:
                raise MissingWeight(op.name, node_id)
            leaves[node_id] = f"constants[{len(constants)}]"
            leaf_slots[node_id] = ("constant", len(constants))
            constants.append(weights[op.name].to(torch_device))
        elif isinstance(op, Const):
            if not node.shape.is_concrete:
                raise NotExecutable(node_id, f"{op} of symbolic shape {node.shape}")
            leaves[node_id] = f"constants[{len(constants)}]"
            leaf_slots[node_id] = ("constant", len(constants))
            constants.append(torch.full(node.shape.dims, op.value, dtype=torch_dtype(node.dtype),
                                        device=torch_device))
        elif isinstance(op, Prim | Fused):
            reads = tuple(same.get(r, r) for r in lowered.reads[node_id])
            dtypes = tuple(graph.node(i).dtype for i in reads) + (node.dtype,)
            # A node stamped for another backend (a placement arm on the route) runs there.
            node_backend = graph.target_backend.get(node_id, backend)
            entry = table.lookup(op_key(op), dtypes, node_backend, required_caps(node))
            kernels.append(entry.kernel(node))
            entries.append(entry)
            steps.append((node_id, reads))
        else:
            raise NotExecutable(node_id, str(op))
    roots = tuple(same.get(r, r) for r in lowered.roots)
    steps, kernels, entries = _drop_unread_concats(graph, steps, kernels, entries, roots)
    native = None
    if torch_device.type == "cpu" and all(
            graph.target_backend.get(n, backend) is BackendId.CPU for n, _ in steps):
        from fuel.runtime import native_steps

        native = native_steps.plan(graph, steps, kernels, entries, leaf_slots, feeds, constants,
                                   roots)
    return Program(lowered.roots, tuple(n for n, _ in steps),
                   lambda timed: _generate(leaves, steps, roots, timed=timed),
                   tuple(kernels), tuple(constants), tuple(feeds), torch_device, len(same), native)


def _sliced_part(graph: Graph, node_id: NodeId, lowered: Lowered, same: dict[NodeId, NodeId],
                 unmergeable: set[NodeId]) -> NodeId | None:
    """The concatenated operand a ``slice`` takes back whole (``slice(concat(a, b), a's range)``
    is ``a``), or None. A packed projection's outputs are concatenated by the lowering and split
    again by the next node (SwiGLU's gate and up): reading the parts spares the copy and the two
    views. Never for values derived from a mutable cache (their contents may change)."""
    op = graph.node(node_id).op
    if not (isinstance(op, Prim) and op.kind is OpKind.SLICE) or node_id in unmergeable:
        return None
    source = same.get(lowered.reads[node_id][0], lowered.reads[node_id][0])
    concat = graph.node(source)
    if not (isinstance(concat.op, Prim) and concat.op.kind is OpKind.CONCAT) or source in unmergeable:
        return None
    part = concat_part(graph, op, concat, lowered.reads[source])
    return None if part is None else same.get(part, part)


def concat_part(graph: Graph, op: Prim, concat, parts) -> NodeId | None:
    """The operand among ``parts`` (the concatenation's, in order) that the slice ``op`` of the
    ``concat`` node takes back whole, or None."""
    attrs, rank = op.attr_dict(), len(concat.shape.dims)
    dim = concat.op.attr_dict()["dim"] % rank
    if attrs["dim"] % rank != dim:
        return None
    offset = 0
    for part in parts:
        extent = graph.node(part).shape.dims[dim]
        if not isinstance(extent, int):
            return None
        if (attrs["start"], attrs["end"]) == (offset, offset + extent):
            return part
        offset += extent
    return None


def _drop_unread_concats(graph: Graph, steps, kernels, entries, roots):
    """Steps and kernels without the ``concat`` steps no later step reads (their slices read the
    parts: :func:`_sliced_part`). Only concatenations: they have no effect but their value."""
    read = set(roots)
    for _, reads in steps:
        read.update(reads)
    keep = [index for index, (node_id, _) in enumerate(steps)
            if node_id in read or not (isinstance(graph.node(node_id).op, Prim)
                                       and graph.node(node_id).op.kind is OpKind.CONCAT)]
    return [steps[i] for i in keep], [kernels[i] for i in keep], [entries[i] for i in keep]


def _unmergeable(graph: Graph, lowered: Lowered) -> set[NodeId]:
    """Nodes whose inputs may change contents between two evaluations, so an equal-looking
    earlier node does not stand for them: every node reading a *mutable* value — a cache a
    ``kv_cache_write`` updates in place, the write's result (that cache), and views or casts of
    one (they may alias it). Other kernels return fresh tensors, fixed once computed, so the
    nodes past attention merge as usual; ``iota``/``size`` read only a shape, which a write
    never changes."""
    mutable: set[NodeId] = set()
    for node_id in lowered.order:
        op = graph.node(node_id).op
        if isinstance(op, Prim) and op.kind is OpKind.KV_CACHE_WRITE:
            mutable.update((node_id, lowered.reads[node_id][0]))
    unmergeable = set(mutable)
    for node_id in lowered.order:
        op = graph.node(node_id).op
        if isinstance(op, Prim) and op.kind in _SHAPE_ONLY:
            continue
        if any(r in mutable for r in lowered.reads.get(node_id, ())):
            unmergeable.add(node_id)
            if isinstance(op, Prim) and op.kind in _ALIASING:
                mutable.add(node_id)
    return unmergeable


_SHAPE_ONLY = frozenset({OpKind.IOTA, OpKind.SIZE})
"""Primitives that read only their operand's shape."""
_ALIASING = frozenset({
    OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE, OpKind.UNSQUEEZE, OpKind.EXPAND,
    OpKind.SLICE, OpKind.SELECT, OpKind.CAST, OpKind.KV_CACHE_WRITE,
})
"""Primitives whose torch kernel may return a view of (or, for a no-op cast, the very) input."""


def execute(graph: Graph, roots, table: KernelBindingTable, feeds: Mapping[str, Any],
            weights: Mapping[str, Any] | None = None, route: Mapping[NodeId, int] | None = None,
            backend: BackendId = BackendId.CPU) -> dict[NodeId, Any]:
    """Lower, compile and run once (for tests and one-off evaluation)."""
    program = compile_program(graph, lower(graph, roots, route), table, backend, weights)
    return program.run(feeds)


__all__ = [
    "ExecutorError", "FeedMismatch", "KernelMissing", "MissingFeed", "MissingWeight",
    "NotExecutable", "Program", "compile_program", "execute",
]
