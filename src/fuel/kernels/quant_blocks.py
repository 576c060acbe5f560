"""Packed-row formats as tensors: which GGUF types fuel reads, how a packed row is shaped,
the reference dequantizer, and valid random blocks for tests and JIT verification.

Decides:
- The GGUF tensor types fuel maps (:data:`GGUF_TYPES`): F32/F16/BF16 are plain formats, the
  block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ...) are ``gguf/<layout>``
  weight formats (:func:`fuel.circuit.format.gguf_format`). Any other type is refused by name.
- A block-quantized ``[rows, cols]`` weight is held exactly as the file stores it: a u8 tensor
  ``[rows, blocks_per_row * block_bytes]`` (llama.cpp's layout: each row a run of block structs,
  scales inside each block). That layout *is* the packed layout every kernel here reads, and
  so is fuel's regrouping of it (:data:`fuel.circuit.format.REGROUPED`: ``q4_1x8``,
  ``q8_0x8``, the same bytes moved within each row, :func:`regroup`), which a stored run holds
  its Q4_1 and Q8_0 tensors in; every reader that wants the file's order moves a row back.
- :func:`dequantize` is the meaning of a packed row (the ``dequantize`` primitive's CPU
  kernel, arm 0 of every quantized matmul): it calls the ``gguf`` package's reference
  dequantizer (the one llama.cpp's Python tools use), so fuel never carries its own copy of the
  recipe it is checked against.
- Per-channel int8 weights (``int8/channel``: a compressed-tensors checkpoint's int8 ``weight``
  and its ``weight_scale``) are held as the row layout ``int8_channel``
  (:data:`fuel.circuit.format.INT8_ROWS`): each row its int8 weights, then its f32 scale. Their
  reference is here (no package carries one): ``w = f32(q) * scale``, one f32 rounding per
  weight, which is what compressed-tensors' ``dequantize`` computes for an f32 scale.
  :func:`pack_int8_channel` builds the rows, :func:`quantize_int8_channel` quantizes
  symmetrically (``scale = absmax / 127`` per row, round to nearest).

Invariants:
- ``rows * packed_row_bytes(layout, cols)`` equals ``Format.weight_bytes(rows, cols)`` for that
  layout (one table: :data:`fuel.circuit.format.ROW_LAYOUTS`, one width rule:
  :func:`fuel.circuit.format.row_bytes`).
- :func:`random_blocks` produces blocks whose every scale is a finite f16 of realistic size, so
  dequantized values are finite and the kernels' tolerances are meaningful.
"""

from __future__ import annotations

from typing import Any

from fuel.circuit.format import (
    GGUF_BLOCKS, HALF_ROWS, INT8_CHANNEL_LAYOUT, REGROUPED, ROW_LAYOUTS, Format, FormatError,
    gguf_format, parse, row_bytes,
)
from fuel.errors import FuelError

PLAIN_GGUF_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
"""GGUF types stored as plain floats (loaded as tensors of that dtype)."""

GGUF_TYPES = {**PLAIN_GGUF_TYPES, **{layout.upper(): f"gguf/{layout}" for layout in GGUF_BLOCKS}}
"""GGUF tensor type name (``gguf.GGMLQuantizationType`` member) → fuel format name."""

HALF_LAYOUTS = HALF_ROWS
"""16-bit float matrices run as packed rows (``bf16``/``f16`` weights, and a GGUF's F16/BF16
matrices in ``--dtype stored``): one element per 2-byte "block", no scale. Their quantized
matmul is the native kernel's (f32 accumulation); the dequantize arm widens them to f32."""

KERNEL_LAYOUTS = ("q8_0", "q8_0x8", "q4_0", "q4_1", "q4_1x8", "q5_0", "q5_1")
"""Block layouts with a numba quantized-matmul template (``fuel.jit.quant_gemv``). On CPU the
native library (``fuel.kernels.native.QUANT_LAYOUTS``: these, the K-quants q4_k/q5_k/q6_k and
the half layouts) answers first; a layout in neither runs its dequantized arm only."""


class UnsupportedTensorType(FuelError):
    """A GGUF tensor stored in a type fuel cannot run, named with the tensor."""

    def __init__(self, path: str, tensor: str, tensor_type: str):
        self.path, self.tensor, self.tensor_type = path, tensor, tensor_type
        super().__init__(f"{path}: tensor `{tensor}` is stored as {tensor_type}, which fuel "
                         f"cannot run (it runs {', '.join(GGUF_TYPES)})")


def format_of_gguf_type(type_name: str) -> Format | None:
    """The fuel format of a GGUF tensor type name, or None when fuel does not map it."""
    name = GGUF_TYPES.get(type_name)
    return parse(name) if name is not None else None


def block_shape(layout: str) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of a llama.cpp block layout (or a half layout,
    or ``int8_channel``: one byte per element, the row's scale its tail)."""
    shape = ROW_LAYOUTS.get(layout)
    if shape is None:
        raise FormatError(f"unknown llama.cpp block format `{layout}`")
    return shape


def packed_row_bytes(layout: str, cols: int) -> int:
    """Bytes of one packed row of ``cols`` elements (``cols`` must fill whole blocks), its tail
    included (:func:`fuel.circuit.format.row_bytes`)."""
    elements, _ = block_shape(layout)
    if cols % elements:
        raise FormatError(f"gguf/{layout} rows hold whole blocks of {elements}; {cols} does not")
    return row_bytes(layout, cols)


def _qtype(layout: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[layout.upper()]


def _x8_order(layout: str, blocks: int):
    """``order`` with ``grouped[:, j] = file[:, order[j]]`` for a row of ``blocks`` blocks of a
    regrouped layout (:data:`fuel.circuit.format.REGROUPED`) and its file layout: per group of
    eight, the d's (q4_1x8: at lanes ``k // 2 + 4 (k % 2)``, then the m's), then the quants in
    block order; a short last group in block order throughout."""
    import numpy as np

    offset = layout == "q4_1x8"  # q4_1: d, m, 16 quant bytes; q8_0: d, 32 int8
    size = 20 if offset else 34
    scales, quants = (4, 16) if offset else (2, 32)
    order = np.empty(blocks * size, dtype=np.int64)
    for start in range(0, blocks, 8):
        n = min(8, blocks - start)
        base = start * size
        for k in range(n):
            at = k // 2 + 4 * (k % 2) if n == 8 and offset else k
            block = base + size * k
            order[base + 2 * at:base + 2 * at + 2] = (block, block + 1)
            if offset:
                order[base + 2 * n + 2 * at:base + 2 * n + 2 * at + 2] = (block + 2, block + 3)
            first = base + scales * n + quants * k
            order[first:first + quants] = np.arange(block + scales, block + size)
    return order


def regroup(packed: Any, layout: str, cols: int, *, back: bool = False):
    """Packed rows ``[..., row_bytes]`` (torch u8) of a regrouped layout (``layout`` is
    ``q4_1x8``, ``q8_0x8``: :data:`fuel.circuit.format.REGROUPED`) from its llama.cpp layout's
    file order, or back to it (``back=True``): the same bytes, moved within each row. The native
    library's ``fuel_regroup`` does the same faster; the tests hold the two equal."""
    import numpy as np
    import torch

    if layout not in REGROUPED:
        raise FormatError(f"`{layout}` is not a regrouped layout (those are {', '.join(REGROUPED)})")
    elements, _ = block_shape(layout)
    order = _x8_order(layout, cols // elements)
    if back:
        order = np.argsort(order)
    rows = packed.reshape(-1, packed.shape[-1]).contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(rows[:, order])).reshape(packed.shape)


def dequantize(packed: Any, layout: str, cols: int):
    """f32 ``[..., cols]`` values of packed rows ``[..., row_bytes]`` (torch u8 in, torch out),
    by the ``gguf`` package's reference dequantizer (a regrouped layout's rows moved back to its
    llama.cpp layout first)."""
    import numpy as np
    import torch
    from gguf import quants

    if layout in REGROUPED:
        return dequantize(regroup(packed, layout, cols, back=True), REGROUPED[layout], cols)
    lead = tuple(packed.shape[:-1])
    if layout in HALF_LAYOUTS:
        half = torch.float16 if layout == "f16" else torch.bfloat16
        return packed.contiguous().view(torch.uint8).view(half).float().reshape(*lead, cols)
    if layout == INT8_CHANNEL_LAYOUT:
        q, scale = int8_channel_parts(packed, cols)
        return (q.float() * scale.unsqueeze(-1)).reshape(*lead, cols)
    rows = packed.reshape(-1, packed.shape[-1]).contiguous().numpy()
    values = quants.dequantize(rows, _qtype(layout))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(*lead, cols)


def int8_channel_parts(packed: Any, cols: int):
    """``(q, scale)`` of ``int8_channel`` rows ``[..., cols + 4]``: the int8 weights ``[R, cols]``
    (a strided view of the rows, no copy) and the f32 scales ``[R]`` (R = the rows, leading
    dimensions flattened)."""
    import torch

    width = row_bytes(INT8_CHANNEL_LAYOUT, cols)
    if packed.dtype != torch.uint8 or packed.shape[-1] != width:
        raise FormatError(f"int8_channel rows of {cols} columns are u8 [..., {width}], got "
                          f"{packed.dtype} {tuple(packed.shape)}")
    rows = packed.reshape(-1, width)
    scale = rows[:, cols:].contiguous().view(torch.float32).reshape(-1)
    return rows[:, :cols].view(torch.int8), scale


def pack_int8_channel(q: Any, scale: Any):
    """``int8_channel`` rows u8 ``[rows, cols + 4]`` of int8 weights ``q [rows, cols]`` and their
    per-row scales (``[rows]`` or ``[rows, 1]``, any float dtype: widened to f32 exactly)."""
    import torch

    rows, cols = q.shape
    out = torch.empty((rows, row_bytes(INT8_CHANNEL_LAYOUT, cols)), dtype=torch.uint8)
    out[:, :cols] = q.to(torch.int8).view(torch.uint8)
    out[:, cols:] = scale.reshape(rows, 1).to(torch.float32).contiguous().view(torch.uint8)
    return out


def quantize_int8_channel(values: Any):
    """``(q, scale)`` of f32 ``[rows, cols]`` values, symmetric per row: ``scale = absmax / 127``
    (f32), ``q = clamp(round(v / scale), -128, 127)`` int8; an all-zero row gets scale 0 and q 0."""
    import torch

    values = values.float()
    scale = values.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(values / safe.unsqueeze(1)), -128, 127).to(torch.int8)
    return q, scale


# Byte offsets of each layout's f16 fields (the scales) inside one block.
_F16_FIELDS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82), "q3_k": (108,),
}


# Scale ranges giving weights of a trained model's size (|w| up to ~0.3): a scale multiplies
# quants up to 127 (q8_0), 15-31 (q4/q5) or a 6-bit sub-scale times 15-63 (K-quants).
_SCALE_RANGES = {"q8_0": (0.0002, 0.002), "q4_k": (0.0002, 0.001), "q5_k": (0.0001, 0.0005),
                 "q6_k": (0.0002, 0.001), "q2_k": (0.0005, 0.002), "q3_k": (0.0005, 0.002)}


def random_blocks(layout: str, rows: int, cols: int, generator: Any):
    """A u8 ``[rows, row_bytes]`` tensor of valid blocks: random quants, f16 scales of the size
    real weights have (``_SCALE_RANGES``; ``U(0.002, 0.02)`` for the 4/5-bit formats, offsets of
    the ``_1`` formats from ``U(-0.1, 0.1)``; ``int8_channel``: every int8 value, f32 scales from
    ``U(0.0002, 0.002)``). ``q8_k`` (an activation format) has no f16 scale and is refused."""
    import torch

    elements, block_bytes = block_shape(layout)
    if layout in HALF_LAYOUTS:  # weights of a trained model's size, as 2-byte elements
        values = torch.randn(rows, cols, generator=generator) * 0.05
        return values.to(torch.float16 if layout == "f16" else torch.bfloat16).view(torch.uint8)
    if layout == INT8_CHANNEL_LAYOUT:  # every int8 (-128 too), scales giving |w| up to ~0.25
        q = torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8)
        scale = torch.empty(rows, dtype=torch.float32).uniform_(0.0002, 0.002, generator=generator)
        return pack_int8_channel(q, scale)
    if layout in REGROUPED:  # the llama.cpp layout's valid blocks, moved
        return regroup(random_blocks(REGROUPED[layout], rows, cols, generator), layout, cols)
    if layout not in _F16_FIELDS:
        raise FormatError(f"gguf/{layout} is not a weight format with f16 scales")
    blocks = rows * (cols // elements)
    # random bytes drawn four at a time (int32 words: half the time of u8 draws, an LM head's
    # 30 MB took ~80 ms); every byte value is drawn (the words miss only 0x7fffffff)
    count = blocks * block_bytes
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, ((count + 3) // 4,), generator=generator,
                          dtype=torch.int32)
    data = words.view(torch.uint8)[:count].reshape(blocks, block_bytes).clone()
    for index, offset in enumerate(_F16_FIELDS[layout]):
        low, high = _SCALE_RANGES.get(layout, (0.002, 0.02)) if index == 0 else (-0.1, 0.1)
        if layout.endswith("_k") and index == 1:
            low, high = _SCALE_RANGES[layout]  # dmin scales the (unsigned) 6-bit mins
        scale = torch.empty(blocks, dtype=torch.float32).uniform_(low, high, generator=generator)
        data[:, offset:offset + 2] = scale.to(torch.float16).view(torch.uint8).reshape(blocks, 2)
    return data.reshape(rows, packed_row_bytes(layout, cols))


def quantize_reference(values: Any, layout: str):
    """Packed rows of f32 ``[rows, cols]`` values by the ``gguf`` package's quantizer (it has
    quantizers for the 32-element formats, not the K-quants; a regrouped layout: its llama.cpp
    layout's rows, moved)."""
    import numpy as np
    import torch
    from gguf import quants

    if layout in REGROUPED:
        return regroup(quantize_reference(values, REGROUPED[layout]), layout, values.shape[-1])

    packed = quants.quantize(values.float().contiguous().numpy(), _qtype(layout))
    return torch.from_numpy(np.ascontiguousarray(packed, dtype=np.uint8))


__all__ = ["GGUF_TYPES", "HALF_LAYOUTS", "KERNEL_LAYOUTS", "PLAIN_GGUF_TYPES", "UnsupportedTensorType",
           "block_shape", "dequantize", "format_of_gguf_type", "gguf_format", "int8_channel_parts",
           "pack_int8_channel", "packed_row_bytes", "quantize_int8_channel", "quantize_reference",
           "random_blocks", "regroup"]
