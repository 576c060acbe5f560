"""Layer 1: the roofline — a cost estimate priced on a device.

Decided here: how an op's work (:class:`CostEstimate`) becomes a time on a device
(:class:`~fuel.cost.spec.DeviceSpec`)::

    composite_ns = max(vector_flops / vector_peak + matrix_flops / matrix_peak(dtype),
                       bytes / bandwidth(tier))
                   + launches * launch_overhead + host_calls * host_call_overhead + overhead_ns

``launches`` are device kernel launches; ``host_calls`` are host-side framework calls that
launch nothing (a view: reshape, permute, slice, ... is metadata only). A GPU spec charges
nothing for them (``host_call_ns = 0``: the host runs ahead of the device); the CPU backend
dispatches each one through torch, so ``cpu-local`` charges its probed per-call overhead, as
its own term, never as a launch.

The memory tier: a device with a cache tier (``DeviceSpec.cache_bytes`` and
``cache_bandwidth_bytes_per_s``) prices an estimate whose working set — its ``bytes``, every
operand read once and every result written once — fits in ``cache_bytes`` at the cache
bandwidth (:attr:`MemoryTier.CACHE`); otherwise, and on a device without a tier, at the DRAM
bandwidth (:attr:`MemoryTier.DRAM`). The cache tier assumes the operands are resident when the
op starts, which holds for activations handed from one op to the next and for a kernel called
repeatedly on the same tensors (how the Judge measures); it is optimistic for an operand read
cold once per step (a weight in a model larger than the cache), which this per-op view cannot
see. Time is therefore not monotone in ``bytes`` across the boundary: one byte more than
``cache_bytes`` moves the op onto the slower tier.

Invariants:

- Pure: no files, clock, environment or randomness; the same inputs give the same integer.
- Never divides by a rate that is not finite and positive. A needed rate that is missing or
  broken makes the result :class:`Unpriced` with the reason (decline-as-value); a term whose
  work is zero needs no rate and so never declines.
- Saturating: every count and the result are clamped to ``SATURATED_NS`` (2**63 - 1), so a
  huge or infinite quotient is a very large time, never an overflow or a float infinity.
- Rounding is upward (ceil) so a non-zero amount of work never costs 0 ns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable

from fuel.cost.spec import DeviceSpec, PeakClass, peak_class_of

SATURATED_NS = 2**63 - 1


def _saturate(value: int) -> int:
    return min(max(value, 0), SATURATED_NS)


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """The work one kernel launch (or one fused region) does, independent of any device.

    ``flops`` counts all floating-point operations (a multiply-add is 2); ``matrix_flops`` is the
    part of them a matrix unit can execute (matmul-shaped contractions) and is priced against
    the dense peak for ``matrix_dtype``; the rest is priced against the vector FP32 rate.
    ``bytes`` is the minimum DRAM traffic (each input read once, each output written once).
    ``overhead_ns`` is fixed device-independent time outside the roofline (host-side work);
    ``launches`` is how many kernel launches the work takes; ``host_calls`` how many host-side
    framework calls it makes that launch no kernel (views).
    """

    flops: int
    bytes: int
    overhead_ns: int = 0
    launches: int = 1
    matrix_flops: int = 0
    matrix_dtype: str | None = None
    host_calls: int = 0
    matrix_rows: int = 0
    """Rows of the matrix product (M per batch); 1 is a matrix-vector product, priced at the
    device's measured matrix-vector rate where it has one. A fold keeps the larger."""

    def __post_init__(self) -> None:
        for name in ("flops", "bytes", "overhead_ns", "launches", "matrix_flops", "host_calls",
                     "matrix_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CostEstimate.{name} must be a non-negative int, got {value!r}")
        if self.matrix_flops > self.flops:
            raise ValueError(
                f"CostEstimate.matrix_flops ({self.matrix_flops}) exceeds flops ({self.flops})"
            )
        if self.matrix_flops and self.matrix_dtype is None:
            raise ValueError("CostEstimate with matrix_flops needs a matrix_dtype")

    @property
    def vector_flops(self) -> int:
        return self.flops - self.matrix_flops

    def __add__(self, other: CostEstimate) -> CostEstimate:
        """Fold two estimates (a region = the sum of its nodes' work and launches).

        Matrix work in two different dtypes cannot share one peak; fold such regions by summing
        their priced times instead (:func:`sum_composite_ns`).
        """
        if not isinstance(other, CostEstimate):
            return NotImplemented
        dtype = self.matrix_dtype if self.matrix_flops else other.matrix_dtype
        if self.matrix_flops and other.matrix_flops and self.matrix_dtype != other.matrix_dtype:
            raise ValueError(
                f"cannot fold matrix work in {self.matrix_dtype} with {other.matrix_dtype}"
            )
        return CostEstimate(
            flops=_saturate(self.flops + other.flops),
            bytes=_saturate(self.bytes + other.bytes),
            overhead_ns=_saturate(self.overhead_ns + other.overhead_ns),
            launches=_saturate(self.launches + other.launches),
            matrix_flops=_saturate(self.matrix_flops + other.matrix_flops),
            matrix_dtype=dtype if (self.matrix_flops or other.matrix_flops) else None,
            host_calls=_saturate(self.host_calls + other.host_calls),
            matrix_rows=max(self.matrix_rows, other.matrix_rows),
        )


class MemoryTier(Enum):
    """Which bandwidth priced an estimate's bytes."""

    DRAM = "dram"
    CACHE = "cache"  # the working set fits in the device's cache tier


def memory_tier(estimate: CostEstimate, device: DeviceSpec) -> MemoryTier:
    """The tier whose bandwidth prices ``estimate``'s bytes on ``device`` (module docstring)."""
    if device.has_cache_tier() and estimate.bytes <= device.cache_bytes:
        return MemoryTier.CACHE
    return MemoryTier.DRAM


class Bound(Enum):
    """Which side of the roofline set the time."""

    COMPUTE = "compute"
    MEMORY = "memory"
    OVERHEAD = "overhead"  # no work at all: only launch and fixed overhead


@dataclass(frozen=True, slots=True)
class Priced:
    """A roofline time and its parts (all ns, saturated)."""

    ns: int
    compute_ns: int
    memory_ns: int
    overhead_ns: int
    bound: Bound
    tier: MemoryTier = MemoryTier.DRAM


@dataclass(frozen=True, slots=True)
class Unpriced:
    """The estimate cannot be priced on this device; ``reason`` says which rate was unusable."""

    reason: str


def _usable(rate: float | None) -> bool:
    return rate is not None and math.isfinite(rate) and rate > 0


def _time_ns(work: int, rate: float) -> int:
    """ceil(work / rate seconds) in ns, saturating; `rate` is known finite and positive."""
    if work == 0:
        return 0
    seconds = work / rate
    ns = seconds * 1e9
    if not math.isfinite(ns) or ns >= SATURATED_NS:
        return SATURATED_NS
    return _saturate(math.ceil(ns))


def roofline(estimate: CostEstimate, device: DeviceSpec) -> Priced | Unpriced:
    """Price ``estimate`` on ``device`` (see the module docstring for the formula)."""
    compute_ns = 0
    if estimate.vector_flops:
        if not _usable(device.vector_flops):
            return Unpriced(f"{device.name}: vector FP32 rate {device.vector_flops!r} is unusable")
        compute_ns += _time_ns(estimate.vector_flops, device.vector_flops)
    if estimate.matrix_flops:
        dtype = estimate.matrix_dtype or ""
        peak = device.matrix_peak(dtype, rows=estimate.matrix_rows)
        if not _usable(peak):
            return Unpriced(f"{device.name}: no usable dense matrix peak for dtype {dtype}")
        compute_ns = _saturate(compute_ns + _time_ns(estimate.matrix_flops, peak))
    memory_ns = 0
    tier = memory_tier(estimate, device)
    if estimate.bytes:
        if tier is MemoryTier.CACHE:
            bandwidth, what = device.cache_bandwidth_bytes_per_s, "cache bandwidth"
        else:
            half = estimate.matrix_flops > 0 and peak_class_of(estimate.matrix_dtype or "") in (
                PeakClass.BF16, PeakClass.FP16)
            bandwidth, what = device.bandwidth_at(estimate.bytes, half=half), "memory bandwidth"
        if not _usable(bandwidth):
            return Unpriced(f"{device.name}: {what} {bandwidth!r} is unusable")
        memory_ns = _time_ns(estimate.bytes, bandwidth)
    launch_ns = _saturate(estimate.launches * max(device.launch_overhead_ns, 0))
    host_ns = _saturate(estimate.host_calls * max(device.host_call_ns, 0))
    overhead_ns = _saturate(launch_ns + host_ns + estimate.overhead_ns)
    if compute_ns == 0 and memory_ns == 0:
        bound = Bound.OVERHEAD
    elif compute_ns >= memory_ns:
        bound = Bound.COMPUTE
    else:
        bound = Bound.MEMORY
    total = _saturate(max(compute_ns, memory_ns) + overhead_ns)
    return Priced(total, compute_ns, memory_ns, overhead_ns, bound, tier)


def composite_ns(estimate: CostEstimate, device: DeviceSpec) -> int | None:
    """The roofline time in ns, or None when the device cannot price this estimate."""
    priced = roofline(estimate, device)
    return priced.ns if isinstance(priced, Priced) else None


def sum_composite_ns(estimates: Iterable[CostEstimate], device: DeviceSpec) -> int | None:
    """Sum of per-estimate roofline times (saturating); None if any one is unpriced."""
    total = 0
    for estimate in estimates:
        ns = composite_ns(estimate, device)
        if ns is None:
            return None
        total = _saturate(total + ns)
    return total
