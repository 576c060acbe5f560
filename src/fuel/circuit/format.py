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
- A ``channel`` scale is one per output channel: one per row of a ``rows x dim`` tensor (a
  weight ``[out, in]`` is priced as ``weight_bytes(out, in)``), as the checkpoints that store
  them do (compressed-tensors' ``weight_scale`` ``[out, 1]``, fp8's per-channel scales).
- nvfp4's f32 global scale is per row on an activation (each token row is quantized on its own,
  so a step's rows never share a scale) and per tensor on a weight.
- A group scale ``g<n>`` tiles a row exactly: a ``dim`` that is not a multiple of ``n`` has no
  size (:class:`UnsizedFormat`, naming format, dim and group), never a silently rounded-up one.
  2-D ``block<r>x<c>`` weight tiles keep partial edge tiles (counted by ceiling), as blockwise
  fp8 checkpoints store them.
- Packed rows (:data:`ROW_LAYOUTS`, what ``quant_linear`` and ``dequantize`` read): a weight held
  as u8 ``[rows, row_bytes]``, each row a run of whole blocks plus the layout's per-row tail
  (:data:`ROW_TAIL_BYTES`). :func:`row_bytes` is the one width rule, and a packed weight's bytes
  equal its format's ``weight_bytes`` (the tests hold every layout to it).
- ``int8/channel`` runs as the row layout ``int8_channel`` (:data:`INT8_ROWS`): each row is its
  ``cols`` int8 weights, then its f32 scale (4 bytes, little-endian), so ``w = q * scale``. One
  "block" is one element of one byte and the scale is the row's tail. Why this layout: the
  scale travels with its row, so every row-wise consumer (a gathered embedding row, a rank's
  slice of rows, the dequantize primitive) reads a row alone, and ``quant_linear`` keeps its one
  packed operand; ``rows * (cols + 4)`` is exactly ``weight_bytes(rows, cols)``. The cost: the
  int8 matrix is not one contiguous ``[rows, cols]`` block, so a kernel that wants one (torch's
  ``_weight_int8pack_mm``) converts once (:mod:`fuel.kernels.int8pack`).
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
    INT4 = "int4"
    """GPTQ/AWQ-style weight-only int4: group scales (f16) and packed 4-bit zero points."""
    INT8 = "int8"
    """Weight-only int8 with per-channel (f32) scales."""
    GGUF = "gguf"
    """A llama.cpp block format (``gguf/q4_1``): the layout names the block struct."""


class ScaleKind(Enum):
    TENSOR = "tensor"
    TOKEN = "token"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    GGUF_BLOCK = "gguf_block"
    """Scales stored inside each llama.cpp block (``group`` = elements per block)."""


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
            case ScaleKind.GGUF_BLOCK:
                return f"gguf_block{self.group}"
            case _:
                return self.kind.value


_PLAIN_BYTES = {FormatKind.BF16: 2, FormatKind.F16: 2, FormatKind.F32: 4, FormatKind.I32: 4}


@dataclass(frozen=True, slots=True)
class Format:
    """A storage format. Plain formats have no scale; quantized ones always have one."""

    kind: FormatKind
    scale: Scale | None = None
    layout: str = ""
    """The llama.cpp block struct of a ``gguf`` format (``q4_1``); empty for every other kind."""

    def name(self) -> str:
        if self.kind is FormatKind.GGUF:
            return f"gguf/{self.layout}"
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
        return self.scale is None or self.scale.kind not in (
            ScaleKind.CHANNEL, ScaleKind.BLOCK, ScaleKind.GGUF_BLOCK)

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
        if self.kind is FormatKind.GGUF:
            # Whole blocks per row: a row's tail block is stored complete (llama.cpp requires
            # rows that are a multiple of the block; a partial one would still occupy a block).
            elements, block_bytes = ROW_LAYOUTS[self.layout]
            return rows * _ceil_div(dim, elements) * block_bytes
        if self.kind is FormatKind.INT8:
            return rows * dim + 4 * _scale_count(self.scale, rows, dim)
        if self.kind is FormatKind.INT4:
            groups = _scale_count(self.scale, rows, dim)
            # f16 scale per group, 4-bit zero point per group packed two to a byte.
            return rows * ((dim + 1) // 2) + 2 * groups + _ceil_div(groups, 2)
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
            return rows  # one per output channel: a row of the [out, in] tensor
        case ScaleKind.GROUP:
            return rows * (dim // scale.group)  # exact: the caller checked the division
        case ScaleKind.BLOCK:
            return _ceil_div(rows, scale.block_rows) * _ceil_div(dim, scale.block_cols)
    raise AssertionError(scale)


GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "q4_0": (32, 18),   # f16 d, 16 bytes of nibbles
    "q4_1": (32, 20),   # f16 d, f16 m, 16 bytes of nibbles
    "q5_0": (32, 22),   # f16 d, 4 bytes of high bits, 16 bytes of nibbles
    "q5_1": (32, 24),   # f16 d, f16 m, 4 bytes of high bits, 16 bytes of nibbles
    "q8_0": (32, 34),   # f16 d, 32 int8
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "q4_k": (256, 144),  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    "q5_k": (256, 176),  # q4_k plus 32 bytes of high bits
    "q6_k": (256, 210),  # 128 low nibbles, 64 high 2-bits, 16 int8 scales, f16 d
    "q8_k": (256, 292),
}
"""llama.cpp block structs: ``(elements per block, bytes per block)``, scales included. Source:
ggml-common.h's ``block_q4_0`` ... ``block_q8_K`` and the ``GGML_QUANT_SIZES`` table of the
``gguf`` package (``gguf.constants``), which fuel's tests check this against."""

REGROUPED: dict[str, str] = {"q4_1x8": "q4_1", "q8_0x8": "q8_0"}
"""fuel's regrouped block layouts → the llama.cpp layout whose bytes they hold. ``q4_1x8``:
each row's q4_1 blocks eight at a time, the eight f16 ``d`` first (in the lane order
``0, 2, 4, 6, 1, 3, 5, 7``), then the eight f16 ``m``, then the eight blocks' 16 quant bytes in
block order; a row's last ``blocks % 8`` blocks as ``d``'s, ``m``'s, quants in block order.
``q8_0x8``: the same for q8_0 (eight ``d`` in block order, then the eight blocks' 32 int8). The
same bytes as the file's row, moved (:func:`fuel.kernels.quant_blocks.regroup`), so a row is as
large and means the same weights; what changes is what a kernel reads with one load: the native
8-bit-activation kernel reads eight blocks' scales at once and sums eight blocks before it
scales them (``fuel.kernels.native``, ``gemv.c``). A stored GGUF run holds its Q4_1 and Q8_0
tensors this way (:func:`fuel.runtime.quant_cache.held_format`). Spelled ``gguf/q4_1x8``: a
llama.cpp quantization in fuel's arrangement, never a GGUF tensor type."""

HALF_ROWS: dict[str, tuple[int, int]] = {"f16": (1, 2), "bf16": (1, 2)}
"""16-bit float matrices held as packed rows (a bf16/f16 run's matrices, a GGUF's F16/BF16
ones in ``--dtype stored``): one element per 2-byte "block"."""

INT8_CHANNEL_LAYOUT = "int8_channel"
INT8_ROWS: dict[str, tuple[int, int]] = {INT8_CHANNEL_LAYOUT: (1, 1)}
"""Per-channel int8 weights (``int8/channel``) as packed rows: one int8 element per one-byte
"block", the row's f32 scale as its tail (module docs)."""

ROW_LAYOUTS: dict[str, tuple[int, int]] = {**GGUF_BLOCKS, **{k: GGUF_BLOCKS[v] for k, v in REGROUPED.items()},
                                             **HALF_ROWS, **INT8_ROWS}
"""Every layout a packed ``[rows, row_bytes]`` weight may have: ``(elements, bytes)`` per block."""

ROW_TAIL_BYTES: dict[str, int] = {INT8_CHANNEL_LAYOUT: 4}
"""Bytes after a layout's blocks in every packed row (the per-row f32 scale of ``int8_channel``);
0 for a layout not named."""


def row_bytes(layout: str, cols: int) -> int:
    """Bytes of one packed row of ``cols`` elements in ``layout`` (``cols`` fills whole blocks:
    the caller checks ``cols % elements``), its tail included."""
    elements, block_bytes = ROW_LAYOUTS[layout]
    return cols // elements * block_bytes + ROW_TAIL_BYTES.get(layout, 0)


def row_cols(layout: str, width: int) -> int:
    """Elements in a packed row of ``width`` bytes (the inverse of :func:`row_bytes`)."""
    elements, block_bytes = ROW_LAYOUTS[layout]
    return (width - ROW_TAIL_BYTES.get(layout, 0)) // block_bytes * elements


def row_layout(format_name: str | None) -> str | None:
    """The packed-row layout a weight held in ``format_name`` runs as: ``gguf/q4_1`` -> ``q4_1``,
    a half-precision matrix ``bf16`` -> ``bf16``, ``int8/channel`` -> ``int8_channel``; None for
    a plain tensor (or no format)."""
    if not format_name:
        return None
    if format_name.startswith("gguf/"):
        return format_name.removeprefix("gguf/")
    if format_name in HALF_ROWS:
        return format_name
    if format_name == "int8/channel":
        return INT8_CHANNEL_LAYOUT
    return None


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
    if head == "gguf":
        if tail not in GGUF_BLOCKS and tail not in REGROUPED:
            raise FormatError(f"unknown llama.cpp block format in `{name}` (expected one of "
                              f"{', '.join('gguf/' + t for t in GGUF_BLOCKS)})")
        return gguf_format(tail)
    if head == "int4":
        m = _GROUP.match(tail)
        if not m:
            raise FormatError(f"`{name}`: int4 takes a group scale g<n>")
        return Format(FormatKind.INT4, Scale(ScaleKind.GROUP, group=int(m.group(1))))
    if head == "int8":
        if tail != "channel":
            raise FormatError(f"`{name}`: int8 weights take per-channel scales (int8/channel)")
        return Format(FormatKind.INT8, Scale(ScaleKind.CHANNEL))
    raise FormatError(f"unknown format `{name}`")


def gguf_format(layout: str) -> Format:
    """The format of a llama.cpp block struct (``q4_1``) or of fuel's regrouping of one
    (``q4_1x8``: :data:`REGROUPED`); :class:`FormatError` if unknown."""
    if layout not in GGUF_BLOCKS and layout not in REGROUPED:
        raise FormatError(f"unknown llama.cpp block format `{layout}`")
    return Format(FormatKind.GGUF, Scale(ScaleKind.GGUF_BLOCK, group=ROW_LAYOUTS[layout][0]),
                  layout)
