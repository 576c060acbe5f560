"""The CUDA synthesizer: the same region classes as the numba synthesizer, emitted as Triton.

Decides what the CUDA JIT builds: row-wise regions (``fuel.jit.rowwise``) as one Triton program
per row (the row held as a ``BLOCK``-wide vector, reductions with ``tl.sum``/``tl.max``, slices
and concats as shifted masked loads), and the paged-attention region (``fuel.jit.paged``) as one
program per (sequence, query head, query row) walking the u32 block table one cache block at a
time with an online softmax, masked by the u32 context length, GQA by kv head ``h // group``.
Anything else is ``Declined`` with the analysis' reason.

Numerics: loads are upcast to f32, arithmetic is f32, stores cast to the output dtype (bf16 and
f16 are native in Triton; no wrapper conversion). ``pow_scalar`` is declined (Triton has no
tensor power with the recipe's semantics for negative bases).

Where it runs: the kernels target CUDA. On a machine without a GPU the numerics are checked
under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, tiny shapes; see
``tests/jit/test_triton_synth.py``); the interpreter says nothing about speed, so performance
(and the adoption cost gate) needs a GPU. Compilation in Triton is lazy (first launch), so the
compile budget here covers generating and importing the source; the first launch's JIT time is
Triton's own cache's business. Source files are cached on disk by structure key, like numba's.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fuel.graph.dtype import BackendId
from fuel.jit import cache
from fuel.jit.paged import PagedRegion, match_paged
from fuel.jit.protocol import (
    ArchSku, Declined, ElementKind, JitRequest, SynthesisResult, Synthesized, SynthesizedKernel,
)
from fuel.jit.rowwise import (
    Binary, Concat, NotRowWise, Read, Reduce, RowProgram, RowValue, Slice, Unary, WithScalar,
    analyze, is_scalar, width,
)

KERNEL_SOURCE = "jit.triton.cuda"
_FLOAT_KINDS = {ElementKind.F32, ElementKind.BF16, ElementKind.F16}
_INDEX_KINDS = {ElementKind.U32, ElementKind.I32, ElementKind.I64}


class TritonSynthesizer:
    """Builds CUDA kernels as Triton source (see the module docstring)."""

    name = "triton"

    def __init__(self, cache_dir: Path | None = None):
        self._cache_dir = cache_dir
        self._ready: dict[str, SynthesizedKernel] = {}
        self.rejections: list[tuple[str, str]] = []

    @property
    def cache_dir(self) -> Path:
        return self._cache_dir if self._cache_dir is not None else cache.jit_cache_dir(self.name)

    def synthesize(self, request: JitRequest) -> SynthesisResult:
        if request.arch is ArchSku.CPU:
            return Declined("Triton builds CUDA kernels; the request targets the CPU")
        try:
            import triton  # noqa: F401
        except ImportError:
            return Declined("triton is not installed (pip install 'fuel[cuda]')")
        plan = _plan(request)
        if isinstance(plan, Declined):
            return plan
        source, make_runner = plan
        key = request.structure_key()
        started = time.perf_counter()
        path = cache.write_source(self.cache_dir, key, source)
        try:
            module = cache.import_module(path)
        except Exception as error:  # noqa: BLE001 — a generated module that fails is a "no"
            return Declined(f"the generated Triton module does not load: "
                            f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        compile_ms = (time.perf_counter() - started) * 1e3
        if compile_ms > request.budget.max_compile_ms:
            return Declined(f"compile budget exceeded: took {compile_ms:.0f} ms > "
                            f"{request.budget.max_compile_ms} ms")
        entry_point = f"triton:{cache.module_name(key)}"
        self._ready[entry_point] = SynthesizedKernel(
            entry_point, key, BackendId.CUDA, KERNEL_SOURCE, make_runner(module), source,
            compile_ms)
        return Synthesized(entry_point)

    def take_kernel(self, entry_point: str) -> SynthesizedKernel | None:
        return self._ready.pop(entry_point, None)

    def on_rejected(self, entry_point: str, report: str) -> None:
        self.rejections.append((entry_point, report))


def _plan(request: JitRequest):
    kinds = [o.dtype for o in request.operands]
    paged = match_paged(request.region)
    if paged is not None:
        data, index = kinds[:3] + kinds[5:], kinds[3:5]
        if len(set(data)) != 1 or data[0] not in _FLOAT_KINDS:
            return Declined("paged attention needs q, caches and output of one float dtype")
        if index[0] != index[1] or index[0] not in _INDEX_KINDS:
            return Declined("paged attention needs block table and context lengths of one "
                            "index dtype")
        return _PAGED_SOURCE.format(softcap=_softcap_code(paged)), \
            lambda module: _PagedRunner(module, paged)
    if not all(k in _FLOAT_KINDS for k in kinds) or len(set(kinds)) != 1:
        return Declined("row-wise operands must share one float dtype; got "
                        + ", ".join(k.value for k in kinds))
    program = analyze(request.region, max(o.rank for o in request.inputs))
    if isinstance(program, NotRowWise):
        return Declined(f"not a row-wise region and not paged attention: {program.reason}")
    if len(request.inputs) != program.binds:
        return Declined(f"the region binds {program.binds} inputs; the request has "
                        f"{len(request.inputs)}")
    try:
        source = _rowwise_source(program)
    except _Unsupported as unsupported:
        return Declined(str(unsupported))
    return source, lambda module: _RowRunner(module, program)


class _Unsupported(Exception):
    pass


_UNARY = {"neg": "(-{x})", "exp": "tl.exp({x})", "log": "tl.log({x})", "sqrt": "tl.sqrt({x})",
          "rsqrt": "tl.rsqrt({x})", "tanh": "(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",
          "silu": "({x} * tl.sigmoid({x}))", "sigmoid": "tl.sigmoid({x})",
          "recip": "(1.0 / {x})", "abs": "tl.abs({x})"}
_BINARY = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
           "div": "({a} / {b})", "maximum": "tl.maximum({a}, {b})"}


class _TritonRowCodegen:
    """Vector expressions over an index vector; values used twice at the identity index are
    kept in a variable, reductions are scalars."""

    def __init__(self, program: RowProgram):
        self.uses: dict[RowValue, int] = {}
        for part in program.parts:
            self._count(part)
        self.names: dict[RowValue, str] = {}
        self.lines: list[str] = []

    def _count(self, value: RowValue) -> None:
        self.uses[value] = self.uses.get(value, 0) + 1
        if self.uses[value] == 1:
            for child in _children(value):
                self._count(child)

    def ensure(self, value: RowValue) -> None:
        if value in self.names:
            return
        for child in _children(value):
            self.ensure(child)
        if isinstance(value, Reduce):
            name = f"s{len(self.names)}"
            n = width(value.x)
            x = self.elem(value.x, "offs")
            if value.fn == "max":
                self.lines.append(f"{name} = tl.max(tl.where(offs < {n}, {x}, -float('inf')), axis=0)")
            else:
                self.lines.append(f"{name} = tl.sum(tl.where(offs < {n}, {x}, 0.0), axis=0)")
                if value.fn == "mean":
                    self.lines.append(f"{name} = {name} / {n}")
            self.names[value] = name
        elif not isinstance(value, Read) and self.uses[value] > 1:
            name = f"t{len(self.names)}"
            self.lines.append(f"{name} = {self.elem(value, 'offs')}")
            self.names[value] = name

    def elem(self, value: RowValue, j: str) -> str:
        name = self.names.get(value)
        if name is not None and (is_scalar(value) or j == "offs"):
            return name
        if isinstance(value, Read):
            i = value.bind
            return (f"tl.load(b{i} + r{i} * W + ({j}), mask=(({j}) >= 0) & (({j}) < W), "
                    f"other=0.0).to(tl.float32)")
        if isinstance(value, Unary):
            return _UNARY[value.fn].format(x=self.elem(value.x, j))
        if isinstance(value, WithScalar):
            if value.fn == "pow":
                raise _Unsupported("pow_scalar has no Triton spelling with the recipe's semantics")
            op = "+" if value.fn == "add" else "*"
            return f"({self.elem(value.x, j)} {op} {value.value!r})"
        if isinstance(value, Binary):
            return _BINARY[value.fn].format(a=self.elem(value.a, j), b=self.elem(value.b, j))
        if isinstance(value, Slice):
            return self.elem(value.x, f"({j}) + {value.start}")
        if isinstance(value, Concat):
            left = width(value.a)
            return (f"tl.where(({j}) < {left}, {self.elem(value.a, j)}, "
                    f"{self.elem(value.b, f'({j}) - {left}')})")
        raise AssertionError(f"unnamed reduction {value!r}")


def _children(value: RowValue) -> tuple[RowValue, ...]:
    if isinstance(value, Read):
        return ()
    if isinstance(value, Binary | Concat):
        return (value.a, value.b)
    return (value.x,)


def _rowwise_source(program: RowProgram) -> str:
    gen = _TritonRowCodegen(program)
    for part in program.parts:
        gen.ensure(part)
    binds = ", ".join(f"b{i}" for i in range(program.binds))
    row_counts = ", ".join(f"R{i}" for i in range(program.binds))
    lines = ['"""Generated by fuel.jit.triton_synth: a row-wise region. Do not edit."""',
             "import triton", "import triton.language as tl", "", "",
             "@triton.jit",
             f"def kernel(out, {binds}, {row_counts}, ROWS, W, WOUT, BLOCK: tl.constexpr):",
             "    r = tl.program_id(0)",
             "    offs = tl.arange(0, BLOCK)"]
    lines += [f"    r{i} = r % R{i}" for i in range(program.binds)]
    lines += [f"    {line}" for line in gen.lines]
    for index, part in enumerate(program.parts):
        base = f"out + {index} * ROWS * WOUT + r * WOUT" if program.stacked else "out + r * WOUT"
        value = gen.elem(part, "offs")
        if is_scalar(part):
            value = f"tl.zeros([BLOCK], tl.float32) + {value}"
        lines.append(f"    tl.store({base} + offs, ({value}).to(out.dtype.element_ty), "
                     "mask=offs < WOUT)")
    lines += ["", "", f"def out_width(W):\n    return {program.out_width}", ""]
    return "\n".join(lines)


class _RowRunner:
    def __init__(self, module: Any, program: RowProgram):
        import torch

        self._kernel, self._out_width = module.kernel, module.out_width
        self._parts, self._stacked = len(program.parts), program.stacked
        self._torch = torch

    def __call__(self, *inputs):
        import triton

        torch = self._torch
        main = tuple(torch.broadcast_shapes(*(t.shape for t in inputs)))
        width_in, rows = main[-1], math.prod(main[:-1])
        flats, counts = [], []
        for t in inputs:
            dims = list(t.shape)
            while dims and dims[0] == 1:
                dims.pop(0)
            if tuple(t.shape) != main and not (dims and dims[-1] == width_in
                                               and tuple(dims) == main[len(main) - len(dims):]):
                t = t.expand(main)
            flat = t.contiguous().reshape(-1, width_in)
            flats.append(flat)
            counts.append(flat.shape[0])
        width_out = self._out_width(width_in)
        lead = (self._parts,) if self._stacked else ()
        out = torch.empty(lead + main[:-1] + (width_out,), dtype=inputs[0].dtype,
                          device=inputs[0].device)
        block = triton.next_power_of_2(max(width_in, width_out))
        if rows:
            self._kernel[(rows,)](out, *flats, *counts, rows, width_in, width_out, BLOCK=block)
        return out


def _softcap_code(paged: PagedRegion) -> str:
    if paged.softcap is None:
        return ""
    return ("\n        s = (2.0 * tl.sigmoid(2.0 * s * " + repr(1.0 / paged.softcap)
            + ") - 1.0) * " + repr(paged.softcap))


_PAGED_SOURCE = '''"""Generated by fuel.jit.triton_synth: the paged-attention decode template. Do not edit."""
import triton
import triton.language as tl


@triton.jit
def kernel(out, q, k_cache, v_cache, block_table, context_lens, scale,
           HQ, SQ, D, HKV, BS, M, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    i = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kv = h // (HQ // HKV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    qv = tl.load(q + ((b * HQ + h) * SQ + i) * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    context = tl.load(context_lens + b).to(tl.int64)
    # Query i sits at position context - SQ + i and sees positions up to it.
    visible = tl.minimum(context - SQ + i + 1, M * BS)
    top = -float("inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for m in range(0, tl.cdiv(visible, BS)):
        block = tl.load(block_table + b * M + m).to(tl.int64)
        pos = m * BS + offs_n
        n_ok = (offs_n < BS) & (pos < visible)
        rows = ((block * BS + offs_n) * HKV + kv) * D
        tile = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + rows[:, None] + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
        s = tl.sum(k * qv[None, :], axis=1) * scale{softcap}
        s = tl.where(n_ok, s, -float("inf"))
        new_top = tl.maximum(top, tl.max(s, axis=0))
        rescale = tl.exp(top - new_top)
        p = tl.exp(s - new_top)
        v = tl.load(v_cache + rows[:, None] + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        total = total * rescale + tl.sum(p, axis=0)
        top = new_top
    tl.store(out + ((b * HQ + h) * SQ + i) * D + offs_d, (acc / total).to(out.dtype.element_ty),
             mask=d_ok)
'''


class _PagedRunner:
    def __init__(self, module: Any, paged: PagedRegion):
        import torch

        self._kernel, self._paged, self._torch = module.kernel, paged, torch

    def __call__(self, q, k_cache, v_cache, block_table, context_lens):
        import triton

        batch, q_heads, q_len, head_dim = q.shape
        blocks, block_size, kv_heads, _ = k_cache.shape
        out = self._torch.empty_like(q)
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
        # Triton has no uint32 loads in every version: indices are reinterpreted as int32
        # views only when they fit (a block id or length below 2^31), never value-converted.
        block_table, context_lens = _index_view(block_table), _index_view(context_lens)
        self._kernel[(batch * q_heads, q_len)](
            out, q, k_cache, v_cache, block_table, context_lens, self._paged.softmax_scale,
            q_heads, q_len, head_dim, kv_heads, block_size, block_table.shape[1],
            BLOCK_N=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(head_dim))
        return out


def _index_view(tensor):
    import torch

    tensor = tensor.contiguous()
    if tensor.dtype == torch.uint32:
        viewed = tensor.view(torch.int32)
        if bool((viewed < 0).any()):
            raise ValueError("u32 index >= 2^31 cannot be read by this kernel")
        return viewed
    return tensor
