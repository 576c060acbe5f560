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

**Idle spin by load** (:func:`bound_pool_spin`). After a region, GNU OpenMP's threads spin
``GOMP_SPINCOUNT`` iterations before they sleep (300,000 when nothing is set; an iteration is a
``pause``, tens of nanoseconds). Measured here with SmolLM2's stored Q4_1 decode step on 2
threads (``benchmarks/profile_step.py --jit --dtype stored``):

- quiet machine: 32 ms a step at 100,000-300,000 iterations, 34 ms at 10,000, 37 ms at 3,000,
  51-58 ms at 1,000 or 0 (a sleeping thread takes tens of microseconds to wake on this VM, and a
  step has ~200 parallel regions); 51 ms on one thread.
- busy machine (load average 6-7 from other processes): 192 ms at 30,000, 44 ms at 1,000, 39 ms
  at 0; one Q4_1 1536x576 product took 7.6 ms a call at the default spin, 0.17 ms bounded. Both
  threads land on one core, and a spinning thread holds the core its partner needs.

So the spin follows the machine: :func:`spin_count_for` gives :data:`SPIN_IDLE` iterations when
the load average leaves a core idle, :data:`SPIN_BUSY` otherwise (read once, when fuel is
imported: OpenMP reads the variable once, when torch loads).

Invariants:
- :func:`set_threads` is the only place fuel sizes a pool; the count it returns is the one in
  effect for every kernel (the run report prints it).
- No numba kernel of fuel's is compiled with ``parallel=True``.
- ``GOMP_SPINCOUNT`` is set by :func:`spin_count_for` when ``fuel`` is imported, unless the
  user set it or ``OMP_WAIT_POLICY`` (their choice stands).
"""

from __future__ import annotations

import os

NUMBA_PARALLEL = False
"""Whether synthesized numba kernels may use numba's own thread pool (never: see above)."""

POOL = "torch intra-op (OpenMP)"
"""The pool every kernel runs on, for reports."""


SPIN_IDLE = 100_000
"""Iterations an idle pool thread spins before sleeping when the machine has an idle core."""
SPIN_BUSY = 1_000
"""... when it has none (see the module docs)."""


def spin_count_for(load: float, cores: int) -> int:
    """The idle spin for a machine whose 1-minute load average is ``load`` on ``cores`` cores."""
    return SPIN_IDLE if load <= cores - 1 else SPIN_BUSY


def bound_pool_spin() -> None:
    """Set the OpenMP pool's idle spin by the machine's load (module docs), unless the user
    chose a policy (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    os.environ["GOMP_SPINCOUNT"] = str(spin_count_for(load, os.cpu_count() or 1))


def set_threads(threads: int | None) -> int:
    """Size the one pool: ``threads`` (default: every core). Returns the count in effect."""
    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


__all__ = ["NUMBA_PARALLEL", "POOL", "SPIN_BUSY", "SPIN_IDLE", "bound_pool_spin", "set_threads",
           "spin_count_for"]
