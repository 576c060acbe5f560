"""Device specifications as values: what the roofline needs to know about one device.

Decided here: the shape of a device's numbers, and how a tensor dtype maps onto the class of
arithmetic unit that prices it. Loading these from ``fuel/data/devices.toml`` (and probing
``cpu-local``) lives in :mod:`fuel.cost.devices` and :mod:`fuel.cost.probe`; this module is pure.

Invariants:

- Every rate is stored as given by its source (FLOP/s, byte/s); nothing here divides. The
  roofline (:mod:`fuel.cost.roofline`) refuses to divide by a rate that is not finite and
  positive, so a broken number becomes an unpriced value, never a crash or an infinity.
- ``peak_flops`` holds DENSE peaks only (never "with sparsity"), keyed by :class:`PeakClass`.
  A class a device lacks is absent, not zero: a kernel in that dtype cannot be priced there.
- ``vector_flops`` is the non-matrix-unit FP32 rate; elementwise, reduction and transcendental
  work is priced against it whatever the storage dtype, because those kernels widen to f32
  and never reach the tensor cores.
- A device has a cache-resident bandwidth tier only when both ``cache_bytes`` and
  ``cache_bandwidth_bytes_per_s`` are given (:meth:`DeviceSpec.has_cache_tier`); a device
  without one is priced at ``bandwidth_bytes_per_s`` whatever the working set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class PeakClass(Enum):
    """The arithmetic classes a datasheet quotes a dense matrix peak for."""

    FP32 = "fp32"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    FP6 = "fp6"
    FP4 = "fp4"
    INT8 = "int8"


# How a tensor dtype's name (graph spelling: `bf16`, `f32`, `f8e4m3`, ...) maps onto the unit that
# multiplies it. Integer indices and f64 have no entry: no matrix peak prices them.
_DTYPE_PEAK: dict[str, PeakClass] = {
    "f32": PeakClass.FP32,
    "fp32": PeakClass.FP32,
    "float32": PeakClass.FP32,
    "tf32": PeakClass.TF32,
    "f16": PeakClass.FP16,
    "fp16": PeakClass.FP16,
    "float16": PeakClass.FP16,
    "bf16": PeakClass.BF16,
    "bfloat16": PeakClass.BF16,
    "fp8": PeakClass.FP8,
    "f8e4m3": PeakClass.FP8,
    "f8e5m2": PeakClass.FP8,
    "fp8e4m3": PeakClass.FP8,
    "fp8e5m2": PeakClass.FP8,
    "f6e2m3": PeakClass.FP6,
    "f6e3m2": PeakClass.FP6,
    "fp6": PeakClass.FP6,
    "f4e2m1": PeakClass.FP4,
    "fp4": PeakClass.FP4,
    "nvfp4": PeakClass.FP4,
    "mxfp4": PeakClass.FP4,
    "i8": PeakClass.INT8,
    "int8": PeakClass.INT8,
    "u8": PeakClass.INT8,
}


def peak_class_of(dtype: str) -> PeakClass | None:
    """The matrix-peak class for a dtype name, or None when no matrix unit prices it."""
    key = dtype.lower()
    # Formats such as `fp8/token` or `nvfp4/g16` are priced by their element type.
    key = key.split("/", 1)[0]
    return _DTYPE_PEAK.get(key)


def bandwidth_by_size(points: Sequence[tuple[int, float]], half_points: Sequence[tuple[int, float]],
                      bandwidth: float, call_bytes: float, *, half: bool = False) -> float:
    """Bytes/s of a call streaming ``call_bytes`` of weight, from ``(bytes, bytes/s)`` measured by
    weight size (``half_points`` for 16-bit weights, when ``half`` and measured): interpolated in
    log2(bytes) as :func:`rate_at_rows` does rows (the nearest measured size outside them);
    ``bandwidth`` where there is no curve."""
    curve = half_points if half and half_points else points
    if not curve or call_bytes <= 0:
        return bandwidth
    return rate_at_rows(curve, max(1, int(call_bytes))) or bandwidth


def rate_at_rows(points: Sequence[tuple[int, float]], rows: int) -> float | None:
    """The rate of a product of ``rows`` rows from rates measured at some row counts.

    ``points`` are ``(rows, FLOP/s)`` measured on one kernel. Between two measured row counts
    the rate is interpolated linearly in ``log2(rows)`` (the probe measures at powers of two, so
    each step of the table is one doubling); outside them it is the nearest measured rate (a
    kernel's rate levels off past its largest measured rows; fewer rows than the smallest
    measured are priced no slower than it was measured, never extrapolated). No usable point:
    None. Pure: same points and rows, same rate."""
    usable = sorted((int(r), float(v)) for r, v in points
                    if r >= 1 and math.isfinite(v) and v > 0)
    if not usable:
        return None
    if rows <= usable[0][0]:
        return usable[0][1]
    for (low, low_rate), (high, high_rate) in zip(usable, usable[1:]):
        if rows <= high:
            if high == low:
                return high_rate
            t = (math.log2(rows) - math.log2(low)) / (math.log2(high) - math.log2(low))
            return low_rate + t * (high_rate - low_rate)
    return usable[-1][1]


class DeviceKind(Enum):
    GPU = "gpu"
    CPU = "cpu"
    SOC = "soc"  # one package, one memory pool shared by CPU and GPU (Apple M-series, GB10)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device's roofline numbers and where each came from.

    ``sources`` maps a field name (``peak_flops``, ``bandwidth``, ``memory``,
    ``launch_overhead``, and ``cache`` when the device has a cache tier) to the datasheet or
    measurement it was taken from.

    ``cache_bytes`` / ``cache_bandwidth_bytes_per_s``: the optional cache-resident tier. An op
    whose whole working set (its ``CostEstimate.bytes``) fits in ``cache_bytes`` streams at
    the cache bandwidth instead of the DRAM bandwidth (see :mod:`fuel.cost.roofline`).
    """

    name: str
    title: str
    kind: DeviceKind
    peak_flops: dict[PeakClass, float]
    vector_flops: float
    bandwidth_bytes_per_s: float
    memory_bytes: int
    launch_overhead_ns: int
    sources: dict[str, str] = field(default_factory=dict)
    probed: bool = False
    cache_bytes: int | None = None
    cache_bandwidth_bytes_per_s: float | None = None
    gemv_flops: dict[PeakClass, float] = field(default_factory=dict)
    """Matrix-vector (one-row) FLOP/s per dtype where it was measured (``cpu-local``: the CPU
    linear kernel at M=1 on a weight larger than the last-level cache). A one-row product is
    priced at it when present; a datasheet device has none and uses its dense peak."""
    host_call_ns: int = 0
    """Host time of one framework call that launches no kernel (a view). 0 on a GPU (the host
    runs ahead of the device); the probed per-call overhead on ``cpu-local``."""
    gemm_rows_flops: dict[PeakClass, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Matrix-product FLOP/s per dtype at several row counts, ``((rows, FLOP/s), ...)``, where
    they were measured (``cpu-local``: the CPU linear kernel at each prompt-chunk size, each
    call reading a weight the pass has not read yet, as a step's projections do). A CPU GEMM's
    rate depends on its rows — the kernel loads and packs each weight block once per call and
    amortizes that over the rows — so a 128-row product runs well below the 256-row peak; a
    product of ``rows`` rows is priced at :func:`rate_at_rows` of these (with the matrix-vector
    rate as the one-row point). A datasheet device has none and uses its dense peak."""
    gemm_rows_fit: dict[PeakClass, tuple[tuple[int, float, float], ...]] = field(default_factory=dict)
    """A matrix-product call's time split per dtype at several row counts, ``((rows, fixed ns,
    FLOP/s), ...)``: ``time = fixed + flops / rate`` through two products of one row count, 512
    and 128 wide (``cpu-local``; ``fuel.cost.probe.call_fit``). A CPU prompt chunk's GEMM pays a
    fixed cost per call, so a narrow product runs well below the rate of a wide one; ``fuel
    plan`` prices each call so (:meth:`fuel.report.roofline.DeviceRates.matrix_call`). Empty: a
    call is priced at ``gemm_rows_flops`` alone."""
    attention_rows_flops: tuple[tuple[int, float], ...] = ()
    """Attention FLOP/s of a prompt chunk at several row counts, ``((rows, FLOP/s), ...)``, where
    measured (``cpu-local``: the CPU's prompt-chunk attention, which is not a packed GEMM and
    runs far below the matrix rate). Attention of several rows a sequence is priced at
    :func:`rate_at_rows` of these; empty (a datasheet device): at the dense matrix peak."""
    attention_rows_fit: tuple[tuple[int, float, float], ...] = ()
    """A prompt chunk's attention call split as :attr:`gemm_rows_fit` splits a product,
    ``((rows, fixed ns, FLOP/s), ...)``, through the probe's layout and one with a quarter of its
    heads (``cpu-local``). Empty: attention is priced at :attr:`attention_rows_flops` alone."""

    bandwidth_by_bytes: tuple[tuple[int, float], ...] = ()
    """DRAM read bandwidth by the size of the weight one call streams, ``((bytes, bytes/s),
    ...)``, where measured (``cpu-local``: the linear kernel streaming distinct weights of 1, 4,
    16 and 64 MiB; each call's read starts cold, so a small matrix streams slower). Bytes are
    priced at :meth:`bandwidth_at`; empty (a datasheet device): ``bandwidth_bytes_per_s``."""

    half_bandwidth_by_bytes: tuple[tuple[int, float], ...] = ()
    """The same for 16-bit (bf16/f16) weights, whose kernel widens each in registers
    (``cpu-local``: bf16 weights of 0.5, 2 and 8 MiB); empty: :attr:`bandwidth_by_bytes`."""

    def has_cache_tier(self) -> bool:
        return self.cache_bytes is not None and self.cache_bandwidth_bytes_per_s is not None

    def bandwidth_at(self, call_bytes: float, *, half: bool = False) -> float:
        """DRAM bytes/s of a call reading ``call_bytes`` (``half``: of 16-bit weights):
        :func:`bandwidth_by_size` over the measured curves."""
        return bandwidth_by_size(self.bandwidth_by_bytes, self.half_bandwidth_by_bytes,
                                 self.bandwidth_bytes_per_s, call_bytes, half=half)

    def matrix_peak(self, dtype: str, *, rows: int = 0) -> float | None:
        """Dense matrix FLOP/s for a dtype, or None when the device has no such peak. A
        one-row product (``rows == 1``) takes the measured matrix-vector rate where there is
        one; a product of more rows the rate measured at its rows (``gemm_rows_flops``,
        interpolated) where the device has that curve; ``rows == 0`` (unknown) the dense peak."""
        peak = peak_class_of(dtype)
        if peak is None:
            return None
        if rows == 1 and peak in self.gemv_flops:
            return self.gemv_flops[peak]
        if rows >= 1 and self.gemm_rows_flops.get(peak):
            return rate_at_rows(self.rows_curve(peak), rows)
        return self.peak_flops.get(peak)

    def rows_curve(self, peak: PeakClass) -> tuple[tuple[int, float], ...]:
        """The measured ``(rows, FLOP/s)`` points of ``peak``'s products: the matrix-vector rate
        at one row (where measured), then ``gemm_rows_flops``; empty when neither was measured."""
        one = ((1, self.gemv_flops[peak]),) if peak in self.gemv_flops else ()
        curve = self.gemm_rows_flops.get(peak, ())
        return (*one, *curve) if curve else ()
