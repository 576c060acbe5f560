"""The CPU synthesizer with two back ends: native C kernels where the library has them, numba for
the rest.

Decides which tool answers a CPU request. The native library (``fuel.kernels.native``) answers:

- a ``quant_linear`` region over a GGUF block layout it multiplies
  (:data:`fuel.kernels.native.QUANT_LAYOUTS`): intrinsics, one pass over the packed rows, a
  parallel loop on torch's own OpenMP pool;
- paged attention over f32 queries and f32, bf16 or f16 caches: its decode body for decode rows, and
  :func:`fuel.jit.paged.prefill_attention` for a prompt chunk (its native flash attention, torch's
  SDPA where that declines);
- ``residual_add_rms_norm`` over f32 rows (recognized by unifying the region with the registry's
  template, so any other region is not mistaken for it).

Every other request (other row-wise regions, MoE, half-precision caches, the layouts the native
library lacks) goes to the numba synthesizer, and so does every request when the native library
is :class:`~fuel.kernels.native.Unavailable` here (no compiler): the reason is kept in
:attr:`CpuSynthesizer.native_note` for the run report. A Llama-family model in f32 or its stored
formats therefore never imports numba (its import and kernel loads were ~0.8 s of a warm run's
first token, its compiles ~3 s of a cold one).

Why C here and numba elsewhere (measured on this 2-core AVX2 machine, one Q4_1 1536x576
matrix-vector product, one thread): numba's best template 133 us, the native kernel ~50-90 us;
and numba's kernels run serial (a numba parallel loop is a second pool: ``kernels/threads``),
while the native loop runs on both cores of torch's pool.

The adoption protocol is unchanged: a native kernel is verified against the dequantized recipe
at the request's shapes and adopted only where the Judge measures it faster (``jit/adopt``).

**8-bit activations (decode).** For the 32-weight block formats
(:data:`fuel.kernels.native.Q8_FORMATS`: q4_0, q4_1, q5_0, q5_1, q8_0) the kernel handed over
rounds the activations of decode rows (at most ``STREAM_ROWS`` of them) to 8 bits per 32-element
block and multiplies integers (``NativeKernels.matmul(..., activations="q8")``, llama.cpp's
technique); prefill rows keep f32 activations (dequantize + GEMM), and the K-quants and 16-bit
layouts keep the f32-activation kernel. Set ``FUEL_Q8_ACTIVATIONS=0`` to keep f32 activations
everywhere (read when a ``CpuSynthesizer`` is made; its ``name``, part of the program cache's
key, says which). Such a kernel is recorded under its own kernel
source (:data:`KERNEL_SOURCE_Q8`) and is *not* within the f32 recipe tolerance, so it states its
error bound (:func:`q8_error_bound`, ``SynthesizedKernel.error_bound``) and adoption verifies it
against the recipe within that bound plus the recipe tolerance:

- Rounding. Block b of row m has ``d_b = amax_b / 127`` (f32) and ``q_j = round(x_j * 127 /
  amax_b)``, so ``|x_j - d_b q_j| <= d_b / 2`` up to the f32 rounding of ``d_b``, ``127/amax_b``
  and their product with ``x_j`` (at most 3 ulps of ``x_j`` plus one of ``d_b``, i.e. a
  relative ``381 * 2^-24 < 2^-14`` of ``d_b / 2``). The output moves by at most
  ``R[m, n] = sum_j |W[n, j]| * (amax_b(j) / 254) * (1 + 2^-14)``.
- Arithmetic. Each block's integer dot product is exact (int32); the kernel scales it in f32
  and sums over blocks and lanes, each term passing through at most ``B + 10`` roundings
  (``B = K / 32``), so it is within ``gamma * sum_j (|W[n, j]| + 2 |o_b|) * |xhat_j|`` of the
  exact value, ``gamma = (B + 10) 2^-24 / (1 - (B + 10) 2^-24)``, ``xhat_j = d_b q_j`` (bounded
  by ``|x_j| + amax_b / 254 (1 + 2^-14)``) and ``o_b`` the block's offset (``m_w`` for q4_1 and
  q5_1; ``8 d_w``, ``16 d_w``, ``128 d_w`` for q4_0, q5_0, q8_0: the integer part runs on the
  unsigned quants and takes the offset back, so the terms are as large as ``|w| + |o|``).
- The recipe's own f32 rounding is what the default tolerance (``RECIPE_TOLERANCE[F32]``) covers
  for every kernel; it is added as usual.

So ``|kernel - recipe| <= R + A + atol + rtol |recipe|`` everywhere; ``R + A`` is what
:func:`q8_error_bound` returns (zero for rows past ``STREAM_ROWS``, which are not rounded).
The bound is a worst case: random activations land one to two orders of magnitude inside it
(benchmarks/bench_native_kquant.py prints both).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fuel.graph.dtype import BackendId
from fuel.jit.protocol import ArchSku, JitRequest, SynthesisResult, Synthesized, SynthesizedKernel
from fuel.jit.quant_gemv import match_quant_linear

KERNEL_SOURCE = "jit.native.cpu"
KERNEL_SOURCE_Q8 = "jit.native.cpu.q8"
"""The kernel source of the 8-bit-activation kernels (their latency is recorded apart from the
f32-activation kernels': a different kernel, a different precision)."""

Q8_ENV = "FUEL_Q8_ACTIVATIONS"
"""``FUEL_Q8_ACTIVATIONS=0`` keeps f32 activations for every quantized matmul (module docs)."""


def q8_activations_enabled() -> bool:
    """Whether decode matmuls of :data:`fuel.kernels.native.Q8_FORMATS` get 8-bit activations."""
    return os.environ.get(Q8_ENV, "1") != "0"


def q8_error_bound(layout: str, cols: int, x, w):
    """The allowed ``|kernel - recipe|`` per output of the 8-bit-activation kernel beyond the
    recipe tolerance (module docs: ``R + A``), f64 of shape ``[..., N]`` for activations
    ``x [..., cols]`` and packed weight rows ``w [N, row_bytes]``. Rows past ``STREAM_ROWS`` are
    not rounded: zero there."""
    import torch

    from fuel.kernels.native import STREAM_ROWS
    from fuel.kernels.torch_kernels import _native_library, dequantize_rows

    # |w| by the recipe's own dequantizer (native, bit-equal to the gguf package's reference):
    # the reference's numpy took ~0.2 s of every adoption of an LM head (49152 rows).
    lib = _native_library()

    from fuel.circuit.format import REGROUPED

    lead = tuple(x.shape[:-1])
    rows = x.reshape(-1, cols).double()
    n = w.shape[0]
    if rows.shape[0] > STREAM_ROWS:
        return torch.zeros(*lead, n, dtype=torch.float64)
    if layout in REGROUPED:  # the same blocks and the same bound: read them in the file's order
        from fuel.kernels.quant_blocks import regroup

        w = (lib.regroup(layout, w, cols, back=True) if lib is not None
             else regroup(w, layout, cols, back=True))
        layout = REGROUPED[layout]
    m, blocks = rows.shape[0], cols // 32
    half_step = (rows.view(m, blocks, 32).abs().amax(-1) / 254.0 * (1 + 2.0 ** -14))  # [M, B]
    reach = rows.abs() + half_step.repeat_interleave(32, -1)                          # [M, K]
    reach_blocks = reach.view(m, blocks, 32).sum(-1)                                   # [M, B]
    units = (blocks + 10) * 2.0 ** -24
    gamma = units / (1 - units)
    packed = w.contiguous().view(torch.uint8).reshape(n, blocks, -1)
    bound = torch.empty(m, n, dtype=torch.float64)
    # A block-constant factor multiplies a block's sum: the [N, K] products are never formed,
    # and the weight is taken a slice of rows at a time (an LM head's 49152 rows in f64 are
    # 226 MB a matrix: the whole-matrix form took ~0.9 s of a cold first token).
    for start in range(0, n, _BOUND_ROWS):
        part = slice(start, min(n, start + _BOUND_ROWS))
        weight = dequantize_rows(w[part], layout, cols, lib).double().abs()           # [c, K]
        d_w = packed[part, :, 0:2].contiguous().view(torch.float16).double().squeeze(-1)
        if layout in ("q4_1", "q5_1"):
            offset = packed[part, :, 2:4].contiguous().view(torch.float16).double().squeeze(-1).abs()
        else:
            offset = d_w.abs() * {"q4_0": 8.0, "q5_0": 16.0, "q8_0": 128.0}[layout]   # [c, B]
        rounding = half_step @ weight.view(-1, blocks, 32).sum(-1).T                  # [M, c]
        arithmetic = gamma * (reach @ weight.T + 2.0 * (reach_blocks @ offset.T))
        bound[:, part] = (rounding + arithmetic) * (1 + 2.0 ** -40)  # the f64 sums' rounding
    return bound.reshape(*lead, n)


_BOUND_ROWS = 4096
"""Weight rows :func:`q8_error_bound` takes at a time (4096 x 576 in f64: 19 MB)."""


class _Q8Bound:
    """``SynthesizedKernel.error_bound`` of an 8-bit-activation kernel: :func:`q8_error_bound`
    at the inputs adoption verifies on."""

    def __init__(self, layout: str, cols: int):
        self.layout, self.cols = layout, cols

    def __call__(self, inputs, reference):
        return q8_error_bound(self.layout, self.cols, inputs[0], inputs[1])


HALF_UNITS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}
"""Unit roundoff of each 16-bit format (8 and 11 significant bits): a value rounded to it moves
by at most this much of itself."""


def half_rows_error_bound(layout: str, cols: int, x, w):
    """The allowed ``|kernel - recipe|`` per output of a bf16/f16 matrix's prompt-chunk product
    (rows past ``STREAM_ROWS``: activations rounded to the format, torch's GEMM in it
    accumulating in f32, the result rounded to it) beyond the recipe tolerance, f64 ``[..., N]``:
    ``(2 u + (K + 2) 2^-24) * (|x| @ |W|^T)`` with ``u`` the format's unit roundoff
    (:data:`HALF_UNITS`): each activation moves by at most ``u |x_j|``, the result by ``u`` of
    its size (at most ``|x| @ |W|^T``), the f32 sum by ``gamma_K`` of that. Decode rows (the
    native kernel, f32 activations): zero."""
    import torch

    from fuel.kernels.native import STREAM_ROWS

    lead = tuple(x.shape[:-1])
    rows = x.reshape(-1, cols).double()
    n = w.shape[0]
    if rows.shape[0] <= STREAM_ROWS:
        return torch.zeros(*lead, n, dtype=torch.float64)
    half = torch.bfloat16 if layout == "bf16" else torch.float16
    weight = w.contiguous().view(torch.uint8).view(half).reshape(n, cols).double()
    scale = (2 * HALF_UNITS[layout] + (cols + 2) * 2.0 ** -24) * (1 + 2.0 ** -40)
    return (scale * (rows.abs() @ weight.abs().T)).reshape(*lead, n)


class _HalfRowsBound:
    """``SynthesizedKernel.error_bound`` of a bf16/f16 matrix's kernel:
    :func:`half_rows_error_bound`."""

    def __init__(self, layout: str, cols: int):
        self.layout, self.cols = layout, cols

    def __call__(self, inputs, reference):
        return half_rows_error_bound(self.layout, self.cols, inputs[0], inputs[1])


class _QuantRunner:
    """``run(x [..., K] f32, w u8 [N, row_bytes])`` through the native library (decode rows with
    8-bit activations when ``activations="q8"``). A bf16/f16 matrix's prompt chunk (more than
    ``STREAM_ROWS`` rows) instead runs
    :func:`~fuel.kernels.torch_kernels.half_chunk_linear` on the matrix as it is held: bf16
    through oneDNN's bf16 GEMM where the CPU has AVX-512 BF16 or AMX (measured here for 48 rows
    of a 3072x576 matrix, 1.3 -> 0.28 ms; the LM head 21 -> 4 ms), activations rounded to bf16 as
    a bf16 model's own reference rounds them; f16 through the native GEMM (weights widened in
    registers, f32 activations: 0.77 against the recipe's 1.03 ms for a layer's four products
    at 48 rows); verified against :func:`half_rows_error_bound`. An f16 chunk whose result
    overflows (torch's f16 GEMM, where no native one runs, tops out at 65504) is computed again
    on the f32 path: never an infinity the recipe would not give."""

    def __init__(self, lib, layout: str, cols: int, activations: str = "f32"):
        import torch

        from fuel.kernels.native import STREAM_ROWS
        from fuel.kernels.torch_kernels import half_chunk_linear

        self._matmul = lib.matmul
        self.layout, self.cols, self.activations = layout, cols, activations
        """What the kernel multiplies (read by ``fuel.runtime.native_steps`` too)."""
        self._half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(layout)
        self._stream_rows = STREAM_ROWS
        self._torch = torch
        self._chunk = half_chunk_linear

    def __call__(self, x, w):
        if self._half is not None and x.numel() > self._stream_rows * self.cols:
            torch = self._torch
            out = self._chunk(x, w.view(self._half).reshape(w.shape[0], self.cols))
            if self._half is torch.bfloat16 or bool(torch.isfinite(out).all()):
                return out
        return self._matmul(self.layout, x, w, self.cols, activations=self.activations)


class _PagedRunner:
    """Paged attention of f32 queries (caches f32, bf16 or f16) without numba: decode rows (fewer than
    :data:`~fuel.jit.paged.PREFILL_MIN_ROWS` a sequence) in one native call, a prompt chunk by
    :func:`~fuel.jit.paged.prefill_attention` (the native flash attention, else SDPA) on torch's
    pool; a soft-capped region (neither has a soft cap) takes the native loop at every row
    count."""

    def __init__(self, lib, paged):
        import torch

        from fuel.jit.paged import PREFILL_MIN_ROWS, prefill_attention

        self._attend = lib.paged_attn
        self.scale, self.softcap = paged.softmax_scale, paged.softcap
        self._prefill_rows = PREFILL_MIN_ROWS
        self._prefill = prefill_attention
        self._f32 = torch.float32

    def native_rows(self, rows: int) -> bool:
        """Whether ``rows`` queries a sequence run the native decode body (else SDPA)."""
        return rows < self._prefill_rows or bool(self.softcap)

    def __call__(self, q, k_cache, v_cache, block_table, context_lens):
        if not self.native_rows(q.shape[2]):
            return self._prefill(q, k_cache, v_cache, block_table, context_lens, self.scale,
                                 self._f32)
        out = self._attend(q, k_cache, v_cache, block_table, context_lens, self.scale,
                           self.softcap)
        if out is None:
            raise ValueError(f"native paged attention refused its operands (q {q.dtype} "
                             f"{tuple(q.shape)}, caches {k_cache.dtype} {tuple(k_cache.shape)}, "
                             f"table {block_table.dtype})")
        return out


class _ResidualNormRunner:
    """``residual_add_rms_norm(x, residual, gain)`` of f32 rows in one native call."""

    def __init__(self, lib, eps: float):
        self._norm = lib.residual_rms_norm
        self.eps = eps

    def __call__(self, x, residual, gain):
        out = self._norm(x, residual, gain, self.eps)
        if out is None:
            raise ValueError(f"native residual_add_rms_norm refused its operands (x {x.dtype} "
                             f"{tuple(x.shape)}, gain {gain.dtype} {tuple(gain.shape)})")
        return out


def match_residual_rms_norm(region) -> float | None:
    """The ``eps`` of a ``residual_add_rms_norm`` recipe region, or None for any other region
    (unified against the registry's own template, as paged attention is)."""
    from fuel.graph.registry import SPECS, FusedOps, ResidualAddRmsNorm
    from fuel.jit.paged import unify

    slots: dict = {}
    template = SPECS[FusedOps.RESIDUAL_ADD_RMS_NORM].template(ResidualAddRmsNorm(0.0))
    if not unify(template, region, slots):
        return None
    eps = slots.get("eps")
    return eps if isinstance(eps, float) and eps >= 0 else None


class CpuSynthesizer:
    """Native kernels for quantized matmuls, numba for everything else (module docs)."""

    def __init__(self, fallback=None, cache_dir: Path | None = None):
        if fallback is None:
            from fuel.jit.numba_synth import NumbaSynthesizer

            fallback = NumbaSynthesizer(cache_dir)
        self.fallback = fallback
        self.q8_activations = q8_activations_enabled()
        """Whether decode matmuls get 8-bit activations (``FUEL_Q8_ACTIVATIONS``, read here)."""
        self.name = "numba+native+q8" if self.q8_activations else "numba+native"
        """In the program cache's key (``runtime.program_cache.options_identity``): a program
        adopted with the 8-bit-activation kernels is never restored where they are off, nor the
        other way round (restoring binds kernels without verifying them again)."""
        self._ready: dict[str, SynthesizedKernel] = {}
        self.native_note: str | None = None
        """Why the native library is not used here (None when it is, or was never needed)."""

    def synthesize(self, request: JitRequest) -> SynthesisResult:
        answer = self._native(request)
        return answer if answer is not None else self.fallback.synthesize(request)

    def _native(self, request: JitRequest) -> SynthesisResult | None:
        """The native library's answer, or None (numba answers instead): every operand a
        native kernel reads as data is f32 (index operands aside)."""
        if request.arch is not ArchSku.CPU:
            return None
        from fuel.jit.paged import match_paged
        from fuel.kernels import native

        paged = match_paged(request.region)
        if paged is not None:  # q and output f32 (the caches f32, or bf16/f16 widened as read;
            # the block table and lengths: indices)
            caches = request.inputs[1:3]
            data = (request.inputs[0], request.output) + (() if paged.half_kv else tuple(caches))
            if paged.half_kv and any(o.dtype.dtype.value not in ("bf16", "f16") for o in caches):
                return None
            return self._answer(request, data, "paged",
                                lambda lib: _PagedRunner(lib, paged),
                                f"fuel.kernels.native fuel_paged_attn_kv (decode rows, scale "
                                f"{paged.softmax_scale}, softcap {paged.softcap}"
                                f"{', half-precision caches' if paged.half_kv else ''}); prompt "
                                f"chunks: fuel.jit.paged.prefill_attention (fuel_prefill_attn_kv, "
                                f"else sdpa_prefill)\n")
        eps = match_residual_rms_norm(request.region)
        if eps is not None:
            return self._answer(request, request.operands, "residual_rms_norm",
                                lambda lib: _ResidualNormRunner(lib, eps),
                                f"fuel.kernels.native fuel_residual_rms_norm(eps={eps})\n")
        quant = match_quant_linear(request.region)
        if quant is None or quant.layout not in native.QUANT_LAYOUTS:
            return None
        q8 = quant.layout in native.Q8_FORMATS and self.q8_activations
        from fuel.circuit.format import GGUF_BLOCKS

        named = f"gguf/{quant.layout}" if quant.layout in GGUF_BLOCKS else quant.layout
        source = f"fuel.kernels.native fuel_matmul({named}, cols={quant.cols})"
        if q8:
            source += ("\n# decode rows: fuel_matmul_q8, activations rounded to 8 bits per "
                       "32-element block (error bound: fuel.jit.native_synth.q8_error_bound)")
        if quant.layout in HALF_UNITS:
            source += (f"\n# prompt chunks: torch's {quant.layout} GEMM, activations rounded to "
                       f"{quant.layout} (error bound: fuel.jit.native_synth.half_rows_error_bound)")
        # The library takes and returns f32 activations (the weight is packed bytes).
        return self._answer(
            request, (request.inputs[0], request.output), f"{quant.layout}{':q8' if q8 else ''}",
            lambda lib: _QuantRunner(lib, quant.layout, quant.cols, "q8" if q8 else "f32"),
            source, KERNEL_SOURCE_Q8 if q8 else KERNEL_SOURCE,
            _Q8Bound(quant.layout, quant.cols) if q8
            else _HalfRowsBound(quant.layout, quant.cols) if quant.layout in HALF_UNITS else None)

    def _answer(self, request: JitRequest, data, kind: str, make_run, source: str,
                kernel_source: str = KERNEL_SOURCE, error_bound=None) -> Synthesized | None:
        """Hand over ``make_run(library)`` for ``request`` when every operand in ``data`` is
        f32 and the library loads here (None otherwise, the reason kept); the compile time
        reported is the build or load it waited for."""
        if any(o.dtype.dtype.value != "f32" for o in data):
            return None
        from fuel.kernels import native

        started = time.perf_counter()
        lib = native.load()
        if isinstance(lib, native.Unavailable):
            self.native_note = lib.reason
            return None
        key = request.structure_key()
        entry_point = f"native:{kind}:{key[:32]}"
        self._ready[entry_point] = SynthesizedKernel(
            entry_point, key, BackendId.CPU, kernel_source, make_run(lib),
            f"{source.rstrip()}\n# library: {lib.path}\n",
            (time.perf_counter() - started) * 1e3, True, error_bound)
        return Synthesized(entry_point)

    def take_kernel(self, entry_point: str) -> SynthesizedKernel | None:
        if entry_point in self._ready:
            return self._ready.pop(entry_point)
        return self.fallback.take_kernel(entry_point)

    def on_rejected(self, entry_point: str, report: str) -> None:
        if not entry_point.startswith("native:"):
            self.fallback.on_rejected(entry_point, report)

    @property
    def rejections(self):
        return self.fallback.rejections


__all__ = ["CpuSynthesizer", "KERNEL_SOURCE", "KERNEL_SOURCE_Q8", "Q8_ENV", "q8_activations_enabled",
           "q8_error_bound"]
