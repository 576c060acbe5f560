"""The primitive op set and its shape/dtype rules.

Decides which primitives exist (enough for embedding lookup, attention, norms, RoPE, MLPs, MoE
routing and the paged KV cache) and, for each, what shape and dtype it produces from its
inputs and attributes. Every primitive has a CPU kernel (``fuel.kernels``) and a rule here;
recipes are trees of these and nothing else.

Conventions every rule follows:
- Elementwise binary ops, ``compare``, ``where`` and ``masked_fill`` broadcast NumPy-style;
  their float/int operands must share one dtype (no implicit promotion: a cast is explicit).
- A ``dim`` attribute may be negative (counted from the end), like PyTorch.
- ``index_select(x, index, dim)`` has *take* semantics: the result's shape is
  ``x.shape[:dim] + index.shape + x.shape[dim+1:]`` (an embedding lookup with ``[B, S]`` ids
  is one node). ``gather`` is ``torch.gather``.
- ``iota(x, dim, dtype)`` and ``size(x, dim, dtype)`` read an extent of their input at run time
  (``[x.shape[dim]]`` positions, or a rank-0 scalar), so recipes stay valid for symbolic dims.
- ``kv_cache_write(cache, rows, slots)`` writes ``rows[t]`` into row ``slots[t]`` of the cache
  viewed as ``[blocks * block_size, ...]`` and *returns the cache*: every reader of the updated
  cache consumes this node, so data edges alone order the effect before its readers.
- Reductions (``sum``/``max``/``mean``/``argmax``) take ``dim`` and ``keepdim``; ``argmax`` and
  ``topk_indices`` produce i64.
- ``expert_matmul(x [R, K], w [E, N, K], ids [R])`` is ``out[r] = x[r] @ w[ids[r]].T`` (llama.cpp's
  ``mul_mat_id``): each row is multiplied by the expert its id names. Its kernels group the rows
  by expert, so every distinct expert's matrix is read once per call (MoE: ``fuel.runtime.moe``).

A rule that cannot type its inputs raises :class:`ShapeError`; callers that must be total
(``decompose``) catch it and decline.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from fuel.errors import FuelError
from fuel.graph.dtype import INDEX_DTYPES, DType, Dim, Shape


class ShapeError(FuelError):
    """Inputs a primitive cannot type: names the op, the attribute or operand, and the values."""

    def __init__(self, op: str, detail: str):
        self.op = op
        self.detail = detail
        super().__init__(f"op `{op}`: {detail}")


class Predicate(Enum):
    """The comparison a ``compare`` node makes."""

    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"


class OpKind(Enum):
    """A primitive op. The value is its canonical spelling (used in hashes and messages)."""

    # Elementwise unary.
    NEG = "neg"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    TANH = "tanh"
    SILU = "silu"
    SIGMOID = "sigmoid"
    RECIP = "recip"
    ABS = "abs"
    # Elementwise with a scalar attribute.
    MUL_SCALAR = "mul_scalar"
    ADD_SCALAR = "add_scalar"
    POW_SCALAR = "pow_scalar"
    # Elementwise binary (broadcasting).
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAXIMUM = "maximum"
    COMPARE = "compare"
    WHERE = "where"
    MASKED_FILL = "masked_fill"
    CAST = "cast"
    # Reductions.
    SUM = "sum"
    MAX = "max"
    MEAN = "mean"
    ARGMAX = "argmax"
    TOPK_VALUES = "topk_values"
    TOPK_INDICES = "topk_indices"
    # Linear algebra.
    MATMUL = "matmul"
    EXPERT_MATMUL = "expert_matmul"
    # Layout.
    RESHAPE = "reshape"
    PERMUTE = "permute"
    TRANSPOSE = "transpose"
    UNSQUEEZE = "unsqueeze"
    EXPAND = "expand"
    SLICE = "slice"
    SELECT = "select"
    CONCAT = "concat"
    REPEAT_INTERLEAVE = "repeat_interleave"
    # Positions and extents.
    IOTA = "iota"
    SIZE = "size"
    # Indexing.
    INDEX_SELECT = "index_select"
    GATHER = "gather"
    # Effects.
    KV_CACHE_WRITE = "kv_cache_write"
    # Collectives over the process group a distributed run set up (fuel.runtime.distributed):
    # ``all_reduce`` sums the input over ``ranks`` processes, ``all_gather`` concatenates
    # their inputs along ``dim``. Every rank runs the same graph, so every rank calls each one.
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    # Stored formats.
    DEQUANTIZE = "dequantize"
    """u8 packed llama.cpp blocks ``[..., row_bytes]`` → f32 ``[..., cols]`` (``layout``, ``cols``)."""

    @property
    def commutative(self) -> bool:
        return self in _COMMUTATIVE

    @property
    def arity(self) -> int | None:
        """Number of tensor inputs; ``None`` for variadic ``concat``."""
        return _ARITY.get(self, 1)


UNARY: frozenset[OpKind] = frozenset({
    OpKind.NEG, OpKind.EXP, OpKind.LOG, OpKind.SQRT, OpKind.RSQRT, OpKind.TANH, OpKind.SILU,
    OpKind.SIGMOID, OpKind.RECIP, OpKind.ABS, OpKind.MUL_SCALAR, OpKind.ADD_SCALAR,
    OpKind.POW_SCALAR,
})
BINARY: frozenset[OpKind] = frozenset({
    OpKind.ADD, OpKind.SUB, OpKind.MUL, OpKind.DIV, OpKind.MAXIMUM,
})
REDUCTIONS: frozenset[OpKind] = frozenset({OpKind.SUM, OpKind.MAX, OpKind.MEAN, OpKind.ARGMAX})
_COMMUTATIVE = frozenset({OpKind.ADD, OpKind.MUL, OpKind.MAXIMUM})
_ARITY = {
    **{kind: 2 for kind in BINARY},
    OpKind.COMPARE: 2, OpKind.WHERE: 3, OpKind.MASKED_FILL: 2, OpKind.MATMUL: 2,
    OpKind.EXPERT_MATMUL: 3,
    OpKind.INDEX_SELECT: 2, OpKind.GATHER: 2, OpKind.KV_CACHE_WRITE: 3, OpKind.CONCAT: None,
}
REQUIRED_ATTRS: dict[OpKind, tuple[str, ...]] = {
    OpKind.MUL_SCALAR: ("value",), OpKind.ADD_SCALAR: ("value",),
    OpKind.POW_SCALAR: ("exponent",), OpKind.COMPARE: ("predicate",),
    OpKind.MASKED_FILL: ("value",), OpKind.CAST: ("dtype",),
    **{kind: ("dim", "keepdim") for kind in REDUCTIONS},
    OpKind.TOPK_VALUES: ("k", "dim"), OpKind.TOPK_INDICES: ("k", "dim"),
    OpKind.RESHAPE: ("shape",), OpKind.PERMUTE: ("dims",), OpKind.TRANSPOSE: ("dim0", "dim1"),
    OpKind.UNSQUEEZE: ("dim",), OpKind.EXPAND: ("shape",), OpKind.SLICE: ("dim", "start", "end"),
    OpKind.SELECT: ("dim", "index"), OpKind.CONCAT: ("dim",),
    OpKind.REPEAT_INTERLEAVE: ("repeats", "dim"), OpKind.IOTA: ("dim", "dtype"),
    OpKind.SIZE: ("dim", "dtype"), OpKind.INDEX_SELECT: ("dim",), OpKind.GATHER: ("dim",),
    OpKind.ALL_REDUCE: ("ranks",), OpKind.ALL_GATHER: ("dim", "ranks"),
    OpKind.DEQUANTIZE: ("layout", "cols"),
}
"""Attributes each primitive must carry (by name); others are refused by :func:`infer`."""


def _axis(op: OpKind, dim: Any, rank: int, *, inclusive: bool = False) -> int:
    limit = rank + 1 if inclusive else rank
    if isinstance(dim, bool) or not isinstance(dim, int) or not -limit <= dim < limit:
        raise ShapeError(op.value, f"dim {dim!r} out of range for rank {rank}")
    return dim % limit


def _broadcast(op: OpKind, shapes: Sequence[Shape]) -> Shape:
    # NumPy broadcasting, by hand: a dim here is an int or a run-time symbol (``"n"``), which
    # numpy.broadcast_shapes does not take; a symbol broadcasts with 1 and itself only.
    rank = max(shape.rank for shape in shapes)
    out: list[Dim] = []
    for axis in range(rank):
        dim: Dim = 1
        for shape in shapes:
            offset = axis - (rank - shape.rank)
            if offset < 0:
                continue
            other = shape.dims[offset]
            if other == 1 or other == dim:
                continue
            if dim == 1:
                dim = other
            else:
                raise ShapeError(op.value, f"cannot broadcast {' and '.join(map(str, shapes))}")
        out.append(dim)
    return Shape(tuple(out))


def _same_dtype(op: OpKind, dtypes: Sequence[DType]) -> DType:
    if len(set(dtypes)) != 1:
        raise ShapeError(op.value, f"operands must share one dtype, got "
                                   f"{', '.join(d.value for d in dtypes)}")
    return dtypes[0]


def _index_dtype(op: OpKind, dtype: DType) -> None:
    if dtype not in INDEX_DTYPES:
        raise ShapeError(op.value, f"index operand must be one of "
                                   f"{', '.join(d.value for d in INDEX_DTYPES)}, got {dtype.value}")


def _reshape(op: OpKind, source: Shape, target: Sequence[Any]) -> Shape:
    if sum(1 for dim in target if dim == -1) > 1:
        raise ShapeError(op.value, f"at most one -1 in shape {tuple(target)}")
    known = [dim for dim in target if dim != -1]
    for dim in known:
        if isinstance(dim, bool) or not isinstance(dim, int | str) or (
                isinstance(dim, int) and dim < 0):
            raise ShapeError(op.value, f"bad dim {dim!r} in shape {tuple(target)}")
    numel = source.numel()
    if -1 not in target:
        if numel is not None and all(isinstance(d, int) for d in known):
            product = 1
            for dim in known:
                product *= dim
            if product != numel:
                raise ShapeError(op.value, f"cannot reshape {source} to {tuple(target)}")
        return Shape(tuple(target))
    if numel is None or not all(isinstance(d, int) for d in known):
        raise ShapeError(op.value, f"-1 needs concrete dims: {source} to {tuple(target)}")
    product = 1
    for dim in known:
        product *= dim
    if product == 0 or numel % product:
        raise ShapeError(op.value, f"cannot reshape {source} to {tuple(target)}")
    return Shape(tuple(numel // product if dim == -1 else dim for dim in target))


def infer(kind: OpKind, attrs: dict[str, Any], shapes: Sequence[Shape],
          dtypes: Sequence[DType]) -> tuple[Shape, DType]:
    """The output shape and dtype of ``kind`` applied to inputs of ``shapes``/``dtypes``.

    Raises :class:`ShapeError` naming the op and the offending value when the inputs or the
    attributes do not type.
    """
    arity = kind.arity
    if (arity is not None and len(shapes) != arity) or (arity is None and not shapes):
        raise ShapeError(kind.value, f"expects {arity or 'at least 1'} inputs, got {len(shapes)}")
    missing = [name for name in REQUIRED_ATTRS.get(kind, ()) if name not in attrs]
    extra = [name for name in attrs if name not in REQUIRED_ATTRS.get(kind, ())]
    if missing or extra:
        raise ShapeError(kind.value, f"attributes: missing {missing}, unknown {extra}")
    x, dtype = shapes[0], dtypes[0]

    if kind in UNARY:
        return x, dtype
    if kind in BINARY:
        return _broadcast(kind, shapes), _same_dtype(kind, dtypes)
    if kind is OpKind.COMPARE:
        if not isinstance(attrs["predicate"], Predicate):
            raise ShapeError(kind.value, f"predicate {attrs['predicate']!r} is not a Predicate")
        _same_dtype(kind, dtypes)
        return _broadcast(kind, shapes), DType.BOOL
    if kind is OpKind.WHERE:
        if dtypes[0] is not DType.BOOL:
            raise ShapeError(kind.value, f"condition must be bool, got {dtypes[0].value}")
        return _broadcast(kind, shapes), _same_dtype(kind, dtypes[1:])
    if kind is OpKind.MASKED_FILL:
        if dtypes[1] is not DType.BOOL:
            raise ShapeError(kind.value, f"mask must be bool, got {dtypes[1].value}")
        if _broadcast(kind, shapes) != x:
            raise ShapeError(kind.value, f"mask {shapes[1]} does not broadcast to {x}")
        return x, dtype
    if kind is OpKind.CAST:
        if not isinstance(attrs["dtype"], DType):
            raise ShapeError(kind.value, f"dtype {attrs['dtype']!r} is not a DType")
        return x, attrs["dtype"]
    if kind in REDUCTIONS:
        axis = _axis(kind, attrs["dim"], x.rank)
        dims = list(x.dims)
        if attrs["keepdim"]:
            dims[axis] = 1
        else:
            del dims[axis]
        return Shape(tuple(dims)), DType.I64 if kind is OpKind.ARGMAX else dtype
    if kind in (OpKind.TOPK_VALUES, OpKind.TOPK_INDICES):
        axis = _axis(kind, attrs["dim"], x.rank)
        k = attrs["k"]
        if not isinstance(k, int) or k < 1 or (isinstance(x.dims[axis], int) and k > x.dims[axis]):
            raise ShapeError(kind.value, f"k={k!r} out of range for dim of extent {x.dims[axis]}")
        dims = list(x.dims)
        dims[axis] = k
        return Shape(tuple(dims)), DType.I64 if kind is OpKind.TOPK_INDICES else dtype
    if kind is OpKind.MATMUL:
        a, b = shapes
        if a.rank < 2 or b.rank < 2:
            raise ShapeError(kind.value, f"operands need rank >= 2, got {a} and {b}")
        if a.dims[-1] != b.dims[-2]:
            raise ShapeError(kind.value, f"inner dims differ: {a} @ {b}")
        batch = _broadcast(kind, [Shape(a.dims[:-2]), Shape(b.dims[:-2])])
        return Shape(batch.dims + (a.dims[-2], b.dims[-1])), _same_dtype(kind, dtypes)
    if kind is OpKind.EXPERT_MATMUL:
        w, ids = shapes[1], shapes[2]
        if x.rank != 2 or w.rank != 3 or ids.rank != 1 or x.dims[1] != w.dims[2] or (
                ids.dims[0] != x.dims[0]):
            raise ShapeError(kind.value, f"x {x}, w {w}, ids {ids} do not fit [R, K], [E, N, K], [R]")
        _index_dtype(kind, dtypes[2])
        return Shape((x.dims[0], w.dims[1])), _same_dtype(kind, dtypes[:2])
    if kind is OpKind.RESHAPE:
        return _reshape(kind, x, attrs["shape"]), dtype
    if kind is OpKind.PERMUTE:
        order = tuple(_axis(kind, d, x.rank) for d in attrs["dims"])
        if sorted(order) != list(range(x.rank)):
            raise ShapeError(kind.value, f"dims {attrs['dims']} is not a permutation of rank {x.rank}")
        return Shape(tuple(x.dims[d] for d in order)), dtype
    if kind is OpKind.TRANSPOSE:
        a, b = _axis(kind, attrs["dim0"], x.rank), _axis(kind, attrs["dim1"], x.rank)
        dims = list(x.dims)
        dims[a], dims[b] = dims[b], dims[a]
        return Shape(tuple(dims)), dtype
    if kind is OpKind.UNSQUEEZE:
        axis = _axis(kind, attrs["dim"], x.rank, inclusive=True)
        return Shape(x.dims[:axis] + (1,) + x.dims[axis:]), dtype
    if kind is OpKind.EXPAND:
        target = Shape.from_dims(attrs["shape"])
        if _broadcast(kind, [x, target]) != target:
            raise ShapeError(kind.value, f"cannot expand {x} to {target}")
        return target, dtype
    if kind is OpKind.SLICE:
        axis = _axis(kind, attrs["dim"], x.rank)
        start, end, extent = attrs["start"], attrs["end"], x.dims[axis]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end) or (
                isinstance(extent, int) and end > extent):
            raise ShapeError(kind.value, f"slice {start}:{end} out of range for extent {extent}")
        dims = list(x.dims)
        dims[axis] = end - start
        return Shape(tuple(dims)), dtype
    if kind is OpKind.SELECT:
        axis = _axis(kind, attrs["dim"], x.rank)
        index, extent = attrs["index"], x.dims[axis]
        if not isinstance(index, int) or index < 0 or (isinstance(extent, int) and index >= extent):
            raise ShapeError(kind.value, f"index {index!r} out of range for extent {extent}")
        return Shape(x.dims[:axis] + x.dims[axis + 1:]), dtype
    if kind is OpKind.CONCAT:
        axis = _axis(kind, attrs["dim"], x.rank)
        _same_dtype(kind, dtypes)
        total: Dim = 0
        for shape in shapes:
            if shape.rank != x.rank or any(
                    shape.dims[d] != x.dims[d] for d in range(x.rank) if d != axis):
                raise ShapeError(kind.value, f"cannot concat {' and '.join(map(str, shapes))}")
            extent = shape.dims[axis]
            if not isinstance(extent, int) or not isinstance(total, int):
                raise ShapeError(kind.value, "concat along a symbolic dim")
            total += extent
        dims = list(x.dims)
        dims[axis] = total
        return Shape(tuple(dims)), dtype
    if kind is OpKind.REPEAT_INTERLEAVE:
        axis = _axis(kind, attrs["dim"], x.rank)
        repeats, extent = attrs["repeats"], x.dims[axis]
        if not isinstance(repeats, int) or repeats < 1:
            raise ShapeError(kind.value, f"repeats {repeats!r} must be a positive int")
        if not isinstance(extent, int):
            raise ShapeError(kind.value, f"repeat along a symbolic dim {extent!r}")
        dims = list(x.dims)
        dims[axis] = extent * repeats
        return Shape(tuple(dims)), dtype
    if kind in (OpKind.IOTA, OpKind.SIZE):
        axis = _axis(kind, attrs["dim"], x.rank)
        if attrs["dtype"] not in INDEX_DTYPES:
            raise ShapeError(kind.value, f"dtype {attrs['dtype']!r} is not an index dtype")
        return (Shape((x.dims[axis],)) if kind is OpKind.IOTA else Shape(())), attrs["dtype"]
    if kind is OpKind.INDEX_SELECT:
        axis = _axis(kind, attrs["dim"], x.rank)
        _index_dtype(kind, dtypes[1])
        return Shape(x.dims[:axis] + shapes[1].dims + x.dims[axis + 1:]), dtype
    if kind is OpKind.GATHER:
        _axis(kind, attrs["dim"], x.rank)
        _index_dtype(kind, dtypes[1])
        if shapes[1].rank != x.rank:
            raise ShapeError(kind.value, f"index rank {shapes[1].rank} != input rank {x.rank}")
        return shapes[1], dtype
    if kind is OpKind.KV_CACHE_WRITE:
        cache, rows, slots = shapes
        _index_dtype(kind, dtypes[2])
        if dtypes[1] is not dtype:
            raise ShapeError(kind.value, f"rows {dtypes[1].value} != cache {dtype.value}")
        if cache.rank < 2 or rows.dims[1:] != cache.dims[2:] or slots.rank != 1 or (
                slots.dims[0] != rows.dims[0]):
            raise ShapeError(kind.value, f"cache {cache}, rows {rows}, slots {slots} do not fit "
                                         "[blocks, block_size, ...], [T, ...], [T]")
        return cache, dtype
    if kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER):
        ranks = attrs["ranks"]
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ShapeError(kind.value, f"ranks {ranks!r} must be a positive int")
        if kind is OpKind.ALL_REDUCE:
            return x, dtype
        axis = _axis(kind, attrs["dim"], x.rank)
        extent = x.dims[axis]
        if not isinstance(extent, int):
            raise ShapeError(kind.value, f"gather along a symbolic dim {extent!r}")
        dims = list(x.dims)
        dims[axis] = extent * ranks
        return Shape(tuple(dims)), dtype
    if kind is OpKind.DEQUANTIZE:
        return _dequantize(kind, attrs, x, dtype)
    raise AssertionError(f"no rule for {kind}")  # every OpKind has a branch above


def _dequantize(kind: OpKind, attrs: dict[str, Any], x: Shape, dtype: DType) -> tuple[Shape, DType]:
    from fuel.circuit.format import ROW_LAYOUTS, row_bytes

    layout, cols = attrs["layout"], attrs["cols"]
    if dtype is not DType.U8 or x.rank < 1:
        raise ShapeError(kind.value, f"packed blocks are u8 [..., row_bytes], got {dtype.value} {x}")
    if layout not in ROW_LAYOUTS or not isinstance(cols, int) or isinstance(cols, bool) or cols < 1:
        raise ShapeError(kind.value, f"layout {layout!r} / cols {cols!r} is not a block format")
    elements, block_bytes = ROW_LAYOUTS[layout]
    width = x.dims[-1]
    if cols % elements or (isinstance(width, int) and width != row_bytes(layout, cols)):
        raise ShapeError(kind.value, f"{cols} columns of {layout} need {cols // elements} whole "
                                     f"blocks of {block_bytes} bytes per row (rows of "
                                     f"{row_bytes(layout, cols)} bytes), rows have {width}")
    return Shape(x.dims[:-1] + (cols,)), DType.F32
