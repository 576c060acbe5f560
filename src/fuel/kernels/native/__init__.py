"""Native CPU matmul kernels: GGUF block formats and f32/f16/bf16 weights, built on this machine.

Decides how fuel gets matrix-vector products that run at this CPU's memory bandwidth, which
neither torch (its M=1 f32/bf16 paths read at a fraction of it here; its int4 kernel targets
other CPUs) nor numba's vectorizer (nibble unpacking compiles to scalar code) reach: a small C
file (``gemv.c`` beside this module: AVX2/FMA/F16C intrinsics with a portable fallback) is
compiled once per machine by the system C compiler at ``-O3 -march=native`` and loaded with
ctypes.

**One thread pool.** The library is linked against the OpenMP runtime torch itself loaded
(``torch/lib/libgomp``), so the dynamic loader hands it the very runtime torch's intra-op pool
lives in: a parallel loop here is a parallel region of torch's pool, its threads already
awake after the previous torch kernel, never a second pool fighting for the cores
(:mod:`fuel.kernels.threads`). Where torch was built with another runtime, or no compiler is
found, :func:`load` answers :class:`Unavailable` with the reason and fuel runs without these
kernels (the numba and torch arms stand).

Invariants:
- Built at most once per (source, compiler, flags, OpenMP runtime, CPU): by the install
  (``python -m fuel.kernels.native``, which ``scripts/setup.sh`` runs) into :data:`INSTALLED`
  beside the sources, else on first use into ``$FUEL_CACHE_DIR/native/<key>/``; written
  atomically (compiled to a temp name, renamed), so a concurrent process never loads a
  half-written file; a file that fails to load is removed and built again once.
- ``matmul(..., activations="f32")`` (the default, and every path other than the one below)
  returns the product of the *dequantized* weight with f32 activations, never rounded to 8
  bits: equal to the dequantize-then-matmul recipe within f32 reassociation, which the JIT
  verifies at every shape it adopts.
- Exactly one kernel rounds activations: ``matmul(..., activations="q8")`` for the formats in
  :data:`Q8_FORMATS` at decode rows (at most :data:`STREAM_ROWS`; ``fuel_matmul_q8`` in
  ``gemv.c``). Each activation row is rounded per 32-element block to ``d * q`` with
  ``d = amax/127`` (f32) and ``q = round_half_even(x * 127/amax)`` in [-127, 127]
  (:meth:`NativeKernels.quantize_q8` returns exactly these), and every block's product with
  the packed quants is an exact integer dot product scaled in f32. It is *not* within the
  recipe tolerance; ``fuel.jit.native_synth.q8_error_bound`` states the bound it is verified
  against. More rows in a ``q8`` call take the f32 path (not rounded).
- Never raises for an ordinary "no": :func:`load` returns :class:`Unavailable`.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("gemv.c")
SOURCES = (SOURCE, Path(__file__).with_name("rows.c"), Path(__file__).with_name("steps.c"))
"""The C files built into the one library: matmuls, rope, attention (gemv.c); row-wise norms
(rows.c); the step list that runs a compiled program in one call (steps.c)."""

FORMAT_CODES: dict[str, int] = {
    "f32": 0, "f16": 1, "bf16": 2, "int8_channel": 3,
    "q4_0": 10, "q4_1": 11, "q5_0": 12, "q5_1": 13, "q8_0": 14,
    "q4_k": 15, "q5_k": 16, "q6_k": 17, "q4_1x8": 18, "q8_0x8": 19,
}
"""The weight formats the library multiplies (GGUF block layouts by their llama.cpp names;
``int8_channel``: per-channel int8 rows, :data:`fuel.circuit.format.INT8_ROWS`; ``q4_1x8``,
``q8_0x8``: q4_1's and q8_0's blocks regrouped by eight, :data:`fuel.circuit.format.REGROUPED`)."""

QUANT_LAYOUTS = frozenset({"q4_0", "q4_1", "q4_1x8", "q5_0", "q5_1", "q8_0", "q8_0x8",
                           "q4_k", "q5_k", "q6_k",
                           "f16", "bf16", "int8_channel"})
"""The packed layouts a ``quant_linear`` region may carry that the library multiplies (GGUF
blocks, 16-bit matrices held as packed rows: ``fuel.kernels.quant_blocks.HALF_LAYOUTS``, and
per-channel int8 rows: ``int8_channel``)."""

KV_CODES: dict[str, int] = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}
"""KV cache element dtypes the library reads and writes (a torch dtype's ``str``) and their
format codes (gemv.c's F32, F16, BF16)."""

Q8_FORMATS = frozenset({"q4_0", "q4_1", "q4_1x8", "q5_0", "q5_1", "q8_0", "q8_0x8"})
"""The formats with an 8-bit-activation decode kernel (``matmul(..., activations="q8")``)."""

STREAM_ROWS = 4
"""Activation rows up to which one streaming pass beats dequantize-then-GEMM (decode shapes)."""

TILE_ELEMENTS = 1 << 21
"""Weights dequantized per GEMM tile above :data:`STREAM_ROWS` rows (8 MiB of f32)."""

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c11")


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why the native kernels cannot run here (no compiler, no torch OpenMP runtime, ...)."""

    reason: str


class NativeKernels:
    """The loaded library: :meth:`matmul` on torch tensors."""

    def __init__(self, lib: ctypes.CDLL, path: Path, compiler: str):
        self._lib = lib
        self.path = path
        self.compiler = compiler
        lib.fuel_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int]
        lib.fuel_matmul.restype = ctypes.c_int
        lib.fuel_gemm_dense.argtypes = lib.fuel_matmul.argtypes
        lib.fuel_gemm_dense.restype = ctypes.c_int
        lib.fuel_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lib.fuel_dequantize.restype = ctypes.c_int
        lib.fuel_rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_int64]
        lib.fuel_rope.restype = None
        lib.fuel_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.fuel_argmax.restype = None
        lib.fuel_kv_write.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64]
        lib.fuel_kv_write.restype = ctypes.c_int
        lib.fuel_paged_attn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [
            ctypes.c_int, ctypes.c_float, ctypes.c_float]
        lib.fuel_paged_attn.restype = ctypes.c_int
        lib.fuel_paged_attn_kv.argtypes = lib.fuel_paged_attn.argtypes + [ctypes.c_int]
        lib.fuel_paged_attn_kv.restype = ctypes.c_int
        lib.fuel_kv_write_rows.argtypes = lib.fuel_kv_write.argtypes
        lib.fuel_prefill_attn_kv.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [
            ctypes.c_int, ctypes.c_float, ctypes.c_int] + [ctypes.c_int64] * 3
        lib.fuel_prefill_attn_kv.restype = ctypes.c_int
        lib.fuel_kv_write_rows.restype = ctypes.c_int
        lib.fuel_cast_half.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.fuel_cast_half.restype = ctypes.c_int
        lib.fuel_residual_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [
            ctypes.c_float]
        lib.fuel_residual_rms_norm.restype = None
        lib.fuel_matmul_q8.argtypes = lib.fuel_matmul.argtypes
        lib.fuel_matmul_q8.restype = ctypes.c_int
        lib.fuel_quantize_q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_void_p]
        lib.fuel_quantize_q8.restype = ctypes.c_int
        lib.fuel_run_steps.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int]
        lib.fuel_run_steps.restype = ctypes.c_int
        lib.fuel_pool_threads.argtypes = [ctypes.c_int]
        lib.fuel_pool_threads.restype = ctypes.c_int
        lib.fuel_regroup.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int]
        lib.fuel_regroup.restype = ctypes.c_int
        self._call = lib.fuel_matmul

    def rope(self, x: Any, cos: Any, sin: Any) -> Any | None:
        """Rotate-half RoPE of f32 ``x [rows, heads, D]`` (last dim contiguous, any row/head
        strides) with ``cos``/``sin`` ``[rows, 1, D]``, in one call; None when the operands have
        another shape, dtype or layout (the caller's torch kernel runs them)."""
        import torch

        if not (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3
                and cos.dim() == 3 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
                and x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
                and x.shape[2] % 2 == 0):
            return None
        rows, heads, width = x.shape
        out = torch.empty((rows, heads, width), dtype=torch.float32)
        self._lib.fuel_rope(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                            out.data_ptr(), rows, heads, width)
        return out

    def argmax(self, x: Any) -> Any | None:
        """``torch.argmax(x, -1)`` of a contiguous f32 ``[rows, V]`` (first maximum; a NaN counts
        as the maximum), in one pass; None for any other operand."""
        import torch

        if not (x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0):
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._lib.fuel_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def kv_write(self, cache: Any, rows: Any, slots: Any) -> bool:
        """Write ``rows [n, *cache.shape[2:]]`` into the paged ``cache [blocks, block_size, ...]``
        at flat ``slots [n]`` (int64), in place. False (nothing written) when the operands are
        not contiguous f32, bf16 or f16 (cache and rows alike) / int64 of those shapes: the
        caller's torch kernel writes them. Raises IndexError for a slot outside the cache
        (nothing written)."""
        import torch

        if not (cache.dtype == rows.dtype and str(cache.dtype) in KV_CODES and slots.dtype == torch.int64
                and cache.is_contiguous() and rows.is_contiguous() and slots.is_contiguous()
                and cache.dim() >= 2 and rows.dim() == cache.dim() - 1 and slots.dim() == 1
                and rows.shape[0] == slots.shape[0] and rows.shape[1:] == cache.shape[2:]):
            return False
        slot_count = cache.shape[0] * cache.shape[1]
        width = math.prod(rows.shape[1:]) * rows.element_size()
        if self._lib.fuel_kv_write_rows(cache.data_ptr(), slot_count, width, rows.data_ptr(),
                                        slots.data_ptr(), slots.shape[0]) != 0:
            raise IndexError(f"a KV slot in {slots.tolist()} is outside the cache's {slot_count}")
        return True

    def paged_attn(self, q: Any, k_cache: Any, v_cache: Any, block_table: Any, context_lens: Any,
                   scale: float, softcap: float | None) -> Any | None:
        """Paged attention of f32 ``q [B, Hq, L, D]`` over f32, bf16 or f16 caches
        ``[blocks, bs, Hkv, D]`` (each row widened to f32 as it is read)
        through ``block_table [B, W]`` / ``context_lens [B]`` (u32, i32 or i64, one dtype): the
        paged-attention recipe's semantics (query ``i`` sees positions up to ``len - L + i``;
        nothing visible is NaN). None when the operands have another dtype or layout. Raises
        IndexError when a block a query reads is outside the cache."""
        import torch

        index = {torch.int64: 8, torch.int32: 4, torch.uint32: 4}.get(block_table.dtype)
        if not (index and context_lens.dtype == block_table.dtype
                and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
                and str(k_cache.dtype) in KV_CODES
                and q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
                and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                and block_table.is_contiguous() and context_lens.is_contiguous()
                and q.shape[3] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0):
            return None
        batch, heads, rows, width = q.shape
        blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        status = self._lib.fuel_paged_attn_kv(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), batch, heads, rows, width, blocks,
            block_size, kv_heads, block_table.shape[1], index, scale, softcap or 0.0,
            KV_CODES[str(k_cache.dtype)])
        if status != 0:
            raise IndexError("a block the paged attention reads is outside the KV cache")
        return out

    def prefill_attn(self, q: Any, k_cache: Any, v_cache: Any, block_table: Any,
                     context_lens: Any, scale: float) -> Any | None:
        """Paged attention of a prompt chunk (many f32 query rows ``q [B, Hq, L, D]`` a
        sequence) over f32, bf16 or f16 caches, with :meth:`paged_attn`'s semantics (no soft
        cap): flash attention over blocks of 64 keys, each (sequence, kv head)'s rows gathered
        and widened once (``fuel_prefill_attn_kv`` in ``gemv.c``). ``q`` may be a strided view
        (heads and rows permuted out of a projection, as a step's are: only its last dim must be
        contiguous); the result is contiguous. None where this build or these
        operands have no such kernel (no AVX-512; a head dim other than 64 or 128; another
        dtype or layout): the caller's SDPA stands. Raises IndexError when a block a query reads
        is outside the cache."""
        import torch

        index = {torch.int64: 8, torch.int32: 4, torch.uint32: 4}.get(block_table.dtype)
        if not (index and context_lens.dtype == block_table.dtype
                and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
                and str(k_cache.dtype) in KV_CODES
                and q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
                and q.stride(3) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
                and block_table.is_contiguous() and context_lens.is_contiguous()
                and q.shape[3] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
                and block_table.dim() == 2 and block_table.shape[0] == q.shape[0]
                and context_lens.numel() == q.shape[0]):
            return None
        batch, heads, rows, width = q.shape
        blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty(q.shape, dtype=torch.float32)
        status = self._lib.fuel_prefill_attn_kv(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), batch, heads, rows, width, blocks,
            block_size, kv_heads, block_table.shape[1], index, scale, KV_CODES[str(k_cache.dtype)],
            q.stride(0), q.stride(1), q.stride(2))
        if status == -2:
            raise IndexError("a block the paged attention reads is outside the KV cache")
        return out if status == 0 else None

    def cast_half(self, x: Any, dtype: Any) -> Any | None:
        """Contiguous f32 ``x`` rounded to ``dtype`` (torch.bfloat16 or torch.float16) as torch's
        ``Tensor.to`` rounds it (nearest even); None for another dtype or layout."""
        import torch

        code = KV_CODES.get(str(dtype))
        if not code or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        out = torch.empty(x.shape, dtype=dtype)
        if self._lib.fuel_cast_half(x.data_ptr(), out.data_ptr(), x.numel(), code) != 0:
            return None
        return out

    def residual_rms_norm(self, x: Any, residual: Any, gain: Any, eps: float) -> Any | None:
        """``residual_add_rms_norm``: ``[2, *x.shape]`` f32 holding ``rms_norm(x + residual) *
        gain`` and ``x + residual`` (rows of the last dim); None for operands that are not f32
        of one shape with a gain as wide as a row."""
        import torch

        if not (x.dtype == residual.dtype == gain.dtype == torch.float32
                and x.shape == residual.shape and x.dim() >= 1 and gain.dim() == 1
                and gain.shape[0] == x.shape[-1] and x.shape[-1] > 0):
            return None
        width = x.shape[-1]
        x, residual, gain = x.contiguous(), residual.contiguous(), gain.contiguous()
        out = torch.empty((2, *x.shape), dtype=torch.float32)
        self._lib.fuel_residual_rms_norm(x.data_ptr(), residual.data_ptr(), gain.data_ptr(),
                                         out.data_ptr(), x.numel() // width, width, eps)
        return out

    def dequantize(self, fmt: str, packed: Any, cols: int) -> Any | None:
        """f32 ``[..., cols]`` values of packed rows ``[..., row_bytes]`` (u8) in a format the
        library reads (:data:`FORMAT_CODES`), bit-equal to the gguf package's reference
        dequantizer (the tests hold it to that); None for another format or operand."""
        import torch

        if fmt not in FORMAT_CODES or packed.dtype != torch.uint8 or packed.dim() < 1:
            return None
        lead = tuple(packed.shape[:-1])
        rows = packed.reshape(-1, packed.shape[-1]).contiguous()
        out = torch.empty((rows.shape[0], cols), dtype=torch.float32)
        threads = torch.get_num_threads() if rows.numel() >= (1 << 20) else 1
        if rows.shape[0] and self._lib.fuel_dequantize(
                FORMAT_CODES[fmt], rows.data_ptr(), out.data_ptr(), rows.shape[0], cols,
                rows.shape[1], threads) != 0:
            return None
        return out.reshape(*lead, cols)

    def regroup(self, layout: str, packed: Any, cols: int, *, back: bool = False) -> Any:
        """Packed rows ``[rows, row_bytes]`` (u8) of ``layout``'s file order moved into its
        regrouped layout (``q4_1`` -> ``q4_1x8``, ``q8_0`` -> ``q8_0x8``:
        :data:`fuel.circuit.format.REGROUPED`), or back (``back=True``, ``layout`` the regrouped
        one): a new tensor, the same bytes reordered within each row. ValueError for a layout
        without a regrouping."""
        import torch

        from fuel.circuit.format import REGROUPED

        grouped = layout if back else {v: k for k, v in REGROUPED.items()}.get(layout)
        if grouped not in REGROUPED:
            raise ValueError(f"{layout} has no regrouped layout (those are {', '.join(REGROUPED)})")
        rows = packed.contiguous()
        out = torch.empty_like(rows)
        if rows.shape[0] and self._lib.fuel_regroup(
                FORMAT_CODES[grouped], rows.data_ptr(), out.data_ptr(), rows.shape[0], cols,
                0 if back else 1) != 0:
            raise ValueError(f"{layout} rows of {cols} weights cannot be regrouped")
        return out

    @property
    def run_steps(self):
        """``fuel_run_steps(records, count, pointers, threads)`` (``steps.c``): a laid-out program
        in one call (``fuel.runtime.native_steps``, which builds its arguments)."""
        return self._lib.fuel_run_steps

    def pool_threads(self, threads: int) -> int:
        """How many threads a parallel region of the library gets when asked for ``threads``."""
        return int(self._lib.fuel_pool_threads(threads))

    def quantize_q8(self, x: Any) -> tuple[Any, Any]:
        """The activation rounding of ``activations="q8"``: f32 ``x [rows, K]`` (K a multiple of
        32) as int8 ``q [rows, K]`` and f32 ``d [rows, K/32]`` with ``x ~ d * q`` per 32-element
        block (``d = amax/127``, ``q = round_half_even(x * (127/amax))``; NaN ``d`` for a block
        holding a NaN or infinity). Natural element order."""
        import torch

        rows = x.to(torch.float32).contiguous()
        count, cols = rows.shape
        if cols % 32:
            raise ValueError(f"q8 activations need a multiple of 32 columns, not {cols}")
        q = torch.empty((count, cols), dtype=torch.int8)
        d = torch.empty((count, cols // 32), dtype=torch.float32)
        self._lib.fuel_quantize_q8(rows.data_ptr(), count, cols, q.data_ptr(), d.data_ptr())
        return q, d

    def gemm(self, fmt: str, x: Any, w: Any, cols: int, threads: int | None = None) -> Any:
        """``x [..., cols] f32 @ W.T`` for a dense ``[N, cols]`` f32/f16/bf16 matrix ``w`` (or its
        packed rows, uint8 ``[N, 2 * cols]``) as it is held: the 16-bit weights widened in
        registers, f32 accumulation (within f32 reassociation of the dequantize-then-matmul
        recipe), no f32 copy of the matrix. The prompt-chunk product of a 16-bit matrix where
        torch has no fast GEMM in its format (f16 on a CPU without AVX512-FP16 or AMX-FP16:
        torch's f16 ``linear`` is 8-10x slower than this here). None where this build has no
        vector GEMM (a CPU without AVX-512 or AVX2+F16C), or for another format."""
        import torch

        if fmt not in ("f32", "f16", "bf16"):
            return None
        threads = threads if threads is not None else torch.get_num_threads()
        lead = tuple(x.shape[:-1])
        rows = x if x.dim() == 2 else x.reshape(-1, cols)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        weight = w if w.is_contiguous() else w.contiguous()
        n = weight.shape[0]
        out = torch.empty((rows.shape[0], n), dtype=torch.float32)
        if self._lib.fuel_gemm_dense(FORMAT_CODES[fmt], rows.data_ptr(), weight.data_ptr(),
                                     out.data_ptr(), rows.shape[0], n, cols,
                                     weight.stride(0) * weight.element_size(), threads):
            return None
        return out if len(lead) == 1 else out.reshape(*lead, n)

    def matmul(self, fmt: str, x: Any, w: Any, cols: int, threads: int | None = None,
               activations: str = "f32") -> Any:
        """``x [..., cols] f32 @ dequantize(w).T`` for ``w`` packed rows ``[N, row_bytes]`` (uint8,
        block formats) or a ``[N, cols]`` f32/f16/bf16 matrix. Returns f32 ``[..., N]``.

        Up to :data:`STREAM_ROWS` activation rows, one pass over the packed weight computes every
        output (decode: the weight read is the cost). More rows (prefill) are a GEMM: the weight
        is dequantized a tile of :data:`TILE_ELEMENTS` at a time and each tile multiplied by
        torch's GEMM (oneDNN's f32 linear where torch has it), so the packed weight is still
        read once and the f32 copy stays small.

        ``activations="q8"`` (formats in :data:`Q8_FORMATS` only; ValueError otherwise): up to
        :data:`STREAM_ROWS` rows, the activations are rounded to 8 bits per 32-element block
        (:meth:`quantize_q8`) and each block's product is an integer dot product on the packed
        quants (``fuel_matmul_q8``): NOT within the f32 recipe tolerance, within the bound
        ``fuel.jit.native_synth.q8_error_bound`` states. More rows take the f32 GEMM path
        above (activations not rounded)."""
        import torch

        from fuel.kernels.torch_kernels import checkpoint_linear

        if activations not in ("f32", "q8"):
            raise ValueError(f"activations must be 'f32' or 'q8', not {activations!r}")
        if activations == "q8" and fmt not in Q8_FORMATS:
            raise ValueError(f"no 8-bit-activation kernel for {fmt} (only {sorted(Q8_FORMATS)})")
        code = FORMAT_CODES[fmt]
        threads = threads if threads is not None else torch.get_num_threads()
        lead = tuple(x.shape[:-1])
        rows = x if x.dim() == 2 else x.reshape(-1, cols)
        if rows.dtype != torch.float32 or not rows.is_contiguous():  # a decode row already is
            rows = rows.to(torch.float32).contiguous()
        weight = w if w.is_contiguous() else w.contiguous()
        n = weight.shape[0]
        row_bytes = weight.stride(0) * weight.element_size()
        if rows.shape[0] <= STREAM_ROWS:
            out = torch.empty((rows.shape[0], n), dtype=torch.float32)
            call = self._lib.fuel_matmul_q8 if activations == "q8" else self._call
            status = call(code, rows.data_ptr(), weight.data_ptr(), out.data_ptr(),
                          rows.shape[0], n, cols, row_bytes, threads)
        else:
            status, step = 0, max(1, TILE_ELEMENTS // cols)
            tile = torch.empty((min(step, n), cols), dtype=torch.float32)
            # one tile: its product is the result (no second [M, N] buffer to copy it into)
            out = None if n <= step else torch.empty((rows.shape[0], n), dtype=torch.float32)
            for start in range(0, n, step):
                count = min(step, n - start)
                status = self._lib.fuel_dequantize(code, weight.data_ptr() + start * row_bytes,
                                                   tile.data_ptr(), count, cols, row_bytes, threads)
                if status:
                    break
                # oneDNN's f32 linear on the tile as it lies (checkpoint_linear): 1.3x MKL's
                # mm at 48 rows of SmolLM2's q4_1 matrices here, 2x at 256
                product = checkpoint_linear(rows, tile[:count])
                if out is None:
                    out = product
                else:
                    out[:, start:start + count] = product
        if status != 0:
            raise ValueError(f"native matmul refused {fmt} with {cols} columns")
        return out if len(lead) == 1 else out.reshape(*lead, n)


_LOADED: NativeKernels | Unavailable | None = None
_LOCK = threading.Lock()


def load() -> NativeKernels | Unavailable:
    """The native kernels for this process (built on first use, then cached on disk). Waits
    for a build :func:`prefetch` started."""
    global _LOADED
    if _LOADED is None:
        with _LOCK:
            if _LOADED is None:
                if os.environ.get("FUEL_NATIVE", "1") == "0":
                    _LOADED = Unavailable("disabled by FUEL_NATIVE=0")
                else:
                    _LOADED = _build_and_load()
    return _LOADED


def prefetch() -> None:
    """Start :func:`load` on a background thread, so that a first build (the C compiler, ~3 s
    on one core) overlaps the caller's own start-up work (reading a GGUF) instead of following
    it; :func:`load` then waits for it. Nothing happens when the library is loaded already."""
    if _LOADED is None:
        threading.Thread(target=load, name="fuel-native-build", daemon=True).start()


def _torch_openmp() -> Path | None:
    """The OpenMP runtime torch loaded (its own ``libgomp``), or None."""
    import torch

    folder = Path(torch.__file__).parent / "lib"
    for name in ("libgomp.so.1", "libgomp.so"):
        if (folder / name).exists():
            return folder / name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


LIBRARY = "libfuelgemv.so"
"""The built library's file name, in :data:`INSTALLED` or the cache's folder of its key."""

INSTALLED = Path(__file__).with_name("built")
"""Where ``python -m fuel.kernels.native`` (run by ``scripts/setup.sh`` after the install) puts
the library it builds, beside these sources: a build step of the install, as a C extension's,
so a first run does not wait for the compiler (~3-7 s here). Keyed as the cache is (sources,
compiler, flags, OpenMP runtime, CPU): a library built for another machine or from other
sources is never loaded, and the cache path below builds one instead."""


@dataclass(frozen=True)
class _Build:
    compiler: str
    version: str
    openmp: Path
    key: str


def _build_key() -> _Build | Unavailable:
    """What a build of this machine's library needs and its key, or why there is none."""
    if platform.system() != "Linux":
        return Unavailable(f"native kernels are built on Linux only (this is {platform.system()})")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return Unavailable("no C compiler found (set CC, or install gcc)")
    openmp = _torch_openmp()
    if openmp is None:
        return Unavailable("torch ships no libgomp here, so a native parallel loop would start "
                           "a second thread pool")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        return Unavailable(f"the C compiler {compiler} does not run: {error}")
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(b"\0".join([
        source, version.encode(), " ".join(FLAGS).encode(), str(openmp.resolve()).encode(),
        _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:24]
    return _Build(compiler, version, openmp, key)


def _build_and_load() -> NativeKernels | Unavailable:
    from fuel.cost.paths import cache_dir

    build = _build_key()
    if isinstance(build, Unavailable):
        return build
    import torch  # noqa: F401 — torch's libgomp must be loaded first (one runtime)

    installed = INSTALLED / build.key / LIBRARY
    if installed.exists():
        try:
            return NativeKernels(ctypes.CDLL(str(installed)), installed, build.version)
        except OSError:
            pass  # an install-time build that does not load: the cache's is built instead
    folder = cache_dir() / "native" / build.key
    target = folder / LIBRARY
    error: OSError | None = None
    for _ in range(2):  # a cached library that does not load is built again, once
        if not target.exists():
            built = _compile(build.compiler, build.openmp, folder, target)
            if isinstance(built, Unavailable):
                return built
        try:
            return NativeKernels(ctypes.CDLL(str(target)), target, build.version)
        except OSError as failed:
            error = failed
            target.unlink(missing_ok=True)
    return Unavailable(f"the native library built but does not load: {error}")


def build_installed() -> Path | Unavailable:
    """Build this machine's library into :data:`INSTALLED` (once: an existing build is kept)
    and check that it loads; returns its path, or why it cannot be built."""
    build = _build_key()
    if isinstance(build, Unavailable):
        return build
    import torch  # noqa: F401 — torch's libgomp must be loaded first (one runtime)

    target = INSTALLED / build.key / LIBRARY
    for stale in INSTALLED.glob("*/") if INSTALLED.is_dir() else ():
        if stale.name != build.key:  # a build of earlier sources: never loaded again
            shutil.rmtree(stale, ignore_errors=True)
    if not target.exists():
        built = _compile(build.compiler, build.openmp, target.parent, target)
        if isinstance(built, Unavailable):
            return built
    try:
        ctypes.CDLL(str(target))
    except OSError as error:
        target.unlink(missing_ok=True)
        return Unavailable(f"the native library built but does not load: {error}")
    return target


UNITS: tuple[tuple[Path, tuple[str, ...]], ...] = (
    (SOURCE, ("-DFUEL_PART=1",)), (SOURCE, ("-DFUEL_PART=2",)), (SOURCES[1], ()), (SOURCES[2], ()))
"""The translation units of one build, compiled side by side (gemv.c in its two halves: the f32-
and the 8-bit-activation kernels, ~3 s each at -O3 here against ~6 s whole), then linked."""


def _compile(compiler: str, openmp: Path, folder: Path, target: Path) -> None | Unavailable:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=folder, prefix="build-"))
    except OSError as error:
        return Unavailable(f"cannot write the native library under {folder}: {error}")
    try:
        return _compile_in(compiler, openmp, work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _compile_in(compiler: str, openmp: Path, work: Path, target: Path) -> None | Unavailable:
    compile_flags = [f for f in FLAGS if f != "-shared"]
    objects = [work / f"unit{index}.o" for index in range(len(UNITS))]
    try:
        running = [subprocess.Popen([compiler, *compile_flags, *defines, "-c", str(source), "-o",
                                     str(obj)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
                   for (source, defines), obj in zip(UNITS, objects)]
        results = [(process, *process.communicate(timeout=300)) for process in running]
        temp = work / "libfuelgemv.so"
        link = subprocess.run([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(temp),
                               f"-L{openmp.parent}", f"-l:{openmp.name}",
                               f"-Wl,-rpath,{openmp.parent}"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        return Unavailable(f"the C compiler failed to run: {error}")
    for process, _, stderr in [*results, (link, link.stdout, link.stderr)]:
        if process.returncode != 0:
            first = (stderr.strip().splitlines() or ["(no message)"])[0][:300]
            return Unavailable(f"the C compiler refused the native sources: {first}")
    os.replace(temp, target)
    return None


__all__ = ["FORMAT_CODES", "INSTALLED", "NativeKernels", "Q8_FORMATS", "QUANT_LAYOUTS", "STREAM_ROWS",
           "Unavailable", "build_installed", "load", "prefetch"]
