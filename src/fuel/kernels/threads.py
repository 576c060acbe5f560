"""The one thread pool every kernel of a step runs on.

Decides how the CPU's cores are shared by the kernel libraries a step calls: **torch's
intra-op OpenMP pool is the only pool.** ``--threads N`` sets its size (torch, and MKL and
oneDNN through it, via ``torch.set_num_threads``); every numba kernel fuel synthesizes runs
serial on the calling thread (``NUMBA_PARALLEL`` is False: ``fuel.jit.numba_synth`` compiles
no ``prange`` variant), and the work that is worth splitting across cores inside a JIT kernel
(prefill attention over a prompt chunk) calls a torch kernel, which runs on the same pool.

Why (measured, ``benchmarks/bench_threads.py``): numba's parallel layer is a second OpenMP
runtime. Called between torch kernels, its workers wait for cores that torch's workers still
spin on after their own region, so a numba ``prange`` kernel of ~80 us took 11-20 ms (a
scheduler time slice) in the median and p90 on this 2-core machine, while the serial variant
of the same kernel stayed at ~100 us. Two pools on the same cores cost a time slice per
hand-over; one pool costs nothing.

Invariants:
- :func:`set_threads` is the only place fuel sizes a pool; the count it returns is the one in
  effect for every kernel (the run report prints it).
- No numba kernel of fuel's is compiled with ``parallel=True``.
"""

from __future__ import annotations

import os

NUMBA_PARALLEL = False
"""Whether synthesized numba kernels may use numba's own thread pool (never: see above)."""

POOL = "torch intra-op (OpenMP)"
"""The pool every kernel runs on, for reports."""


def set_threads(threads: int | None) -> int:
    """Size the one pool: ``threads`` (default: every core). Returns the count in effect."""
    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


__all__ = ["NUMBA_PARALLEL", "POOL", "set_threads"]
