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
- Per-node work at run time is one list read per input, one call and one list write: the
  kernel callables and input slots are precomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuel.errors import FuelError
from fuel.graph.branch import Lowered, lower
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Const, Fused, Graph, Input, NodeId, Prim, Weight
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
    slot: int
    dtype: Any
    dims: tuple[Any, ...]
    label: str


class Program:
    """A compiled dispatch order: call :meth:`run` with the feeds for each step."""

    __slots__ = ("roots", "executed", "executed_nodes", "_steps", "_template", "_feeds",
                 "_root_slots", "device")

    def __init__(self, roots, executed, steps, template, feeds, root_slots, device):
        self.roots: tuple[NodeId, ...] = roots
        self.executed: tuple[NodeId, ...] = executed
        self.executed_nodes = 0
        self.device = device
        self._steps = steps
        self._template = template
        self._feeds = feeds
        self._root_slots = root_slots

    def run(self, feeds: Mapping[str, Any]) -> dict[NodeId, Any]:
        """Run every step; returns ``{root id: tensor}``."""
        values = list(self._template)
        for feed in self._feeds:
            tensor = feeds.get(feed.name)
            if tensor is None:
                raise MissingFeed(feed.name, feed.node)
            if tensor.dtype != feed.dtype or tensor.dim() != len(feed.dims) or any(
                    isinstance(d, int) and d != actual for d, actual in zip(feed.dims, tensor.shape)):
                raise FeedMismatch(feed.name, feed.label, f"{tensor.dtype}{list(tensor.shape)}")
            values[feed.slot] = tensor.to(self.device)
        self.executed_nodes = 0
        count = 0
        for fn, args, out in self._steps:
            values[out] = fn(*[values[i] for i in args])
            count += 1
        self.executed_nodes = count
        return {root: values[slot] for root, slot in self._root_slots}

    def __len__(self) -> int:
        return len(self._steps)


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
    slot_of = {node_id: slot for slot, node_id in enumerate(lowered.order)}
    template: list[Any] = [None] * len(lowered.order)
    feeds: list[_Feed] = []
    steps: list[tuple[Any, tuple[int, ...], int]] = []
    executed: list[NodeId] = []
    for slot, node_id in enumerate(lowered.order):
        node = graph.node(node_id)
        op = node.op
        if isinstance(op, Input):
            dims = node.shape.dims
            feeds.append(_Feed(op.name, node_id, slot, torch_dtype(node.dtype), dims,
                               f"{node.dtype.value}{node.shape}"))
        elif isinstance(op, Weight):
            if op.name not in weights:
                raise MissingWeight(op.name, node_id)
            template[slot] = weights[op.name].to(torch_device)
        elif isinstance(op, Const):
            if not node.shape.is_concrete:
                raise NotExecutable(node_id, f"{op} of symbolic shape {node.shape}")
            template[slot] = torch.full(node.shape.dims, op.value, dtype=torch_dtype(node.dtype),
                                        device=torch_device)
        elif isinstance(op, Prim | Fused):
            reads = lowered.reads[node_id]
            dtypes = tuple(graph.node(i).dtype for i in reads) + (node.dtype,)
            key = op_key(op)
            entry = table.lookup(key, dtypes, backend, required_caps(node))
            steps.append((entry.kernel(node), tuple(slot_of[i] for i in reads), slot))
            executed.append(node_id)
        else:
            raise NotExecutable(node_id, str(op))
    root_slots = tuple((root, slot_of[root]) for root in lowered.roots)
    return Program(lowered.roots, tuple(executed), steps, template, feeds, root_slots, torch_device)


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
