"""The numba answer to a quantized matmul: ``x @ dequantize(w).T`` read straight from llama.cpp
blocks, one pass over the packed weight, the weights dequantized in registers.

Decides which ``quant_linear`` regions the numba synthesizer builds (:func:`match_quant_linear`:
exactly the recipe ``matmul(x, transpose(dequantize(w, layout, cols)))`` with a layout in
:data:`~fuel.kernels.quant_blocks.KERNEL_LAYOUTS`) and the kernel's source per layout.

How a kernel computes (llama.cpp's block dot product, kept in f32): for each output feature
``n`` (one thread streams the packed rows once) and
each activation row ``m``, every block contributes ``d * sum(q_j * x_j) (+ m * sum(x_j))``;
``sum(x_j)`` per block is computed once per activation row for all features, and the f16
scales are read through a 65,536-entry f32 table. The inner loop over a block's 16 or 32
quants runs under ``fastmath={"reassoc", "contract"}`` only, so LLVM vectorizes the nibble
unpacking and multiply-adds (AVX2 here) while NaN/inf stay IEEE.

Invariants:
- Activations stay f32 (llama.cpp rounds them to 8 bits; fuel does not), so a kernel equals
  the dequantize-then-matmul recipe within f32 rounding of a reordered sum: the JIT's F32
  tolerance verifies it, and the stated bound in the tests is ``2e-5`` absolute plus relative.
- A layout without a template is declined by name, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.graph.ops import OpKind
from fuel.graph.recipe import Bind, PatternNode, PatternOp
from fuel.kernels.quant_blocks import KERNEL_LAYOUTS, block_shape

@dataclass(frozen=True, slots=True)
class QuantRegion:
    layout: str
    cols: int


def match_quant_linear(region: PatternNode) -> QuantRegion | None:
    """The layout and width of a ``quant_linear`` recipe, or None for any other region."""
    if not (isinstance(region, PatternOp) and region.tag is OpKind.MATMUL
            and region.operands[0] == Bind(0)):
        return None
    transpose = region.operands[1]
    if not (isinstance(transpose, PatternOp) and transpose.tag is OpKind.TRANSPOSE
            and transpose.attr_dict() == {"dim0": 0, "dim1": 1}):
        return None
    dequant = transpose.operands[0]
    if not (isinstance(dequant, PatternOp) and dequant.tag is OpKind.DEQUANTIZE
            and dequant.operands == (Bind(1),)):
        return None
    attrs = dequant.attr_dict()
    layout, cols = attrs.get("layout"), attrs.get("cols")
    if not isinstance(layout, str) or not isinstance(cols, int):
        return None
    return QuantRegion(layout, cols)


# Per layout: the statements adding one block to the 32 lane accumulators ``acc`` (and, for the
# ``_1`` formats, its offset times the block's activation sum to ``bias``). ``row`` is the row
# of packed bytes, ``o`` the block's byte offset, ``xr`` the activation row from element ``xb``,
# ``xs`` the block's activation sum, ``signed`` the same row viewed as int8.
_SCALE = "d = f16[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]"
_OFFSET = "bias += f16[np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)] * xs"
_NIBBLES = '''
                for j in range(16):
                    q = np.int32(row[o + {at} + j])
                    acc[j] += (d * np.float32((q & 15){shift})) * xr[xb + j]
                    acc[16 + j] += (d * np.float32((q >> 4){shift})) * xr[xb + 16 + j]'''
_FIVE_BITS = '''
                qh = (np.int64(row[o + {h}]) | (np.int64(row[o + {h} + 1]) << 8)
                      | (np.int64(row[o + {h} + 2]) << 16) | (np.int64(row[o + {h} + 3]) << 24))
                for j in range(16):
                    q = np.int64(row[o + {at} + j])
                    lo = (q & 15) | (((qh >> j) & 1) << 4)
                    hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                    acc[j] += (d * np.float32(lo{shift})) * xr[xb + j]
                    acc[16 + j] += (d * np.float32(hi{shift})) * xr[xb + 16 + j]'''
_BLOCK_CODE = {
    "q8_0": f'''
                {_SCALE}
                for j in range(32):
                    acc[j] += (d * np.float32(signed[o + 2 + j])) * xr[xb + j]''',
    "q4_0": f"\n                {_SCALE}" + _NIBBLES.format(at=2, shift=" - 8"),
    "q4_1": f"\n                {_SCALE}\n                {_OFFSET}" + _NIBBLES.format(at=4, shift=""),
    "q5_0": f"\n                {_SCALE}" + _FIVE_BITS.format(h=2, at=6, shift=" - 16"),
    "q5_1": f"\n                {_SCALE}\n                {_OFFSET}" + _FIVE_BITS.format(h=4, at=8, shift=""),
    # q4_1's blocks regrouped by eight (fuel.circuit.format.REGROUPED): block b's d and m sit in
    # its group's scale runs (at its lane in a full group, in block order in a short last one),
    # its quants after them
    "q4_1x8": '''
                first = (b // 8) * 8
                n8 = min(8, blocks - first)
                k = b - first
                at = k // 2 + 4 * (k % 2) if n8 == 8 else k
                o = first * 20
                d = f16[np.int32(row[o + 2 * at]) | (np.int32(row[o + 2 * at + 1]) << 8)]
                bias += f16[np.int32(row[o + 2 * n8 + 2 * at]) | (np.int32(row[o + 2 * n8 + 2 * at + 1]) << 8)] * xs
                o = o + 4 * n8 + 16 * k''' + _NIBBLES.format(at=0, shift=""),
    # q8_0's the same way: the eight d's in block order, then the eight blocks' 32 int8
    "q8_0x8": '''
                first = (b // 8) * 8
                n8 = min(8, blocks - first)
                k = b - first
                o = first * 34
                d = f16[np.int32(row[o + 2 * k]) | (np.int32(row[o + 2 * k + 1]) << 8)]
                o = o + 2 * n8 + 32 * k
                for j in range(32):
                    acc[j] += (d * np.float32(signed[o + j])) * xr[xb + j]''',
}

_HEADER = '''"""Generated by fuel.jit.quant_gemv: the {layout} quantized matmul. Do not edit: regenerated
from the structure key."""
import numpy as np
from numba import njit
'''

_KERNEL = '''

@njit("void(float32[:, ::1], float32[:, ::1], float32[:, ::1], uint8[:, ::1], int8[:, ::1], float32[::1])",
      fastmath={{"reassoc", "contract"}}, cache=True)
def kernel_serial(out, x, xsum, w, w_signed, f16):
    rows, cols = x.shape
    features = w.shape[0]
    blocks = cols // 32
    acc = np.empty(32, np.float32)
    for n in range(features):
        row = w[n]
        signed = w_signed[n]
        for m in range(rows):
            xr = x[m]
            acc[:] = 0.0
            bias = np.float32(0.0)
            for b in range(blocks):
                o = b * {block_bytes}
                xb = b * 32
                xs = xsum[m, b]{body}
            out[m, n] = acc.sum() + bias
'''


def kernel_source(layout: str) -> str | None:
    """The numba module for ``layout`` (``kernel_serial``), or None when the layout has no
    template. One thread: measured on this 2-core machine, numba's parallel variant woke its
    pool at ~25 ms per call against torch's own threads (0.3-0.8 ms serial), so only the serial
    kernel is built."""
    if layout not in _BLOCK_CODE:
        return None
    elements, block_bytes = block_shape(layout)
    assert elements == 32
    text = _HEADER.format(layout=layout)
    text += _KERNEL.format(block_bytes=block_bytes, body=_BLOCK_CODE[layout])
    return text


_F16_TABLE: Any = None


def f16_table():
    """Every f16 bit pattern's f32 value (256 KiB, built once)."""
    global _F16_TABLE
    if _F16_TABLE is None:
        import numpy as np

        _F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
            .astype(np.float32)
    return _F16_TABLE


class QuantGemvRunner:
    """Calls the compiled kernel on torch tensors: ``run(x [..., K] f32, w u8 [N, row_bytes])``."""

    def __init__(self, module: Any, region: QuantRegion):
        import torch

        self._serial = module.kernel_serial
        self._cols = region.cols
        self._table = f16_table()
        self._torch = torch

    def __call__(self, x, w):
        torch = self._torch
        lead = tuple(x.shape[:-1])
        flat = x.reshape(-1, self._cols).to(torch.float32).contiguous()
        sums = flat.view(flat.shape[0], -1, 32).sum(-1).contiguous()
        out = torch.empty((flat.shape[0], w.shape[0]), dtype=torch.float32)
        packed = w if w.is_contiguous() else w.contiguous()
        self._serial(out.numpy(), flat.numpy(), sums.numpy(), packed.numpy(),
               packed.view(torch.int8).numpy(), self._table)
        return out.reshape(*lead, w.shape[0])


def plan_quant(region: QuantRegion):
    """``(source, make_runner)`` for the numba synthesizer, or a reason it declines."""
    if region.layout not in KERNEL_LAYOUTS or region.layout not in _BLOCK_CODE:
        from fuel.circuit.format import GGUF_BLOCKS

        name = f"gguf/{region.layout}" if region.layout in GGUF_BLOCKS else f"the {region.layout} rows"
        return (f"no quantized-matmul template for {name} (numba builds "
                f"{', '.join('gguf/' + layout for layout in KERNEL_LAYOUTS)}); it runs dequantized")
    source = kernel_source(region.layout)
    return source, lambda module: QuantGemvRunner(module, region)


__all__ = ["QuantGemvRunner", "QuantRegion", "f16_table", "kernel_source",
           "match_quant_linear", "plan_quant"]
