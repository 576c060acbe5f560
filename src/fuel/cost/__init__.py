"""Cost: Layer 1 (the roofline over real device specs) and Layer 2 (the Judge's measurements).

Public API:

- :class:`CostEstimate`, :func:`roofline`, :func:`composite_ns`, :func:`sum_composite_ns`,
  :class:`Priced`, :class:`Unpriced`, :class:`Bound`, :class:`MemoryTier`, :func:`memory_tier`
  — pricing work on a device (pure).
- :class:`DeviceSpec`, :class:`PeakClass`, :func:`load_devices`, :func:`device`,
  :func:`device_names`, :func:`probe_cpu_local` — device specs (data + the ``cpu-local`` probe).
- :func:`size_class` (and the per-family helpers) — the shared size bucketing.
- :func:`estimate`, :func:`estimate_for_kernel`, :func:`size_class_of`, :func:`judge_op_name`,
  :class:`Unestimated` — Layer 1 for a tensor-graph node (and for the kernel bound to run it).
- :class:`JudgeOracle`, :class:`JudgeStore`, :class:`StoredMeasurement`,
  :func:`profile_kernel`, :func:`profile_pair`, :class:`Measurement` — the Judge.

Importing this package is cheap: torch is imported only by the probe and the profiler's
callers, inside functions.
"""

from fuel.cost.devices import (
    DeviceSpecError,
    UnknownDeviceError,
    device,
    device_names,
    load_devices,
)
from fuel.cost.estimate import (
    Unestimated,
    estimate,
    estimate_for_kernel,
    judge_op_name,
    size_class_of,
)
from fuel.cost.fingerprint import device_fingerprint, library_versions
from fuel.cost.judge import JudgeOracle
from fuel.cost.probe import probe_cpu_local
from fuel.cost.profile import Measurement, profile_cells, profile_kernel, profile_pair
from fuel.cost.roofline import (
    SATURATED_NS,
    Bound,
    CostEstimate,
    MemoryTier,
    Priced,
    Unpriced,
    composite_ns,
    memory_tier,
    roofline,
    sum_composite_ns,
)
from fuel.cost.sizeclass import (
    size_class,
    size_class_attention,
    size_class_elements,
    size_class_matmul,
)
from fuel.cost.spec import DeviceKind, DeviceSpec, PeakClass, peak_class_of
from fuel.cost.store import (
    JudgeStore,
    JudgeStoreError,
    MergeReport,
    StoreCorruptError,
    StoredMeasurement,
    StoreVersionError,
)

__all__ = [
    "SATURATED_NS",
    "Bound",
    "CostEstimate",
    "DeviceKind",
    "DeviceSpec",
    "DeviceSpecError",
    "JudgeOracle",
    "JudgeStore",
    "JudgeStoreError",
    "Measurement",
    "MemoryTier",
    "MergeReport",
    "PeakClass",
    "Priced",
    "StoreCorruptError",
    "StoreVersionError",
    "StoredMeasurement",
    "UnknownDeviceError",
    "Unpriced",
    "Unestimated",
    "composite_ns",
    "estimate",
    "estimate_for_kernel",
    "judge_op_name",
    "size_class_of",
    "device",
    "device_fingerprint",
    "device_names",
    "library_versions",
    "load_devices",
    "memory_tier",
    "peak_class_of",
    "probe_cpu_local",
    "profile_cells",
    "profile_kernel",
    "profile_pair",
    "roofline",
    "size_class",
    "size_class_attention",
    "size_class_elements",
    "size_class_matmul",
    "sum_composite_ns",
]
