"""fuel: a planner and runtime for LLM inference.

The pipeline, one subpackage per stage::

    config.json -> fuel.circuit (Circuit, FusionPlan) -> fuel.graph (tensor IR)
      -> fuel.optimize (arms, bake) -> fuel.jit (synthesized kernels)
      -> fuel.runtime (route picker, executor, generation)

Each subpackage's ``__init__`` names its public API. Importing ``fuel`` is cheap: no torch.
"""

from fuel.kernels.threads import bound_pool_spin

bound_pool_spin()  # before anything imports torch (its OpenMP runtime reads it once, at load)

from fuel.errors import FuelError, InputError  # noqa: E402

__version__ = "0.1.0"

__all__ = ["FuelError", "InputError", "__version__"]
