"""The covering fuse, gaps, and the coverage matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.circuit.fuser import AvailableKernels, Policy, fuse
from fuel.circuit.rules import Mode, load_rules
from fuel.circuit.runs import RowTable
from fuel.report.coverage import (DEFAULT_TABLES, covering_fuse, gaps_of, is_novel, novel_rules,
                                  coverage_matrix, tiers, unserved)
from tests.report.builders import dense_circuit

CPU_RULES = tuple(load_rules(Path(__file__).parents[2] / "src" / "fuel" / "data" / "rules" /
                             "cpu.toml"))
AVAILABLE = AvailableKernels.all_named_by(CPU_RULES)
TABLES = tuple(RowTable.parse(t) for t in DEFAULT_TABLES)


def _without(op: str) -> tuple:
    return tuple(r for r in CPU_RULES if all(p.op.value != op for p in r.pattern))


def test_covering_fuse_is_the_plain_plan_when_nothing_is_missing():
    c = dense_circuit()
    plain = fuse(c, CPU_RULES, AVAILABLE, Policy(), Mode.DECODE, 1)
    covered = covering_fuse(c, CPU_RULES, AVAILABLE, Policy(), Mode.DECODE, 1)
    assert covered.digest == plain.digest
    assert gaps_of(c, covered) == ()


def test_uncovered_ops_become_novel_placeholders_with_one_launch_each():
    c = dense_circuit(layers=3)
    plan = covering_fuse(c, _without("paged_attention"), AVAILABLE, Policy(), Mode.DECODE, 1)
    novel = [g for g in plan.groups if is_novel(g.rule)]
    assert [c.nodes[g.nodes[0]].id for g in novel] == ["l0.attn.attn", "l1.attn.attn",
                                                        "l2.attn.attn"]
    assert all(g.launch_count(1) == 1 for g in novel)
    (site,) = gaps_of(c, plan)
    assert (site.op, site.block, site.local, len(site.nodes)) == ("paged_attention", "attn",
                                                                  "attn", 3)


def test_novel_rules_rank_below_every_real_rule():
    c = dense_circuit()
    lowest = min(r.priority for r in CPU_RULES)
    assert all(r.priority < lowest for r in novel_rules(c, lowest))
    # Real rules still claim every node they can: only the removed op falls to a placeholder.
    plan = covering_fuse(c, _without("silu_mul"), AVAILABLE, Policy(), Mode.PREFILL, 64)
    assert {c.nodes[n].op.kind.value for g in plan.groups if is_novel(g.rule)
            for n in g.nodes} == {"silu_mul"}


@settings(max_examples=25, deadline=None)
@given(dropped=st.sets(st.sampled_from(sorted({r.pattern[0].op.value for r in CPU_RULES}))),
       rows=st.integers(1, 64))
def test_a_covering_plan_owns_every_node_exactly_once(dropped, rows):
    c = dense_circuit()
    rules = tuple(r for r in CPU_RULES if all(p.op.value not in dropped for p in r.pattern))
    plan = covering_fuse(c, rules, AVAILABLE, Policy(), Mode.MULTI_SEQ, rows)
    owned = sorted(n for g in plan.groups for n in g.nodes)
    assert owned == list(range(len(c.nodes)))
    gap_ops = {site.op.split(":")[0] for site in gaps_of(c, plan)}
    # Every rule naming a dropped op is gone, so exactly the circuit's dropped ops are gaps.
    assert gap_ops == dropped & {n.op.kind.value for n in c.nodes}


def test_coverage_matrix_lists_tiers_in_fixed_order_with_planned_launches():
    c = dense_circuit()
    cells = coverage_matrix(c, CPU_RULES, AVAILABLE, Policy(), tiers(TABLES))
    labels = [(cell.tier.mode.value, cell.tier.label) for cell in cells]
    assert labels[:3] == [("decode", "1"), ("multi_seq", "2"), ("multi_seq", "4")]
    assert ("verify", "8") in labels and ("verify_batch", "4x3 3x1!") in labels
    assert labels[-3:] == [("draft", "1"), ("prefill", "512"), ("prefill", "2048")]
    decode = cells[0]
    assert decode.planned
    assert decode.launches == fuse(c, CPU_RULES, AVAILABLE, Policy(), Mode.DECODE, 1).launches()


def test_a_tier_with_no_plan_carries_the_typed_error_message():
    c = dense_circuit()
    cells = coverage_matrix(c, _without("paged_attention"), AVAILABLE, Policy(), tiers(TABLES))
    decode = cells[0]
    assert not decode.planned and decode.error_kind == "Uncovered"
    assert decode.reason == ("no applicable rule covers node `l0.attn.attn` (paged_attention) in "
                             "decode at 1 rows")
    draft = next(cell for cell in cells if cell.tier.mode is Mode.DRAFT)
    assert (draft.error_kind, draft.reason) == ("EmptySection", "the circuit has no draft nodes")


def test_unserved_names_the_tiers_of_each_requested_mode():
    c = dense_circuit()
    cells = coverage_matrix(c, CPU_RULES, AVAILABLE, Policy(), tiers(TABLES))
    assert unserved(cells, [Mode.DECODE, Mode.DRAFT]) == {"decode": [], "draft": ["1"]}


def test_no_rule_set_makes_every_tier_say_why():
    c = dense_circuit()
    cells = coverage_matrix(c, None, AVAILABLE, Policy(), tiers(TABLES), "no rule set for X")
    assert {(cell.planned, cell.reason, cell.error_kind) for cell in cells} == {
        (False, "no rule set for X", "NoRuleSet")}


@pytest.mark.parametrize("mode", [Mode.DECODE, Mode.VERIFY])
def test_no_rules_at_all_covers_every_node_with_placeholders(mode):
    c = dense_circuit()
    plan = covering_fuse(c, (), AvailableKernels(), Policy(), mode, 2 if mode is Mode.VERIFY else 1)
    assert len(plan.groups) == len(c.nodes)
    assert all(is_novel(g.rule) for g in plan.groups)
