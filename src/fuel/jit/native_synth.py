"""The CPU synthesizer with two back ends: native C kernels for quantized matmuls, numba for the
rest.

Decides which tool answers a CPU request. A ``quant_linear`` region over a GGUF block layout
the native library multiplies (:data:`fuel.kernels.native.QUANT_LAYOUTS`) gets the native
kernel (``fuel.kernels.native``: intrinsics, one pass over the packed rows, a parallel loop on
torch's own OpenMP pool); every other request (paged attention, row-wise regions, MoE, the
layouts the native library lacks) goes to the numba synthesizer, and so does every request
when the native library is :class:`~fuel.kernels.native.Unavailable` here (no compiler): the
reason is kept in :attr:`CpuSynthesizer.native_note` for the run report.

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
    """Paged attention: decode rows (fewer than ``PREFILL_MIN_ROWS`` a sequence) of f32 operands
    in one native call; everything else (prefill chunks, half-precision caches) by the numba
    template's runner it wraps."""

    def __init__(self, lib, paged, numba_run):
        from fuel.jit.numba_synth import PREFILL_MIN_ROWS

        self._attend = lib.paged_attn
        self._scale, self._softcap = paged.softmax_scale, paged.softcap
        self._numba = numba_run
        self._prefill_rows = PREFILL_MIN_ROWS

    def __call__(self, q, k_cache, v_cache, block_table, context_lens):
        if q.shape[2] < self._prefill_rows:
            out = self._attend(q, k_cache, v_cache, block_table, context_lens, self._scale,
                               self._softcap)
            if out is not None:
                return out
        return self._numba(q, k_cache, v_cache, block_table, context_lens)


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
        """The numba template's kernel (it serves prefill chunks and half-precision caches)
        with the native decode body in front of it, for f32 operands."""
        from dataclasses import replace

        from fuel.kernels import native

        if any(o.dtype.dtype.value != "f32" for o in (request.inputs[0], request.output)):
            return None
        lib = native.load()
        if isinstance(lib, native.Unavailable):
            self.native_note = lib.reason
            return None
        answer = self.fallback.synthesize(request)
        if not isinstance(answer, Synthesized):
            return answer
        kernel = self.fallback.take_kernel(answer.entry_point)
        if kernel is None:
            return None
        entry_point = f"native:paged:{kernel.structure_key[:32]}"
        self._ready[entry_point] = replace(
            kernel, entry_point=entry_point, kernel_source=KERNEL_SOURCE,
            run=_PagedRunner(lib, paged, kernel.run),
            source=kernel.source + "\n# decode rows: fuel.kernels.native fuel_paged_attn\n")
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
