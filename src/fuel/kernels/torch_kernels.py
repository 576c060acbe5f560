"""PyTorch kernels for every primitive and for the fused ops with a real PyTorch kernel.

Decides which (op, dtypes) pairs the torch backends serve and how. The kernels are device-
agnostic torch calls, so the same set binds for ``cpu`` (``kernel_source="torch.cpu"``) and,
where a GPU is present, ``cuda`` (``"torch.cuda"``).

Deliberate gaps: ``paged_attn`` and ``residual_add_rms_norm`` have **no** fused kernel here.
They run decomposed (their recipes over primitives) until the JIT synthesizes one; that gap is
the JIT seam's reason to exist, and ``tests/kernels`` asserts the lookups miss.
``quant_linear`` has no kernel of its own either; on the CPU, torch's int4 weight-only kernel is
bound for the 4-bit GGUF layouts as a *variant arm* (:mod:`fuel.kernels.int4pack`), and its int8
weight-only kernel for per-channel int8 rows (:mod:`fuel.kernels.int8pack`): the node is still
lowered to its recipe and handed to the JIT, and the bake measures the arms side by side.

u32: PyTorch implements little arithmetic for ``torch.uint32`` (no add, compare, arange or
u32 indices on the CPU), so a signature with a u32 operand runs its kernel on int64 copies and
casts a u32 result back. The graph, the key and the result stay u32; only the kernel's internals
widen. Layout ops (views, concatenation) move u32 natively — widening them would be two copies
for nothing — so they bind the plain kernel (:data:`U32_NATIVE`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from fuel.graph.dtype import FLOAT_DTYPES, BackendId, DType
from fuel.graph.ir import Node, Prim
from fuel.graph.ops import OpKind, Predicate
from fuel.graph.registry import FlashAttn, FusedOps
from fuel.kernels.table import CallsFn, KernelBindingTable, KernelEntry, KernelFactory, Precision

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.BOOL: torch.bool, DType.U8: torch.uint8, DType.I8: torch.int8, DType.U32: torch.uint32,
    DType.I16: torch.int16, DType.I32: torch.int32, DType.I64: torch.int64,
    DType.BF16: torch.bfloat16, DType.F16: torch.float16, DType.F32: torch.float32,
    DType.F64: torch.float64, DType.F8E4M3: torch.float8_e4m3fn, DType.F8E5M2: torch.float8_e5m2,
}
"""The dtypes with a torch spelling (fp6/fp4 have none: packed formats torch cannot compute in)."""

INTS = (DType.I32, DType.I64, DType.U32)
NUMERIC = FLOAT_DTYPES + INTS
ANY = NUMERIC + (DType.BOOL,)
INDEX = (DType.U32, DType.I32, DType.I64)
MAX_CONCAT_INPUTS = 16
U32_NATIVE = frozenset({
    OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE, OpKind.UNSQUEEZE, OpKind.EXPAND,
    OpKind.SLICE, OpKind.SELECT, OpKind.CONCAT, OpKind.IOTA, OpKind.SIZE,
})
"""Primitives whose kernels never do arithmetic on a u32 operand's values, so they run on
``uint32`` tensors as they are: layout ops (torch moves u32 natively) and ``iota``/``size``
(they read only the shape, and cast their own result)."""


def torch_dtype(dtype: DType) -> torch.dtype:
    return TORCH_DTYPES[dtype]


def _attrs(node: Node) -> dict[str, Any]:
    assert isinstance(node.op, Prim)
    return node.op.attr_dict()


def _fixed(fn: Callable[..., Any]) -> KernelFactory:
    return lambda node: fn


def _argmax(node: Node):
    attrs = _attrs(node)
    dim, keepdim = attrs["dim"], attrs["keepdim"]
    native = _native_library()

    def argmax(x):
        # The greedy pick over a vocabulary row: one native pass where torch's reduction costs
        # ~90 us on a 49,152-wide row here (same result: first maximum, NaN counts as maximum);
        # a prompt chunk's 128 rows took 7.9 ms through torch.
        if native is not None and x.device.type == "cpu" and dim in (-1, x.dim() - 1):
            out = native.argmax(x)
            if out is not None:
                return out.unsqueeze(-1) if keepdim else out
        return torch.argmax(x, dim, keepdim)
    return argmax


def _index_select(node: Node):
    dim = _attrs(node)["dim"]

    def take(x, index):
        dim_ = dim % x.dim()
        flat = torch.index_select(x, dim_, index.reshape(-1))
        return flat.reshape(x.shape[:dim_] + index.shape + x.shape[dim_ + 1:])
    return take


def _kv_cache_write(node: Node):
    native = _native_library()

    def write(cache, rows, slots):
        # The effect: the fed cache tensor is updated in place and returned, so readers that
        # consume this node observe the write. One native call (row copies into their slots)
        # where the operands are contiguous f32 / int64; else torch's index_copy_.
        if native is not None and cache.device.type == "cpu" and native.kv_write(cache, rows, slots):
            return cache
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        return cache
    return write


_GROUP_IN_PYTHON = 256
"""Up to this many rows, ``expert_matmul`` groups its rows with a Python dict (a few
microseconds); beyond, with a stable argsort on the ids (the Python loop would cost more)."""


def _expert_groups(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(expert, row indices)`` for every distinct expert in ``ids``, experts ascending."""
    if ids.numel() <= _GROUP_IN_PYTHON:
        rows: dict[int, list[int]] = {}
        for row, expert in enumerate(ids.tolist()):
            rows.setdefault(expert, []).append(row)
        return [(expert, torch.tensor(rows[expert], dtype=torch.int64, device=ids.device))
                for expert in sorted(rows)]
    order = torch.argsort(ids, stable=True)
    experts, counts = torch.unique_consecutive(ids.index_select(0, order), return_counts=True)
    return [(expert, part) for expert, part in
            zip(experts.tolist(), torch.split(order, counts.tolist()))]


def _expert_matmul(node: Node):
    def grouped(x, w, ids):
        # Rows grouped by expert: one matmul per distinct expert, so each expert's matrix is
        # read once per call however many rows chose it (the MoE runtime's contract).
        out = x.new_empty((x.shape[0], w.shape[1]))
        for expert, rows in _expert_groups(ids):
            if rows.numel() == x.shape[0]:
                torch.mm(x, w[expert].t(), out=out)
            else:
                out.index_copy_(0, rows, torch.mm(x.index_select(0, rows), w[expert].t()))
        return out
    return grouped


_COMPARE = {Predicate.EQ: torch.eq, Predicate.NE: torch.ne, Predicate.LT: torch.lt,
            Predicate.LE: torch.le, Predicate.GT: torch.gt, Predicate.GE: torch.ge}


def _prim_factories() -> dict[OpKind, KernelFactory]:
    a = _attrs
    return {
        OpKind.NEG: _fixed(torch.neg), OpKind.EXP: _fixed(torch.exp), OpKind.LOG: _fixed(torch.log),
        OpKind.SQRT: _fixed(torch.sqrt), OpKind.RSQRT: _fixed(torch.rsqrt),
        OpKind.TANH: _fixed(torch.tanh), OpKind.SILU: _fixed(F.silu),
        OpKind.SIGMOID: _fixed(torch.sigmoid), OpKind.RECIP: _fixed(torch.reciprocal),
        OpKind.ABS: _fixed(torch.abs),
        OpKind.MUL_SCALAR: lambda n: (lambda x, v=a(n)["value"]: x * v),
        OpKind.ADD_SCALAR: lambda n: (lambda x, v=a(n)["value"]: x + v),
        OpKind.POW_SCALAR: lambda n: (lambda x, e=a(n)["exponent"]: torch.pow(x, e)),
        OpKind.ADD: _fixed(torch.add), OpKind.SUB: _fixed(torch.sub), OpKind.MUL: _fixed(torch.mul),
        OpKind.DIV: _fixed(torch.div), OpKind.MAXIMUM: _fixed(torch.maximum),
        OpKind.COMPARE: lambda n: _COMPARE[a(n)["predicate"]],
        OpKind.WHERE: _fixed(torch.where),
        OpKind.MASKED_FILL: lambda n: (lambda x, m, v=a(n)["value"]: x.masked_fill(m, v)),
        OpKind.CAST: lambda n: (lambda x, t=torch_dtype(a(n)["dtype"]): x.to(t)),
        OpKind.SUM: lambda n: (lambda x, d=a(n)["dim"], k=a(n)["keepdim"]: torch.sum(x, d, k)),
        OpKind.MAX: lambda n: (lambda x, d=a(n)["dim"], k=a(n)["keepdim"]: torch.amax(x, d, k)),
        OpKind.MEAN: lambda n: (lambda x, d=a(n)["dim"], k=a(n)["keepdim"]: torch.mean(x, d, k)),
        OpKind.ARGMAX: _argmax,
        OpKind.TOPK_VALUES: lambda n: (lambda x, k=a(n)["k"], d=a(n)["dim"]: torch.topk(x, k, d).values),
        OpKind.TOPK_INDICES: lambda n: (lambda x, k=a(n)["k"], d=a(n)["dim"]: torch.topk(x, k, d).indices),
        OpKind.MATMUL: _matmul,
        OpKind.EXPERT_MATMUL: _expert_matmul,
        OpKind.RESHAPE: lambda n: (lambda x, s=a(n)["shape"]: x.reshape(s)),
        OpKind.PERMUTE: lambda n: (lambda x, d=a(n)["dims"]: x.permute(d)),
        OpKind.TRANSPOSE: lambda n: (lambda x, i=a(n)["dim0"], j=a(n)["dim1"]: x.transpose(i, j)),
        OpKind.UNSQUEEZE: lambda n: (lambda x, d=a(n)["dim"]: x.unsqueeze(d)),
        OpKind.EXPAND: lambda n: (lambda x, s=a(n)["shape"]: x.expand(s)),
        OpKind.SLICE: lambda n: (lambda x, d=a(n)["dim"], s=a(n)["start"], e=a(n)["end"]:
                                 x.narrow(d, s, e - s)),
        OpKind.SELECT: lambda n: (lambda x, d=a(n)["dim"], i=a(n)["index"]: x.select(d, i)),
        OpKind.CONCAT: lambda n: (lambda *xs, d=a(n)["dim"]: torch.cat(xs, d)),
        OpKind.REPEAT_INTERLEAVE: lambda n: (lambda x, r=a(n)["repeats"], d=a(n)["dim"]:
                                             torch.repeat_interleave(x, r, d)),
        OpKind.IOTA: lambda n: (lambda x, d=a(n)["dim"], t=torch_dtype(a(n)["dtype"]):
                                torch.arange(x.shape[d], device=x.device).to(t)),
        OpKind.SIZE: lambda n: (lambda x, d=a(n)["dim"], t=torch_dtype(a(n)["dtype"]):
                                torch.tensor(x.shape[d], device=x.device).to(t)),
        OpKind.INDEX_SELECT: _index_select,
        OpKind.DEQUANTIZE: _dequantize,
        OpKind.GATHER: lambda n: (lambda x, i, d=a(n)["dim"]: torch.gather(x, d, i)),
        OpKind.KV_CACHE_WRITE: _kv_cache_write,
        OpKind.ALL_REDUCE: _collective,
        OpKind.ALL_GATHER: _collective,
    }


def _collective(node: Node):
    """A collective over the default process group (:mod:`fuel.kernels.collectives`)."""
    from fuel.kernels.collectives import all_gather_kernel, all_reduce_kernel

    attrs = _attrs(node)
    if node.op.kind is OpKind.ALL_REDUCE:
        return all_reduce_kernel(attrs["ranks"])
    return all_gather_kernel(attrs["ranks"], attrs["dim"])


def _prim_signatures(kind: OpKind) -> Iterable[tuple[DType, ...]]:
    """Every (inputs..., output) dtype tuple the torch kernels serve for a primitive."""
    float_unary = {OpKind.EXP, OpKind.LOG, OpKind.SQRT, OpKind.RSQRT, OpKind.TANH, OpKind.SILU,
                   OpKind.SIGMOID, OpKind.RECIP, OpKind.POW_SCALAR}
    if kind in float_unary:
        return ((d, d) for d in FLOAT_DTYPES)
    if kind in (OpKind.NEG, OpKind.ABS, OpKind.MUL_SCALAR, OpKind.ADD_SCALAR):
        return ((d, d) for d in NUMERIC)
    if kind in (OpKind.ADD, OpKind.SUB, OpKind.MUL, OpKind.MAXIMUM):
        return ((d, d, d) for d in NUMERIC)
    if kind is OpKind.DIV:
        return ((d, d, d) for d in FLOAT_DTYPES)
    if kind is OpKind.COMPARE:
        return ((d, d, DType.BOOL) for d in NUMERIC)
    if kind is OpKind.WHERE:
        return ((DType.BOOL, d, d, d) for d in ANY)
    if kind is OpKind.MASKED_FILL:
        return ((d, DType.BOOL, d) for d in NUMERIC)
    if kind is OpKind.CAST:
        castable = ANY + (DType.F8E4M3, DType.F8E5M2)
        return ((s, t) for s, t in itertools.product(castable, castable)
                if not ({s, t} & {DType.F8E4M3, DType.F8E5M2}) or {s, t} <= set(FLOAT_DTYPES) | {
                    DType.F8E4M3, DType.F8E5M2})
    if kind in (OpKind.SUM, OpKind.MAX):
        return ((d, d) for d in NUMERIC)
    if kind is OpKind.MEAN:
        return ((d, d) for d in FLOAT_DTYPES)
    if kind is OpKind.ARGMAX:
        return ((d, DType.I64) for d in NUMERIC)
    if kind is OpKind.TOPK_VALUES:
        return ((d, d) for d in FLOAT_DTYPES)
    if kind is OpKind.TOPK_INDICES:
        return ((d, DType.I64) for d in FLOAT_DTYPES)
    if kind is OpKind.MATMUL:
        return ((d, d, d) for d in FLOAT_DTYPES)
    if kind is OpKind.EXPERT_MATMUL:
        return ((d, d, i, d) for d in FLOAT_DTYPES for i in INDEX)
    if kind is OpKind.CONCAT:
        return ((d,) * count + (d,) for d in ANY for count in range(1, MAX_CONCAT_INPUTS + 1))
    if kind in (OpKind.IOTA, OpKind.SIZE):
        return ((s, t) for s in ANY for t in INDEX)
    if kind is OpKind.INDEX_SELECT:
        # u8 too: packed quantized rows (an embedding's blocks) are gathered before dequantizing.
        return ((d, i, d) for d in (*ANY, DType.U8) for i in INDEX)
    if kind is OpKind.GATHER:
        return ((d, i, d) for d in ANY for i in INDEX)
    if kind is OpKind.KV_CACHE_WRITE:
        return ((d, d, i, d) for d in FLOAT_DTYPES for i in INDEX)
    if kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER):
        return ((d, d) for d in FLOAT_DTYPES)
    if kind is OpKind.DEQUANTIZE:
        return ((DType.U8, DType.F32),)
    # Layout ops move data of any dtype.
    return ((d, d) for d in ANY)


def dequantize_rows(packed, layout: str, cols: int, lib) -> torch.Tensor:
    """f32 values of packed rows by ``lib``'s dequantizer (the native library, or None): bit-equal
    to the gguf package's reference (tests), which runs numpy over every block (an embedding row
    per decode step took ~0.4 ms, a recipe arm's weights seconds); a format it lacks, or no
    library, goes to the reference."""
    out = lib.dequantize(layout, packed, cols) if lib is not None else None
    if out is None:
        from fuel.kernels.quant_blocks import dequantize

        out = dequantize(packed, layout, cols)
    return out


def _dequantize(node: Node):
    attrs = _attrs(node)
    layout, cols = attrs["layout"], attrs["cols"]
    lib = _native_library()

    def native_dequantize(packed):
        return dequantize_rows(packed, layout, cols, lib)
    return native_dequantize


def _via_int64(factory: KernelFactory, output: DType) -> KernelFactory:
    """Run a kernel on int64 copies of u32 operands, casting a u32 result back."""
    def build(node: Node):
        fn = factory(node)
        back = output is DType.U32

        def run(*tensors):
            widened = [t.to(torch.int64) if t.dtype == torch.uint32 else t for t in tensors]
            result = fn(*widened)
            return result.to(torch.uint32) if back else result
        return run
    return build


# Fused kernels.
def _rms_norm(node: Node):
    params = node.op.params
    width = (node.shape.dims[-1],)
    if params.has_gain:
        return lambda x, gain: F.rms_norm(x, width, gain, params.eps)
    return lambda x: F.rms_norm(x, width, None, params.eps)


def _layer_norm(node: Node):
    params, width = node.op.params, (node.shape.dims[-1],)
    return lambda x, gain, bias: F.layer_norm(x, width, gain, bias, params.eps)


def _rope(node: Node):
    native = _native_library()

    def rope(x, cos, sin):
        if native is not None and x.device.type == "cpu":
            # One native call for the 6 torch ops below where the layout allows (f32, decode
            # and prefill rows of [rows, heads, head_dim]); the same arithmetic per element.
            out = native.rope(x, cos, sin)
            if out is not None:
                return out
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin
    return rope


def _silu_mul(node: Node):
    def silu_mul(gate, up):
        # silu returns a fresh tensor, so the product is taken in place (one allocation fewer).
        # torch's vectorized silu beat a native scalar-expf loop at every size measured here
        # (1,536 elements: 3.3 against 6.8 us; a 48-row prompt chunk: 29 against 245 us).
        return F.silu(gate).mul_(up)
    return silu_mul


class LinearLayout(Enum):
    """How the CPU linear kernel holds a weight (chosen once per weight tensor, by dtype)."""

    TRANSPOSED = "transposed"
    """``w.T`` made contiguous once, then ``mm``/``addmm``: ``F.linear`` on the ``[N, K]``
    checkpoint layout transposes per call and misses MKL's fast small-M path (measured here at
    M=1..8, f32: 1.2x at M=1, 2x at M=8)."""
    ONEDNN_PACKED = "onednn_packed"
    """oneDNN's blocked layout (``mkldnn._reorder_linear_weight``), run by
    ``mkldnn._linear_pointwise``: bf16 through AVX512-BF16/AMX, 1.5-1.7x ``F.linear`` bf16 at
    M=1..64 on this CPU, bit-identical at M=1..8."""
    CHECKPOINT = "checkpoint"
    """The weight as it is, ``F.linear`` (any non-CPU device)."""


HALF_GEMM_NATIVE = frozenset(
    {torch.bfloat16} if (torch.backends.mkldnn.is_available()
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported()) else set())
"""The 16-bit formats torch's CPU GEMM multiplies in that format at full speed here (oneDNN's
bf16 path on AVX-512 BF16 / AMX), which :func:`half_chunk_linear` runs as they are and
:func:`linear_layout` packs for oneDNN."""


def linear_layout(dtype: torch.dtype, device: torch.device) -> LinearLayout:
    """The layout :func:`_fused_linear` uses for weights of ``dtype`` on ``device``."""
    if device.type != "cpu":
        return LinearLayout.CHECKPOINT
    if dtype in HALF_GEMM_NATIVE:
        return LinearLayout.ONEDNN_PACKED
    return LinearLayout.TRANSPOSED


class _PreparedWeights:
    """Each weight tensor's prepared layout, made on its first use and shared by every node and
    program that binds the same tensor (an engine's programs bind the same weights), dropped
    when the tensor is. Keyed by identity and checked against the tensor's version counter, so
    a weight updated in place is prepared again, never read stale."""

    def __init__(self) -> None:
        self._prepared: dict[int, tuple[int, LinearLayout, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> tuple[LinearLayout, torch.Tensor]:
        key = id(weight)
        held = self._prepared.get(key)
        if held is not None and held[0] == weight._version:
            return held[1], held[2]
        layout = linear_layout(weight.dtype, weight.device)
        if layout is LinearLayout.ONEDNN_PACKED:
            # Packed for one row: measured as fast as or faster than a larger hint up to M=64.
            prepared = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        elif layout is LinearLayout.TRANSPOSED:
            prepared = weight.detach().t().contiguous()
        else:
            prepared = weight
        if held is None:
            weakref.finalize(weight, self._prepared.pop, key, None)
        self._prepared[key] = (weight._version, layout, prepared)
        return layout, prepared

    def __len__(self) -> int:
        return len(self._prepared)


PREPARED_WEIGHTS = _PreparedWeights()

CHECKPOINT_ROWS = 32
"""Rows from which an f32 product runs ``F.linear`` on the checkpoint layout instead of the
transposed copy (measured on this 2-core AVX-512 machine, 3072x576 and 576x1536 weights: the
copy is 1.7x faster at 16 rows, 1.1x at 48, 1.0x at 128)."""


NATIVE_WEIGHT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
"""The dense weight dtypes the native matmul reads as they are (its format names)."""


def _native_serves(node: Node, inputs: Sequence[Node], rank: int | None = None) -> bool:
    """Whether the native library runs this f32 node in one call (it loads here, and the
    operands have the rank its kernel takes)."""
    if node.dtype is not DType.F32 or (rank is not None and len(inputs[0].shape.dims) != rank):
        return False
    return _native_library() is not None


def _native_library():
    """The native kernels (``fuel.kernels.native``) when they load here, else None. Looked up
    once per kernel factory; the library is built or loaded once per process."""
    from fuel.kernels import native

    lib = native.load()
    return None if isinstance(lib, native.Unavailable) else lib


ONEDNN_F32 = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
"""Whether torch's oneDNN f32 linear (``mkldnn._linear_pointwise``) runs here: on this 2-core
AVX-512 AMD CPU it multiplies a 64-row prompt chunk by a SmolLM2 weight at 270-310 GFLOP/s on
the checkpoint layout as it is, where ``F.linear`` (MKL) reaches 110-150 (2.0-2.9x; 256 rows
1.5-2.1x; measured for 1536x576, 576x1536 and 49152x576 weights), f32 throughout: the results
differ from MKL's by the order of the f32 sums only."""


def checkpoint_linear(x, w, bias=None):
    """``x @ w.T (+ bias)`` for an f32 prompt chunk on the ``[N, K]`` checkpoint layout:
    oneDNN's f32 linear where torch has it (:data:`ONEDNN_F32`), else ``F.linear``."""
    if ONEDNN_F32 and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 \
            and w.dim() == 2 and w.is_contiguous():
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), w, bias, "none", [], "")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    return F.linear(x, w, bias)


def half_chunk_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for a prompt chunk of f32 activations ``x [M, K]`` against a bf16 or f16
    matrix ``w [N, K]`` as it is held, f32 out. The kernel a bf16/f16 matrix's prompt chunk runs
    (``fuel.jit.native_synth``), and what the ``cpu-local`` probe times for those formats:

    - bf16 where oneDNN multiplies it natively (AVX-512 BF16 or AMX: ``HALF_GEMM_NATIVE``):
      torch's GEMM in bf16, the activations rounded to bf16 first, as a bf16 model's own
      reference rounds them (2x the native f32-accumulating GEMM below here);
    - otherwise (f16: torch's f16 GEMM on a CPU without AVX512-FP16 is 8-10x slower than the
      recipe here) the native library's GEMM (``NativeKernels.gemm``): the 16-bit weights
      widened in registers, f32 activations and accumulation (the recipe's values within f32
      reassociation), no f32 copy of the matrix;
    - where neither runs, torch's GEMM in the matrix's format, activations rounded to it."""
    if w.dtype in HALF_GEMM_NATIVE:
        return F.linear(x.to(w.dtype), w).float()
    lib = _native_library() if x.device.type == "cpu" else None
    if lib is not None:
        out = lib.gemm(NATIVE_WEIGHT_FORMATS[w.dtype], x, w, x.shape[-1])
        if out is not None:
            return out
    return F.linear(x.to(w.dtype), w).float()


def _matmul(node: Node):
    """``torch.matmul``, except an f32 prompt chunk against a transposed ``[N, K]`` weight (a
    quantized or half matrix's recipe: dequantize, transpose, matmul), which runs as
    :func:`checkpoint_linear` on the weight as it lies."""

    def matmul(a, b):
        if (a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype == torch.float32
                and a.shape[0] >= CHECKPOINT_ROWS and b.t().is_contiguous()):
            return checkpoint_linear(a, b.t())
        return torch.matmul(a, b)

    return matmul


def _fused_linear(node: Node):
    stream = _native_library()
    from fuel.kernels.native import STREAM_ROWS

    def linear(x, w, bias=None):
        # Decode shapes (a few rows) read the checkpoint weight once at memory bandwidth in the
        # native kernel (f16/bf16 loaded as they are, f32 accumulation); torch's M=1 paths read
        # at a fraction of it on this CPU (the probe's 8.4 GB/s f32 GEMV before, 21-26 GB/s
        # with this path: `fuel devices --probe`). GEMM shapes use torch.
        if (stream is not None and x.device.type == "cpu" and w.dim() == 2
                and w.dtype in NATIVE_WEIGHT_FORMATS and x.numel() <= STREAM_ROWS * x.shape[-1]):
            out = stream.matmul(NATIVE_WEIGHT_FORMATS[w.dtype], x, w, x.shape[-1])
            if bias is not None:
                out += bias
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        if w.dtype == torch.float32 and x.numel() >= CHECKPOINT_ROWS * x.shape[-1]:
            # A prompt chunk, on the checkpoint layout (no copy: a process's first prompt never
            # transposes every f32 weight before its first token): oneDNN where torch has it.
            return checkpoint_linear(x, w, bias)
        if (stream is not None and x.device.type == "cpu" and w.dim() == 2
                and w.dtype in (torch.float16, torch.bfloat16) and w.dtype not in HALF_GEMM_NATIVE):
            # A 16-bit matrix torch cannot multiply fast in its format (f16 here): the kernel a
            # prompt chunk of it runs everywhere (the native GEMM, weights widened in registers).
            out = half_chunk_linear(x, w)
            if bias is not None:
                out += bias
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        layout, prepared = PREPARED_WEIGHTS.get(w)
        if layout is LinearLayout.CHECKPOINT:
            return F.linear(x, w, bias)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        # f32 activations against a 16-bit matrix (a bf16/f16 run's rows without the native
        # kernel): rounded to the matrix's format, as half_chunk_linear and a 16-bit
        # reference round them (torch multiplies like dtypes only); the result in x's dtype.
        rows = rows if rows.dtype == w.dtype else rows.to(w.dtype)
        if bias is not None and bias.dtype != w.dtype:
            bias = bias.to(w.dtype)
        if layout is LinearLayout.ONEDNN_PACKED:
            out = torch.ops.mkldnn._linear_pointwise(rows, prepared, bias, "none", [], "")
        elif bias is None:
            out = torch.mm(rows, prepared)
        else:
            out = torch.addmm(bias, rows, prepared)
        out = out if out.dtype == x.dtype else out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    if node.op.params.has_bias:
        return linear
    return lambda x, w: linear(x, w)


def _flash_attn(node: Node):
    params: FlashAttn = node.op.params
    scale, causal, softcap = params.softmax_scale, params.causal, params.softcap

    def visible(q, k):
        # Bottom-right aligned causal mask (queries are the last Sq positions), True = attend;
        # SDPA's is_causal is top-left aligned, so the mask is passed explicitly when Sq != Sk.
        sq, sk = q.shape[-2], k.shape[-2]
        rows = torch.arange(sq, device=q.device).unsqueeze(-1) + (sk - sq)
        return torch.arange(sk, device=q.device) <= rows

    if softcap is None:
        def attend(q, k, v):
            if not causal:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            if q.shape[-2] == k.shape[-2]:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(q, k), scale=scale,
                                                  enable_gqa=True)
        return attend

    def attend_softcapped(q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if causal:
            scores = scores.masked_fill(~visible(q, k), float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v.float()).to(q.dtype)
    return attend_softcapped


_FUSED: dict[FusedOps, tuple[KernelFactory, frozenset[str], Callable[[DType], Iterable[tuple[DType, ...]]]]] = {
    FusedOps.SOFTMAX_LAST_DIM: (_fixed(lambda x: torch.softmax(x, -1)), frozenset(),
                                lambda d: [(d, d)]),
    FusedOps.RMS_NORM: (_rms_norm, frozenset({"gain", "no_gain"}), lambda d: [(d, d), (d, d, d)]),
    FusedOps.LAYER_NORM: (_layer_norm, frozenset(), lambda d: [(d, d, d, d)]),
    FusedOps.ROPE: (_rope, frozenset({"rotate_half"}), lambda d: [(d, d, d, d)]),
    FusedOps.FUSED_LINEAR: (_fused_linear, frozenset({"bias"}), lambda d: [(d, d, d), (d, d, d, d)]),
    FusedOps.SILU_MUL: (_silu_mul, frozenset(), lambda d: [(d, d, d)]),
    FusedOps.FLASH_ATTN: (_flash_attn, frozenset({"causal", "gqa", "softcap", "symbolic_k_len"}),
                          lambda d: [(d, d, d, d)]),
}
"""The fused ops with a real torch kernel. Not here on purpose: PAGED_ATTN, RESIDUAL_ADD_RMS_NORM."""


def _flash_attn_calls(node: Node, inputs: Sequence[Node]) -> int:
    """Operator calls :func:`_flash_attn`'s kernel dispatches: SDPA is one; the bottom-right
    causal mask adds arange, unsqueeze, add, arange, le and SDPA's conversion of a bool mask
    two scalar_tensor and a where; the soft-capped path is 26 (two repeat_interleave of four
    calls, transpose, two torch.matmul of six, mul, div, tanh, mul, softmax), four f32
    widenings more when the dtype is not f32, and the mask with bitwise_not and masked_fill
    when causal."""
    params: FlashAttn = node.op.params
    if params.softcap is None:
        if not params.causal:
            return 1
        square = inputs[0].shape.dims[-2] == inputs[1].shape.dims[-2]  # SDPA's own causal flag
        return 1 if square else 9
    widen = 0 if node.dtype is DType.F32 else 4
    return 26 + widen + (7 if params.causal else 0)


def _matmul_calls(node: Node, inputs: Sequence[Node]) -> int:
    """Operator calls torch.matmul dispatches for these ranks: mm alone; a batched left
    operand against a matrix folds into view, mm, _unsafe_view; equal batch dims go through
    expand, view, expand, view, bmm, _unsafe_view; a batch that must broadcast adds a copy
    (or, for a left batch of one, a squeeze and a transpose)."""
    a, b = inputs[0].shape.dims, inputs[1].shape.dims  # the graph's matmul has rank >= 2
    if (ONEDNN_F32 and len(a) == len(b) == 2 and node.dtype is DType.F32
            and isinstance(a[0], int) and a[0] >= CHECKPOINT_ROWS
            and isinstance(inputs[1].op, Prim) and inputs[1].op.kind is OpKind.TRANSPOSE):
        return 2  # a prompt chunk against a transposed weight: the weight's view, oneDNN linear
    if len(b) == 2:
        return 1 if len(a) == 2 else 3
    if len(a) == len(b) and a[:-2] == b[:-2]:
        return 6
    return 8 if len(a) == len(b) and all(d == 1 for d in a[:-2]) else 7


def _linear_calls(node: Node, inputs: Sequence[Node]) -> int:
    """The prepared weight is reused, so one mm/addmm (or oneDNN linear) call; a batched input
    adds a view in and out. An f32 prompt chunk (``CHECKPOINT_ROWS`` rows or more) runs on the
    checkpoint layout: one oneDNN linear (:func:`checkpoint_linear`), or ``F.linear`` and its
    transpose view where torch has no oneDNN."""
    dims = inputs[0].shape.dims
    batched = 0 if len(dims) == 2 else 2
    rows = math.prod(dims[:-1]) if all(isinstance(d, int) for d in dims[:-1]) else None
    if node.dtype is DType.F32 and rows is not None and rows >= CHECKPOINT_ROWS:
        return (1 if ONEDNN_F32 else 2) + batched
    return 1 + batched


_CALLS: dict[FusedOps, CallsFn] = {
    # split (chunk), mul, neg, cat, mul, add; one native call for f32 [rows, heads, D]
    FusedOps.ROPE: lambda node, inputs: 1 if _native_serves(node, inputs, rank=3) else 6,
    FusedOps.SILU_MUL: lambda node, inputs: 2,  # silu, mul_
    FusedOps.FUSED_LINEAR: _linear_calls,
    FusedOps.FLASH_ATTN: _flash_attn_calls,
}
"""Operator calls of the fused kernels that dispatch more than one (``KernelEntry.calls``); the
others (softmax, layer_norm) dispatch one."""

_CPU_CALLS: dict[FusedOps, CallsFn] = {
    # F.rms_norm decomposes on the CPU into pow, mean, add_ (eps), rsqrt, mul (and mul by the
    # gain); its CUDA count was not measured here, so only the CPU entry declares it.
    FusedOps.RMS_NORM: lambda node, inputs: 6 if node.op.params.has_gain else 5,
}


def torch_table(backend: BackendId = BackendId.CPU) -> KernelBindingTable:
    """Bind the torch kernels for ``backend`` (``cpu`` or ``cuda``)."""
    table = KernelBindingTable()
    source = f"torch.{backend.value}"
    for kind, factory in _prim_factories().items():
        for signature in _prim_signatures(kind):
            widen = DType.U32 in signature and kind not in U32_NATIVE
            bound = _via_int64(factory, signature[-1]) if widen else factory
            calls = _matmul_calls if kind is OpKind.MATMUL else None
            table.bind(kind, signature, backend, KernelEntry(bound, kernel_source=source, calls=calls))
    calls_here = _CPU_CALLS if backend is BackendId.CPU else {}
    for fused_id, (factory, caps, signatures) in _FUSED.items():
        for dtype in FLOAT_DTYPES:
            for signature in signatures(dtype):
                table.bind(fused_id, signature, backend, KernelEntry(
                    factory, caps, Precision.RECIPE_TOLERANCE, kernel_source=source,
                    calls=_CALLS.get(fused_id, calls_here.get(fused_id))))
    if backend is BackendId.CPU:
        _bind_weight_only(table)
    return table


def _int4pack_calls(node: Node, inputs: Sequence[Node]) -> int:
    """The int4pack matmul between two views (the rows in, the output back); a weight whose
    row count is not a multiple of 16 adds the slice of its padded rows and a copy."""
    from fuel.kernels.int4pack import ROW_MULTIPLE

    return 3 + (2 if node.shape.dims[-1] % ROW_MULTIPLE else 0)


def _int8pack_calls(node: Node, inputs: Sequence[Node]) -> int:
    """The int8pack matmul between two views (the rows in, the output back)."""
    return 3


def _bind_weight_only(table: KernelBindingTable) -> None:
    """torch's weight-only CPU kernels for ``quant_linear``: int4pack over Q4_0/Q4_1/Q4_K
    weights, int8pack over ``int8_channel`` ones. Each is a variant arm (the node keeps its
    recipe as arm 0 and its JIT request; the Judge decides)."""
    from fuel.kernels import int4pack, int8pack
    from fuel.kernels.table import layout_capability

    for module, factory, calls in ((int4pack, int4pack.quant_linear_int4pack, _int4pack_calls),
                                   (int8pack, int8pack.quant_linear_int8pack, _int8pack_calls)):
        caps = frozenset(layout_capability(layout) for layout in module.LAYOUTS)
        table.bind(FusedOps.QUANT_LINEAR, (DType.F32, DType.U8, DType.F32), BackendId.CPU,
                   KernelEntry(factory, caps, Precision.RECIPE_TOLERANCE,
                               kernel_source=module.KERNEL_SOURCE, calls=calls, variant_arm=True))
