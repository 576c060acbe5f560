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

**The native kernels share torch's pool** (``fuel.kernels.native``): they are linked against
torch's own ``libgomp``, so their parallel loops are regions of the same team torch uses, not a
second pool.

**Bounded spinning** (:func:`bound_pool_spin`). After a region, GNU OpenMP's threads spin
``GOMP_SPINCOUNT`` iterations before they sleep (300,000 when nothing is set; one iteration is
a ``pause``, tens of nanoseconds). On a busy 2-core machine both of a step's threads can land on
one core; a spinning thread then holds the core the other needs, and every region (or every
serial kernel after one) waits out the spin. Measured here with SmolLM2's stored Q4_1 decode
step on 2 threads, load average 6-7 from other processes: 192 ms a step at 30,000 iterations,
44 ms at 1,000, 39 ms at 0 (passive), against 41 ms on one thread; one Q4_1 1536x576 product
took 7.6 ms a call at the default spin and 0.17 ms bounded. :data:`SPIN_COUNT` keeps a short
spin, which still bridges back-to-back kernels on a quiet machine.

Invariants:
- :func:`set_threads` is the only place fuel sizes a pool; the count it returns is the one in
  effect for every kernel (the run report prints it).
- No numba kernel of fuel's is compiled with ``parallel=True``.
- ``GOMP_SPINCOUNT`` is set to :data:`SPIN_COUNT` when ``fuel`` is imported, unless the user
  set it or ``OMP_WAIT_POLICY`` (their choice stands).
"""

from __future__ import annotations

import os

NUMBA_PARALLEL = False
"""Whether synthesized numba kernels may use numba's own thread pool (never: see above)."""

POOL = "torch intra-op (OpenMP)"
"""The pool every kernel runs on, for reports."""


SPIN_COUNT = "1000"
"""Iterations an idle pool thread spins before sleeping (see the module docs)."""


def bound_pool_spin() -> None:
    """Bound the OpenMP pool's idle spinning (module docs), unless the user chose a policy."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def set_threads(threads: int | None) -> int:
    """Size the one pool: ``threads`` (default: every core). Returns the count in effect."""
    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


__all__ = ["NUMBA_PARALLEL", "POOL", "SPIN_COUNT", "bound_pool_spin", "set_threads"]
