"""The CPU synthesizer: regions compiled to fused kernels with numba.

Decides what the CPU JIT can build and how:

- **Row-wise regions** (``fuel.jit.rowwise``: elementwise ops, broadcasts, last-axis keepdim
  reductions, last-axis slices/concats — rms_norm, residual_add_rms_norm, softmax, silu_mul,
  rope, layer_norm) get *generated* code: one pass per row, reductions as loops, a value used
  twice kept in a per-chunk float32 scratch row (the storage dtype the recipe computes in)
  instead of recomputed, every part of a stacked output
  written from the same pass.
- **The paged-attention region** (recognized by ``fuel.jit.paged``) gets a structural
  template: per (sequence, kv head, query row) task, scores gathered through the u32 block
  table, masked by the u32 context length, soft-capped when the region is, a two-pass softmax,
  and the weighted values; GQA by serving the kv head's whole query-head group from one pass
  over its cached rows (each key and value row read once for the group).
- **The moe region** (recognized by ``fuel.jit.moe_template``) gets its decode template: routing
  and a loop over the selected experts only, each expert's rows read once for its tokens.
- Anything else is :class:`~fuel.jit.protocol.Declined` with the analysis' precise reason.

Every kernel is compiled serial: it runs on the calling thread, inside a step whose torch
kernels own the cores (:mod:`fuel.kernels.threads`: one pool; numba's parallel layer is a second
OpenMP runtime and costs a scheduler time slice per hand-over).

Numerics and dtypes: kernels compute elementwise in float64 over float32 storage, reduce
with four float64 partial sums (a fixed order), and keep reused rows in float32. numba has
no bf16 (and partial f16), so for bf16/f16 operands the wrapper upcasts the inputs to f32 and
casts the result back; the conversion is part of the measured cost the adoption gate compares,
and verification uses that dtype's tolerance. Index operands stay in their own dtype (u32 is
read as uint32; never widened in the request or the key).

Compile time is measured (source generation, numba compilation or cache load) and compared with
the request's ``max_compile_ms``: over budget is ``Declined("compile budget exceeded: …")``.
Compiled kernels are cached on disk keyed by the structure key (``fuel.jit.cache``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuel.graph.dtype import BackendId, DType
from fuel.jit import cache
from fuel.jit.quant_gemv import match_quant_linear, plan_quant
from fuel.jit.moe_template import match_moe, plan_moe
from fuel.jit.paged import PREFILL_MIN_ROWS, PagedRegion, match_paged, sdpa_prefill
from fuel.jit.protocol import (
    ArchSku, Declined, ElementKind, JitRequest, SynthesisResult, Synthesized, SynthesizedKernel,
)
from fuel.kernels.threads import NUMBA_PARALLEL
from fuel.jit.rowwise import (
    Binary, Concat, NotRowWise, Read, Reduce, RowProgram, RowValue, Slice, Unary, WithScalar,
    analyze, is_scalar, width,
)

KERNEL_SOURCE = "jit.numba.cpu"

_FLOAT_KINDS = {ElementKind.F32, ElementKind.BF16, ElementKind.F16}
_INDEX_NUMBA = {ElementKind.U32: "uint32", ElementKind.I32: "int32", ElementKind.I64: "int64"}


@dataclass(frozen=True, slots=True)
class Rejection:
    """A kernel adoption refused, as told to :meth:`NumbaSynthesizer.on_rejected`."""

    entry_point: str
    report: str


class NumbaSynthesizer:
    """Builds CPU kernels with numba (see the module docstring for what it builds)."""

    name = "numba"

    def __init__(self, cache_dir: Path | None = None):
        self._cache_dir = cache_dir
        self._ready: dict[str, SynthesizedKernel] = {}
        self.rejections: list[Rejection] = []

    @property
    def cache_dir(self) -> Path:
        return self._cache_dir if self._cache_dir is not None else cache.jit_cache_dir(self.name)

    def synthesize(self, request: JitRequest) -> SynthesisResult:
        if request.arch is not ArchSku.CPU:
            return Declined(f"numba builds CPU kernels; the request targets {request.arch.value}")
        try:
            import numba  # noqa: F401
        except ImportError:
            return Declined("numba is not installed (pip install 'fuel[jit]')")
        plan = _plan(request)
        if isinstance(plan, Declined):
            return plan
        source, make_runner = plan
        key = request.structure_key()
        path = cache.write_source(self.cache_dir, key, source)
        from_cache = cache.has_compiled(path)
        started = time.perf_counter()
        try:
            try:
                module = cache.import_module(path)
            except Exception:
                if not from_cache:
                    raise
                # A stale or corrupt compiled cache is dropped and the kernel compiled afresh,
                # never trusted; a second failure is the compiler's answer.
                cache.drop_compiled(path)
                from_cache = False
                started = time.perf_counter()
                module = cache.import_module(path)
        except Exception as error:  # noqa: BLE001 — a compiler failure is this kernel's "no"
            return Declined(f"numba could not compile the generated kernel: "
                            f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        compile_ms = (time.perf_counter() - started) * 1e3
        if compile_ms > request.budget.max_compile_ms:
            return Declined(f"compile budget exceeded: took {compile_ms:.0f} ms > "
                            f"{request.budget.max_compile_ms} ms")
        entry_point = f"numba:{cache.module_name(key)}"
        self._ready[entry_point] = SynthesizedKernel(
            entry_point, key, BackendId.CPU, KERNEL_SOURCE, make_runner(module), source,
            compile_ms, from_cache)
        return Synthesized(entry_point)

    def take_kernel(self, entry_point: str) -> SynthesizedKernel | None:
        return self._ready.pop(entry_point, None)

    def on_rejected(self, entry_point: str, report: str) -> None:
        self.rejections.append(Rejection(entry_point, report))


# Planning a request: the source text and how to wrap the compiled module.
def _plan(request: JitRequest):
    kinds = [o.dtype for o in request.operands]
    paged = match_paged(request.region)
    if paged is not None:
        return _plan_paged(request, paged)
    quant = match_quant_linear(request.region)
    if quant is not None:
        planned = plan_quant(quant)
        return Declined(planned) if isinstance(planned, str) else planned
    moe = match_moe(request.region)
    if moe is not None:
        return plan_moe(request, moe)
    if not all(kind in _FLOAT_KINDS for kind in kinds):
        return Declined("row-wise kernels take float operands only; got "
                        + ", ".join(k.value for k in kinds))
    if len(set(kinds)) != 1:
        return Declined("row-wise operands must share one float dtype; got "
                        + ", ".join(k.value for k in kinds))
    rank = max(o.rank for o in request.inputs)
    program = analyze(request.region, rank)
    if isinstance(program, NotRowWise):
        return Declined(f"not a row-wise region and not paged attention: {program.reason}")
    if len(request.inputs) != program.binds:
        return Declined(f"the region binds {program.binds} inputs; the request has "
                        f"{len(request.inputs)}")
    source = _rowwise_source(program)
    return source, lambda module: _RowRunner(module, program, kinds[-1].dtype)


# Row-wise code generation.
_UNARY_CODE = {"neg": "(-{x})", "exp": "math.exp({x})", "log": "math.log({x})",
               "sqrt": "math.sqrt({x})", "rsqrt": "(1.0 / math.sqrt({x}))",
               "tanh": "math.tanh({x})", "silu": "_silu({x})", "sigmoid": "_sigmoid({x})",
               "recip": "(1.0 / {x})", "abs": "abs({x})"}
_BINARY_CODE = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
                "div": "({a} / {b})", "maximum": "max({a}, {b})"}
_SCALAR_CODE = {"add": "({x} + {v})", "mul": "({x} * {v})", "pow": "({x} ** {v})"}


class _RowCodegen:
    """Emits the per-row body; values used more than once are computed once (a scalar variable,
    or a scratch row for a vector)."""

    def __init__(self, program: RowProgram):
        self.uses: Counter[RowValue] = Counter()
        for part in program.parts:
            self._count(part)
        self.names: dict[RowValue, str] = {}
        self.scratch: list[tuple[str, str]] = []  # (name, width code)
        self.lines: list[str] = []

    def _count(self, value: RowValue) -> None:
        self.uses[value] += 1
        if self.uses[value] > 1:
            return
        for child in _children(value):
            self._count(child)

    def ensure(self, value: RowValue) -> None:
        """Emit statements for ``value``'s dependencies and, if it is named, for itself."""
        if value in self.names:
            return
        for child in _children(value):
            self.ensure(child)
        if isinstance(value, Reduce):
            self._reduce(value)
        elif is_scalar(value) and self.uses[value] > 1:
            name = f"s{len(self.names)}"
            self.lines.append(f"{name} = {self.scalar(value)}")
            self.names[value] = name
        elif not isinstance(value, Read) and not is_scalar(value) and self.uses[value] > 1:
            name = f"t{len(self.names)}"
            self.scratch.append((name, width(value)))
            self.lines += [f"for j in range({width(value)}):",
                           f"    {name}[j] = {self.elem(value, 'j')}"]
            self.names[value] = name

    def _reduce(self, value: Reduce) -> None:
        # Four partial accumulators: without fastmath the compiler may not reorder a reduction,
        # so one accumulator is a serial dependency chain; four independent chains are ~4x
        # faster and still a fixed, deterministic order.
        name = f"s{len(self.names)}"
        init = "-math.inf" if value.fn == "max" else "0.0"
        lanes = [f"{name}_{k}" for k in range(4)]
        combine = (lambda acc, e: f"{acc} = max({acc}, {e})") if value.fn == "max" else \
            (lambda acc, e: f"{acc} += {e}")
        n = width(value.x)
        self.lines += [f"{lane} = {init}" for lane in lanes]
        self.lines += [f"n_{name} = {n}", f"for j in range(0, n_{name} - n_{name} % 4, 4):"]
        self.lines += ["    " + combine(lane, self.elem(value.x, f"(j + {k})" if k else "j"))
                       for k, lane in enumerate(lanes)]
        self.lines += [f"for j in range(n_{name} - n_{name} % 4, n_{name}):",
                       "    " + combine(lanes[0], self.elem(value.x, "j"))]
        if value.fn == "max":
            self.lines.append(f"{name} = max(max({lanes[0]}, {lanes[1]}), max({lanes[2]}, {lanes[3]}))")
        else:
            self.lines.append(f"{name} = ({lanes[0]} + {lanes[1]}) + ({lanes[2]} + {lanes[3]})")
        if value.fn == "mean":
            self.lines.append(f"{name} = {name} / n_{name}")
        self.names[value] = name

    def scalar(self, value: RowValue) -> str:
        if value in self.names:
            return self.names[value]
        return self.elem(value, "0")

    def elem(self, value: RowValue, j: str) -> str:
        """Code for element ``j`` of ``value`` in the current row."""
        name = self.names.get(value)
        if name is not None:
            return name if is_scalar(value) else f"{name}[{j}]"
        if isinstance(value, Read):
            return f"b{value.bind}[r{value.bind}, {j}]"
        if isinstance(value, Unary):
            return _UNARY_CODE[value.fn].format(x=self.elem(value.x, j))
        if isinstance(value, WithScalar):
            return _SCALAR_CODE[value.fn].format(x=self.elem(value.x, j), v=repr(value.value))
        if isinstance(value, Binary):
            return _BINARY_CODE[value.fn].format(a=self.elem(value.a, j), b=self.elem(value.b, j))
        if isinstance(value, Slice):
            return self.elem(value.x, f"({j} + {value.start})")
        if isinstance(value, Concat):
            left = width(value.a)
            return (f"({self.elem(value.a, j)} if {j} < {left} "
                    f"else {self.elem(value.b, f'({j} - {left})')})")
        raise AssertionError(f"unnamed reduction {value!r}")  # ensure() names every Reduce


def _children(value: RowValue) -> tuple[RowValue, ...]:
    if isinstance(value, Read):
        return ()
    if isinstance(value, Binary):
        return (value.a, value.b)
    if isinstance(value, Concat):
        return (value.a, value.b)
    return (value.x,)


_PRELUDE = '''"""Generated by fuel.jit.numba_synth: {what}. Do not edit: regenerated from the structure key."""
import math

import numpy as np
from numba import njit


@njit(cache=True, fastmath=False)
def _silu(v):
    return v / (1.0 + math.exp(-v))


@njit(cache=True, fastmath=False)
def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))
'''


def _rowwise_source(program: RowProgram) -> str:
    gen = _RowCodegen(program)
    for part in program.parts:
        gen.ensure(part)
    body = list(gen.lines)
    out_width = program.out_width
    for index, part in enumerate(program.parts):
        target = f"out[{index}, r, j]" if program.stacked else "out[r, j]"
        body += [f"for j in range({out_width}):", f"    {target} = {gen.elem(part, 'j')}"]
    binds = ", ".join(f"b{i}" for i in range(program.binds))
    row_index = [f"r{i} = r % b{i}.shape[0]" for i in range(program.binds)]
    scratch = [f"{name} = np.empty({code}, np.float32)" for name, code in gen.scratch]
    out_type = "float32[:, :, ::1]" if program.stacked else "float32[:, ::1]"
    signature = f"void({out_type}, {', '.join(['float32[:, ::1]'] * program.binds)}, int64, int64)"

    lines = [f'@njit("{signature}", parallel={NUMBA_PARALLEL}, fastmath=False, cache=True)',
             f"def kernel(out, {binds}, rows, W):"]
    lines += [f"    {line}" for line in scratch]
    lines += ["    for r in range(rows):"]
    lines += [f"        {line}" for line in row_index + body]
    text = _PRELUDE.format(what="a row-wise region") + "\n\n"
    text += "\n".join(lines) + "\n\n\n"
    text += f"def out_width(W):\n    return {out_width}\n"
    return text


class _RowRunner:
    """Presents torch tensors to a row-wise kernel (see ``fuel.jit.rowwise`` conventions)."""

    def __init__(self, module: Any, program: RowProgram, out_dtype: DType):
        import numpy
        import torch

        from fuel.kernels.torch_kernels import torch_dtype

        self._kernel = module.kernel
        self._out_width = module.out_width
        self._parts = len(program.parts)
        self._stacked = program.stacked
        self._dtype = torch_dtype(out_dtype)
        self._torch = torch
        self._np = numpy
        self._layouts: dict[tuple[tuple[int, ...], ...], tuple] = {}

    def _rows_of(self, tensor, main: tuple[int, ...], width: int):
        """A ``[rows, width]`` float32 NumPy view of ``tensor`` (a copy only when it must be)."""
        torch = self._torch
        if tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
        shape = tuple(tensor.shape)
        dims = list(shape)
        while dims and dims[0] == 1:
            dims.pop(0)
        if shape != main and not (dims and dims[-1] == width
                                  and tuple(dims) == main[len(main) - len(dims):]):
            tensor = tensor.expand(main)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return tensor.numpy().reshape(-1, width)

    def _layout(self, shapes: tuple[tuple[int, ...], ...]):
        """Per input shapes (memoized): the main shape, rows, widths, output shape."""
        main = self._np.broadcast_shapes(*shapes)  # memoized per shapes: its ~3 us is paid once
        width_in = main[-1]
        rows = math.prod(main[:-1])
        width_out = self._out_width(width_in)
        lead = (self._parts,) if self._stacked else ()
        # Inputs readable in place (same shape, or broadcasting over leading axes only): their
        # row count; 0 means the wrapper must materialize the broadcast.
        direct = []
        for shape in shapes:
            dims = list(shape)
            while dims and dims[0] == 1:
                dims.pop(0)
            shape = tuple(shape)
            fits = shape == main or (dims and dims[-1] == width_in
                                     and tuple(dims) == main[len(main) - len(dims):])
            direct.append(math.prod(shape) // width_in if fits and width_in else 0)
        layout = (main, width_in, rows, lead + (rows, width_out), lead + main[:-1] + (width_out,),
                  tuple(direct))
        self._layouts[shapes] = layout
        return layout

    def __call__(self, *inputs):
        # NumPy-side views and allocation, and the layout memoized per input shapes: at decode
        # shapes the kernel itself takes about a microsecond, so the wrapper must not add ten.
        shapes = tuple([t.shape for t in inputs])  # torch.Size is a hashable tuple
        layout = self._layouts.get(shapes) or self._layout(shapes)
        main, width_in, rows, flat_shape, out_shape, direct = layout
        f32 = self._torch.float32
        arrays = [t.numpy().reshape(rows_in, width_in)
                  if rows_in and t.dtype == f32 and t.is_contiguous()
                  else self._rows_of(t, main, width_in) for t, rows_in in zip(inputs, direct)]
        flat = self._np.empty(flat_shape, self._np.float32)
        if rows:
            self._kernel(flat, *arrays, rows, width_in)
        out = self._torch.from_numpy(flat).view(out_shape)
        return out if self._dtype == self._torch.float32 else out.to(self._dtype)


# The paged-attention template.
_PAGED_BODY = '''
@njit("void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], {index}[:, ::1], {index}[::1], float64, float64)",
      parallel={parallel}, fastmath={{"reassoc", "contract"}}, cache=True)
def {name}(out, q, k_cache, v_cache, block_table, context_lens, scale, softcap):
    batch, q_heads, q_len, head_dim = q.shape
    block_size = k_cache.shape[1]
    kv_heads = k_cache.shape[2]
    capacity = block_table.shape[1] * block_size
    group = q_heads // kv_heads
    for task in range(batch * kv_heads * q_len):
        b = task // (kv_heads * q_len)
        kv = (task // q_len) % kv_heads
        i = task % q_len
        context = np.int64(context_lens[b])
        # Query i sits at position context - q_len + i and sees positions up to it.
        visible = min(context - q_len + i + 1, capacity)
        if visible <= 0:
            for g in range(group):
                for d in range(head_dim):
                    out[b, kv * group + g, i, d] = np.nan
            continue
        # The kv head's whole query group is served from one pass over its keys and values:
        # each cached row is read once for all `group` heads (GQA).
        scores = np.empty((group, visible), np.float64)
        for t in range(visible):
            block = np.int64(block_table[b, t // block_size])
            offset = t % block_size
            key = k_cache[block, offset, kv]
            for g in range(group):
                query = q[b, kv * group + g, i]
                # An f32 dot product the compiler may reassociate (fastmath `reassoc` only:
                # NaN and infinity semantics stay IEEE), so it vectorizes; the recipe's own
                # matmul accumulates in f32 too.
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += query[d] * key[d]
                s = np.float64(dot) * scale{softcap}
                scores[g, t] = s
        acc = np.zeros((group, head_dim), np.float32)
        for g in range(group):
            top = -math.inf
            for t in range(visible):
                top = max(top, scores[g, t])
            total = 0.0
            for t in range(visible):
                e = math.exp(scores[g, t] - top)
                scores[g, t] = e
                total += e
            for t in range(visible):
                scores[g, t] = scores[g, t] / total
        for t in range(visible):
            block = np.int64(block_table[b, t // block_size])
            offset = t % block_size
            value = v_cache[block, offset, kv]
            for g in range(group):
                w = np.float32(scores[g, t])
                for d in range(head_dim):
                    acc[g, d] += w * value[d]
        for g in range(group):
            for d in range(head_dim):
                out[b, kv * group + g, i, d] = acc[g, d]
'''


def _plan_paged(request: JitRequest, paged: PagedRegion):
    kinds = [o.dtype for o in request.operands]
    data, index = kinds[:3] + kinds[5:], kinds[3:5]
    if len(set(data)) != 1 or data[0] not in _FLOAT_KINDS:
        return Declined("paged attention needs q, caches and output of one float dtype; got "
                        + ", ".join(k.value for k in data))
    if index[0] != index[1] or index[0] not in _INDEX_NUMBA:
        return Declined("paged attention needs block table and context lengths of one index "
                        "dtype (u32, i32, i64); got " + ", ".join(k.value for k in index))
    if [o.rank for o in request.operands] != [4, 4, 4, 2, 1, 4]:
        return Declined("paged attention operands must have ranks q 4, caches 4, block table 2, "
                        "context lengths 1, output 4")
    softcap = "" if paged.softcap is None else "\n                s = math.tanh(s * (1.0 / softcap)) * softcap"
    source = _PRELUDE.format(what="the paged-attention decode template")
    source += _PAGED_BODY.format(index=_INDEX_NUMBA[index[0]], parallel=NUMBA_PARALLEL,
                                 name="kernel", softcap=softcap)
    return source, lambda module: _PagedRunner(module, paged, kinds[-1].dtype)


class _PagedRunner:
    """The paged-attention template's two bodies behind one kernel.

    - **Decode** (fewer than :data:`PREFILL_MIN_ROWS` query rows): the numba loop above, serial
      (one row gains nothing from threads; :mod:`fuel.kernels.threads`); a bf16/f16 cache is
      upcast to f32 only for the blocks the step's tables name.
    - **Prefill** (a prompt chunk, a verify step): causal attention over the whole chunk as one
      torch ``scaled_dot_product_attention`` call on torch's pool: the sequences' cached rows
      gathered through the block table, query row ``i`` of a sequence with context ``c`` seeing
      positions ``<= c - q_len + i`` (``is_causal`` when the chunk is the whole context of one
      sequence, an explicit mask otherwise), GQA by the kernel's own head grouping. A soft-capped
      region has no SDPA form and always takes the numba loop.

    Either body is verified against the recipe at the shapes it serves (adoption is per shape).
    """

    def __init__(self, module: Any, paged: PagedRegion, out_dtype: DType):
        import torch

        from fuel.kernels.torch_kernels import torch_dtype

        self._kernel = module.kernel
        self._scale = paged.softmax_scale
        self._softcap = paged.softcap or 0.0
        self._dtype = torch_dtype(out_dtype)
        self._torch = torch

    def __call__(self, q, k_cache, v_cache, block_table, context_lens):
        if q.shape[2] >= PREFILL_MIN_ROWS and not self._softcap:
            return self._prefill(q, k_cache, v_cache, block_table, context_lens)
        torch = self._torch
        as_f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
        table = block_table.contiguous()
        if k_cache.dtype == torch.float32:
            k32, v32 = as_f32(k_cache), as_f32(v_cache)
        else:
            # A half-precision cache: upcast only the blocks the tables name (not the whole
            # cache, every call), and read them through a table renumbered to match.
            used = table.reshape(-1).to(torch.int64)
            k32, v32 = as_f32(k_cache.index_select(0, used)), as_f32(v_cache.index_select(0, used))
            table = torch.arange(used.numel()).to(table.dtype).reshape(table.shape)
        q32 = as_f32(q)
        out = torch.empty(q32.shape, dtype=torch.float32)
        self._kernel(out.numpy(), q32.numpy(), k32.numpy(), v32.numpy(), table.numpy(),
                     context_lens.contiguous().numpy(), self._scale, self._softcap)
        return out if self._dtype == torch.float32 else out.to(self._dtype)

    def _prefill(self, q, k_cache, v_cache, block_table, context_lens):
        return sdpa_prefill(q, k_cache, v_cache, block_table, context_lens, self._scale,
                            self._dtype)
