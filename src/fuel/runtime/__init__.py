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

# Running real models (issue 8): lowering, step programs, the engine, generation, speculation.
from fuel.runtime.engine import BadStep, ContextTooLong, Engine, EngineError, StepResult  # noqa: E402
from fuel.runtime.generate import Generation, generate, generate_batch, prefill  # noqa: E402
from fuel.runtime.lower import (  # noqa: E402
    ConstructionMismatch, LowerError, NoConstruction, StepGraph, StepShape, UnsupportedParam, lower,
)
from fuel.runtime.program import StepProgram, WeightStore, build_program  # noqa: E402
from fuel.runtime.speculative import (  # noqa: E402
    EarlyExitDrafter, PromptLookupDrafter, speculative_generate, speculative_generate_batch,
)

__all__ += [
    "BadStep", "ConstructionMismatch", "ContextTooLong", "EarlyExitDrafter", "Engine", "EngineError",
    "Generation", "LowerError", "NoConstruction", "PromptLookupDrafter", "StepGraph", "StepProgram",
    "StepResult", "StepShape", "UnsupportedParam", "WeightStore", "build_program", "generate",
    "generate_batch", "lower", "prefill", "speculative_generate", "speculative_generate_batch",
]
