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
the load leaves a core idle, :data:`SPIN_BUSY` otherwise (read once, when fuel is imported:
OpenMP reads the variable once, when torch loads). The load is :func:`current_load`: the tasks
running *now* besides this process (the kernel's runnable count, the least of a few samples),
not the one-minute average, which still counts a run that ended seconds ago: a second
``fuel run`` straight after a first one saw an average above 1 on this 2-core machine, took the
busy spin on a quiet machine, and decoded at half speed.

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


def runnable_from(loadavg: str) -> int | None:
    """Tasks running or runnable at this instant, from ``/proc/loadavg``'s text (its fourth
    field, ``running/total``); None when the text has no such field."""
    fields = loadavg.split()
    if len(fields) < 4 or "/" not in fields[3]:
        return None
    running = fields[3].split("/", 1)[0]
    return int(running) if running.isdigit() else None


def current_load(samples: int = 5, read=None) -> float:
    """Other tasks running now: the least runnable count of ``samples`` reads of
    ``/proc/loadavg`` (``read`` returns its text; 1 ms apart), less this process. Where the
    kernel gives no such count, the one-minute load average."""
    import time

    read = read or (lambda: open("/proc/loadavg", encoding="ascii").read())  # noqa: SIM115
    counts = []
    for sample in range(samples):
        try:
            count = runnable_from(read())
        except OSError:
            count = None
        if count is None:
            break
        counts.append(count)
        if sample + 1 < samples:
            time.sleep(0.001)
    if counts:
        return float(max(0, min(counts) - 1))
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def bound_pool_spin() -> None:
    """Set the OpenMP pool's idle spin by the machine's load now (module docs), unless the
    user chose a policy (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = str(spin_count_for(current_load(), os.cpu_count() or 1))


def set_threads(threads: int | None) -> int:
    """Size the one pool: ``threads`` (default: every core). Returns the count in effect."""
    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


__all__ = ["NUMBA_PARALLEL", "POOL", "SPIN_BUSY", "SPIN_IDLE", "bound_pool_spin", "current_load",
           "runnable_from", "set_threads", "spin_count_for"]
