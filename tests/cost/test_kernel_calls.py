"""Layer 1 for a bound kernel charges one launch per operator call the kernel really makes.

``estimate_for_kernel`` takes the launches from ``KernelEntry.calls``; these tests pin that
formula on a hand-computed case and check every declared count against what torch's dispatcher
actually sees when the CPU kernel runs (so a torch upgrade that changes a decomposition fails
here instead of silently skewing the overhead term).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fuel.circuit import zoo
from fuel.cost import CostEstimate, DeviceKind, DeviceSpec, PeakClass, composite_ns, estimate_for_kernel
from fuel.cost.campaign import _inputs
from fuel.cost.estimate import estimate
from fuel.cost.workloads import ModelDims, workloads
from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind
from fuel.kernels import cpu_table, key_dtypes, op_key, required_caps


class _CountCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def _entry(graph, node_id):
    node = graph.node(node_id)
    return cpu_table().find(op_key(node.op), key_dtypes(graph, node_id), BackendId.CPU, required_caps(node))


def _dispatched(graph, node_id) -> list[str]:
    kernel = _entry(graph, node_id).kernel(graph.node(node_id))
    tensors = _inputs(graph, node_id)
    # One call first: a linear prepares its weight's layout once per weight (transpose, pack),
    # which every later step reuses; the declared count is the steady per-step figure.
    kernel(*tensors)
    with _CountCalls() as counter:
        kernel(*tensors)
    return counter.calls


def _declared(graph, node_id) -> int:
    work = estimate_for_kernel(graph, node_id, _entry(graph, node_id))
    assert isinstance(work, CostEstimate)
    return work.launches


def _rms_norm(gain: bool):
    graph = Graph()
    x = graph.input("x", [8, 64], DType.F32)
    inputs = (x, graph.weight("g", [64], DType.F32)) if gain else (x,)
    return graph, graph.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(eps=1e-5, has_gain=gain), *inputs)


def test_the_cpu_rms_norm_is_priced_with_its_six_calls_and_their_overhead():
    graph, node = _rms_norm(gain=True)
    work = estimate_for_kernel(graph, node, _entry(graph, node))
    assert work == CostEstimate(flops=estimate(graph, node).flops, bytes=estimate(graph, node).bytes, launches=6)
    # 6 launches x 1000 ns outside the roofline max: (8*64*4 flop ... ) priced on a round device
    device = DeviceSpec(name="d", title="d", kind=DeviceKind.CPU, peak_flops={PeakClass.FP32: 1e9},
                        vector_flops=1e9, bandwidth_bytes_per_s=1e12, memory_bytes=1, launch_overhead_ns=1000)
    assert composite_ns(work, device) == work.flops + 6 * 1000  # 1 flop per ns, memory negligible
    assert _declared(*_rms_norm(gain=False)) == 5


def test_a_kernel_that_declares_no_count_keeps_one_launch():
    graph = Graph()
    node = graph.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), graph.input("s", [4, 16], DType.F32))
    assert _entry(graph, node).calls is None and _declared(graph, node) == 1


def _benchmark_nodes():
    dims = ModelDims.from_config(zoo.config("smollm2-135m"))
    return [(w.family + " " + w.label, w.graph, w.node) for w in workloads(dims)]


def _flash(dtype, causal, softcap, q_len, k_len):
    graph = Graph()
    params = FusedOpParams.FlashAttn(softmax_scale=0.125, causal=causal, softcap=softcap)
    node = graph.fused(FusedOps.FLASH_ATTN, params, graph.input("q", [1, 4, q_len, 8], dtype),
                       graph.input("k", [1, 2, k_len, 8], dtype), graph.input("v", [1, 2, k_len, 8], dtype))
    return (f"flash {dtype.value} causal={causal} softcap={softcap} q{q_len} k{k_len}", graph, node)


def _matmul(a, b):
    graph = Graph()
    node = graph.prim(OpKind.MATMUL, graph.input("a", list(a), DType.F32), graph.input("b", list(b), DType.F32))
    return (f"matmul {a}@{b}", graph, node)


def _linear(x, bias):
    graph = Graph()
    inputs = [graph.input("x", list(x), DType.F32), graph.weight("w", [16, x[-1]], DType.F32)]
    if bias:
        inputs.append(graph.weight("b", [16], DType.F32))
    return (f"linear {x} bias={bias}", graph, graph.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(has_bias=bias), *inputs))


VARIANTS = [
    *[_flash(dtype, causal, softcap, q, k) for dtype in (DType.F32, DType.BF16) for causal in (False, True)
      for softcap in (None, 30.0) for q, k in ((1, 16), (16, 16))],
    *[_matmul(a, b) for a, b in (((8, 64), (64, 8)), ((9, 8, 64), (9, 64, 8)), ((2, 9, 8, 64), (2, 9, 64, 8)),
                                 ((9, 8, 64), (64, 8)), ((8, 64), (9, 64, 8)), ((2, 1, 8, 64), (2, 9, 64, 8)),
                                 ((1, 8, 64), (9, 64, 8)))],
    *[_linear(x, bias) for x in ((8, 64), (2, 8, 64)) for bias in (False, True)],
]


@pytest.mark.parametrize("label, graph, node", _benchmark_nodes() + VARIANTS, ids=lambda v: v if isinstance(v, str) else "")
def test_declared_calls_match_what_torch_dispatches(label, graph, node):
    torch.manual_seed(0)
    calls = _dispatched(graph, node)
    assert _declared(graph, node) == len(calls), f"{label}: torch dispatched {calls}"
