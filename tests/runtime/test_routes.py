"""The route picker at run time: a step whose graph keeps placement branches resolves them per
step from live signals, runs the route it picked, and the run report says which and why.

The two devices are the CPU and a "cuda" the binding table serves with the CPU's own kernels
(tests have no GPU; the picker and the executor only need a table that can run both arms)."""

from __future__ import annotations

import pytest

from fuel.graph import BackendId, Device
from fuel.kernels import cpu_table
from fuel.optimize import OptimizeOptions
from fuel.runtime.engine import Engine
from fuel.runtime.generate import generate
from fuel.runtime.model import route_report
from fuel.runtime.program import ProgramOptions
from fuel.runtime.route_picker import DeviceSignals, FakeSignals

from tests.optimize.builders import SPEC

CPU, CUDA = Device(BackendId.CPU), Device(BackendId.CUDA)


def two_device_table():
    table = cpu_table()
    for key in list(table.keys()):
        for entry in table.lookup_alternatives(key.op, key.dtypes, key.backend):
            table.bind(key.op, key.dtypes, BackendId.CUDA, entry)
    return table


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    from fuel.runtime.weights import load_weights
    from tests.runtime.conftest import write_tiny_gguf

    folder = tmp_path_factory.mktemp("routes")
    model = write_tiny_gguf(folder / "tiny.gguf")
    return load_weights(model.path, cache=folder / "cache", progress=False)


def engine_with(weights, reports):
    table = two_device_table()
    options = ProgramOptions(
        OptimizeOptions(table=table, device_spec=SPEC, placement_devices=(CUDA,)),
        signals=FakeSignals(reports), route_specs={CUDA: SPEC})
    return Engine(weights, max_context=32, table=table, optimize_options=options)


def test_steps_take_the_cpu_arm_when_the_other_device_has_no_room(tiny_weights):
    engine = engine_with(tiny_weights, {
        CPU: DeviceSignals(CPU, free_bytes=1 << 30, total_bytes=1 << 31),
        CUDA: DeviceSignals(CUDA, free_bytes=0, total_bytes=1 << 30)})
    tokens = generate(engine, [3, 4, 5], 3).tokens
    routes = route_report(engine.stats)
    assert routes, "the placement branches were resolved per step"
    assert {(r["arm"], r["device"]) for r in routes} == {(0, "cpu")}
    assert all("smallest" in r["reason"] for r in routes)
    baseline = Engine(tiny_weights, max_context=32)
    assert tokens == generate(baseline, [3, 4, 5], 3).tokens


def test_a_saturated_cpu_sends_the_heavy_nodes_to_the_idle_device(tiny_weights):
    engine = engine_with(tiny_weights, {
        CPU: DeviceSignals(CPU, free_bytes=1 << 30, total_bytes=1 << 31, pending=64, capacity=2),
        CUDA: DeviceSignals(CUDA, free_bytes=1 << 30, total_bytes=1 << 31, pending=0,
                            capacity=2)})
    tokens = generate(engine, [3, 4, 5], 3).tokens
    routes = route_report(engine.stats)
    assert routes and {(r["arm"], r["device"]) for r in routes} == {(1, "cuda:0")}
    # The picker's key says why: the CPU arm's load tier (2) loses to the idle device's (0).
    assert all(r["reason"].startswith("key (0, 0,") for r in routes)
    # Both arms compute the same value: the route changes where, never what.
    assert tokens == generate(Engine(tiny_weights, max_context=32), [3, 4, 5], 3).tokens


def test_without_live_branches_nothing_is_routed(tiny_weights):
    engine = Engine(tiny_weights, max_context=32)
    generate(engine, [3, 4, 5], 2)
    assert route_report(engine.stats) == []
    assert all(p.routing is None for p in engine.programs())
