"""Layer 1 for a graph node: ``estimate(graph, node_id) -> CostEstimate | Unestimated``.

Decided here: which family formula (:mod:`fuel.cost.families`) prices each op of the tensor
graph, with the node's real shapes, dtypes and params, and which Judge key (op name, size
class) names the same node — the one ``size_class`` the profiler also uses.

- Symbolic dims (``"k_len"``) are priced at their capacity from ``symbols`` (name → the largest
  value the plan allows); a symbol without a binding makes the node :class:`Unestimated`.
- Paged attention is priced at occupancy when ``context_lens`` (one length per sequence) is
  given, else at the block table's capacity.
- Layout ops that torch performs as views (reshape, permute, transpose, unsqueeze, expand,
  slice, select) are :func:`fuel.cost.families.view`: no launch, no traffic, one host-side
  call (zero on a GPU spec, the probed per-call overhead on ``cpu-local``); leaves (inputs,
  weights) and branch nodes cost nothing.
- Runtime fused ops (ids from 0x8000) have no family formula: :class:`Unestimated` with the
  reason, so a provider prices their interior instead.
- The family formula assumes the op runs as one kernel (one launch). Priced for a specific
  bound kernel (:func:`estimate_for_kernel`), the launches are the compute calls that kernel
  really makes (``KernelEntry.calls``: a torch composite such as the CPU rms_norm makes six),
  so the roofline charges one launch overhead per call; the work (flops, bytes) is the op's.

Invariants: pure (no files, clock or environment); never raises for a well-formed node — an
ordinary "cannot price" is an :class:`Unestimated` value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Sequence

from fuel.cost import families as fam
from fuel.cost.roofline import CostEstimate
from fuel.cost.sizeclass import size_class_attention, size_class_elements, size_class_matmul
from fuel.graph.ir import Branch, Const, Fused, Graph, Input, Node, NodeId, Prim, Weight
from fuel.graph.ops import OpKind
if TYPE_CHECKING:
    from fuel.kernels.table import KernelEntry
from fuel.graph.registry import (
    FlashAttn,
    FusedOps,
    LayerNorm,
    PagedAttn,
    RmsNorm,
    fused_name,
)


@dataclass(frozen=True, slots=True)
class Unestimated:
    """No Layer-1 estimate for this node; ``reason`` says why (an ordinary "no")."""

    reason: str


class _Symbolic(Exception):
    """Internal: a symbolic dim without a capacity binding."""


_TRANSCENDENTAL = {OpKind.EXP, OpKind.LOG, OpKind.SQRT, OpKind.RSQRT, OpKind.TANH, OpKind.SIGMOID, OpKind.POW_SCALAR}
_ELEMENTWISE = {
    OpKind.NEG, OpKind.RECIP, OpKind.ABS, OpKind.MUL_SCALAR, OpKind.ADD_SCALAR, OpKind.ADD,
    OpKind.SUB, OpKind.MUL, OpKind.DIV, OpKind.MAXIMUM, OpKind.COMPARE, OpKind.WHERE,
    OpKind.MASKED_FILL, OpKind.CAST, OpKind.SILU, *_TRANSCENDENTAL,
}
_REDUCTIONS = {OpKind.SUM, OpKind.MAX, OpKind.MEAN, OpKind.ARGMAX, OpKind.TOPK_VALUES, OpKind.TOPK_INDICES}
_VIEWS = {OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE, OpKind.UNSQUEEZE, OpKind.EXPAND, OpKind.SLICE, OpKind.SELECT, OpKind.SIZE}
_MOVES = {OpKind.CONCAT, OpKind.REPEAT_INTERLEAVE, OpKind.INDEX_SELECT, OpKind.GATHER}


def judge_op_name(node: Node) -> str | None:
    """The Judge's ``op`` key for a node: the primitive's or fused op's canonical name."""
    if isinstance(node.op, Prim):
        return node.op.kind.value
    if isinstance(node.op, Fused):
        return fused_name(node.op.id)
    return None


def _dims(node: Node, symbols: Mapping[str, int]) -> tuple[int, ...]:
    out = []
    for dim in node.shape.dims:
        if isinstance(dim, str):
            if dim not in symbols:
                raise _Symbolic(dim)
            out.append(int(symbols[dim]))
        else:
            out.append(dim)
    return tuple(out)


def _numel(node: Node, symbols: Mapping[str, int]) -> int:
    return math.prod(_dims(node, symbols))


def _elementwise_flops(kind: OpKind) -> int:
    if kind is OpKind.SILU:
        return fam.TRANSCENDENTAL_FLOPS + 2
    if kind in _TRANSCENDENTAL:
        return fam.TRANSCENDENTAL_FLOPS
    return 1


def _prim(graph: Graph, node: Node, symbols: Mapping[str, int]) -> CostEstimate:
    kind = node.op.kind
    inputs = [graph.node(i) for i in node.inputs]
    out = _numel(node, symbols)
    dtype = node.dtype.value
    if kind in _ELEMENTWISE:
        return fam.elementwise(
            out, dtype, [(_numel(i, symbols), i.dtype.value) for i in inputs],
            flops_per_element=_elementwise_flops(kind),
        )
    if kind in _REDUCTIONS:
        return fam.reduction(_numel(inputs[0], symbols), out, inputs[0].dtype.value, dtype)
    if kind is OpKind.MATMUL:
        a, b = (_dims(i, symbols) for i in inputs)
        o = _dims(node, symbols)
        m = a[-2] if len(a) >= 2 else 1
        n = b[-1] if len(b) >= 2 else 1
        return fam.matmul(
            batch=math.prod(o[:-2]), m=m, k=a[-1], n=n, dtype=inputs[0].dtype.value,
            out_dtype=dtype, a_batch=math.prod(a[:-2]), b_batch=math.prod(b[:-2]),
        )
    if kind is OpKind.EXPERT_MATMUL:
        # Rows grouped by expert: at most min(rows, experts) distinct matrices are read (the
        # ids are data, so Layer 1 prices the worst case: every row a different expert).
        x, w, ids = (_dims(i, symbols) for i in inputs)
        rows, experts, n, k = x[0], w[0], w[1], x[1]
        dtype_in = inputs[0].dtype.value
        read = (min(rows, experts) * fam.tensor_bytes(n * k, inputs[1].dtype.value)
                + fam.tensor_bytes(rows * k, dtype_in)
                + fam.tensor_bytes(rows, inputs[2].dtype.value))
        return CostEstimate(flops=2 * rows * n * k, bytes=read + fam.tensor_bytes(rows * n, dtype),
                            matrix_flops=2 * rows * n * k, matrix_dtype=dtype_in)
    if kind in _VIEWS:
        return fam.view()
    if kind in _MOVES:
        index_bytes = sum(
            fam.tensor_bytes(_numel(i, symbols), i.dtype.value) for i in inputs[1:]
        ) if kind in (OpKind.INDEX_SELECT, OpKind.GATHER) else 0
        return fam.data_movement(out, dtype, extra_read_bytes=index_bytes)
    if kind is OpKind.IOTA:
        return CostEstimate(flops=out, bytes=fam.tensor_bytes(out, dtype))
    if kind is OpKind.KV_CACHE_WRITE:
        # inputs: cache, values, slots — the cache is updated in place where slots point
        values, slots = inputs[1], inputs[2]
        moved = fam.tensor_bytes(_numel(values, symbols), values.dtype.value)
        return CostEstimate(flops=0, bytes=2 * moved + fam.tensor_bytes(_numel(slots, symbols), slots.dtype.value))
    if kind is OpKind.DEQUANTIZE:
        # Read the packed blocks once, write f32; a multiply-add per element.
        packed = inputs[0]
        return fam.elementwise(out, dtype, [(_numel(packed, symbols), packed.dtype.value)],
                               flops_per_element=2)
    raise _Unknown(f"no Layer-1 family for primitive {kind.value}")


class _Unknown(Exception):
    pass


def _fused(graph: Graph, node: Node, symbols: Mapping[str, int], context_lens: Sequence[int] | None) -> CostEstimate:
    fused_id, params = node.op.id, node.op.params
    inputs = [graph.node(i) for i in node.inputs]
    if fused_id not in FusedOps._value2member_map_:
        raise _Unknown(f"runtime fused op {fused_name(fused_id)} has no Layer-1 family; price its interior")
    which = FusedOps(fused_id)
    x = _dims(inputs[0], symbols)
    dtype = inputs[0].dtype.value
    rows, last = (math.prod(x[:-1]), x[-1]) if x else (1, 1)
    if which is FusedOps.SOFTMAX_LAST_DIM:
        return fam.softmax(rows, last, dtype)
    if which is FusedOps.RMS_NORM:
        assert isinstance(params, RmsNorm)
        return fam.rms_norm(rows, last, dtype, gain=params.has_gain)
    if which is FusedOps.LAYER_NORM:
        assert isinstance(params, LayerNorm)
        return fam.layer_norm(rows, last, dtype, affine=len(inputs) >= 3)
    if which is FusedOps.ROPE:
        table = _dims(inputs[1], symbols)
        return fam.rope(
            math.prod(x), math.prod(table[:-1]), table[-1], dtype, table_dtype=inputs[1].dtype.value
        )
    if which is FusedOps.FUSED_LINEAR:
        w = _dims(inputs[1], symbols)
        return fam.matmul(
            batch=1, m=rows, k=last, n=w[0], dtype=dtype, out_dtype=node.dtype.value,
            bias=len(inputs) >= 3,
        )
    if which is FusedOps.QUANT_LINEAR:
        # The packed weight is read once (its bytes, scales included), the product in f32.
        w = _dims(inputs[1], symbols)
        packed = fam.tensor_bytes(math.prod(w), inputs[1].dtype.value)
        contraction = 2 * rows * last * w[0]
        return CostEstimate(flops=contraction, bytes=packed + fam.tensor_bytes(rows * last, dtype)
                            + fam.tensor_bytes(rows * w[0], node.dtype.value),
                            matrix_flops=contraction, matrix_dtype=dtype)
    if which is FusedOps.SILU_MUL:
        return fam.silu_mul(_numel(node, symbols), dtype)
    if which is FusedOps.RESIDUAL_ADD_RMS_NORM:
        return fam.residual_rms_norm(rows, last, dtype, gain=len(inputs) >= 3)
    if which is FusedOps.FLASH_ATTN:
        assert isinstance(params, FlashAttn)
        k = _dims(inputs[1], symbols)
        batch, heads, q_len, head_dim = x
        return fam.attention(
            batch=batch, heads=heads, kv_heads=k[1], q_len=q_len, k_len=k[2], head_dim=head_dim,
            dtype=dtype, out_dtype=node.dtype.value,
        )
    if which is FusedOps.PAGED_ATTN:
        assert isinstance(params, PagedAttn)
        cache = _dims(inputs[1], symbols)  # [blocks, block_size, kv_heads, head_dim]
        table = _dims(inputs[3], symbols)  # [seqs, blocks_per_seq]
        batch, heads, q_len, head_dim = x
        return fam.paged_attention(
            seqs=batch, heads=heads, kv_heads=cache[2], q_len=q_len, head_dim=head_dim,
            dtype=dtype, block_size=params.block_size, blocks_per_seq=table[1],
            context_lens=context_lens, index_dtype=inputs[3].dtype.value,
        )
    if which is FusedOps.MOE:
        # Route, grouped expert MLP, combine: at most min(T*k, E) distinct experts' matrices are
        # read (the routing is data: Layer 1 prices the worst case, every choice distinct).
        tokens, hidden = x
        experts, two_inter = _dims(inputs[2], symbols)[:2]
        choices = tokens * params.top_k
        per_expert = fam.tensor_bytes(3 * hidden * (two_inter // 2), inputs[2].dtype.value)
        contraction = 2 * choices * 3 * hidden * (two_inter // 2)
        moved = sum(fam.tensor_bytes(_numel(i, symbols), i.dtype.value)
                    for index, i in enumerate(inputs) if index not in (2, 3))
        return CostEstimate(
            flops=contraction + choices * (two_inter + 2 * hidden),
            bytes=min(choices, experts) * per_expert + moved
            + fam.tensor_bytes(_numel(node, symbols), node.dtype.value),
            matrix_flops=contraction, matrix_dtype=dtype)
    raise _Unknown(f"no Layer-1 family for fused op {fused_name(fused_id)}")


def estimate(
    graph: Graph,
    node_id: NodeId,
    *,
    symbols: Mapping[str, int] | None = None,
    context_lens: Sequence[int] | None = None,
) -> CostEstimate | Unestimated:
    """The Layer-1 work of one node (see the module docstring for the rules)."""
    symbols = symbols or {}
    node = graph.node(node_id)
    try:
        if isinstance(node.op, (Input, Weight, Branch)):
            return CostEstimate(flops=0, bytes=0, launches=0)
        if isinstance(node.op, Const):
            return CostEstimate(flops=0, bytes=fam.tensor_bytes(_numel(node, symbols), node.dtype.value))
        if isinstance(node.op, Prim):
            return _prim(graph, node, symbols)
        if isinstance(node.op, Fused):
            return _fused(graph, node, symbols, context_lens)
        return Unestimated(f"node {node_id}: unknown op {node.op}")
    except _Symbolic as missing:
        return Unestimated(f"node {node_id}: symbolic dim `{missing}` has no capacity binding")
    except _Unknown as unknown:
        return Unestimated(f"node {node_id}: {unknown}")


def estimate_for_kernel(
    graph: Graph,
    node_id: NodeId,
    entry: KernelEntry,
    *,
    symbols: Mapping[str, int] | None = None,
    context_lens: Sequence[int] | None = None,
) -> CostEstimate | Unestimated:
    """The node's Layer-1 work as run by ``entry``: :func:`estimate`, with ``launches`` = the
    compute calls the kernel makes for this node (``entry.calls``). An entry that declares no
    count keeps the estimate's launches (one for a kernel, none for a leaf)."""
    work = estimate(graph, node_id, symbols=symbols, context_lens=context_lens)
    if not isinstance(work, CostEstimate) or entry.calls is None:
        return work
    node = graph.node(node_id)
    calls = entry.calls(node, [graph.node(i) for i in node.inputs])
    return replace(work, launches=calls)


def size_class_of(
    graph: Graph,
    node_id: NodeId,
    *,
    symbols: Mapping[str, int] | None = None,
    context_lens: Sequence[int] | None = None,
) -> str | None:
    """The Judge size class for a node (matmul and attention get aspect keys); None when a
    symbolic dim has no binding."""
    symbols = symbols or {}
    node = graph.node(node_id)
    try:
        inputs = [graph.node(i) for i in node.inputs]
        if isinstance(node.op, Prim) and node.op.kind is OpKind.MATMUL:
            a, o = _dims(inputs[0], symbols), _dims(node, symbols)
            return size_class_matmul(
                batch=math.prod(o[:-2]), m=a[-2] if len(a) >= 2 else 1, k=a[-1], n=o[-1]
            )
        if isinstance(node.op, Fused) and node.op.id == FusedOps.FUSED_LINEAR:
            x, o = _dims(inputs[0], symbols), _dims(node, symbols)
            return size_class_matmul(batch=1, m=math.prod(x[:-1]), k=x[-1], n=o[-1])
        if isinstance(node.op, Fused) and node.op.id in (FusedOps.FLASH_ATTN, FusedOps.PAGED_ATTN):
            batch, heads, q_len, head_dim = _dims(inputs[0], symbols)
            if node.op.id == FusedOps.FLASH_ATTN:
                k_len = _dims(inputs[1], symbols)[2]
            elif context_lens is not None:
                k_len = max(context_lens, default=0)
            else:
                k_len = _dims(inputs[3], symbols)[1] * node.op.params.block_size
            return size_class_attention(batch=batch, heads=heads, q_len=q_len, k_len=k_len, head_dim=head_dim)
        return size_class_elements(_numel(node, symbols))
    except _Symbolic:
        return None
