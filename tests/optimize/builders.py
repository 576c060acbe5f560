"""Small graphs for the optimize tests: same-device and placement branches, decode attention."""

from __future__ import annotations

from types import MappingProxyType

from fuel.cost import DeviceKind, DeviceSpec, JudgeOracle, PeakClass, StoredMeasurement
from fuel.graph import BackendId, Device, DType, FusedOpParams, FusedOps, Graph, OpKind, open_branch

# A made-up device with round numbers, so expected Layer-1 figures are easy to reason about.
SPEC = DeviceSpec(
    name="test-cpu", title="test cpu", kind=DeviceKind.CPU, peak_flops={PeakClass.FP32: 1e11},
    vector_flops=5e10, bandwidth_bytes_per_s=2e10, memory_bytes=16 * 2**30, launch_overhead_ns=2000,
)
CPU = Device(BackendId.CPU)
CUDA = Device(BackendId.CUDA)


def variant_graph(arms: int = 2, stamp: tuple[Device | None, ...] | None = None):
    """x -> arm i = (neg, exp, tanh, ...)(x) -> merge add_scalar(arm 0). Returns (graph, merge,
    branch, exits). ``stamp`` gives each arm exit's device (default: all on the CPU)."""
    graph = Graph()
    x = graph.input("x", [4, 8], DType.F32)
    kinds = (OpKind.NEG, OpKind.EXP, OpKind.TANH, OpKind.SILU)
    exits = [graph.prim(kinds[i], x) for i in range(arms)]
    merge = graph.prim(OpKind.ADD_SCALAR, exits[0], value=1.0)
    builder = open_branch(graph, x)
    for exit in exits:
        builder.add_arm(exit)
    branch = builder.finalize(merge)
    stamp = stamp if stamp is not None else (CPU,) * arms
    for exit, device in zip(exits, stamp):
        if device is not None:
            graph.target_backend[exit] = device.backend
            graph.placement[exit] = device
    return graph, merge, branch, exits


def softmax_branch_graph(*, views: bool = False, backend: BackendId = BackendId.CPU):
    """Arm 0: a two-node region (exp, neg; with ``views``, two reshapes between them); arm 1: a
    fused softmax; every node on ``backend``. The arms are not numerically equal — these graphs
    are priced, never run. Returns (graph, merge, branch, arm-0 kernels, fused)."""
    graph = Graph()
    x = graph.input("x", [4, 64], DType.F32)
    e = graph.prim(OpKind.EXP, x)
    last = e
    if views:
        last = graph.prim(OpKind.RESHAPE, graph.prim(OpKind.RESHAPE, e, shape=(256,)),
                          shape=(4, 64))
    n = graph.prim(OpKind.NEG, last)
    fused = graph.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), x)
    merge = graph.prim(OpKind.ADD_SCALAR, n, value=1.0)
    builder = open_branch(graph, x)
    builder.add_arm(n)
    builder.add_arm(fused)
    branch = builder.finalize(merge)
    for node in range(1, len(graph)):
        if node not in (merge, branch):
            graph.target_backend[node] = backend
    return graph, merge, branch, (e, n), fused


def decode_attention(graph: Graph, *, heads=4, kv_heads=2, k_len=64, head_dim=16, q_rows=1,
                     dtype=DType.F32, softcap=None, causal=True):
    q = graph.input("q", [1, heads, q_rows, head_dim], dtype)
    k = graph.input("k", [1, kv_heads, k_len, head_dim], dtype)
    v = graph.input("v", [1, kv_heads, k_len, head_dim], dtype)
    params = FusedOpParams.FlashAttn(head_dim**-0.5, causal=causal, softcap=softcap)
    return graph.fused(FusedOps.FLASH_ATTN, params, q, k, v)


def judge_of(cells: dict[tuple[str, str, str, str, str], int]) -> JudgeOracle:
    """A Judge snapshot holding exactly ``cells`` ((op, dtype, size_class, backend, source) → ns)."""
    rows = {key: StoredMeasurement(*key, device_fingerprint="test", library_versions="test",
                                   median_ns=ns, spread_ns=0, samples=1)
            for key, ns in cells.items()}
    return JudgeOracle(MappingProxyType(rows))


def snapshot(graph: Graph):
    """Everything a bake may change: the nodes and both side tables."""
    return graph.nodes(), dict(graph.target_backend), dict(graph.placement)
