"""Mixture-of-experts lowering: the graph constructions of the MoE ops, the stacked expert
weights they bind, and the routing probes the run report counts experts with.

Decides what an MoE block of ``moe_gqa`` (``fuel/data/circuits/moe_gqa.toml``) computes on the
CPU, with each family's semantics as transformers implements them (``modeling_mixtral``,
``modeling_qwen2_moe``, ``modeling_qwen3_moe``, 5.x): router logits ``h @ W_gate.T``; softmax in
f32, then the top k, renormalized to sum 1 where the config map's ``norm_topk_prob`` says so
(Mixtral always); every (token, choice) row through its expert's gate_up, SwiGLU and down;
the choices summed weighted by their routing weights; Qwen2-MoE's shared expert added scaled by
``sigmoid(shared_gate)``.

=========================  ==================================================================
kernel func                graph construction
=========================  ==================================================================
router                     ``Fused FUSED_LINEAR(h, W_gate)`` (the logits, model dtype)
top_k                      ``moe_routing``: weights f32 ``[T, k]`` and ids i64 ``[T, k]``
expert_gate_up             ``expert_matmul(repeat_interleave(h, k), stack[E, 2I, H], ids)``
expert_down                ``expert_matmul(act, stack[E, H, I], ids)``
blend                      ``moe_blend`` (+ ``moe_shared`` with the shared expert's inputs)
moe                        the router's linear, then one ``Fused MOE`` over the rest
=========================  ==================================================================

The pieces are :mod:`fuel.graph.registry`'s (``moe_routing``, ``moe_choice_rows``, …): the
fused op's recipe is their composition, so the single-op route and the fused route compute the
same function, and a JIT kernel for ``moe`` is verified against exactly that.

Invariants:
- Tokens are grouped by expert: the experts' matmuls are ``expert_matmul`` nodes, whose kernels
  (and the numba ``moe`` template) read each distinct chosen expert's matrices once per step,
  never once per token, and never the experts no token chose.
- An expert binding's ``*`` is the expert index ``0 .. experts-1``. The experts' tensors are
  stacked once into a :class:`~fuel.runtime.lower.DerivedWeight` (``EXPERT_STACK``) shared by
  every program of the engine.
- Every MoE layer of a lowered step has one :class:`RoutingProbe`: its chosen expert ids as an
  extra root (the top_k construction's own ids, or, inside the fused op, ``topk_indices`` of the
  router logits: softmax is monotonic, so the same experts). The engine counts the distinct
  experts each step read from them; the probe never feeds the model's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuel.circuit.ir import Circuit, Node as CircuitNode, OpKind as CircuitOp
from fuel.errors import FuelError
from fuel.graph.dtype import DType
from fuel.graph.ir import NodeId
from fuel.graph.ops import OpKind
from fuel.graph.recipe import Bind, DimOf, EmitRefused, PatternNode, emit, op
from fuel.graph.registry import (
    FusedOpParams, FusedOps, moe_blend, moe_choice_ids, moe_choice_rows, moe_routing, moe_shared,
)

if TYPE_CHECKING:
    from fuel.circuit.fuser import Group


class MoeLowerError(FuelError):
    """An MoE node lowering cannot build (a malformed param, a piece that does not type)."""

    def __init__(self, node: str, detail: str):
        self.node, self.detail = node, detail
        super().__init__(f"MoE node `{node}`: {detail}")


@dataclass(frozen=True, slots=True)
class RoutingProbe:
    """One MoE layer's chosen experts in a lowered step: ``node`` is ``[T, k]`` i64 ids."""

    node: NodeId
    block: str
    experts: int
    expert_bytes: int
    """Bytes of one expert's matrices (gate_up and down) in the step's dtype."""


EXPERT_WILDCARD = "*"


def expert_names(binding: str, experts: int) -> tuple[str, ...]:
    """The checkpoint names an expert binding stands for, expert 0 first."""
    return tuple(binding.replace(EXPERT_WILDCARD, str(e)) for e in range(experts))


def stack_name(bindings: Sequence[str]) -> str:
    return "stack[" + "+".join(bindings) + "]"


def stack_experts(tensors: Mapping[str, Any], sources: Sequence[str], group: int):
    """``[E, rows, in]``: each expert's ``group`` tensors concatenated along dim 0 (gate then
    up), the experts stacked along a new leading dim (``sources`` is expert-major)."""
    import torch

    parts = [tensors[name] for name in sources]
    experts = [torch.cat(parts[i:i + group], dim=0) if group > 1 else parts[i]
               for i in range(0, len(parts), group)]
    return torch.stack(experts).contiguous()


# ------------------------------------------------------------------------------ params


def _int(node: CircuitNode, key: str) -> int:
    value = node.param(key)
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MoeLowerError(node.id, f"{key} = {value!r} is not an integer") from None
    if number < 1:
        raise MoeLowerError(node.id, f"{key} = {number} must be at least 1")
    return number


def _bool(node: CircuitNode, key: str) -> bool:
    value = node.param(key)
    if value not in ("true", "false"):
        raise MoeLowerError(node.id, f"{key} = {value!r} is not true or false")
    return value == "true"


def _emit(low: Any, node: CircuitNode, region: PatternNode, binds: Sequence[NodeId],
          top_k: int) -> NodeId:
    """Emit a registry piece; ``dtype`` is the activations' (the step's) dtype."""
    root = emit(low.graph, region, binds, {"top_k": top_k, "dtype": low.dtype})
    if isinstance(root, EmitRefused):
        raise MoeLowerError(node.id, root.reason)
    return root


# -------------------------------------------------------------------------- weights


def _stacked(low: Any, node: CircuitNode) -> NodeId:
    """The node's expert bindings stacked ``[E, rows, in]`` (one derived weight per layer)."""
    from fuel.runtime.lower import DerivedKind, DerivedWeight

    experts = _int(node, "experts")
    per_expert = [expert_names(b, experts) for b in node.bindings]
    sources = tuple(name for e in range(experts) for names in per_expert for name in (names[e],))
    first = [low.weight_shapes[names[0]] for names in per_expert]
    dims = (experts, sum(shape[0] for shape in first), first[0][1])
    spec = DerivedWeight(stack_name(node.bindings), DerivedKind.EXPERT_STACK, sources,
                         group=len(node.bindings))
    return low.derived_weight(spec, dims)


def _expert_bytes(low: Any, gate_up: CircuitNode, down: CircuitNode) -> int:
    size = 4 if low.dtype is DType.F32 else 2
    total = 0
    for node in (gate_up, down):
        for binding in node.bindings:
            rows, cols = low.weight_shapes[expert_names(binding, 1)[0]]
            total += rows * cols * size
    return total


def _probe(low: Any, ids: NodeId, block: str, experts: int, gate_up: CircuitNode,
           down: CircuitNode) -> None:
    low.routing.append(RoutingProbe(ids, block, experts, _expert_bytes(low, gate_up, down)))


def _block_node(low: Any, block: str, kind: CircuitOp) -> CircuitNode:
    """The block's (first) node of ``kind``: the per-op constructions find their partners."""
    for node in low.circuit.nodes:
        if node.block == block and node.op.kind is kind:
            return node
    raise MoeLowerError(block, f"the block has no {kind.value} node")


# ---------------------------------------------------------------------- constructions


def _router_node(low: Any, node: CircuitNode) -> NodeId:
    logits = low.graph.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(),
                             low.read(node, 0), low.weight(node.bindings[0]))
    low.write(node, 0, logits)
    return logits


def _router(low: Any, group: Group, kernel: str) -> None:
    (node,) = low.members(group)
    _router_node(low, node)


def _top_k(low: Any, group: Group, kernel: str) -> None:
    (node,) = low.members(group)
    k, normalize = _int(node, "k"), _bool(node, "normalize")
    weights, ids = moe_routing(Bind(0), normalize)
    logits = low.read(node, 0)
    low.write(node, 0, _emit(low, node, weights, (logits,), k))
    chosen = _emit(low, node, ids, (logits,), k)
    low.write(node, 1, chosen)
    gate_up = _block_node(low, node.block, CircuitOp.EXPERT_GATE_UP)
    down = _block_node(low, node.block, CircuitOp.EXPERT_DOWN)
    _probe(low, chosen, node.block, _int(gate_up, "experts"), gate_up, down)


def _expert_gate_up(low: Any, group: Group, kernel: str) -> None:
    (node,) = low.members(group)
    k = _int(node, "k")
    rows = op(OpKind.EXPERT_MATMUL, moe_choice_rows(Bind(0)), Bind(1), moe_choice_ids(Bind(2)))
    low.write(node, 0, _emit(low, node, rows, (low.read(node, 0), _stacked(low, node),
                                               low.read(node, 1)), k))


def _expert_down(low: Any, group: Group, kernel: str) -> None:
    (node,) = low.members(group)
    k = _int(node, "k")
    rows = op(OpKind.EXPERT_MATMUL, Bind(0), Bind(1), moe_choice_ids(Bind(2)))
    low.write(node, 0, _emit(low, node, rows, (low.read(node, 0), _stacked(low, node),
                                               low.read(node, 1)), k))


def _blend(low: Any, group: Group, kernel: str) -> None:
    (node,) = low.members(group)
    k = _int(node, "k")
    region = moe_blend(Bind(0), Bind(1), DimOf(0, 1))
    binds = [low.read(node, 0), low.read(node, 1)]
    if len(node.inputs) == 4:
        region = moe_shared(region, Bind(2), Bind(3))
        binds += [low.read(node, 2), low.read(node, 3)]
    elif len(node.inputs) != 2:
        raise MoeLowerError(node.id, f"blend reads {len(node.inputs)} inputs; expected the "
                                     "experts' rows and weights, and optionally the shared "
                                     "expert's output and gate")
    low.write(node, 0, _emit(low, node, region, binds, k))


def _moe(low: Any, group: Group, kernel: str) -> None:
    router, top_k, gate_up, act, down, blend = low.members(group)
    k, normalize = _int(top_k, "k"), _bool(top_k, "normalize")
    if act.inputs[0] != gate_up.outputs[0] or down.inputs[0] != act.outputs[0]:
        raise MoeLowerError(act.id, "the SwiGLU must sit between the experts' gate_up and down")
    logits = _router_node(low, router)
    operands = [low.read(gate_up, 0), logits, _stacked(low, gate_up), _stacked(low, down)]
    shared = len(blend.inputs) == 4
    if shared:
        operands += [low.read(blend, 2), low.read(blend, 3)]
    g = low.graph
    low.write(blend, 0, g.fused(FusedOps.MOE, FusedOpParams.Moe(k, normalize, shared), *operands))
    chosen = g.prim(OpKind.TOPK_INDICES, logits, k=k, dim=-1)
    _probe(low, chosen, router.block, _int(gate_up, "experts"), gate_up, down)


CONSTRUCTIONS: Mapping[str, tuple[tuple[CircuitOp, ...], Callable[..., None]]] = {
    "router": ((CircuitOp.ROUTER,), _router),
    "top_k": ((CircuitOp.TOP_K,), _top_k),
    "expert_gate_up": ((CircuitOp.EXPERT_GATE_UP,), _expert_gate_up),
    "expert_down": ((CircuitOp.EXPERT_DOWN,), _expert_down),
    "blend": ((CircuitOp.BLEND,), _blend),
    "moe": ((CircuitOp.ROUTER, CircuitOp.TOP_K, CircuitOp.EXPERT_GATE_UP, CircuitOp.SILU_MUL,
             CircuitOp.EXPERT_DOWN, CircuitOp.BLEND), _moe),
}
"""``fuel.kernels.cpu::<func>`` → (the member ops it serves, its construction)."""


def expected_shapes(circuit: Circuit, node: CircuitNode) -> dict[str, tuple[int, ...]] | None:
    """The checkpoint tensors an MoE node binds and their shapes (``None``: not an MoE node):
    the router ``[experts, hidden]``, each expert's gate and up ``[I, hidden]``, its down
    ``[hidden, I]``."""
    kind = node.op.kind
    if kind not in (CircuitOp.ROUTER, CircuitOp.EXPERT_GATE_UP, CircuitOp.EXPERT_DOWN):
        return None
    width = circuit.edges[node.inputs[0]].dim_value
    out = circuit.edges[node.outputs[0]].dim_value
    if kind is CircuitOp.ROUTER:
        return {node.bindings[0]: (int(out), int(width))}
    experts = _int(node, "experts")
    rows = int(out) // len(node.bindings)
    return {name: (rows, int(width)) for binding in node.bindings
            for name in expert_names(binding, experts)}


__all__ = ["CONSTRUCTIONS", "EXPERT_WILDCARD", "MoeLowerError", "RoutingProbe", "expected_shapes",
           "expert_names", "stack_experts", "stack_name"]
