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
import statistics
import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

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


class StepThreads:
    """The thread count native step lists run with, chosen from their own step times: the
    pool's, or one thread while the pool stalls.

    A parallel region waits for every thread of the pool. When another process holds a core,
    a pool thread waits for a time slice at every region, and a decode step has ~120 of them:
    SmolLM2's stored Q4_1 decode on this 2-core machine, one busy process beside it, ran 20
    tokens/s on the pool of 2 (38 with the pool's threads sleeping instead of spinning) and 62
    on one thread, against 129 on the pool when quiet. No setting chosen at start-up fits both,
    so the step lists measure themselves: they run on the pool, one thread is probed for
    ``probe_steps`` steps now and then, and the count whose recent steps took less (the median,
    compared within one step list: a program's steps are alike, two programs' are not) is kept.

    One chooser serves the process (:func:`step_threads`): a stall is the machine's, not one
    program's, and a decode moves through several programs (one a context bucket). The first
    probe comes ``probe_every`` steps in, the next ``after_switch`` steps after a switch (a
    switch on a passing stall is undone soon), the interval doubling each time a probe keeps
    the choice (up to ``max_interval``); and one comes at once when ``stall_steps`` steps of a
    program in a row take ``stall`` times the median of its recent ones (a process just took a
    core; those steps are then its figure). One slow step alone is a blip (a page fault, a
    time slice) and counts as any other. On a quiet machine the probes cost two one-thread
    steps an interval (~0.2% of the steps once it reaches ``max_interval``); under a stall,
    they are how the pool is taken back when it ends.

    Only for step lists whose results do not depend on the thread count (every native kernel
    computes a row, a tile or an attention unit the same on whichever thread, in the same
    order): the caller decides that. Pure bookkeeping: the caller times the runs."""

    def __init__(self, pool: int, *, probe_every: int = 64, probe_steps: int = 2,
                 max_interval: int = 512, window: int = 5, stall: float = 2.0,
                 stall_steps: int = 2, after_switch: int = 16):
        self.pool = max(1, pool)
        self.current = self.pool
        self.probe_every, self.probe_steps, self.max_interval = probe_every, probe_steps, max_interval
        self.window, self.stall, self.stall_steps, self.after_switch = window, stall, stall_steps, after_switch
        self._times: dict[tuple[Any, int], Any] = {}
        """(program key, count) -> its recent step seconds."""
        self._interval = probe_every
        self._until_probe = probe_every
        self._probe: list[tuple[Any, float]] = []  # (key, seconds) of the probe under way
        self._probing = 0
        self._slow: dict[Any, list[float]] = {}
        self._lock = threading.Lock()
        self.switches: list[tuple[int, int, float, float]] = []
        """(step, new count, the program's median on it, on the old count), per switch."""
        self.steps = 0

    @property
    def _other(self) -> int:
        return 1 if self.current == self.pool else self.pool

    def threads(self) -> int:
        """The count the next run takes."""
        return self._other if self._probing else self.current

    def _window(self, key: Any, count: int):
        return self._times.setdefault((key, count), deque(maxlen=self.window))

    def record(self, key: Any, threads: int, seconds: float) -> None:
        """Program ``key``'s run took ``seconds`` on ``threads`` threads (the count
        :meth:`threads` gave)."""
        with self._lock:
            self.steps += 1
            if self.pool == 1 or threads not in (1, self.pool):
                return
            if self._probing and threads == self._other:
                self._probe.append((key, seconds))
                self._probing -= 1
                if not self._probing:
                    self._decide(key)
                return
            if threads != self.current:
                return  # a run that began before a switch
            times, slow = self._window(key, threads), self._slow.setdefault(key, [])
            self._until_probe -= 1
            if len(times) == times.maxlen and seconds > self.stall * statistics.median(times):
                slow.append(seconds)
                if len(slow) < self.stall_steps:
                    return  # one slow step is a blip (a page fault, a time slice), not a stall
                times.clear()  # the program's figure is now the stalled steps
                times.extend(slow)
                self._until_probe = 0
            else:
                times.extend(slow)  # a blip: its steps count as any others
                times.append(seconds)
            slow.clear()
            if self._until_probe <= 0:
                self._probe = []
                self._probing = self.probe_steps

    def _decide(self, key: Any) -> None:
        probed = [seconds for k, seconds in self._probe if k == key]
        mine = self._times.get((key, self.current))
        other = statistics.median(probed)
        if mine and other < statistics.median(mine):
            self.switches.append((self.steps, self._other, other, statistics.median(mine)))
            self.current = self._other
            window = self._window(key, self.current)
            window.clear()
            window.extend(probed)
            self._interval = self.after_switch  # a switch on a passing stall is undone soon
        else:  # kept (or this program has no figure on the current count yet: ask again soon)
            self._interval = min(2 * self._interval, self.max_interval) if mine else self.after_switch
        self._until_probe = self._interval


GAP_S = 100e-6
"""The serial stretch :func:`pool_stalled` leaves between two regions (a step's epilogues): the
pool's other threads wait through it, where another process can take their core."""

STALLED_REGION_S = 50e-6
"""Mean seconds an empty parallel region of the pool may take before the pool counts as
stalled (:func:`pool_stalled`): a few microseconds on a quiet machine."""


def pool_stalled(threads: int, regions: int = 50, clock=None) -> float | None:
    """The mean seconds an empty parallel region of ``threads`` threads took, over ``regions``
    of them, where that is more than :data:`STALLED_REGION_S` (the pool is stalled: another
    process holds a core), else None; None too on one thread or without the native library.

    A stall is a mean effect: most regions still take microseconds, and one in several waits a
    time slice (milliseconds) for a descheduled thread, so the median of a few regions misses
    it (a torch fill of 1 MB: 23-31 us median with one or two busy processes beside it, while
    the decode step, ~120 regions, ran 6x slower). Fifty regions and their gaps take ~5 ms when
    quiet; it runs only before a program build times Judge cells."""
    import time

    if threads <= 1:
        return None
    from fuel.kernels import native

    lib = native.load()
    if isinstance(lib, native.Unavailable):
        return None
    clock = clock or time.perf_counter
    spent = 0.0
    for _ in range(regions):
        started = clock()
        lib.pool_threads(threads)
        ended = clock()
        spent += ended - started
        while clock() - ended < GAP_S:  # serial work between regions, as a step has
            pass
    mean = spent / regions
    return mean if mean > STALLED_REGION_S else None


@contextmanager
def one_thread() -> Iterator[int]:
    """The pool shrunk to one thread inside the block, its size given back after (yields the
    size it had): what the cost gate and the Judge time kernels with on a stalled pool."""
    import torch

    pool = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield pool
    finally:
        torch.set_num_threads(pool)


_SHARED: dict[int, StepThreads] = {}


def step_threads(pool: int) -> StepThreads:
    """The process's :class:`StepThreads` for a pool of ``pool`` threads."""
    chooser = _SHARED.get(pool)
    if chooser is None:
        chooser = _SHARED[pool] = StepThreads(pool)
    return chooser


__all__ = ["NUMBA_PARALLEL", "POOL", "SPIN_BUSY", "SPIN_IDLE", "StepThreads", "bound_pool_spin", "current_load",
           "one_thread", "pool_stalled", "step_threads",
           "runnable_from", "set_threads", "spin_count_for"]
