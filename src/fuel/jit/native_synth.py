"""The CPU synthesizer with two back ends: native C kernels where the library has them, numba for
the rest.

Decides which tool answers a CPU request. The native library (``fuel.kernels.native``) answers:

- a ``quant_linear`` region over a GGUF block layout it multiplies
  (:data:`fuel.kernels.native.QUANT_LAYOUTS`): intrinsics, one pass over the packed rows, a
  parallel loop on torch's own OpenMP pool;
- paged attention over f32 operands: its decode body for decode rows, and
  :func:`fuel.jit.paged.sdpa_prefill` (torch) for a prompt chunk;
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
"""

from __future__ import annotations

import time
from pathlib import Path

from fuel.graph.dtype import BackendId
from fuel.jit.protocol import ArchSku, JitRequest, SynthesisResult, Synthesized, SynthesizedKernel
from fuel.jit.quant_gemv import match_quant_linear

KERNEL_SOURCE = "jit.native.cpu"


class _QuantRunner:
    """``run(x [..., K] f32, w u8 [N, row_bytes])`` through the native library."""

    def __init__(self, lib, layout: str, cols: int):
        self._matmul = lib.matmul
        self._layout = layout
        self._cols = cols

    def __call__(self, x, w):
        return self._matmul(self._layout, x, w, self._cols)


class _PagedRunner:
    """Paged attention of f32 operands without numba: decode rows (fewer than
    :data:`~fuel.jit.paged.PREFILL_MIN_ROWS` a sequence) in one native call, a prompt chunk by
    :func:`~fuel.jit.paged.sdpa_prefill` on torch's pool; a soft-capped region (no SDPA form)
    takes the native loop at every row count."""

    def __init__(self, lib, paged):
        import torch

        from fuel.jit.paged import PREFILL_MIN_ROWS, sdpa_prefill

        self._attend = lib.paged_attn
        self._scale, self._softcap = paged.softmax_scale, paged.softcap
        self._prefill_rows = PREFILL_MIN_ROWS
        self._prefill = sdpa_prefill
        self._f32 = torch.float32

    def __call__(self, q, k_cache, v_cache, block_table, context_lens):
        if q.shape[2] >= self._prefill_rows and not self._softcap:
            return self._prefill(q, k_cache, v_cache, block_table, context_lens, self._scale,
                                 self._f32)
        out = self._attend(q, k_cache, v_cache, block_table, context_lens, self._scale,
                           self._softcap)
        if out is None:
            raise ValueError(f"native paged attention refused its operands (q {q.dtype} "
                             f"{tuple(q.shape)}, caches {k_cache.dtype} {tuple(k_cache.shape)}, "
                             f"table {block_table.dtype})")
        return out


class _ResidualNormRunner:
    """``residual_add_rms_norm(x, residual, gain)`` of f32 rows in one native call."""

    def __init__(self, lib, eps: float):
        self._norm = lib.residual_rms_norm
        self._eps = eps

    def __call__(self, x, residual, gain):
        out = self._norm(x, residual, gain, self._eps)
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

    name = "numba+native"

    def __init__(self, fallback=None, cache_dir: Path | None = None):
        if fallback is None:
            from fuel.jit.numba_synth import NumbaSynthesizer

            fallback = NumbaSynthesizer(cache_dir)
        self.fallback = fallback
        self._ready: dict[str, SynthesizedKernel] = {}
        self.native_note: str | None = None
        """Why the native library is not used here (None when it is, or was never needed)."""

    def synthesize(self, request: JitRequest) -> SynthesisResult:
        answer = self._native(request)
        return answer if answer is not None else self.fallback.synthesize(request)

    def _native(self, request: JitRequest) -> SynthesisResult | None:
        if request.arch is not ArchSku.CPU:
            return None
        from fuel.jit.paged import match_paged
        from fuel.kernels import native

        paged = match_paged(request.region)
        if paged is not None:
            return self._paged(request, paged)
        eps = match_residual_rms_norm(request.region)
        if eps is not None:
            return self._residual_norm(request, eps)
        quant = match_quant_linear(request.region)
        if quant is None or quant.layout not in native.QUANT_LAYOUTS:
            return None
        if any(o.dtype.dtype.value != "f32" for o in (request.inputs[0], request.output)):
            return None  # the library takes and returns f32 activations
        started = time.perf_counter()
        lib = native.load()
        if isinstance(lib, native.Unavailable):
            self.native_note = lib.reason
            return None
        key = request.structure_key()
        entry_point = f"native:{quant.layout}:{key[:32]}"
        source = (f"fuel.kernels.native fuel_matmul(gguf/{quant.layout}, cols={quant.cols}) "
                  f"from {lib.path}")
        self._ready[entry_point] = SynthesizedKernel(
            entry_point, key, BackendId.CPU, KERNEL_SOURCE,
            _QuantRunner(lib, quant.layout, quant.cols), source,
            (time.perf_counter() - started) * 1e3, True)
        return Synthesized(entry_point)

    def _paged(self, request: JitRequest, paged) -> SynthesisResult | None:
        """f32 operands: the native decode body and SDPA for prompt chunks (no numba at all);
        anything else (half-precision caches) goes to the numba template."""
        if any(o.dtype.dtype.value != "f32" for o in (*request.inputs[:3], request.output)):
            return None
        started = time.perf_counter()
        lib = self._lib()
        if lib is None:
            return None
        return self._ready_kernel(request, started, "paged", _PagedRunner(lib, paged),
                                  f"fuel.kernels.native fuel_paged_attn (decode rows, scale "
                                  f"{paged.softmax_scale}, softcap {paged.softcap}); prompt "
                                  f"chunks: fuel.jit.paged.sdpa_prefill\n")

    def _residual_norm(self, request: JitRequest, eps: float) -> SynthesisResult | None:
        if any(o.dtype.dtype.value != "f32" for o in request.operands):
            return None
        started = time.perf_counter()
        lib = self._lib()
        if lib is None:
            return None
        return self._ready_kernel(request, started, "residual_rms_norm", _ResidualNormRunner(lib, eps),
                                  f"fuel.kernels.native fuel_residual_rms_norm(eps={eps})\n")

    def _lib(self):
        from fuel.kernels import native

        lib = native.load()
        if isinstance(lib, native.Unavailable):
            self.native_note = lib.reason
            return None
        return lib

    def _ready_kernel(self, request: JitRequest, started: float, kind: str, run,
                      source: str) -> Synthesized:
        """Hand over ``run`` for ``request`` (``started``: when the library was asked for, so
        the compile time reported is the build or load it waited for)."""
        key = request.structure_key()
        entry_point = f"native:{kind}:{key[:32]}"
        self._ready[entry_point] = SynthesizedKernel(
            entry_point, key, BackendId.CPU, KERNEL_SOURCE, run, source,
            (time.perf_counter() - started) * 1e3, True)
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


__all__ = ["CpuSynthesizer", "KERNEL_SOURCE"]
