"""Arm providers: Layer 1 summed per node, the Judge per node where measured, availability."""

from __future__ import annotations

from fuel.cost import composite_ns, estimate, size_class_of
from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind, RuntimeFusedRegistry, open_branch
from fuel.graph.ir import Fused, Node
from fuel.graph.registry import RuntimeFusedParams, recipe_for
from fuel.kernels import KernelBindingTable, KernelEntry, cpu_table
from fuel.optimize import (
    ArmDeclined, ArmPrice, CostSource, Pricing, Reason, bake, decode_arm_composite_ns,
    decode_arm_composite_ns_judged, price_arm,
)

from tests.optimize.builders import CPU, CUDA, SPEC, judge_of, softmax_branch_graph, variant_graph


def layer1(graph, node):
    return composite_ns(estimate(graph, node), SPEC)


def cell(graph, node, ns, source="torch.cpu"):
    n = graph.node(node)
    op = n.op.kind.value if hasattr(n.op, "kind") else "softmax_last_dim"
    return (op, n.dtype.value, size_class_of(graph, node), "cpu", source), ns


def test_layer1_provider_sums_node_composites():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    pricing = Pricing(SPEC, cpu_table())
    assert decode_arm_composite_ns(graph, branch, 0, pricing) == layer1(graph, e) + layer1(graph, n)
    assert decode_arm_composite_ns(graph, branch, 1, pricing) == layer1(graph, fused)


def test_judge_measured_flash_arm_wins():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    judge = judge_of(dict([cell(graph, e, 500), cell(graph, n, 500), cell(graph, fused, 400)]))
    pricing = Pricing(SPEC, cpu_table())
    assert decode_arm_composite_ns_judged(graph, branch, 0, pricing, judge) == 1000
    assert decode_arm_composite_ns_judged(graph, branch, 1, pricing, judge) == 400
    outcome = bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing, judge))
    assert outcome.baked == 1 and graph.node(merge).inputs == (fused,)
    assert [arm.source for arm in outcome.decisions[0].arms] == [CostSource.JUDGE, CostSource.JUDGE]


def test_slower_measured_flash_keeps_the_region():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    judge = judge_of(dict([cell(graph, e, 500), cell(graph, n, 500), cell(graph, fused, 1100)]))
    pricing = Pricing(SPEC, cpu_table())
    outcome = bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing, judge))
    assert outcome.baked == 0 and graph.node(merge).inputs == (n,)


def test_hybrid_sum_mixes_measured_and_layer1_exactly():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    judge = judge_of(dict([cell(graph, e, 500)]))
    price = price_arm(graph, branch, 0, Pricing(SPEC, cpu_table()), judge)
    assert isinstance(price, ArmPrice)
    assert price.ns == 500 + layer1(graph, n)
    assert price.source is CostSource.MIXED
    assert [(p.node, p.source) for p in price.nodes] == [(e, CostSource.JUDGE), (n, CostSource.LAYER1)]


def test_without_a_judge_the_judged_provider_is_layer1():
    graph, merge, branch, *_ = softmax_branch_graph()
    pricing = Pricing(SPEC, cpu_table())
    for arm in (0, 1):
        assert decode_arm_composite_ns_judged(graph, branch, arm, pricing, None) == \
            decode_arm_composite_ns(graph, branch, arm, pricing)


def test_measurement_for_another_kernel_source_is_not_used():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    judge = judge_of(dict([cell(graph, fused, 1, source="triton")]))
    pricing = Pricing(SPEC, cpu_table())
    assert decode_arm_composite_ns_judged(graph, branch, 1, pricing, judge) == layer1(graph, fused)


def test_judge_never_touches_a_placement_branch():
    graph, merge, branch, exits = variant_graph(stamp=(CPU, CUDA))
    asked = []

    class Spy:
        def measured_latency_ns(self, *key):
            asked.append(key)
            return 1

    outcome = bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, Pricing(SPEC, cpu_table()), Spy()))
    assert outcome.baked == 0 and asked == []
    assert graph.node(merge).inputs == (exits[0],)


def test_capability_missing_keeps_arm0():
    graph = Graph()
    q = graph.input("q", [1, 4, 1, 16], DType.F32)
    k = graph.input("k", [1, 2, 32, 16], DType.F32)
    v = graph.input("v", [1, 2, 32, 16], DType.F32)
    flash = graph.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25, softcap=30.0), q, k, v)
    merge = graph.prim(OpKind.NEG, flash)
    from fuel.graph import branch_fused_over_recipe

    branch = branch_fused_over_recipe(graph, flash, merge)
    for node in range(len(graph)):
        graph.target_backend[node] = BackendId.CPU
    full = cpu_table()
    table = KernelBindingTable()
    for key in full.keys():
        for entry in full.lookup_alternatives(key.op, key.dtypes, key.backend):
            caps = entry.caps - {"softcap"} if key.op is FusedOps.FLASH_ATTN else entry.caps
            table.bind(key.op, key.dtypes, key.backend, KernelEntry(entry.kernel, caps, entry.precision,
                                                                    entry.cost_fn, entry.kernel_source))
    pricing = Pricing(SPEC, table)
    declined = price_arm(graph, branch, 1, pricing)
    assert isinstance(declined, ArmDeclined) and declined.reason is Reason.KERNEL_UNAVAILABLE
    outcome = bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing))
    assert outcome.baked == 0 and outcome.decisions[0].reason is Reason.KERNEL_UNAVAILABLE
    assert graph.node(merge).inputs != (flash,)


def test_a_measured_cell_is_evidence_the_kernel_exists():
    graph, merge, branch, (e, n), fused = softmax_branch_graph()
    judge = judge_of(dict([cell(graph, fused, 300)]))
    empty = KernelBindingTable()
    for key in cpu_table().keys():
        if key.op is not FusedOps.SOFTMAX_LAST_DIM:
            for entry in cpu_table().lookup_alternatives(key.op, key.dtypes, key.backend):
                empty.bind(key.op, key.dtypes, key.backend, entry)
    pricing = Pricing(SPEC, empty)
    assert isinstance(price_arm(graph, branch, 1, pricing), ArmDeclined)
    assert decode_arm_composite_ns_judged(graph, branch, 1, pricing, judge) == 300


def test_symbolic_k_len_is_priced_at_capacity():
    def flash_branch(k_len):
        graph = Graph()
        q = graph.input("q", [1, 8, 1, 64], DType.F32)
        k = graph.input("k", [1, 2, k_len, 64], DType.F32)
        v = graph.input("v", [1, 2, k_len, 64], DType.F32)
        flash = graph.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.125), q, k, v)
        merge = graph.prim(OpKind.NEG, flash)
        from fuel.graph import branch_fused_over_recipe

        return graph, branch_fused_over_recipe(graph, flash, merge)

    symbolic, branch_s = flash_branch("k_len")
    concrete, branch_c = flash_branch(4096)
    at_capacity = Pricing(SPEC, None, {"k_len": 4096})
    for arm in (0, 1):
        assert decode_arm_composite_ns(symbolic, branch_s, arm, at_capacity) == \
            decode_arm_composite_ns(concrete, branch_c, arm, Pricing(SPEC, None))
    unbound = price_arm(symbolic, branch_s, 1, Pricing(SPEC, None))
    assert isinstance(unbound, ArmDeclined) and unbound.reason is Reason.UNKNOWN_COST


def _runtime_branch():
    graph = Graph()
    x = graph.input("x", [64, 256], DType.F32)
    registry = RuntimeFusedRegistry()
    probe = Graph()
    p = probe.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(),
                    probe.input("x", [64, 256], DType.F32))
    runtime_id = registry.register_runtime_fused("softmax_jit", recipe_for(probe, p))
    from fuel.graph import decompose

    fused_static = graph.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), x)
    region = decompose(graph, fused_static)
    merge = graph.prim(OpKind.NEG, region)
    runtime = graph.push(Node(Fused(runtime_id, RuntimeFusedParams()), (x,), graph.node(region).shape,
                              DType.F32))
    builder = open_branch(graph, x)
    builder.add_arm(region)
    builder.add_arm(runtime)
    branch = builder.finalize(merge)
    for node in range(len(graph)):
        graph.target_backend[node] = BackendId.CPU
    table = cpu_table()
    table.bind(runtime_id, (DType.F32, DType.F32), BackendId.CPU, KernelEntry(lambda node: None))
    return graph, merge, branch, runtime, registry, table


def test_runtime_fused_arm_is_unpriceable_by_default():
    graph, merge, branch, runtime, registry, table = _runtime_branch()
    pricing = Pricing(SPEC, table, runtime=registry)
    declined = price_arm(graph, branch, 1, pricing)
    assert isinstance(declined, ArmDeclined) and declined.reason is Reason.UNKNOWN_COST
    assert bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing)).baked == 0


def test_runtime_fused_arm_priced_by_composing_its_recipe():
    graph, merge, branch, runtime, registry, table = _runtime_branch()
    pricing = Pricing(SPEC, table, runtime=registry, price_runtime_fused=True)
    price = price_arm(graph, branch, 1, pricing)
    # The composed recipe: the softmax region's FLOPs, 64x256 f32 read and written once, 1 launch.
    region = price_arm(graph, branch, 0, pricing)
    assert isinstance(price, ArmPrice) and isinstance(region, ArmPrice)
    boundary_ns = -(-2 * 64 * 256 * 4 * 10**9 // int(SPEC.bandwidth_bytes_per_s))
    assert price.ns >= boundary_ns + SPEC.launch_overhead_ns
    assert price.ns < region.ns  # one launch and one pass beat five launches
    assert bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing)).baked == 1
    assert graph.node(merge).inputs == (runtime,)


def _viewed_branch(backend: BackendId):
    """softmax_branch_graph with two views between arm 0's kernels; returns the views too."""
    from fuel.graph.branch import arm_interiors

    graph, merge, branch, (e, n), fused = softmax_branch_graph(views=True, backend=backend)
    flat, back = sorted(arm_interiors(graph, branch)[0] - {e, n})
    return graph, merge, branch, (e, n), (flat, back), fused


def _judged(graph, cells):
    backend = graph.target_backend[cells[0][0]].value
    return judge_of({(graph.node(node).op.kind.value if hasattr(graph.node(node).op, "kind")
                      else "softmax_last_dim", graph.node(node).dtype.value,
                      size_class_of(graph, node), backend, f"torch.{backend}"): ns
                     for node, ns in cells})


def test_a_fused_arm_measured_slower_than_the_measured_cells_loses_on_a_gpu():
    # Why: views were charged a 5 us launch each on a GPU, so a decomposed region with views
    # looked slower than a fused kernel the Judge measured slower than its real cells.
    from fuel.cost import device

    h100 = device("h100-sxm")
    graph, merge, branch, (e, n), (flat, back), fused = _viewed_branch(BackendId.CUDA)
    judge = _judged(graph, [(e, 500), (n, 500), (fused, 1100)])
    pricing = Pricing(h100, None, backend=BackendId.CUDA)
    arm0 = price_arm(graph, branch, 0, pricing, judge)
    assert isinstance(arm0, ArmPrice) and arm0.ns == 1000  # the views cost nothing on a GPU
    outcome = bake(graph, [merge], lambda g, b, a: price_arm(g, b, a, pricing, judge))
    assert outcome.baked == 0 and outcome.decisions[0].winner == 0
    assert graph.node(merge).inputs == (n,)


def test_a_hybrid_region_is_its_measured_cells_plus_layer1_views_at_their_host_cost():
    # Why: on the CPU backend each view is one torch call: its cost is the per-call host
    # overhead, as its own term, and the region's price is exactly measured + Layer 1.
    from dataclasses import replace

    host = replace(SPEC, host_call_ns=700)
    graph, merge, branch, (e, n), (flat, back), fused = _viewed_branch(BackendId.CPU)
    judge = _judged(graph, [(e, 500), (n, 500)])
    price = price_arm(graph, branch, 0, Pricing(host, cpu_table()), judge)
    assert isinstance(price, ArmPrice)
    assert composite_ns(estimate(graph, flat), host) == 700  # no launch: the host call only
    assert price.ns == 500 + 500 + 2 * 700
    assert composite_ns(estimate(graph, flat), SPEC) == 0  # a spec with no host cost
