"""The seed's bake rules, one test per rule, with opaque cost functions (``arm_cost``)."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from fuel.graph import lower
from fuel.kernels import Precision
from fuel.optimize import (
    ArmPrice, BakePolicy, BranchKind, CostSource, Reason, bake, bake_variant_branches,
    variant_bakes_thread_local,
)

from tests.optimize.builders import CPU, CUDA, snapshot, variant_graph


def costs(table):
    """An ``arm_cost`` reading ``table[arm]`` (None = unknown)."""
    return lambda graph, branch, arm: table[arm]


def test_cheaper_variant_is_baked_and_becomes_the_route():
    graph, merge, branch, exits = variant_graph()
    assert bake_variant_branches(graph, [merge], costs({0: 100, 1: 50})) == 1
    assert graph.node(merge).inputs == (exits[1],)
    assert graph.node(branch).inputs == (exits[1],)  # inert one-arm branch
    order = lower(graph, [merge]).order
    assert exits[1] in order and exits[0] not in order


def test_counter_tracks_the_return():
    before = variant_bakes_thread_local()
    graph, merge, *_ = variant_graph()
    baked = bake_variant_branches(graph, [merge], costs({0: 100, 1: 50}))
    graph2, merge2, *_ = variant_graph()
    baked += bake_variant_branches(graph2, [merge2], costs({0: 10, 1: 50}))
    assert baked == 1
    assert variant_bakes_thread_local() - before == 1


def test_counter_is_per_thread():
    seen = []

    def other():
        seen.append(variant_bakes_thread_local())
        graph, merge, *_ = variant_graph()
        bake_variant_branches(graph, [merge], costs({0: 100, 1: 50}))
        seen.append(variant_bakes_thread_local())

    mine = variant_bakes_thread_local()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [0, 1]
    assert variant_bakes_thread_local() == mine


def test_costlier_variant_keeps_arm0():
    graph, merge, branch, exits = variant_graph()
    outcome = bake(graph, [merge], lambda g, b, a: ArmPrice({0: 100, 1: 150}[a], CostSource.GIVEN))
    assert outcome.baked == 0
    assert graph.node(merge).inputs == (exits[0],)
    assert graph.node(branch).inputs == (exits[0],)
    assert outcome.decisions[0].reason is Reason.NOT_CHEAPER


def test_unknown_cost_keeps_arm0():
    graph, merge, branch, exits = variant_graph()
    assert bake_variant_branches(graph, [merge], costs({0: 100, 1: None})) == 0
    assert graph.node(merge).inputs == (exits[0],)


def test_tie_keeps_arm0():
    graph, merge, branch, exits = variant_graph()
    assert bake_variant_branches(graph, [merge], costs({0: 100, 1: 100})) == 0
    assert graph.node(merge).inputs == (exits[0],)


def test_two_equally_cheap_variants_tie_and_keep_arm0():
    graph, merge, branch, exits = variant_graph(arms=3)
    from fuel.optimize.variant_bake import _given

    outcome = bake(graph, [merge], _given(costs({0: 100, 1: 40, 2: 40})))
    assert outcome.baked == 0 and outcome.decisions[0].reason is Reason.TIE
    assert graph.node(merge).inputs == (exits[0],)


def test_cheapest_of_several_variants_wins():
    graph, merge, branch, exits = variant_graph(arms=3)
    assert bake_variant_branches(graph, [merge], costs({0: 100, 1: 60, 2: 40})) == 1
    assert graph.node(merge).inputs == (exits[2],)


def test_unpriceable_arm0_leaves_the_branch_as_it_is():
    graph, merge, branch, exits = variant_graph()
    before = snapshot(graph)
    assert bake_variant_branches(graph, [merge], costs({0: None, 1: 1})) == 0
    assert snapshot(graph) == before


def test_placement_branch_is_untouched():
    graph, merge, branch, exits = variant_graph(stamp=(CPU, CUDA))
    before = snapshot(graph)
    priced = []
    outcome = bake(graph, [merge], lambda g, b, a: priced.append(a) or ArmPrice(1, CostSource.GIVEN))
    assert outcome.baked == 0 and priced == []
    assert outcome.decisions[0].kind is BranchKind.PLACEMENT
    assert snapshot(graph) == before


def test_unstamped_branch_is_skipped():
    graph, merge, branch, exits = variant_graph(stamp=(CPU, None))
    before = snapshot(graph)
    outcome = bake(graph, [merge], lambda g, b, a: ArmPrice(100 - 90 * a, CostSource.GIVEN))
    assert outcome.baked == 0 and outcome.decisions[0].kind is BranchKind.UNSTAMPED
    assert snapshot(graph) == before


def test_a_raising_cost_function_declines_and_never_raises():
    graph, merge, branch, exits = variant_graph()

    def boom(g, b, arm):
        if arm:
            raise RuntimeError("no")
        return 10

    assert bake_variant_branches(graph, [merge], boom) == 0
    assert graph.node(merge).inputs == (exits[0],)


def test_unreachable_branch_is_not_baked():
    graph, merge, branch, exits = variant_graph()
    unrelated = graph.input("y", [1], graph.node(exits[0]).dtype)
    before = snapshot(graph)
    assert bake_variant_branches(graph, [unrelated], costs({0: 100, 1: 1})) == 0
    assert snapshot(graph) == before


@given(st.lists(st.sampled_from(["neg", "exp", "tanh"]), min_size=1, max_size=6))
def test_graph_without_variant_branch_is_unchanged(chain):
    from fuel.graph import DType, Graph, OpKind

    graph = Graph()
    node = graph.input("x", [3], DType.F32)
    for name in chain:
        node = graph.prim(OpKind(name), node)
        graph.target_backend[node] = CPU.backend
    before = snapshot(graph)
    assert bake_variant_branches(graph, [node], costs({0: 1, 1: 0})) == 0
    assert snapshot(graph) == before


@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_bake_picks_the_variant_exactly_when_strictly_cheaper(arm0, arm1):
    graph, merge, branch, exits = variant_graph()
    baked = bake_variant_branches(graph, [merge], costs({0: arm0, 1: arm1}))
    assert baked == (1 if arm1 < arm0 else 0)
    assert graph.node(merge).inputs == ((exits[1],) if arm1 < arm0 else (exits[0],))


def test_min_margin_requires_beating_arm0_by_more_than_the_margin():
    graph, merge, branch, exits = variant_graph()
    from fuel.optimize.variant_bake import _given

    outcome = bake(graph, [merge], _given(costs({0: 100, 1: 92})), BakePolicy(min_margin=0.1))
    decision = outcome.decisions[0]
    assert (outcome.baked, decision.reason, round(decision.margin, 2)) == (0, Reason.WITHIN_MARGIN, 0.08)
    graph, merge, branch, exits = variant_graph()
    outcome = bake(graph, [merge], _given(costs({0: 100, 1: 85})), BakePolicy(min_margin=0.1))
    assert outcome.baked == 1 and round(outcome.decisions[0].margin, 2) == 0.15


def test_arm_below_required_precision_cannot_win():
    graph, merge, branch, exits = variant_graph()
    prices = {0: ArmPrice(100, CostSource.LAYER1, Precision.EXACT),
              1: ArmPrice(10, CostSource.LAYER1, Precision.RECIPE_TOLERANCE)}
    outcome = bake(graph, [merge], lambda g, b, a: prices[a],
                   BakePolicy(required_precision=Precision.EXACT))
    assert outcome.baked == 0 and outcome.decisions[0].reason is Reason.BELOW_PRECISION
    graph, merge, branch, exits = variant_graph()
    assert bake(graph, [merge], lambda g, b, a: prices[a]).baked == 1  # no policy: it wins


def test_pareto_retention_keeps_arms_live_and_records_the_winner():
    graph, merge, branch, exits = variant_graph()
    before = snapshot(graph)
    outcome = bake(graph, [merge], lambda g, b, a: ArmPrice((100, 50)[a], CostSource.GIVEN),
                   BakePolicy(pareto_retention=True))
    decision = outcome.decisions[0]
    assert outcome.baked == 0 and decision.retained and decision.winner == 1
    assert snapshot(graph) == before
