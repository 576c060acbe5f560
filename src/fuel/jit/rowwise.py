"""Row-wise region analysis: which regions the synthesizers can generate code for, as a small IR.

Decides whether a region is *row-wise*: every value is either a vector along the last axis of
one row or a per-row scalar (a keepdim reduction over the last axis), so a kernel can process
one row at a time with no communication between rows. That covers rms_norm (with and without
gain), layer_norm, residual_add_rms_norm, softmax, silu_mul and rope (rotate-half: slices and a
concat along the last axis). Anything else is refused with a precise reason (the synthesizer's
``Declined``): a matmul, a gather, a reduction over another axis, a reshape.

Conventions the generated kernels share:
- Every input is presented as rows of the broadcast ("main") shape's last extent ``W``; an input
  that broadcasts over leading axes is indexed by ``row % its_rows`` (gain vectors, rope tables
  whose leading axes are a suffix of the main shape) and otherwise materialized to the main shape
  by the wrapper. Widths are code expressions over ``W`` (``"W"``, ``"(W // 2)"``).
- The output is either one vector per row (``[rows, width]``) or, when the root is a
  ``concat(dim=0)`` of ``unsqueeze(dim=0)`` parts, ``parts`` vectors per row stacked on a new
  leading axis (``[parts, rows, width]``): residual_add_rms_norm's two results.

Invariants: the analysis is pure and total: it returns a :class:`RowProgram` or a
:class:`NotRowWise` reason, never raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.graph.ops import OpKind
from fuel.graph.recipe import Bind, DimOf, PatternNode, PatternOp, Quot, Slot

UNARY = {OpKind.NEG: "neg", OpKind.EXP: "exp", OpKind.LOG: "log", OpKind.SQRT: "sqrt",
         OpKind.RSQRT: "rsqrt", OpKind.TANH: "tanh", OpKind.SILU: "silu",
         OpKind.SIGMOID: "sigmoid", OpKind.RECIP: "recip", OpKind.ABS: "abs"}
BINARY = {OpKind.ADD: "add", OpKind.SUB: "sub", OpKind.MUL: "mul", OpKind.DIV: "div",
          OpKind.MAXIMUM: "maximum"}
WITH_SCALAR = {OpKind.MUL_SCALAR: ("mul", "value"), OpKind.ADD_SCALAR: ("add", "value"),
               OpKind.POW_SCALAR: ("pow", "exponent")}
REDUCE = {OpKind.SUM: "sum", OpKind.MAX: "max", OpKind.MEAN: "mean"}


@dataclass(frozen=True, slots=True)
class Read:
    bind: int


@dataclass(frozen=True, slots=True)
class Unary:
    fn: str
    x: RowValue


@dataclass(frozen=True, slots=True)
class WithScalar:
    fn: str
    x: RowValue
    value: float


@dataclass(frozen=True, slots=True)
class Binary:
    fn: str
    a: RowValue
    b: RowValue


@dataclass(frozen=True, slots=True)
class Reduce:
    fn: str
    x: RowValue


@dataclass(frozen=True, slots=True)
class Slice:
    x: RowValue
    start: str
    end: str


@dataclass(frozen=True, slots=True)
class Concat:
    a: RowValue
    b: RowValue


RowValue = Read | Unary | WithScalar | Binary | Reduce | Slice | Concat


def is_scalar(value: RowValue) -> bool:
    """A per-row scalar (a reduction, or arithmetic over reductions only)."""
    if isinstance(value, Reduce):
        return True
    if isinstance(value, Read | Slice | Concat):
        return False
    if isinstance(value, Binary):
        return is_scalar(value.a) and is_scalar(value.b)
    return is_scalar(value.x)


def width(value: RowValue) -> str:
    """The vector width as a code expression over ``W`` (``"1"`` for a scalar)."""
    if isinstance(value, Read):
        return "W"
    if isinstance(value, Reduce):
        return "1"
    if isinstance(value, Slice):
        return f"({value.end} - {value.start})"
    if isinstance(value, Concat):
        return f"({width(value.a)} + {width(value.b)})"
    if isinstance(value, Binary):
        return width(value.b) if is_scalar(value.a) else width(value.a)
    return width(value.x)


@dataclass(frozen=True, slots=True)
class RowProgram:
    """A row-wise region: ``parts`` output vectors per row (stacked when ``stacked``)."""

    binds: int
    parts: tuple[RowValue, ...]
    stacked: bool

    @property
    def out_width(self) -> str:
        return width(self.parts[0])


@dataclass(frozen=True, slots=True)
class NotRowWise:
    reason: str


def analyze(region: PatternNode, rank: int) -> RowProgram | NotRowWise:
    """The region as a :class:`RowProgram`, or why not. ``rank`` is the main shape's rank (the
    widest input's): a reduction or slice must act on axis ``-1`` or ``rank - 1``."""
    try:
        parts, stacked = _root_parts(region)
        analyzed = tuple(_value(part, rank) for part in parts)
        binds = _bind_count(region)
    except _Refused as refused:
        return NotRowWise(str(refused))
    return RowProgram(binds, analyzed, stacked)


class _Refused(Exception):
    pass


def _root_parts(region: PatternNode) -> tuple[tuple[PatternNode, ...], bool]:
    if (isinstance(region, PatternOp) and region.tag is OpKind.CONCAT
            and region.attr_dict().get("dim") == 0
            and all(isinstance(o, PatternOp) and o.tag is OpKind.UNSQUEEZE
                    and o.attr_dict().get("dim") == 0 for o in region.operands)):
        return tuple(o.operands[0] for o in region.operands), True
    return (region,), False


def _bind_count(region: PatternNode) -> int:
    seen: set[int] = set()
    stack = [region]
    while stack:
        node = stack.pop()
        if isinstance(node, Bind):
            seen.add(node.index)
        else:
            stack.extend(node.operands)
    return max(seen) + 1 if seen else 0


def _last_axis(dim: Any, rank: int, tag: OpKind) -> None:
    if dim not in (-1, rank - 1):
        raise _Refused(f"`{tag.value}` acts on axis {dim!r}, not the last axis: not row-wise")


def _width_code(value: Any, tag: OpKind) -> str:
    if isinstance(value, bool):
        raise _Refused(f"`{tag.value}` has a boolean extent")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, DimOf):
        # Every input is presented with last extent W; other axes are not visible per row.
        if value.axis != -1:
            raise _Refused(f"`{tag.value}` reads extent {value.axis} of input {value.bind}: "
                           "only the last extent is known per row")
        return "W"
    if isinstance(value, Quot):
        return f"({_width_code(value.a, tag)} // {_width_code(value.b, tag)})"
    raise _Refused(f"`{tag.value}` has an unresolved extent {value!r}")


def _number(value: Any, tag: OpKind, name: str) -> float:
    if isinstance(value, Slot):
        raise _Refused(f"`{tag.value}` has an open slot `{value.name}`")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refused(f"`{tag.value}` attribute `{name}` = {value!r} is not a number")
    return float(value)


def _value(node: PatternNode, rank: int) -> RowValue:
    if isinstance(node, Bind):
        return Read(node.index)
    if not isinstance(node, PatternOp):
        raise _Refused(f"{node!r} is not a pattern op")
    tag, attrs = node.tag, node.attr_dict()
    if tag in UNARY:
        return Unary(UNARY[tag], _value(node.operands[0], rank))
    if tag in WITH_SCALAR:
        fn, name = WITH_SCALAR[tag]
        return WithScalar(fn, _value(node.operands[0], rank), _number(attrs.get(name), tag, name))
    if tag in BINARY:
        return Binary(BINARY[tag], _value(node.operands[0], rank), _value(node.operands[1], rank))
    if tag in REDUCE:
        _last_axis(attrs.get("dim"), rank, tag)
        if attrs.get("keepdim") is not True:
            raise _Refused(f"`{tag.value}` drops the reduced axis (keepdim=False): not row-wise")
        x = _value(node.operands[0], rank)
        if is_scalar(x):
            raise _Refused(f"`{tag.value}` reduces a per-row scalar again")
        return Reduce(REDUCE[tag], x)
    if tag is OpKind.SLICE:
        _last_axis(attrs.get("dim"), rank, tag)
        x = _value(node.operands[0], rank)
        return Slice(x, _width_code(attrs.get("start"), tag), _width_code(attrs.get("end"), tag))
    if tag is OpKind.CONCAT:
        _last_axis(attrs.get("dim"), rank, tag)
        values = [_value(o, rank) for o in node.operands]
        if any(is_scalar(v) for v in values):
            raise _Refused("`concat` of a per-row scalar")
        joined = values[0]
        for value in values[1:]:
            joined = Concat(joined, value)
        return joined
    raise _Refused(f"`{tag.value}` is not a row-wise op (only elementwise ops, last-axis "
                   "keepdim reductions, last-axis slices and concats are)")
