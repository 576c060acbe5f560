"""Storage formats of edges and weights (SPEC §A1).

Decides: the one spelling of every format (``parse(f.name()) == f``), which formats may sit on an
edge (``channel`` and ``block`` scales are weight layouts only), and how many bytes a
``rows x dim`` tensor occupies, scales included.

Invariants:
- Every format has exactly one spelling; ``parse`` refuses any other (``FP8/Token``, ``g0``, ...).
- ``bytes(rows, dim)`` (an activation edge) and ``weight_bytes(rows, dim)`` (a stored weight)
  are exact: packed 4-bit data rounds up to whole bytes per row, and each scale is counted at
  its stored width (f32 for fp8 scales and the nvfp4 global scale, one byte for the fp8 E4M3
  block scales of nvfp4 and the E8M0 scales of mxfp4).
- nvfp4's f32 global scale is per row on an activation (each token row is quantized on its own,
  so a step's rows never share a scale) and per tensor on a weight.
- A group scale ``g<n>`` tiles a row exactly: a ``dim`` that is not a multiple of ``n`` has no
  size (:class:`UnsizedFormat`, naming format, dim and group), never a silently rounded-up one.
  2-D ``block<r>x<c>`` weight tiles keep partial edge tiles (counted by ceiling), as blockwise
  fp8 checkpoints store them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from fuel.errors import FuelError


class FormatError(FuelError):
    """A format name that is not one of the spellings of §A1."""


class UnsizedFormat(FormatError):
    """A tensor whose row does not divide into its format's scale groups: it has no size."""

    def __init__(self, fmt: str, dim: int, group: int):
        self.format, self.dim, self.group = fmt, dim, group
        super().__init__(f"format `{fmt}` scales groups of {group} elements along a row; a row "
                         f"of {dim} is not a multiple of {group}, so the tensor has no size in "
                         f"this format (choose a group that divides {dim})")


class FormatKind(Enum):
    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    I32 = "i32"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


class ScaleKind(Enum):
    TENSOR = "tensor"
    TOKEN = "token"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"


@dataclass(frozen=True, slots=True)
class Scale:
    """How a quantized format's scales are laid out. ``group`` counts elements along the row;
    ``block_rows x block_cols`` is a 2-D tile (weights only)."""

    kind: ScaleKind
    group: int = 0
    block_rows: int = 0
    block_cols: int = 0

    def name(self) -> str:
        match self.kind:
            case ScaleKind.GROUP:
                return f"g{self.group}"
            case ScaleKind.BLOCK:
                return f"block{self.block_rows}x{self.block_cols}"
            case _:
                return self.kind.value


_PLAIN_BYTES = {FormatKind.BF16: 2, FormatKind.F16: 2, FormatKind.F32: 4, FormatKind.I32: 4}


@dataclass(frozen=True, slots=True)
class Format:
    """A storage format. Plain formats have no scale; quantized ones always have one."""

    kind: FormatKind
    scale: Scale | None = None

    def name(self) -> str:
        if self.scale is None:
            return self.kind.value
        return f"{self.kind.value}/{self.scale.name()}"

    def __str__(self) -> str:
        return self.name()

    @property
    def is_quantized(self) -> bool:
        return self.scale is not None

    @property
    def edge_legal(self) -> bool:
        """Whether an activation edge may be stored in this format. Per-channel and 2-D block
        scales describe weight layouts; an activation has no fixed channel to scale."""
        return self.scale is None or self.scale.kind not in (ScaleKind.CHANNEL, ScaleKind.BLOCK)

    def bytes(self, rows: int, dim: int) -> int:
        """Bytes of a ``rows x dim`` activation (an edge) in this format, scales included; an
        nvfp4 activation carries one f32 global scale per row."""
        return self._bytes(rows, dim, global_scales=rows)

    def weight_bytes(self, rows: int, dim: int) -> int:
        """Bytes of a ``rows x dim`` stored weight in this format, scales included; an nvfp4
        weight carries one f32 global scale for the whole tensor."""
        return self._bytes(rows, dim, global_scales=1)

    def _bytes(self, rows: int, dim: int, *, global_scales: int) -> int:
        if rows < 0 or dim < 0:
            raise ValueError(f"negative shape {rows}x{dim}")
        if self.kind in _PLAIN_BYTES:
            return _PLAIN_BYTES[self.kind] * rows * dim
        assert self.scale is not None
        if self.scale.kind is ScaleKind.GROUP and dim % self.scale.group:
            raise UnsizedFormat(self.name(), dim, self.scale.group)
        if self.kind is FormatKind.FP8:
            return rows * dim + 4 * _scale_count(self.scale, rows, dim)
        # 4-bit formats: two elements per byte, each row padded to a whole byte.
        data = rows * ((dim + 1) // 2)
        scales = _scale_count(self.scale, rows, dim)  # one byte each (E4M3 or E8M0)
        global_scale = 4 * global_scales if self.kind is FormatKind.NVFP4 else 0
        return data + scales + global_scale


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scale_count(scale: Scale | None, rows: int, dim: int) -> int:
    assert scale is not None
    match scale.kind:
        case ScaleKind.TENSOR:
            return 1
        case ScaleKind.TOKEN:
            return rows
        case ScaleKind.CHANNEL:
            return dim
        case ScaleKind.GROUP:
            return rows * (dim // scale.group)  # exact: the caller checked the division
        case ScaleKind.BLOCK:
            return _ceil_div(rows, scale.block_rows) * _ceil_div(dim, scale.block_cols)
    raise AssertionError(scale)


BF16 = Format(FormatKind.BF16)
F16 = Format(FormatKind.F16)
F32 = Format(FormatKind.F32)
I32 = Format(FormatKind.I32)

_POSITIVE = r"[1-9][0-9]*"
_FP8_SCALE = re.compile(rf"^(tensor|token|channel|g({_POSITIVE})|block({_POSITIVE})x({_POSITIVE}))$")
_GROUP = re.compile(rf"^g({_POSITIVE})$")


def parse(name: str) -> Format:
    """Parse one spelling of §A1. Raises :class:`FormatError` naming the text otherwise."""
    plain = {k.value: Format(k) for k in _PLAIN_BYTES}
    if name in plain:
        return plain[name]
    head, sep, tail = name.partition("/")
    if not sep:
        raise FormatError(f"unknown format `{name}` (expected one of bf16, f16, f32, i32, "
                          "fp8/<scale>, nvfp4/g<n>, mxfp4/g32)")
    if head == "fp8":
        m = _FP8_SCALE.match(tail)
        if not m:
            raise FormatError(f"unknown fp8 scale in `{name}` (expected tensor, token, channel, "
                              "g<n> or block<r>x<c>)")
        if m.group(2):
            return Format(FormatKind.FP8, Scale(ScaleKind.GROUP, group=int(m.group(2))))
        if m.group(3):
            return Format(FormatKind.FP8, Scale(ScaleKind.BLOCK, block_rows=int(m.group(3)),
                                                block_cols=int(m.group(4))))
        return Format(FormatKind.FP8, Scale(ScaleKind(tail)))
    if head in ("nvfp4", "mxfp4"):
        m = _GROUP.match(tail)
        if not m:
            raise FormatError(f"`{name}`: {head} takes a group scale g<n>")
        group = int(m.group(1))
        if head == "mxfp4" and group != 32:
            raise FormatError(f"`{name}`: mxfp4 scales groups of exactly 32 (mxfp4/g32)")
        return Format(FormatKind(head), Scale(ScaleKind.GROUP, group=group))
    raise FormatError(f"unknown format `{name}`")
