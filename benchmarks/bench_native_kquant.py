"""The native K-quant kernels (q4_k, q5_k, q6_k) against the recipe they replace.

Before the native kernels took them, a ``quant_linear`` over a K-quant layout on CPU ran its
decomposed arm: dequantize the packed weight (fuel's ``dequantize`` primitive, the ``gguf``
package's reference dequantizer) and multiply with torch. This prints, per format and weight
shape, one decode-shaped product (M=1 activation row) on ONE thread (``torch.set_num_threads(1)``):

- ``kernel``: ``fuel_matmul`` streaming the packed super-blocks once (µs, and GB/s of packed
  weight bytes read);
- ``recipe``: ``dequantize`` + ``x @ W.T`` (what the kernel replaces) and the speedup over it;
- ``deq+mm``: the native library's own large-M path (``fuel_dequantize`` to f32, ``torch.mm``),
  for scale;
- ``f32 mm``: ``x @ W.T`` on an already dequantized f32 weight (4-7x the bytes of the packed one);
- ``M=4``: the kernel with four activation rows (a small decode batch: each sub-block is
  decoded once for all four);
- ``max err``: the kernel's largest absolute difference from the recipe, and whether every
  output is within the JIT's bound (``|got - want| <= 2e-5 + 2e-5 |want|``).

A second table (``--table q8``) measures the 8-bit-activation decode kernel of the 32-weight
block formats (``matmul(..., activations="q8")``, what ``CpuSynthesizer`` adopts for decode rows)
against the f32-activation kernel it replaces, on ``--threads`` threads (default 2, fuel's pool
on this machine), M=1, at SmolLM2-135M's shapes (1536x576 and 576x1536 MLP, 49152x576 LM head):

- ``f32 act`` / ``q8 act``: µs per product (the median of ``--repeats`` samples, fuel's
  profiler), the speedup, and GB/s of packed weight read by the q8 kernel;
- ``max err``: the q8 kernel's largest absolute difference from the recipe (x @ dequantize(W).T
  in f32), ``rel``: that over the largest |output|, ``bound``: the largest allowance of its stated bound
  (``native_synth.q8_error_bound``), and whether every output is within bound + tolerance.

A third table (``--table int4pack``) measures torch's int4 weight-only CPU kernel, the table's
variant arm for q4_0/q4_1/q4_k (``fuel.kernels.int4pack``: group 32, scale/zero mapped exactly),
against the arms it competes with in the bake, on ``--threads`` threads, at SmolLM2-135M's
shapes, for a decode row (M=1) and a 64-row prompt chunk:

- ``recipe``: arm 0 as fuel runs it (the native dequantizer, then ``x @ W.T``);
- ``int4pack``: the offered arm (f32 activations and scales, exact weights) and its max error
  against the recipe (``within`` the f32 recipe tolerance or not);
- ``native``: the JIT's native kernel (8-bit activations for a decode row of q4_0/q4_1, f32
  otherwise: what ``CpuSynthesizer`` hands over);
- ``bf16 path``: torch's fast path, which needs bf16 activations *and* bf16 scales, so it
  rounds the weights' scales and the activations: NOT offered; its time and relative error
  are printed to show what exactness costs;
- ``convert``: the one-time conversion of the packed weight into int4pack's layout (ms).

Weights are valid random blocks (``quant_blocks.random_blocks``). The median of ``--repeats``
samples is printed; on a shared machine the numbers move with the load. Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_native_kquant.py [--repeats 15]
        [--table kquant|q8|int4pack|all] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys

SHAPES = ((1536, 1536), (4096, 4096))
"""(output features N, input features K): K-quant rows hold whole 256-weight super-blocks."""

LAYOUTS = ("q4_k", "q5_k", "q6_k")

Q8_SHAPES = ((1536, 576), (576, 1536), (49152, 576))
"""SmolLM2-135M's decode matmuls: MLP up/gate, MLP down, the LM head."""

Q8_LAYOUTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def _library(threads: int):
    """The native kernels with torch's pool at ``threads``, or None (the reason printed)."""
    import torch

    from fuel.kernels import native

    torch.set_num_threads(threads)
    lib = native.load()
    if isinstance(lib, native.Unavailable):
        print(f"native kernels unavailable: {lib.reason}")
        return None
    return lib


def _case(layout: str, n: int, k: int):
    """Valid random ``[n, k]`` weight blocks, one activation row, and the recipe's product."""
    import torch

    from fuel.kernels.quant_blocks import dequantize, random_blocks

    w = random_blocks(layout, n, k, torch.Generator().manual_seed(0))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    dense = dequantize(w, layout, k)
    return w, x, dense, x @ dense.T


def median_us(call, repeats: int) -> float:
    from fuel.cost.profile import profile_kernel

    return profile_kernel(call, warmup=2, repeats=repeats).median_ns / 1e3


def q8_table(repeats: int, threads: int) -> int:
    from fuel.graph.dtype import DType
    from fuel.jit.adopt import verify
    from fuel.jit.native_synth import q8_error_bound
    from fuel.kernels import RECIPE_TOLERANCE

    lib = _library(threads)
    if lib is None:
        return 1
    print(f"\n{threads} thread(s), M=1, 8-bit vs f32 activations; median of {repeats} samples\n")
    print(f"{'format':<6} {'N x K':<11} {'packed':>8} {'f32 act':>9} {'q8 act':>9} {'speedup':>8} "
          f"{'GB/s':>6} {'max err':>9} {'rel':>8} {'bound':>9}")
    for layout in Q8_LAYOUTS:
        for n, k in Q8_SHAPES:
            w, x, _, want = _case(layout, n, k)
            got = lib.matmul(layout, x, w, k, threads=threads, activations="q8")
            bound = q8_error_bound(layout, k, x, w)
            check = verify(got, want, RECIPE_TOLERANCE[DType.F32], bound)
            f32_us = median_us(lambda: lib.matmul(layout, x, w, k, threads=threads), repeats)
            q8_us = median_us(lambda: lib.matmul(layout, x, w, k, threads=threads,
                                                 activations="q8"), repeats)
            print(f"{layout:<6} {f'{n}x{k}':<11} {w.numel() / 2**20:>6.2f}Mi {f32_us:>7.1f}us "
                  f"{q8_us:>7.1f}us {f32_us / q8_us:>7.2f}x {w.numel() / q8_us / 1e3:>6.1f} "
                  f"{check.max_abs_error:>9.2e} {check.max_abs_error / float(want.abs().max()):>8.1e} "
                  f"{check.bound_max:>9.2e} "
                  f"({'within' if check.ok else 'OUTSIDE'})")
    return 0


INT4_SHAPES = ((576, 576), (1536, 576), (576, 1536))
"""SmolLM2-135M's attention projection, MLP up/gate and MLP down (q4_k, whose super-blocks hold
256 weights, takes the last and a 1536x1536 matrix)."""

INT4_K_SHAPES = ((576, 1536), (1536, 1536))


def int4pack_table(repeats: int, threads: int) -> int:
    import time

    import torch

    from fuel.graph.dtype import DType
    from fuel.jit.adopt import verify
    from fuel.kernels import RECIPE_TOLERANCE, native
    from fuel.kernels.int4pack import GROUP, LAYOUTS, Int4Packed

    lib = _library(threads)
    if lib is None:
        return 1
    print(f"\n{threads} thread(s), torch int4pack (group {GROUP}) vs the bake's other arms; "
          f"median of {repeats} samples\n")
    print(f"{'format':<6} {'N x K':<11} {'M':>3} {'recipe':>10} {'int4pack':>10} {'max err':>9} "
          f"{'':8} {'native':>9} {'bf16 path':>10} {'rel err':>8} {'convert':>8}")
    for layout in LAYOUTS:
        for n, k in INT4_K_SHAPES if layout == "q4_k" else INT4_SHAPES:
            w, _, dense, _ = _case(layout, n, k)
            start = time.perf_counter()
            held = Int4Packed.convert(w, layout, k)
            convert_ms = (time.perf_counter() - start) * 1e3
            bf16_weight = held.scales_and_zeros.to(torch.bfloat16)
            for rows in (1, 64):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                want = x @ dense.T
                check = verify(held.matmul(x), want, RECIPE_TOLERANCE[DType.F32])
                q8 = rows <= native.STREAM_ROWS and layout in native.Q8_FORMATS
                activations = "q8" if q8 else "f32"
                slow = max(3, repeats // 3) if rows > 1 else repeats  # int4pack f32: ~0.1 s

                def bf16_path(x=x):
                    return torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x.bfloat16(), held.weight, GROUP, bf16_weight)

                bf16_err = float((bf16_path().float() - want).abs().max() / want.abs().max())
                recipe_us = median_us(lambda: x @ lib.dequantize(layout, w, k).T, repeats)
                int4_us = median_us(lambda: held.matmul(x), slow)
                native_us = median_us(lambda: lib.matmul(layout, x, w, k, threads=threads,
                                                         activations=activations), repeats)
                bf16_us = median_us(bf16_path, repeats)
                print(f"{layout:<6} {f'{n}x{k}':<11} {rows:>3} {recipe_us:>8.1f}us "
                      f"{int4_us:>8.1f}us {check.max_abs_error:>9.2e} "
                      f"{'(within)' if check.ok else '(OUTSIDE)':8} {native_us:>7.1f}us "
                      f"{bf16_us:>8.1f}us {bf16_err:>8.1e} {convert_ms:>6.1f}ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--table", choices=("kquant", "q8", "int4pack", "all"), default="all")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads for the q8 and int4pack tables")
    args = parser.parse_args()
    if args.table in ("kquant", "all"):
        status = kquant_table(args.repeats)
        if status:
            return status
    if args.table in ("q8", "all"):
        status = q8_table(args.repeats, args.threads)
        if status:
            return status
    return int4pack_table(args.repeats, args.threads) if args.table in ("int4pack", "all") else 0


def kquant_table(repeats: int) -> int:
    import torch

    from fuel.graph.dtype import DType
    from fuel.jit.adopt import verify
    from fuel.kernels import RECIPE_TOLERANCE, native
    from fuel.kernels.quant_blocks import dequantize

    lib = _library(1)
    if lib is None:
        return 1
    print(f"one thread, M=1; median of {repeats} samples\n")
    print(f"{'format':<6} {'N x K':<11} {'packed':>8} {'kernel':>9} {'GB/s':>6} {'recipe':>10} "
          f"{'speedup':>8} {'deq+mm':>9} {'f32 mm':>8} {'M=4':>8}  max err")
    for layout in LAYOUTS:
        for n, k in SHAPES:
            w, x, dense, want = _case(layout, n, k)
            got = lib.matmul(layout, x, w, k, threads=1)
            check = verify(got, want, RECIPE_TOLERANCE[DType.F32])
            packed = w.numel()
            code = native.FORMAT_CODES[layout]
            tile = torch.empty(n, k)

            def deq_mm(w=w, x=x, tile=tile, code=code, n=n, k=k):
                lib._lib.fuel_dequantize(code, w.data_ptr(), tile.data_ptr(), n, k, w.shape[1], 1)
                return x @ tile.t()

            kernel_us = median_us(lambda: lib.matmul(layout, x, w, k, threads=1), repeats)
            slow = max(3, repeats // 3)  # the numpy recipe takes tens of ms at 4096x4096
            recipe_us = median_us(lambda: x @ dequantize(w, layout, k).T, slow)
            deq_us = median_us(deq_mm, slow)
            f32_us = median_us(lambda: x @ dense.T, repeats)
            x4 = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
            four_us = median_us(lambda: lib.matmul(layout, x4, w, k, threads=1), repeats)
            print(f"{layout:<6} {f'{n}x{k}':<11} {packed / 2**20:>6.2f}Mi {kernel_us:>7.1f}us "
                  f"{packed / kernel_us / 1e3:>6.1f} {recipe_us:>8.0f}us "
                  f"{recipe_us / kernel_us:>7.0f}x "
                  f"{deq_us:>7.0f}us {f32_us:>6.0f}us {four_us:>6.0f}us  {check.max_abs_error:.1e} "
                  f"({'within' if check.ok else 'OUTSIDE'} the JIT bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
