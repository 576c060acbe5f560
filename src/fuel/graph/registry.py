"""The fused-op registry: static fused ops with params, shape/dtype rules and recipes, and the
runtime sidecar for regions registered while running (the JIT's synthesized kernels).

Decides what each fused op means. A fused op's meaning *is* its recipe: the decomposed arm,
the JIT request and the kernel tests all read the same region, so a kernel is correct exactly
when it equals its recipe's decomposition.

Layouts the static ops assume (the rules refuse anything else):
- attention: ``q [B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0`` (GQA: kv
  head ``h // (Hq // Hkv)`` serves query head ``h``); ``Sk`` may be a symbol (``"k_len"``).
  Causal means query ``i`` sees keys ``j <= i + (Sk - Sq)`` (the queries are the last ``Sq``
  positions).
- paged attention: caches ``[num_blocks, block_size, Hkv, D]``; ``block_table [B, M]`` and
  ``context_lens [B]`` are index dtypes (u32 in practice, and kept u32 by the recipe); query
  ``i`` of sequence ``b`` sits at position ``context_lens[b] - Sq + i`` and sees positions up
  to it. Block-table entries past the context must still name a valid block (0 will do):
  the recipe gathers whole blocks and masks the tail.
- ``residual_add_rms_norm(x, residual, gain)`` has two results, stacked on a new leading axis:
  ``out[0]`` is the normed value, ``out[1]`` the residual sum ``x + residual``; readers take
  ``select(dim=0, index=i)``. One node, one allocation, so a kernel writes both halves.
- ``rope(x, cos, sin)`` is rotate-half over the last dim; ``cos``/``sin`` broadcast to ``x``.
- ``fused_linear(x, w[, b])``: ``w`` is ``[N, K]`` (the checkpoint layout), ``x @ w.T + b``.
- ``quant_linear(x, w)``: ``w`` is u8 ``[N, row_bytes]`` packed rows — llama.cpp blocks, 16-bit
  elements or per-channel int8 (``QuantLinear`` names the layout:
  :data:`fuel.circuit.format.ROW_LAYOUTS`); the recipe is ``x @ dequantize(w).T`` in f32.
- ``moe(h [T, H], router_logits [T, E], gate_up [E, 2I, H], down [E, H, I][, shared_out [T, H],
  shared_gate [T, 1]])``: softmax of the logits in f32, the top ``k`` (renormalized to sum 1 when
  ``normalize``), each token's row repeated per choice, ``expert_matmul`` through the chosen
  experts' gate_up, SwiGLU, ``expert_matmul`` through their down, the choices' rows summed
  weighted (weights cast to the activations' dtype), plus ``sigmoid(shared_gate) * shared_out``
  when ``shared`` (Qwen2-MoE). The router projection stays outside (a linear: the runtime reads
  the routing off its logits for the expert-load report).

Invariants:
- Static ids are ``FusedOps`` members (< 0x8000); runtime ids start at 0x8000 and are unique
  per :class:`RuntimeFusedRegistry`; registering a structurally equal region returns the id
  already given (dedup by :func:`~fuel.graph.recipe.structural_hash`).
- :func:`recipe_for` never touches the graph; :func:`decompose` never raises: any failure
  returns the node itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from fuel.errors import FuelError
from fuel.graph.dtype import INDEX_DTYPES, DType, Shape
from fuel.pickling import fast_pickle
from fuel.graph.ir import Fused, Graph, NodeId
from fuel.graph.ops import OpKind, Predicate, ShapeError
from fuel.graph.recipe import (
    Bind, DimOf, EmitRefused, PatternNode, PatternOp, Quot, Slot, bind_indices, emit, fill_slots,
    op, structural_hash, walk,
)

RUNTIME_FUSED_BASE = 0x8000


class FusedOps(IntEnum):
    """Static fused-op ids."""

    SOFTMAX_LAST_DIM = 1
    RMS_NORM = 2
    LAYER_NORM = 3
    ROPE = 4
    FUSED_LINEAR = 5
    SILU_MUL = 6
    RESIDUAL_ADD_RMS_NORM = 7
    FLASH_ATTN = 8
    PAGED_ATTN = 9
    QUANT_LINEAR = 10
    MOE = 11


# Params, one frozen dataclass per op.
@fast_pickle
@dataclass(frozen=True, slots=True)
class SoftmaxLastDim:
    pass


@fast_pickle
@dataclass(frozen=True, slots=True)
class RmsNorm:
    eps: float
    has_gain: bool = True


@fast_pickle
@dataclass(frozen=True, slots=True)
class LayerNorm:
    eps: float


@fast_pickle
@dataclass(frozen=True, slots=True)
class Rope:
    pass


@fast_pickle
@dataclass(frozen=True, slots=True)
class FusedLinear:
    has_bias: bool = False


@fast_pickle
@dataclass(frozen=True, slots=True)
class SiluMul:
    pass


@fast_pickle
@dataclass(frozen=True, slots=True)
class ResidualAddRmsNorm:
    eps: float


@fast_pickle
@dataclass(frozen=True, slots=True)
class FlashAttn:
    softmax_scale: float
    causal: bool = True
    softcap: float | None = None


@fast_pickle
@dataclass(frozen=True, slots=True)
class PagedAttn:
    softmax_scale: float
    block_size: int
    softcap: float | None = None
    kv_dtype: DType | None = None
    """The caches' element dtype where it is not the query's (a bf16/f16 cache read by f32
    queries: each gathered row widened to the query's dtype, never the whole cache); None: the
    query's."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class QuantLinear:
    """``x @ dequantize(w).T`` for a weight stored as packed rows of ``layout`` (llama.cpp
    blocks, half-precision elements or ``int8_channel``) with ``cols`` input features (``w`` is
    u8 ``[N, row_bytes]``: :func:`fuel.circuit.format.row_bytes`)."""

    layout: str
    cols: int


@fast_pickle
@dataclass(frozen=True, slots=True)
class Moe:
    top_k: int
    normalize: bool
    shared: bool = False


@fast_pickle
@dataclass(frozen=True, slots=True)
class RuntimeFusedParams:
    """Values for a runtime region's open slots (name-sorted pairs)."""

    slots: tuple[tuple[str, Any], ...] = ()


class FusedOpParams:
    """Namespace of the params types, in the seeds' spelling: ``FusedOpParams.PagedAttn(...)``."""

    SoftmaxLastDim = SoftmaxLastDim
    RmsNorm = RmsNorm
    LayerNorm = LayerNorm
    Rope = Rope
    FusedLinear = FusedLinear
    SiluMul = SiluMul
    ResidualAddRmsNorm = ResidualAddRmsNorm
    FlashAttn = FlashAttn
    PagedAttn = PagedAttn
    QuantLinear = QuantLinear
    Moe = Moe
    Runtime = RuntimeFusedParams


# Recipe building blocks.
def _softmax(x: PatternNode) -> PatternNode:
    shifted = op(OpKind.SUB, x, op(OpKind.MAX, x, dim=-1, keepdim=True))
    exps = op(OpKind.EXP, shifted)
    return op(OpKind.DIV, exps, op(OpKind.SUM, exps, dim=-1, keepdim=True))


def _rms(x: PatternNode, gain: PatternNode | None) -> PatternNode:
    mean_square = op(OpKind.MEAN, op(OpKind.MUL, x, x), dim=-1, keepdim=True)
    normed = op(OpKind.MUL, x, op(OpKind.RSQRT, op(OpKind.ADD_SCALAR, mean_square, value=Slot("eps"))))
    return normed if gain is None else op(OpKind.MUL, normed, gain)


def _softcap(scores: PatternNode, softcap: float | None) -> PatternNode:
    if softcap is None:
        return scores
    squashed = op(OpKind.TANH, op(OpKind.MUL_SCALAR, scores, value=Slot("softcap_recip")))
    return op(OpKind.MUL_SCALAR, squashed, value=Slot("softcap"))


def _attend(q: PatternNode, k: PatternNode, v: PatternNode, kv_heads_axis_bind: DimOf,
            softcap: float | None) -> tuple[PatternNode, PatternNode]:
    """Scores (scaled, soft-capped) and the GQA-expanded values; masking is the caller's."""
    groups = Quot(DimOf(0, 1), kv_heads_axis_bind)
    k = op(OpKind.REPEAT_INTERLEAVE, k, repeats=groups, dim=1)
    v = op(OpKind.REPEAT_INTERLEAVE, v, repeats=groups, dim=1)
    scores = op(OpKind.MATMUL, q, op(OpKind.TRANSPOSE, k, dim0=-2, dim1=-1))
    return _softcap(op(OpKind.MUL_SCALAR, scores, value=Slot("softmax_scale")), softcap), v


def _softcap_slots(softcap: float | None) -> dict[str, Any]:
    return {} if softcap is None else {"softcap": softcap, "softcap_recip": 1.0 / softcap}


def _recipe_softmax(p: SoftmaxLastDim) -> PatternNode:
    return _softmax(Bind(0))


def _recipe_rms(p: RmsNorm) -> PatternNode:
    return _rms(Bind(0), Bind(1) if p.has_gain else None)


def _recipe_layer_norm(p: LayerNorm) -> PatternNode:
    x = Bind(0)
    centered = op(OpKind.SUB, x, op(OpKind.MEAN, x, dim=-1, keepdim=True))
    variance = op(OpKind.MEAN, op(OpKind.MUL, centered, centered), dim=-1, keepdim=True)
    normed = op(OpKind.MUL, centered, op(OpKind.RSQRT, op(OpKind.ADD_SCALAR, variance, value=Slot("eps"))))
    return op(OpKind.ADD, op(OpKind.MUL, normed, Bind(1)), Bind(2))


def _recipe_rope(p: Rope) -> PatternNode:
    x, width = Bind(0), DimOf(0, -1)
    half = Quot(width, 2)
    first = op(OpKind.SLICE, x, dim=-1, start=0, end=half)
    second = op(OpKind.SLICE, x, dim=-1, start=half, end=width)
    rotated = op(OpKind.CONCAT, op(OpKind.NEG, second), first, dim=-1)
    return op(OpKind.ADD, op(OpKind.MUL, x, Bind(1)), op(OpKind.MUL, rotated, Bind(2)))


def _recipe_linear(p: FusedLinear) -> PatternNode:
    out = op(OpKind.MATMUL, Bind(0), op(OpKind.TRANSPOSE, Bind(1), dim0=0, dim1=1))
    return op(OpKind.ADD, out, Bind(2)) if p.has_bias else out


def _recipe_quant_linear(p: QuantLinear) -> PatternNode:
    weight = op(OpKind.DEQUANTIZE, Bind(1), layout=p.layout, cols=p.cols)
    return op(OpKind.MATMUL, Bind(0), op(OpKind.TRANSPOSE, weight, dim0=0, dim1=1))


def _recipe_silu_mul(p: SiluMul) -> PatternNode:
    return op(OpKind.MUL, op(OpKind.SILU, Bind(0)), Bind(1))


def _recipe_residual_rms(p: ResidualAddRmsNorm) -> PatternNode:
    total = op(OpKind.ADD, Bind(0), Bind(1))
    normed = _rms(total, Bind(2))
    return op(OpKind.CONCAT, op(OpKind.UNSQUEEZE, normed, dim=0),
              op(OpKind.UNSQUEEZE, total, dim=0), dim=0)


def _recipe_flash(p: FlashAttn) -> PatternNode:
    scores, v = _attend(Bind(0), Bind(1), Bind(2), DimOf(1, 1), p.softcap)
    if p.causal:
        query_pos = op(OpKind.IOTA, Bind(0), dim=2, dtype=DType.I64)
        key_pos = op(OpKind.IOTA, Bind(1), dim=2, dtype=DType.I64)
        offset = op(OpKind.SUB, op(OpKind.SIZE, Bind(1), dim=2, dtype=DType.I64),
                    op(OpKind.SIZE, Bind(0), dim=2, dtype=DType.I64))
        limit = op(OpKind.UNSQUEEZE, op(OpKind.ADD, query_pos, offset), dim=-1)
        future = op(OpKind.COMPARE, key_pos, limit, predicate=Predicate.GT)
        scores = op(OpKind.MASKED_FILL, scores, future, value=-math.inf)
    return op(OpKind.MATMUL, _softmax(scores), v)


def _gather_cache(cache: PatternNode, slots: PatternNode) -> PatternNode:
    rows = op(OpKind.RESHAPE, cache, shape=(-1, DimOf(1, 2), DimOf(1, 3)))
    gathered = op(OpKind.INDEX_SELECT, rows, slots, dim=0)  # [B, L, Hkv, D]
    return op(OpKind.PERMUTE, gathered, dims=(0, 2, 1, 3))  # [B, Hkv, L, D]


def _recipe_paged(p: PagedAttn) -> PatternNode:
    q, block_table, context_lens = Bind(0), Bind(3), Bind(4)
    # Every index stays in the operands' own dtype (u32): slot = block * block_size + offset.
    index_dtype = Slot("index_dtype")
    block_base = op(OpKind.MUL_SCALAR, block_table, value=Slot("block_size"))
    offsets = op(OpKind.IOTA, Bind(1), dim=1, dtype=index_dtype)
    slots = op(OpKind.RESHAPE, op(OpKind.ADD, op(OpKind.UNSQUEEZE, block_base, dim=-1), offsets),
               shape=(DimOf(3, 0), -1))  # [B, M * block_size]
    keys, values = _gather_cache(Bind(1), slots), _gather_cache(Bind(2), slots)
    if p.kv_dtype is not None:  # rows widened as they are read: the cache stays half precision
        keys = op(OpKind.CAST, keys, dtype=Slot("dtype"))
        values = op(OpKind.CAST, values, dtype=Slot("dtype"))
    scores, v = _attend(q, keys, values, DimOf(1, 2), p.softcap)
    key_pos = op(OpKind.IOTA, slots, dim=1, dtype=index_dtype)
    query_pos = op(OpKind.IOTA, q, dim=2, dtype=index_dtype)
    limit = op(OpKind.SUB, op(OpKind.ADD, op(OpKind.UNSQUEEZE, context_lens, dim=-1), query_pos),
               op(OpKind.SIZE, q, dim=2, dtype=index_dtype))  # [B, Sq]
    hidden = op(OpKind.COMPARE, key_pos, op(OpKind.UNSQUEEZE, limit, dim=-1), predicate=Predicate.GT)
    scores = op(OpKind.MASKED_FILL, scores, op(OpKind.UNSQUEEZE, hidden, dim=1), value=-math.inf)
    return op(OpKind.MATMUL, _softmax(scores), v)


# MoE pieces: the fused recipe is their composition, and lowering emits the same pieces for the
# single-op rules (router, top_k, expert_gate_up, expert_down, blend), so both routes compute
# one function. Open slots: ``top_k`` (choices per token), ``dtype`` (the activations' dtype).
def moe_routing(logits: PatternNode, normalize: bool) -> tuple[PatternNode, PatternNode]:
    """``(weights f32 [T, k], ids i64 [T, k])``: softmax in f32, then the top k, renormalized
    to sum 1 when ``normalize`` (transformers' Mixtral always, Qwen-MoE when norm_topk_prob)."""
    probs = _softmax(op(OpKind.CAST, logits, dtype=DType.F32))
    weights = op(OpKind.TOPK_VALUES, probs, k=Slot("top_k"), dim=-1)
    ids = op(OpKind.TOPK_INDICES, probs, k=Slot("top_k"), dim=-1)
    if normalize:
        weights = op(OpKind.DIV, weights, op(OpKind.SUM, weights, dim=-1, keepdim=True))
    return weights, ids


def moe_choice_ids(ids: PatternNode) -> PatternNode:
    """``[T * k]``: the expert of each (token, choice) row, token-major."""
    return op(OpKind.RESHAPE, ids, shape=(-1,))


def moe_choice_rows(h: PatternNode) -> PatternNode:
    """``[T * k, H]``: each token's row once per choice, token-major (the expert inputs)."""
    return op(OpKind.REPEAT_INTERLEAVE, h, repeats=Slot("top_k"), dim=0)


def moe_blend(expert_rows: PatternNode, weights: PatternNode, hidden: Any) -> PatternNode:
    """``[T, H]``: each token's choice rows summed, weighted by its routing weights."""
    per_token = op(OpKind.RESHAPE, expert_rows, shape=(-1, Slot("top_k"), hidden))
    scale = op(OpKind.UNSQUEEZE, op(OpKind.CAST, weights, dtype=Slot("dtype")), dim=-1)
    return op(OpKind.SUM, op(OpKind.MUL, per_token, scale), dim=1, keepdim=False)


def moe_shared(routed: PatternNode, shared_out: PatternNode, shared_gate: PatternNode) -> PatternNode:
    """Qwen2-MoE's shared expert added to the routed experts, scaled by sigmoid of its gate."""
    return op(OpKind.ADD, routed, op(OpKind.MUL, op(OpKind.SIGMOID, shared_gate), shared_out))


def _recipe_moe(p: Moe) -> PatternNode:
    h, gate_up, down = Bind(0), Bind(2), Bind(3)
    weights, ids = moe_routing(Bind(1), p.normalize)
    choices = moe_choice_ids(ids)
    projected = op(OpKind.EXPERT_MATMUL, moe_choice_rows(h), gate_up, choices)
    inter = DimOf(3, 2)
    act = op(OpKind.MUL, op(OpKind.SILU, op(OpKind.SLICE, projected, dim=-1, start=0, end=inter)),
             op(OpKind.SLICE, projected, dim=-1, start=inter, end=DimOf(2, 1)))
    routed = moe_blend(op(OpKind.EXPERT_MATMUL, act, down, choices), weights, DimOf(0, 1))
    return moe_shared(routed, Bind(4), Bind(5)) if p.shared else routed


# Shape/dtype rules.
def _need(fused: str, condition: bool, detail: str) -> None:
    if not condition:
        raise ShapeError(fused, detail)


def _floats(fused: str, dtypes: Sequence[DType]) -> DType:
    _need(fused, len(set(dtypes)) == 1 and dtypes[0].is_float,
          f"float operands of one dtype expected, got {', '.join(d.value for d in dtypes)}")
    return dtypes[0]


def _rule_same(name: str) -> Callable[..., tuple[Shape, DType]]:
    def rule(p: Any, shapes: Sequence[Shape], dtypes: Sequence[DType]) -> tuple[Shape, DType]:
        _need(name, all(s == shapes[0] for s in shapes), f"operands differ in shape: "
                                                         f"{', '.join(map(str, shapes))}")
        return shapes[0], _floats(name, dtypes)
    return rule


def _rule_norm(name: str, extra: int) -> Callable[..., tuple[Shape, DType]]:
    """x plus ``extra`` per-channel vectors of the last dim's extent."""
    def rule(p: Any, shapes: Sequence[Shape], dtypes: Sequence[DType]) -> tuple[Shape, DType]:
        x = shapes[0]
        _need(name, x.rank >= 1, "x needs rank >= 1")
        for vector in shapes[len(shapes) - extra:]:
            _need(name, vector.dims == (x.dims[-1],), f"gain/bias {vector} must be [{x.dims[-1]}]")
        return x, _floats(name, dtypes)
    return rule


def _rule_rms(p: RmsNorm, shapes, dtypes):
    return _rule_norm("rms_norm", 1 if p.has_gain else 0)(p, shapes, dtypes)


def _rule_residual_rms(p: ResidualAddRmsNorm, shapes, dtypes):
    _need("residual_add_rms_norm", shapes[0] == shapes[1], f"x {shapes[0]} != residual {shapes[1]}")
    x, dtype = _rule_norm("residual_add_rms_norm", 1)(p, shapes, dtypes)
    return Shape((2,) + x.dims), dtype


def _rule_rope(p: Rope, shapes, dtypes):
    x = shapes[0]
    _need("rope", x.rank >= 1 and isinstance(x.dims[-1], int) and x.dims[-1] % 2 == 0,
          f"x {x} needs an even, concrete last dim")
    for table in shapes[1:]:
        _need("rope", table.rank <= x.rank and all(
            t in (1, d) for t, d in zip(reversed(table.dims), reversed(x.dims))),
            f"cos/sin {table} do not broadcast to x {x}")
    return x, _floats("rope", dtypes)


def _rule_linear(p: FusedLinear, shapes, dtypes):
    x, w = shapes[0], shapes[1]
    _need("fused_linear", x.rank >= 2 and w.rank == 2 and x.dims[-1] == w.dims[1],
          f"x {x} and w {w} need x [..., K], w [N, K]")
    if p.has_bias:
        _need("fused_linear", shapes[2].dims == (w.dims[0],), f"bias {shapes[2]} must be [{w.dims[0]}]")
    return Shape(x.dims[:-1] + (w.dims[0],)), _floats("fused_linear", dtypes)


def _rule_quant_linear(p: QuantLinear, shapes, dtypes):
    from fuel.circuit.format import ROW_LAYOUTS, row_bytes

    x, w = shapes
    _need("quant_linear", p.layout in ROW_LAYOUTS, f"layout {p.layout!r} is not a block format")
    elements, _ = ROW_LAYOUTS[p.layout]
    width = row_bytes(p.layout, p.cols)
    _need("quant_linear", x.rank >= 2 and w.rank == 2 and x.dims[-1] == p.cols
          and p.cols % elements == 0 and w.dims[1] == width,
          f"x {x} and packed w {w} need x [..., {p.cols}], w [N, {width}]")
    _need("quant_linear", dtypes[0] is DType.F32 and dtypes[1] is DType.U8,
          f"x f32 and w u8 expected, got {dtypes[0].value}, {dtypes[1].value}")
    return Shape(x.dims[:-1] + (w.dims[0],)), DType.F32


def _heads(name: str, q: Shape, kv_heads: Any) -> None:
    _need(name, isinstance(q.dims[1], int) and isinstance(kv_heads, int) and kv_heads > 0
          and q.dims[1] % kv_heads == 0, f"q heads {q.dims[1]} not a multiple of kv heads {kv_heads}")


def _rule_flash(p: FlashAttn, shapes, dtypes):
    q, k, v = shapes
    _need("flash_attn", q.rank == k.rank == v.rank == 4, f"q {q}, k {k}, v {v} must be rank 4")
    _need("flash_attn", q.dims[0] == k.dims[0] == v.dims[0] and q.dims[3] == k.dims[3]
          and k.dims[1:3] == v.dims[1:3], f"q {q}, k {k}, v {v} disagree")
    _heads("flash_attn", q, k.dims[1])
    return Shape(q.dims[:3] + (v.dims[3],)), _floats("flash_attn", dtypes)


def _rule_paged(p: PagedAttn, shapes, dtypes):
    q, k_cache, v_cache, block_table, context_lens = shapes
    _need("paged_attn", q.rank == 4 and k_cache.rank == 4 and k_cache == v_cache,
          f"q {q} must be [B, Hq, Sq, D], caches {k_cache}/{v_cache} [blocks, block_size, Hkv, D]")
    _need("paged_attn", k_cache.dims[1] == p.block_size,
          f"cache block size {k_cache.dims[1]} != params block_size {p.block_size}")
    _need("paged_attn", k_cache.dims[3] == q.dims[3], f"head dims differ: q {q}, cache {k_cache}")
    _need("paged_attn", block_table.rank == 2 and context_lens.dims == (q.dims[0],)
          and block_table.dims[0] == q.dims[0],
          f"block_table {block_table} must be [B, M] and context_lens {context_lens} [B]")
    _need("paged_attn", dtypes[3] in INDEX_DTYPES and dtypes[3] == dtypes[4],
          f"block_table/context_lens must share an index dtype, got {dtypes[3].value}/{dtypes[4].value}")
    _heads("paged_attn", q, k_cache.dims[2])
    if p.kv_dtype is None:
        return q, _floats("paged_attn", dtypes[:3])
    _need("paged_attn", dtypes[1] == dtypes[2] == p.kv_dtype and p.kv_dtype.is_float
          and dtypes[0].is_float and dtypes[0] != p.kv_dtype,
          f"caches of kv_dtype {p.kv_dtype.value} and a query of another float dtype expected, "
          f"got {', '.join(d.value for d in dtypes[:3])}")
    return q, dtypes[0]


def _rule_moe(p: Moe, shapes, dtypes):
    h, logits, gate_up, down = shapes[:4]
    _need("moe", isinstance(p.top_k, int) and p.top_k >= 1, f"top_k {p.top_k!r} must be >= 1")
    _need("moe", h.rank == 2 and logits.rank == 2 and logits.dims[0] == h.dims[0],
          f"h {h} and router_logits {logits} must be [T, H] and [T, E]")
    _need("moe", gate_up.rank == 3 and down.rank == 3 and gate_up.dims[0] == down.dims[0]
          == logits.dims[1] and gate_up.dims[2] == h.dims[1] and down.dims[1] == h.dims[1]
          and gate_up.dims[1] == 2 * down.dims[2],
          f"experts gate_up {gate_up} and down {down} must be [E, 2I, H] and [E, H, I] "
          f"for h {h}, logits {logits}")
    _need("moe", isinstance(logits.dims[1], int) and p.top_k <= logits.dims[1],
          f"top_k {p.top_k} exceeds the {logits.dims[1]} experts")
    data = [dtypes[0], dtypes[2], dtypes[3]]
    if p.shared:
        _need("moe", shapes[4] == h and shapes[5].dims == (h.dims[0], 1),
              f"shared_out {shapes[4]} must be {h}, shared_gate {shapes[5]} [T, 1]")
        data += dtypes[4:6]
    _floats("moe", [dtypes[1]])
    return h, _floats("moe", data)


@dataclass(frozen=True, slots=True)
class FusedOpSpec:
    """What the registry knows about one static fused op."""

    id: FusedOps
    name: str
    params_type: type
    arity: Callable[[Any], int]
    rule: Callable[[Any, Sequence[Shape], Sequence[DType]], tuple[Shape, DType]]
    template: Callable[[Any], PatternNode]
    slot_values: Callable[[Any, Sequence[DType]], dict[str, Any]] = field(
        default=lambda params, dtypes: {})


def _eps(params: Any, dtypes: Sequence[DType]) -> dict[str, Any]:
    return {"eps": params.eps}


SPECS: dict[FusedOps, FusedOpSpec] = {spec.id: spec for spec in (
    FusedOpSpec(FusedOps.SOFTMAX_LAST_DIM, "softmax_last_dim", SoftmaxLastDim, lambda p: 1,
                _rule_same("softmax_last_dim"), _recipe_softmax),
    FusedOpSpec(FusedOps.RMS_NORM, "rms_norm", RmsNorm, lambda p: 2 if p.has_gain else 1,
                _rule_rms, _recipe_rms, _eps),
    FusedOpSpec(FusedOps.LAYER_NORM, "layer_norm", LayerNorm, lambda p: 3,
                _rule_norm("layer_norm", 2), _recipe_layer_norm, _eps),
    FusedOpSpec(FusedOps.ROPE, "rope", Rope, lambda p: 3, _rule_rope, _recipe_rope),
    FusedOpSpec(FusedOps.FUSED_LINEAR, "fused_linear", FusedLinear,
                lambda p: 3 if p.has_bias else 2, _rule_linear, _recipe_linear),
    FusedOpSpec(FusedOps.SILU_MUL, "silu_mul", SiluMul, lambda p: 2, _rule_same("silu_mul"),
                _recipe_silu_mul),
    FusedOpSpec(FusedOps.RESIDUAL_ADD_RMS_NORM, "residual_add_rms_norm", ResidualAddRmsNorm,
                lambda p: 3, _rule_residual_rms, _recipe_residual_rms, _eps),
    FusedOpSpec(FusedOps.FLASH_ATTN, "flash_attn", FlashAttn, lambda p: 3, _rule_flash,
                _recipe_flash,
                lambda p, d: {"softmax_scale": p.softmax_scale, **_softcap_slots(p.softcap)}),
    FusedOpSpec(FusedOps.PAGED_ATTN, "paged_attn", PagedAttn, lambda p: 5, _rule_paged,
                _recipe_paged,
                lambda p, d: {"softmax_scale": p.softmax_scale, "block_size": p.block_size,
                              "index_dtype": d[3], **_softcap_slots(p.softcap),
                              **({} if p.kv_dtype is None else {"dtype": d[0]})}),
    FusedOpSpec(FusedOps.QUANT_LINEAR, "quant_linear", QuantLinear, lambda p: 2,
                _rule_quant_linear, _recipe_quant_linear),
    FusedOpSpec(FusedOps.MOE, "moe", Moe, lambda p: 6 if p.shared else 4, _rule_moe, _recipe_moe,
                lambda p, d: {"top_k": p.top_k, "dtype": d[0]}),
)}


def fused_name(fused_id: int) -> str:
    if fused_id in SPECS:
        return SPECS[FusedOps(fused_id)].name
    return f"runtime#{fused_id:#06x}"


def infer_fused(fused_id: int, params: Any, shapes: Sequence[Shape],
                dtypes: Sequence[DType]) -> tuple[Shape, DType]:
    """Output shape and dtype of a static fused op; raises ``ShapeError`` naming the op."""
    spec = SPECS.get(fused_id)  # type: ignore[call-overload]
    if spec is None:
        raise ShapeError(fused_name(fused_id), "not a static fused op")
    if not isinstance(params, spec.params_type):
        raise ShapeError(spec.name, f"params {params!r} are not {spec.params_type.__name__}")
    if len(shapes) != spec.arity(params):
        raise ShapeError(spec.name, f"expects {spec.arity(params)} inputs, got {len(shapes)}")
    return spec.rule(params, shapes, dtypes)


# The runtime sidecar.
class RegionRefused(FuelError):
    """A region that cannot be registered as a runtime fused op: names the region and why."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"runtime fused op `{name}`: {reason}")


@dataclass(frozen=True, slots=True)
class RuntimeFusedOp:
    id: int
    name: str
    region: PatternNode
    hash: str

    @property
    def arity(self) -> int:
        return len(bind_indices(self.region))


class RuntimeFusedRegistry:
    """Regions registered at run time (by the JIT's adoption) as fused ops with ids from 0x8000.

    Owned by the caller that runs the pipeline (no process-global state): a structurally equal
    region gets the id it already has; a name may name one region only.
    """

    def __init__(self) -> None:
        self._ops: list[RuntimeFusedOp] = []
        self._by_hash: dict[str, int] = {}
        self._by_name: dict[str, int] = {}

    def register_runtime_fused(self, name: str, region: PatternNode) -> int:
        reason = _not_reemittable(region)
        if reason is not None:
            raise RegionRefused(name, reason)
        digest = structural_hash(region)
        if digest in self._by_hash:
            return self._by_hash[digest]
        if name in self._by_name:
            raise RegionRefused(name, f"the name already names a different region "
                                      f"(id {self._by_name[name]:#06x})")
        new_id = RUNTIME_FUSED_BASE + len(self._ops)
        self._ops.append(RuntimeFusedOp(new_id, name, region, digest))
        self._by_hash[digest] = new_id
        self._by_name[name] = new_id
        return new_id

    def get(self, fused_id: int) -> RuntimeFusedOp | None:
        index = fused_id - RUNTIME_FUSED_BASE
        return self._ops[index] if 0 <= index < len(self._ops) else None

    def find_by_hash(self, digest: str) -> int | None:
        return self._by_hash.get(digest)

    def __iter__(self):
        return iter(tuple(self._ops))

    def __len__(self) -> int:
        return len(self._ops)


def _not_reemittable(region: PatternNode) -> str | None:
    if not isinstance(region, PatternOp):
        return "the root must be a primitive op, not a bare bind"
    for node in walk(region):
        if isinstance(node, PatternOp):
            if not isinstance(node.tag, OpKind):
                return f"{node.tag!r} has no primitive"
            if node.tag is OpKind.KV_CACHE_WRITE:
                return "kv_cache_write has an effect; a fused region must be pure"
            try:
                hash(node.attrs)
            except TypeError:
                return f"attributes of {node.tag.value} are not immutable values"
        elif not isinstance(node, Bind):
            return f"{node!r} is neither a primitive op nor a bind"
    indices = bind_indices(region)
    if list(indices) != list(range(len(indices))):
        return f"bind indices {list(indices)} have a gap (expected 0..{len(indices) - 1})"
    return None


# Reading recipes.
def recipe_for(graph: Graph, node_id: NodeId,
               runtime: RuntimeFusedRegistry | None = None) -> PatternNode | None:
    """The region a fused node computes, its slots filled from its params; ``None`` when the
    node is not fused, its id is unknown, or its params/inputs do not fit. Never mutates."""
    node = graph.node(node_id)
    if not isinstance(node.op, Fused):
        return None
    fused_id, params = node.op.id, node.op.params
    spec = SPECS.get(fused_id)  # type: ignore[call-overload]
    if spec is not None:
        if not isinstance(params, spec.params_type) or len(node.inputs) != spec.arity(params):
            return None
        dtypes = [graph.node(i).dtype for i in node.inputs]
        return fill_slots(spec.template(params), spec.slot_values(params, dtypes))
    registered = runtime.get(fused_id) if runtime is not None else None
    if registered is None or len(node.inputs) != registered.arity:
        return None
    values = dict(params.slots) if isinstance(params, RuntimeFusedParams) else {}
    return fill_slots(registered.region, values)


def decompose(graph: Graph, node_id: NodeId,
              runtime: RuntimeFusedRegistry | None = None) -> NodeId:
    """Emit the node's recipe over its inputs and return the region's root; on any ordinary
    failure (not fused, no recipe, untypable, a root whose shape/dtype differs from the node's)
    return ``node_id`` itself. Those are values (``None``, :class:`EmitRefused`) or a
    :class:`ShapeError` from a recipe template that cannot type the node's params; anything
    else is a bug and propagates, never disguised as "no recipe"."""
    try:
        region = recipe_for(graph, node_id, runtime)
    except ShapeError:
        return node_id
    if region is None:
        return node_id
    node = graph.node(node_id)
    root = emit(graph, region, node.inputs, expect=(node.shape, node.dtype))
    return node_id if isinstance(root, EmitRefused) else root
