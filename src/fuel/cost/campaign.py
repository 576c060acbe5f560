"""Measuring workloads for the Judge: resolve each node through the kernel binding table, run
it on generated inputs with the profiler, and store the latency under the shared key.

Decided here: a workload is measured with the kernel the executor would run (``table.lookup``
on the node's exact key and required capabilities — no substitute); a node with no bound
kernel is a :class:`Skipped` value with the reason, never an error. Inputs are random tensors of
the node's input shapes and dtypes (values do not change these kernels' cost).

This module runs kernels and reads the clock: an edge. torch is imported inside functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from fuel.cost.estimate import estimate_for_kernel, judge_op_name, size_class_of
from fuel.cost.fingerprint import device_fingerprint, library_versions
from fuel.cost.profile import Measurement, profile_kernel
from fuel.cost.roofline import CostEstimate
from fuel.cost.store import JudgeStore, StoredMeasurement
from fuel.cost.workloads import Workload
from fuel.graph import BackendId


@dataclass(frozen=True, slots=True)
class Measured:
    workload: Workload
    row: StoredMeasurement
    measurement: Measurement
    estimate: CostEstimate


@dataclass(frozen=True, slots=True)
class Skipped:
    workload: Workload
    reason: str


def _inputs(graph, node_id):
    import torch

    from fuel.kernels.torch_kernels import torch_dtype

    generator = torch.Generator().manual_seed(0)
    tensors = []
    for input_id in graph.node(node_id).inputs:
        node = graph.node(input_id)
        dims = [int(d) for d in node.shape.dims]
        values = torch.randn(dims, generator=generator, dtype=torch.float32)
        tensors.append(values.to(torch_dtype(node.dtype)))
    return tensors


def measure_workload(workload: Workload, table, backend: BackendId = BackendId.CPU, **profile_options) -> Measured | Skipped:
    """Profile one workload's node with the kernel bound for it on ``backend``."""
    from fuel.kernels import key_dtypes, op_key, required_caps

    graph, node_id = workload.graph, workload.node
    node = graph.node(node_id)
    entry = table.find(op_key(node.op), key_dtypes(graph, node_id), backend, required_caps(node))
    if entry is None:
        return Skipped(workload, f"no {backend.value} kernel bound for {judge_op_name(node)}")
    layer1 = estimate_for_kernel(graph, node_id, entry)  # one launch per call the kernel makes
    if not isinstance(layer1, CostEstimate):
        return Skipped(workload, layer1.reason)
    kernel = entry.kernel(node)
    tensors = _inputs(graph, node_id)
    measurement = profile_kernel(lambda: kernel(*tensors), **profile_options)
    row = StoredMeasurement(
        op=judge_op_name(node),
        dtype=node.dtype.value,
        size_class=size_class_of(graph, node_id),
        backend=backend.value,
        kernel_source=entry.kernel_source,
        device_fingerprint=device_fingerprint(backend.value),
        library_versions=library_versions(),
        median_ns=measurement.median_ns,
        spread_ns=measurement.spread_ns,
        samples=measurement.samples,
    )
    return Measured(workload, row, measurement, layer1)


def run_campaign(
    items: Iterable[Workload],
    store: JudgeStore | None,
    *,
    table=None,
    on_done: Callable[[Measured | Skipped], None] | None = None,
    **profile_options,
) -> list[Measured | Skipped]:
    """Measure every workload (in order), recording each measurement in ``store`` as it lands."""
    if table is None:
        from fuel.kernels import cpu_table

        table = cpu_table()
    results = []
    for workload in items:
        result = measure_workload(workload, table, **profile_options)
        if isinstance(result, Measured) and store is not None:
            store.record(result.row)
        results.append(result)
        if on_done is not None:
            on_done(result)
    return results


def log_ratio(predicted_ns: int, measured_ns: int) -> float:
    """|log(predicted / measured)|: 0 is a perfect prediction, log(2) a factor of two."""
    return abs(math.log(max(predicted_ns, 1) / max(measured_ns, 1)))
