"""The route picker: keys (pressure, load, latency, index), would_fit's 85% threshold, arm 0 when
nothing fits or nothing reports, the memory-bucket cache, and the signal providers."""

from __future__ import annotations

from dataclasses import replace

from fuel.cost import DeviceKind, DeviceSpec, PeakClass
from fuel.graph import BackendId, Device, DType, FusedOpParams, FusedOps, Graph, OpKind
from fuel.kernels import KernelEntry, cpu_table
from fuel.optimize import OptimizeOptions, optimize_graph
from fuel.runtime.route_picker import (
    CpuSignals, DeviceSignals, FakeSignals, Fit, PickerPricing, RoutePicker, memory_bucket,
    pick_route,
)

CPU, CUDA = Device(BackendId.CPU), Device(BackendId.CUDA)
GIB = 2**30
SLOW = DeviceSpec("slow-cpu", "slow", DeviceKind.CPU, {PeakClass.FP32: 1e11}, 5e10, 2e10, 16 * GIB, 2000)
FAST = DeviceSpec("fast-gpu", "fast", DeviceKind.GPU, {PeakClass.FP32: 5e13}, 5e13, 2e12, 80 * GIB, 5000)


def placement_setup():
    graph = Graph()
    q = graph.input("q", [1, 8, 1, 64], DType.F32)
    k = graph.input("k", [1, 2, 4096, 64], DType.F32)
    v = graph.input("v", [1, 2, 4096, 64], DType.F32)
    attn = graph.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.125), q, k, v)
    out = graph.prim(OpKind.NEG, attn)
    table = cpu_table()
    table.bind(FusedOps.FLASH_ATTN, (DType.F32,) * 4, BackendId.CUDA,
               KernelEntry(lambda node: None, frozenset({"causal"}), kernel_source="torch.cuda"))
    optimized = optimize_graph(graph, [out], OptimizeOptions(table=table, placement_devices=(CUDA,)))
    (decision,) = optimized.decisions
    pricing = PickerPricing({CPU: SLOW, CUDA: FAST}, table)
    return graph, optimized, decision.branch, pricing


def comfortable(device, **changes):
    return replace(DeviceSignals(device, free_bytes=60 * GIB, total_bytes=80 * GIB, pending=0,
                                 capacity=4, inbound_bytes_per_s=25e9), **changes)


def test_no_signals_gives_the_empty_route():
    graph, optimized, branch, pricing = placement_setup()
    route = pick_route(optimized, graph, None, pricing)
    assert dict(route.arms) == {} and route.choices[0].reason == "no signals: arm 0"
    assert dict(pick_route(optimized, graph, FakeSignals(), pricing).arms) == {}


def test_the_faster_device_wins_when_both_are_comfortable():
    graph, optimized, branch, pricing = placement_setup()
    signals = FakeSignals({CPU: comfortable(CPU), CUDA: comfortable(CUDA)})
    route = pick_route(optimized, graph, signals, pricing)
    assert dict(route.arms) == {branch: 1}
    cpu_arm, cuda_arm = route.choices[0].arms
    assert cuda_arm.transfer_ns > 0 and cpu_arm.transfer_ns == 0  # inbound copy priced
    assert cuda_arm.key[2] < cpu_arm.key[2]


def test_memory_pressure_sends_work_to_the_host_arm():
    graph, optimized, branch, pricing = placement_setup()
    tight = comfortable(CUDA, free_bytes=GIB // 2**7, total_bytes=80 * GIB)  # > 85% full
    route = pick_route(optimized, graph, FakeSignals({CPU: comfortable(CPU), CUDA: tight}), pricing)
    assert dict(route.arms) == {}
    assert route.choices[0].arms[1].fit is Fit.TIGHT


def test_load_sends_work_to_the_unloaded_arm():
    graph, optimized, branch, pricing = placement_setup()
    busy = comfortable(CUDA, pending=8, capacity=4)
    route = pick_route(optimized, graph, FakeSignals({CPU: comfortable(CPU), CUDA: busy}), pricing)
    assert dict(route.arms) == {}
    idle_gpu = FakeSignals({CPU: comfortable(CPU, pending=9, capacity=2), CUDA: comfortable(CUDA)})
    assert dict(pick_route(optimized, graph, idle_gpu, pricing).arms) == {branch: 1}


def test_when_no_arm_fits_arm0_is_taken():
    graph, optimized, branch, pricing = placement_setup()
    full = {CPU: comfortable(CPU, free_bytes=10), CUDA: comfortable(CUDA, free_bytes=10)}
    route = pick_route(optimized, graph, FakeSignals(full), pricing)
    assert dict(route.arms) == {} and route.choices[0].reason == "no arm fits: arm 0"
    assert all(a.fit is Fit.WONT_FIT for a in route.choices[0].arms)


def test_would_fit_thresholds():
    device = DeviceSignals(CUDA, free_bytes=20, total_bytes=100)
    assert device.would_fit(21) is Fit.WONT_FIT
    assert device.would_fit(5) is Fit.COMFORTABLE  # 85% used after: not above
    assert device.would_fit(6) is Fit.TIGHT
    assert DeviceSignals(CUDA).would_fit(1) is Fit.UNKNOWN
    assert DeviceSignals(CUDA, free_bytes=100).would_fit(86) is Fit.TIGHT


def test_cache_hits_within_a_bucket_and_resolves_across_buckets():
    graph, optimized, branch, pricing = placement_setup()
    picker = RoutePicker(optimized, graph, [CPU, CUDA], pricing)
    signals = FakeSignals({CPU: comfortable(CPU), CUDA: comfortable(CUDA)})
    first = picker.route(signals)
    signals.reports[CUDA] = comfortable(CUDA, free_bytes=61 * GIB)  # same power-of-16 bucket
    assert picker.route(signals) is first
    assert (picker.hits, picker.resolves) == (1, 1)
    signals.reports[CUDA] = comfortable(CUDA, free_bytes=GIB // 2**7)  # another bucket: tight
    assert dict(picker.route(signals).arms) == {}
    assert (picker.hits, picker.resolves) == (1, 2)


def test_memory_bucket_is_floor_log16():
    assert [memory_bucket(n) for n in (None, 0, 1, 15, 16, 255, 256, 2**32)] == [-1, -1, 0, 0, 1, 1, 2, 8]


def test_cpu_signals_read_available_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:         1000 kB\nMemAvailable:    8000 kB\n")
    report = CpuSignals(meminfo).signals(CPU)
    assert (report.free_bytes, report.total_bytes) == (8000 * 1024, 16000 * 1024)
    assert CpuSignals(meminfo).signals(CUDA) is None
