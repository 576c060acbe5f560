"""Kernels: the binding table (pure, importable without torch) and the PyTorch kernels.

``cpu_table()`` / ``torch_table(backend)`` import torch on first call only, so planning code
that only reads tables stays light.
"""

from fuel.kernels.table import (
    RECIPE_TOLERANCE, CostFn, KernelBindingTable, KernelEntry, KernelFactory, KernelKey,
    KernelMissing, OpKey, Precision, key_dtypes, op_key, op_key_name, required_caps,
)


def torch_table(backend=None):
    """A table binding the PyTorch kernels for ``backend`` (default: the CPU)."""
    from fuel.kernels.torch_kernels import torch_table as build

    return build(backend) if backend is not None else build()


def cpu_table() -> KernelBindingTable:
    """The default CPU table: every primitive plus the fused ops with a real CPU kernel."""
    from fuel.kernels.torch_kernels import torch_table as build

    return build()


__all__ = [
    "RECIPE_TOLERANCE", "CostFn", "KernelBindingTable", "KernelEntry", "KernelFactory", "KernelKey",
    "KernelMissing", "OpKey", "Precision", "cpu_table", "key_dtypes", "op_key", "op_key_name",
    "required_caps", "torch_table",
]
