"""A real Judge (measured on this CPU, not injected) drives the bake: every arm is priced from
the measured cells alone and the baked arm is the one the measurements say is faster."""

from __future__ import annotations

import pytest

from fuel.cost import judge_op_name, size_class_of
from fuel.graph import BackendId, Fused, Graph, OpKind, Prim, arm_interiors
from fuel.kernels import cpu_table
from fuel.optimize import CostSource, OptimizeOptions, Reason, optimize_graph
from fuel.optimize.judge_arms import measure_arm, measure_branch, oracle_from
from fuel.optimize.pathfinders import offer_decode_flash_arms

from tests.optimize.builders import SPEC, decode_attention
from tests.optimize.test_pathfinders import feeds

FAST = {"warmup": 1, "repeats": 3, "min_sample_ns": 20_000}


def step(k_len):
    graph = Graph()
    out = graph.prim(OpKind.NEG, decode_attention(graph, k_len=k_len, head_dim=32, heads=4, kv_heads=2))
    return graph, out


@pytest.mark.parametrize("k_len", [8, 128])
def test_bake_follows_the_judges_measurements(k_len):
    table = cpu_table()
    probe, probe_out = step(k_len)
    (offer,) = offer_decode_flash_arms(probe, (probe_out,), table, BackendId.CPU)
    rows = measure_branch(probe, offer.branch, feeds(probe), table, **FAST)
    judge = oracle_from(rows)
    assert len(judge) == len(rows) > 2

    graph, out = step(k_len)
    result = optimize_graph(graph, [out], OptimizeOptions(device_spec=SPEC, table=table, judge=judge))
    (decision,) = result.decisions
    assert [arm.source for arm in decision.arms] == [CostSource.JUDGE, CostSource.JUDGE]
    # Each arm's cost is exactly the sum of its interior nodes' measured cells (read off the
    # probe, which holds the same nodes under the same ids).
    cells = {(r.op, r.dtype, r.size_class): r.median_ns for r in rows}
    for arm, interior in enumerate(arm_interiors(probe, offer.branch)):
        expected = sum(cells[(judge_op_name(probe.node(n)), probe.node(n).dtype.value,
                              size_class_of(probe, n))]
                       for n in interior if isinstance(probe.node(n).op, Prim | Fused))
        assert decision.arms[arm].cost_ns == expected
    arm0, arm1 = (a.cost_ns for a in decision.arms)
    winner = 1 if arm1 < arm0 else 0
    assert decision.winner == winner
    assert decision.reason is (Reason.CHEAPER if winner else
                               (Reason.TIE if arm0 == arm1 else Reason.NOT_CHEAPER))


def test_measure_arm_times_each_arm_alone():
    """The benchmark's end-to-end arm timing runs each arm's kernels alone."""
    table = cpu_table()
    graph, out = step(64)
    (offer,) = offer_decode_flash_arms(graph, (out,), table, BackendId.CPU)
    for arm in (0, 1):
        measured = measure_arm(graph, offer.branch, arm, feeds(graph), table, **FAST)
        assert measured.median_ns >= 1 and measured.samples == FAST["repeats"]


def test_a_cell_that_already_lost_by_the_race_margin_is_retired_from_sampling(monkeypatch):
    # Why: measuring every cell in full made a cold first token sample a 44 ms recipe 9 times
    # beside its 1 ms kernel. measure_branches hands the rounds a race: a cell whose calibrated
    # call exceeds RACE_MARGIN times the cheapest other arm of its branch is retired, if it is a
    # recipe's; a cell within the margin, with no complete rival, or a kernel's, is sampled.
    import fuel.optimize.judge_arms as judge_arms
    from fuel.cost.profile import Measurement

    seen = {}

    def rounds(calls, *, retire=None, **options):
        seen["calls"], seen["retire"] = len(calls), retire
        return [Measurement(1000, 0, 3, 1) for _ in calls]

    monkeypatch.setattr(judge_arms, "profile_cells", rounds)
    table = cpu_table()
    graph, out = step(64)
    (offer,) = offer_decode_flash_arms(graph, (out,), table, BackendId.CPU)
    measure_branch(graph, offer.branch, feeds(graph), table, **FAST)
    cells, retire = seen["calls"], seen["retire"]
    assert cells > 2 and retire is not None
    assert retire([1.0] * cells) == []
    # one cell far slower than everything else: the other arm wins by more than the margin.
    # A recipe's cell (arm 0: every cell but the kernel's) is retired; the kernel's is sampled
    # in full (noise only adds time: a kernel seen slow may be a fast one a time slice caught)
    outcomes = []
    for slow in range(cells):
        estimates = [1.0] * cells
        estimates[slow] = 1e9
        outcomes.append(retire(estimates))
    assert sorted(map(tuple, outcomes)).count(()) == 1
    assert all(got in ([], [slow]) for slow, got in enumerate(outcomes))


def test_the_memoized_newest_ancestor_equals_a_fresh_walk_through_a_whole_pass(monkeypatch, capsys):
    # Why: each offered kernel branches after the newest node its inputs depend on; the walk
    # that finds it is memoized over a pass (it covered the whole model again for each of
    # ~1,500 offers). The memo must give what a fresh walk of the graph as it is then gives,
    # through a real pass that lowers, rewires and branches a SmolLM2 prefill step.
    import fuel.optimize.optimize as optimize
    from fuel.cli.app import main
    from fuel.graph.branch import ancestors

    memoized = optimize._newest_ancestors
    checked = []

    def checking(graph):
        newest = memoized(graph)

        def both(starts):
            starts = tuple(starts)
            got = newest(starts)
            checked.append(got == max(ancestors(graph, starts)))
            return got

        return both

    monkeypatch.setattr(optimize, "_newest_ancestors", checking)
    assert main(["explain", "smollm2-135m", "--jit", "--mode", "prefill", "--rows", "64"]) == 0
    capsys.readouterr()
    assert len(checked) > 50 and all(checked)
