"""Layer-1 work per op family: pure functions from sizes to a :class:`CostEstimate`.

Decided here: how much arithmetic and DRAM traffic each op family does, with its real
parameters — softmax, norms, RoPE and attention are never free. The graph adapter
(:mod:`fuel.cost.estimate`) reads a node's shapes, dtypes and params and calls one of these.

Conventions (hand-checkable; the unit tests pin each formula):

- Bytes are the minimum DRAM traffic: every input read once, every output written once, at
  the storage width of its dtype (sub-byte formats round up per tensor). Broadcast operands
  count their own (smaller) size.
- A multiply-add is 2 FLOP; an add, multiply, max, compare or select is 1; a transcendental
  (exp, tanh, rsqrt, sqrt, sigmoid's exp) is ``TRANSCENDENTAL_FLOPS`` = 4, roughly its cost in
  vector-unit operations (range reduction + polynomial).
- Matmul-shaped contractions are ``matrix_flops`` at the dtype of their operands; everything
  else is vector work priced at the FP32 vector rate.
- Attention with a symbolic (unknown until run time) key length is priced at its capacity;
  paged attention is priced at the occupied context (``sum(context_lens)``) when known, at
  capacity (block-table slots × block size) when not.

Invariants: pure and total for non-negative sizes; every result is a valid CostEstimate.
"""

from __future__ import annotations

import math
from typing import Sequence

from fuel.cost.roofline import CostEstimate

TRANSCENDENTAL_FLOPS = 4

# Storage width in bits per element, by dtype name (graph spelling and aliases).
_BITS: dict[str, int] = {
    "bool": 8, "u8": 8, "i8": 8, "u16": 16, "i16": 16, "u32": 32, "i32": 32, "u64": 64,
    "i64": 64, "bf16": 16, "f16": 16, "f32": 32, "f64": 64,
    "f8e4m3": 8, "f8e5m2": 8, "fp8": 8, "f6e2m3": 6, "f6e3m2": 6, "fp6": 6, "f4e2m1": 4,
    "fp4": 4,
}


def dtype_bits(dtype: str) -> int:
    key = dtype.lower().split("/", 1)[0]
    if key not in _BITS:
        raise ValueError(f"no storage width known for dtype {dtype!r}")
    return _BITS[key]


def tensor_bytes(elements: int, dtype: str) -> int:
    """Bytes to store ``elements`` values of ``dtype`` (sub-byte formats round up)."""
    return math.ceil(elements * dtype_bits(dtype) / 8)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def elementwise(
    out_elements: int,
    out_dtype: str,
    inputs: Sequence[tuple[int, str]],
    *,
    flops_per_element: int = 1,
) -> CostEstimate:
    """A map over ``out_elements`` (unary, binary, cast, where, scalar ops, activations)."""
    read = sum(tensor_bytes(n, dtype) for n, dtype in inputs)
    return CostEstimate(
        flops=out_elements * flops_per_element,
        bytes=read + tensor_bytes(out_elements, out_dtype),
    )


def data_movement(moved_elements: int, dtype: str, *, extra_read_bytes: int = 0) -> CostEstimate:
    """Copies that compute nothing (permute, concat, slice, gather, index_select, copy)."""
    return CostEstimate(
        flops=0,
        bytes=2 * tensor_bytes(moved_elements, dtype) + extra_read_bytes,
    )


def view() -> CostEstimate:
    """Reshape/permute/transpose/unsqueeze/expand/slice/select of a tensor: metadata only, no
    kernel launch and no traffic; one host-side framework call (priced by the device's
    ``host_call_ns``: nothing on a GPU, the probed per-call overhead on the CPU backend)."""
    return CostEstimate(flops=0, bytes=0, launches=0, host_calls=1)


def reduction(in_elements: int, out_elements: int, dtype: str, out_dtype: str) -> CostEstimate:
    """sum / max / mean over a dim: one op per input element (mean adds one per output)."""
    return CostEstimate(
        flops=in_elements + out_elements,
        bytes=tensor_bytes(in_elements, dtype) + tensor_bytes(out_elements, out_dtype),
    )


def matmul(
    *, batch: int, m: int, k: int, n: int, dtype: str, out_dtype: str | None = None,
    a_batch: int | None = None, b_batch: int | None = None, bias: bool = False,
) -> CostEstimate:
    """C[batch, m, n] = A[a_batch, m, k] @ B[b_batch, k, n] (+ bias[n]).

    ``a_batch`` / ``b_batch`` default to ``batch``; a broadcast operand (a weight shared across
    the batch) passes 1 and is read once.
    """
    out_dtype = out_dtype or dtype
    a_batch = batch if a_batch is None else a_batch
    b_batch = batch if b_batch is None else b_batch
    contraction = 2 * batch * m * k * n
    bias_flops = batch * m * n if bias else 0
    traffic = (
        tensor_bytes(a_batch * m * k, dtype)
        + tensor_bytes(b_batch * k * n, dtype)
        + tensor_bytes(batch * m * n, out_dtype)
        + (tensor_bytes(n, dtype) if bias else 0)
    )
    return CostEstimate(
        flops=contraction + bias_flops,
        bytes=traffic,
        matrix_flops=contraction,
        matrix_dtype=dtype if contraction else None,
        matrix_rows=m if contraction else 0,
    )


def softmax(rows: int, cols: int, dtype: str) -> CostEstimate:
    """Row softmax: max, subtract, exp, sum, divide per element."""
    per_element = 1 + 1 + TRANSCENDENTAL_FLOPS + 1 + 1
    n = rows * cols
    return CostEstimate(flops=n * per_element, bytes=2 * tensor_bytes(n, dtype))


def rms_norm(rows: int, dim: int, dtype: str, *, gain: bool) -> CostEstimate:
    """x * rsqrt(mean(x²) + eps) (* gain): square+sum, scale (and gain) per element; one
    mean, add-eps and rsqrt per row."""
    n = rows * dim
    per_element = 2 + 1 + (1 if gain else 0)
    per_row = 2 + TRANSCENDENTAL_FLOPS
    return CostEstimate(
        flops=n * per_element + rows * per_row,
        bytes=2 * tensor_bytes(n, dtype) + (tensor_bytes(dim, dtype) if gain else 0),
    )


def layer_norm(rows: int, dim: int, dtype: str, *, affine: bool = True) -> CostEstimate:
    """(x - mean) * rsqrt(var + eps) (* gain + bias): sum, subtract, square+sum, scale
    (and gain, bias) per element; two divides, add-eps and rsqrt per row."""
    n = rows * dim
    per_element = 1 + 1 + 2 + 1 + (2 if affine else 0)
    per_row = 3 + TRANSCENDENTAL_FLOPS
    return CostEstimate(
        flops=n * per_element + rows * per_row,
        bytes=2 * tensor_bytes(n, dtype) + (2 * tensor_bytes(dim, dtype) if affine else 0),
    )


def residual_rms_norm(rows: int, dim: int, dtype: str, *, gain: bool = True) -> CostEstimate:
    """h = x + residual, y = rms_norm(h): reads x and residual, writes h and y."""
    norm = rms_norm(rows, dim, dtype, gain=gain)
    n = rows * dim
    return CostEstimate(
        flops=n + norm.flops,
        bytes=norm.bytes + 2 * tensor_bytes(n, dtype),
    )


def rope(elements: int, positions: int, rotary_dim: int, dtype: str, table_dtype: str | None = None) -> CostEstimate:
    """Rotate-half RoPE: x*cos + rotate_half(x)*sin — negate, two multiplies, one add per
    element; the cos and sin tables ([positions, rotary_dim] each) are read once."""
    table_dtype = table_dtype or dtype
    return CostEstimate(
        flops=4 * elements,
        bytes=2 * tensor_bytes(elements, dtype) + 2 * tensor_bytes(positions * rotary_dim, table_dtype),
    )


def silu_mul(elements: int, dtype: str) -> CostEstimate:
    """SwiGLU: silu(gate) * up = gate / (1 + exp(-gate)) * up — negate, exp, add, divide,
    multiply per element; reads gate and up, writes the product."""
    return CostEstimate(
        flops=elements * (TRANSCENDENTAL_FLOPS + 4),
        bytes=3 * tensor_bytes(elements, dtype),
    )


def _attention_work(batch: int, heads: int, q_len: int, k_len: int, head_dim: int) -> tuple[int, int]:
    """(matrix_flops, vector_flops) of softmax(Q Kᵀ · scale) V."""
    scores = batch * heads * q_len * k_len
    matrix = 2 * scores * head_dim * 2  # QKᵀ and PV, 2 FLOP per multiply-add each
    vector = scores * (1 + 1 + 1 + TRANSCENDENTAL_FLOPS + 1) + batch * heads * q_len * head_dim
    # scale, max, subtract, exp, sum per score; one normalizing divide per output element
    return matrix, vector


def attention(
    *, batch: int, heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int,
    dtype: str, out_dtype: str | None = None, mask_bytes: int = 0,
) -> CostEstimate:
    """Flash attention: Q [b, h, q, d], K/V [b, kv_heads, k, d] read once, O [b, h, q, d]."""
    out_dtype = out_dtype or dtype
    matrix, vector = _attention_work(batch, heads, q_len, k_len, head_dim)
    traffic = (
        tensor_bytes(batch * heads * q_len * head_dim, dtype)
        + 2 * tensor_bytes(batch * kv_heads * k_len * head_dim, dtype)
        + tensor_bytes(batch * heads * q_len * head_dim, out_dtype)
        + mask_bytes
    )
    return CostEstimate(
        flops=matrix + vector, bytes=traffic, matrix_flops=matrix,
        matrix_dtype=dtype if matrix else None,
    )


def paged_attention(
    *, seqs: int, heads: int, kv_heads: int, q_len: int, head_dim: int, dtype: str,
    block_size: int, blocks_per_seq: int, context_lens: Sequence[int] | None = None,
    index_dtype: str = "u32",
) -> CostEstimate:
    """Paged attention over a block table [seqs, blocks_per_seq] of ``block_size`` slots.

    Keys per sequence = its context length when ``context_lens`` is known (occupancy), else
    the table's capacity ``blocks_per_seq * block_size``. Reads Q, the touched K/V blocks, the
    block table and the context lengths; writes O.
    """
    capacity = blocks_per_seq * block_size
    if context_lens is None:
        per_seq = [capacity] * seqs
    else:
        if len(context_lens) != seqs:
            raise ValueError(f"context_lens has {len(context_lens)} entries for {seqs} sequences")
        per_seq = [min(max(length, 0), capacity) for length in context_lens]
    matrix = vector = 0
    kv_bytes = 0
    for keys in per_seq:
        m, v = _attention_work(1, heads, q_len, keys, head_dim)
        matrix += m
        vector += v
        kv_bytes += 2 * tensor_bytes(kv_heads * keys * head_dim, dtype)
    q_elements = seqs * heads * q_len * head_dim
    traffic = (
        2 * tensor_bytes(q_elements, dtype)
        + kv_bytes
        + tensor_bytes(seqs * blocks_per_seq, index_dtype)
        + tensor_bytes(seqs, index_dtype)
    )
    return CostEstimate(
        flops=matrix + vector, bytes=traffic, matrix_flops=matrix,
        matrix_dtype=dtype if matrix else None,
    )
