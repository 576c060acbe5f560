"""The runtime: executor (here), KV cache, weights, generation, route picker.

Imports stay light: nothing here imports torch at module level; kernels and tensors are
imported inside the functions that run them.
"""

from fuel.runtime.executor import (
    ExecutorError, FeedMismatch, MissingFeed, MissingWeight, NotExecutable, Program,
    compile_program, execute,
)
from fuel.runtime.route_picker import (
    CpuSignals, CudaSignals, DeviceSignals, FakeSignals, Fit, PickerPricing, Route, RoutePicker,
    SystemSignals, pick_route, would_fit,
)

__all__ = [
    "ExecutorError", "FeedMismatch", "MissingFeed", "MissingWeight", "NotExecutable", "Program",
    "compile_program", "execute",
    "CpuSignals", "CudaSignals", "DeviceSignals", "FakeSignals", "Fit", "PickerPricing", "Route",
    "RoutePicker", "SystemSignals", "pick_route", "would_fit",
]
