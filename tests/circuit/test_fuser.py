"""The fuser (§A7): each test pins one behaviour of the seed's greedy cover."""

from __future__ import annotations

import pytest

from fuel.circuit.format import F32, parse as parse_format
from fuel.circuit.fuser import (
    AvailableKernels,
    Cycle,
    EdgeState,
    EmptySection,
    FormatConflict,
    Policy,
    PolicyMissing,
    RowTableMismatch,
    Uncovered,
    ZeroRows,
    fuse,
    fuse_table,
    group_io,
    section_of,
)
from fuel.circuit.ir import OpKind, Section
from fuel.circuit.rules import Mode
from fuel.circuit.runs import KernelId, RowTable
from tests.circuit.builders import CircuitBuilder, dense, make_rules, rule, singles

ADD_NORM = [{"op": "residual_add", "keep": True}, {"op": "rms_norm"}]


def plan(circuit, *rule_dicts, mode=Mode.DECODE, rows=1, policy=Policy(), available=None, table=None):
    rules = make_rules(*rule_dicts)
    available = available or AvailableKernels.all_named_by(rules)
    if table is not None:
        return fuse_table(circuit, rules, available, policy, table)
    return fuse(circuit, rules, available, policy, mode, rows)


def groups_by_rule(circuit, p):
    return [(g.rule, [circuit.nodes[n].id for n in g.nodes]) for g in p.groups]


def rule_of(circuit, p, node_id):
    n = circuit.node_index(node_id)
    return next(g.rule for g in p.groups if n in g.nodes)


def test_every_in_scope_node_is_in_exactly_one_group():
    c = dense(3, draft=True)
    p = plan(c, rule("add_norm", ADD_NORM, priority=5), *singles())
    members = [n for g in p.groups for n in g.nodes]
    main = [i for i in range(len(c.nodes)) if c.section_of_node(i) is Section.MAIN]
    assert sorted(members) == main


def test_priority_then_id_decides_overlaps_never_file_order():
    c = dense(1)
    low = rule("a.low", ADD_NORM, priority=1)
    high = rule("z.high", ADD_NORM, priority=2)
    for order in ((low, high), (high, low)):
        p = plan(c, *order, *singles())
        assert rule_of(c, p, "l0.mlp.mlp_norm") == "z.high"
    # Equal priority: the lower id wins, whatever the file order.
    tie_b = rule("b", ADD_NORM, priority=2)
    for order in ((tie_b, high), (high, tie_b)):
        assert rule_of(c, plan(c, *order, *singles()), "l0.mlp.mlp_norm") == "b"


def test_an_absent_kernel_or_capability_is_never_selected():
    c = dense(1)
    fused = rule("add_norm", ADD_NORM, priority=5, requires=["sm90"],
                 kernels=[{"module": "k", "func": "fused"}])
    rules = make_rules(fused, *singles())
    everything = AvailableKernels.all_named_by(rules)
    assert rule_of(c, fuse(c, rules, everything, Policy(), Mode.DECODE, 1), "l0.mlp.mlp_norm") == "add_norm"
    no_kernel = AvailableKernels(everything.kernels - {KernelId("k", "fused")}, everything.caps)
    no_cap = AvailableKernels(everything.kernels, frozenset())
    for available in (no_kernel, no_cap):
        p = fuse(c, rules, available, Policy(), Mode.DECODE, 1)
        assert rule_of(c, p, "l0.mlp.mlp_norm") == "single.rms_norm"
        assert all(k in available.kernels for g in p.groups for k in g.kernels)


def test_differs_is_selected_only_with_its_lever():
    c = dense(1)
    fast = rule("fast_norm", "rms_norm", priority=9, numerics="differs", lever="approx_norm")
    assert rule_of(c, plan(c, fast, *singles()), "l0.attn.attn_norm") == "single.rms_norm"
    with_lever = plan(c, fast, *singles(), policy=Policy(opt_in_levers=frozenset({"approx_norm"})))
    assert rule_of(c, with_lever, "l0.attn.attn_norm") == "fast_norm"
    other_lever = plan(c, fast, *singles(), policy=Policy(opt_in_levers=frozenset({"other"})))
    assert rule_of(c, other_lever, "l0.attn.attn_norm") == "single.rms_norm"


@pytest.mark.parametrize(("rows", "expected"), [(1, "single.paged_attention"), (2, "ranged"),
                                                (8, "ranged"), (9, "single.paged_attention")])
def test_row_ranges_are_inclusive_and_respected(rows, expected):
    c = dense(1)
    ranged = rule("ranged", "paged_attention", rows=[2, 8], priority=3)
    assert rule_of(c, plan(c, ranged, *singles(), mode=Mode.VERIFY, rows=rows), "l0.attn.attn") == expected


def test_modes_are_respected():
    c = dense(1)
    decode_only = rule("decode_only", "paged_attention", modes=["decode"], priority=3)
    assert rule_of(c, plan(c, decode_only, *singles()), "l0.attn.attn") == "decode_only"
    assert rule_of(c, plan(c, decode_only, *singles(), mode=Mode.MULTI_SEQ, rows=4),
                   "l0.attn.attn") == "single.paged_attention"


def test_when_selects_by_policy_and_a_missing_setting_fails():
    c = dense(1)
    fp8 = rule("kv_fp8", "kv_write", when={"kv_cache_dtype": "fp8"}, priority=3)
    auto = rule("kv_auto", "kv_write", when={"kv_cache_dtype": "auto"}, priority=3)
    for setting, expected in (("fp8", "kv_fp8"), ("auto", "kv_auto")):
        p = plan(c, fp8, auto, *singles(), policy=Policy(settings={"kv_cache_dtype": setting}))
        assert rule_of(c, p, "l0.attn.kv_write") == expected
    with pytest.raises(PolicyMissing) as caught:
        plan(c, fp8, auto, *singles())
    assert (caught.value.rule, caught.value.key) == ("kv_fp8", "kv_cache_dtype")
    assert str(caught.value) == "rule `kv_fp8` reads setting `kv_cache_dtype`, which the policy does not state"


def test_a_policy_must_state_settings_even_of_rules_that_do_not_apply():
    c = dense(1)
    prefill_only = rule("p", "kv_write", when={"x": "1"}, modes=["prefill"])
    with pytest.raises(PolicyMissing):
        plan(c, prefill_only, *singles())


def test_a_cross_layer_fusion_needs_keep():
    c = dense(2)
    # l0's mlp_residual output is read by l1's attn_norm and l1's attn_residual.
    without_keep = rule("add_norm", [{"op": "residual_add"}, {"op": "rms_norm"}], priority=5)
    p = plan(c, without_keep, *singles())
    assert rule_of(c, p, "l0.mlp.mlp_residual") == "single.residual_add"
    p = plan(c, rule("add_norm", ADD_NORM, priority=5), *singles())
    assert ("add_norm", ["l0.mlp.mlp_residual", "l1.attn.attn_norm"]) in groups_by_rule(c, p)


def test_the_last_layer_residual_has_no_rms_norm_to_join():
    c = dense(2)
    p = plan(c, rule("add_norm", ADD_NORM, priority=5), *singles())
    assert rule_of(c, p, "l1.mlp.mlp_residual") == "single.residual_add"


def sibling_circuit():
    """Block `blk`: a -> x -> b (an outside node between siblings a and b)."""
    b = CircuitBuilder()
    b.block("blk")
    b.node("a", OpKind.LINEAR, ["in"], ["a.out"], role="q")
    b.node("x", OpKind.SILU_MUL, ["a.out"], ["x.out"])
    b.node("b", OpKind.LINEAR, ["x.out"], ["b.out"], role="k")
    b.output("b.out")
    return b.build()


def test_a_sibling_chain_with_an_outside_node_between_members_is_refused():
    c = sibling_circuit()
    pair = rule("pair", [{"op": "linear", "role": "q", "keep": True},
                         {"op": "linear", "role": "k", "sibling": True}], priority=5)
    p = plan(c, pair, *singles())
    assert groups_by_rule(c, p) == [("single.linear", ["blk.a"]), ("single.silu_mul", ["blk.x"]),
                                    ("single.linear", ["blk.b"])]


def test_qkv_siblings_fuse_when_nothing_lies_between():
    c = dense(1)
    qkv = rule("qkv", [{"op": "linear", "role": "q", "keep": True},
                       {"op": "linear", "role": "k", "keep": True, "sibling": True},
                       {"op": "linear", "role": "v", "sibling": True}], priority=5)
    p = plan(c, qkv, *singles())
    assert ("qkv", ["l0.attn.q", "l0.attn.k", "l0.attn.v"]) in groups_by_rule(c, p)


def test_a_member_output_leaving_the_group_needs_keep():
    c = dense(1)
    qkv_no_keep = rule("qkv", [{"op": "linear", "role": "q"},
                               {"op": "linear", "role": "k", "sibling": True}], priority=5)
    assert rule_of(c, plan(c, qkv_no_keep, *singles()), "l0.attn.q") == "single.linear"


def test_writes_against_a_readers_input_is_a_format_conflict():
    c = dense(1)
    f32_norm = rule("norm_f32", [{"op": "rms_norm", "writes": "f32"}], priority=5)
    bf16_linear = rule("linear_bf16", [{"op": "linear", "input": "bf16"}], priority=5)
    with pytest.raises(FormatConflict) as caught:
        plan(c, f32_norm, bf16_linear, *singles())
    e = caught.value
    assert (e.edge, e.stored, e.rule, e.expected) == ("l0.attn.attn_norm.out", "f32", "linear_bf16", "bf16")
    assert str(e) == ("edge `l0.attn.attn_norm.out` is stored as f32 but rule `linear_bf16` reads it as bf16")
    # Without the disagreeing reader the override is simply the stored format.
    p = plan(c, f32_norm, *singles())
    assert p.edge_formats[c.edge_index("l0.attn.attn_norm.out")] == F32


def test_a_quantized_input_fits_only_an_element_naming_that_format():
    b = CircuitBuilder()
    b.block("blk")
    b.node("quant", OpKind.ACT_QUANT, ["in"], ["q.out"], fmt=parse_format("fp8/token"))
    b.node("proj", OpKind.LINEAR, ["q.out"], ["p.out"], role="o")
    b.output("p.out")
    c = b.build()
    fp8 = rule("linear_fp8", [{"op": "linear", "input": "fp8/token"}])
    plain = rule("linear_plain", "linear", priority=9)
    p = plan(c, fp8, plain, *singles(["act_quant"]))
    assert rule_of(c, p, "blk.proj") == "linear_fp8"
    with pytest.raises(Uncovered) as caught:
        plan(c, plain, *singles(["act_quant"]))
    assert caught.value.node == "blk.proj"
    # And a quantized-input element does not fit a bf16-reading node.
    with pytest.raises(Uncovered):
        plan(dense(1), fp8, *singles([k.value for k in OpKind if k is not OpKind.LINEAR]))


def test_zero_rows_is_refused():
    with pytest.raises(ZeroRows, match="a plan needs at least one row"):
        plan(dense(1), *singles(), rows=0)


def test_a_circuit_without_draft_has_an_empty_draft_section():
    with pytest.raises(EmptySection) as caught:
        plan(dense(1), *singles(), mode=Mode.DRAFT)
    assert caught.value.section == "draft"
    assert str(caught.value) == "the circuit has no draft nodes"


def test_draft_mode_covers_only_the_draft_section():
    c = dense(2, draft=True)
    p = plan(c, *singles(), mode=Mode.DRAFT)
    assert all(c.section_of_node(n) is Section.DRAFT for g in p.groups for n in g.nodes)
    assert section_of(Mode.DRAFT) is Section.DRAFT and section_of(Mode.PREFILL) is Section.MAIN
    assert all(s is None for e, s in zip(c.edges, p.edge_states) if e.id.startswith("l1."))


def test_uncovered_names_node_op_mode_and_rows():
    with pytest.raises(Uncovered) as caught:
        plan(dense(1), *singles([k.value for k in OpKind if k is not OpKind.ROPE]), mode=Mode.VERIFY, rows=3)
    e = caught.value
    assert (e.node, e.op, e.mode, e.rows) == ("l0.attn.rope", "rope", "verify", 3)
    assert str(e) == "no applicable rule covers node `l0.attn.rope` (rope) in verify at 3 rows"


def test_fuse_refuses_verify_batch_and_fuse_table_plans_it():
    c = dense(1)
    with pytest.raises(RowTableMismatch, match="fuse_table"):
        plan(c, *singles(), mode=Mode.VERIFY_BATCH, rows=4)
    table = RowTable.parse("4x3 2x1!")
    p = plan(c, *singles(), table=table)
    assert (p.mode, p.rows, p.table) == (Mode.VERIFY_BATCH, 14, table)


@pytest.mark.parametrize(("repeat", "copies", "rows", "launches", "copy_count"), [
    ("once", None, 5, 2, 0),
    ("per_row", "once", 5, 10, 1),
    ("chunk2", "per_row", 5, 6, 5),
    ("per_row_but_last", "per_row_but_last", 5, 8, 4),
    ("per_row_but_last", None, 1, 0, 0),
])
def test_launch_counts_follow_repeat(repeat, copies, rows, launches, copy_count):
    c = dense(1)
    attn = rule("attn2", "paged_attention", priority=5, repeat=repeat, copies=copies,
                kernels=[{"module": "k", "func": "a"}, {"module": "k", "func": "b"}])
    p = plan(c, attn, *singles(), mode=Mode.VERIFY, rows=rows)
    g = next(g for g in p.groups if g.rule == "attn2")
    assert (g.launch_count(rows), g.copy_count(rows)) == (launches, copy_count)
    others = sum(h.launch_count(rows) for h in p.groups if h is not g)
    assert p.launches() == others + launches and p.copies() == copy_count


def test_per_run_launches_come_from_the_resolved_runs():
    c = dense(1)
    batched = rule("batched", "paged_attention", priority=5, repeat="per_run", kernels=[],
                   modes=["verify_batch"],
                   run=[{"k": [1, 8], "n": [2, 64], "contiguous": True,
                         "launches": [{"module": "fa", "func": "batched", "times": "once"},
                                      {"module": "fa", "func": "merge", "times": "per_seq"}]},
                        {"k": [1, 8], "n": [1, 64], "copies": "per_seq_row_but_last",
                         "launches": [{"module": "fa", "func": "single", "times": "per_seq"}]}])
    p = plan(c, batched, *singles(), table=RowTable.parse("4x3 2x2! 3x1!"))
    g = next(g for g in p.groups if g.rule == "batched")
    assert [r.launch_count() for r in g.runs] == [1 + 3, 2, 1]
    assert g.launch_count(p.rows) == 7
    assert g.copy_count(p.rows) == 0 + 2 + 2
    # A table with a run no selector serves: the rule does not apply.
    q = plan(c, batched, *singles(), table=RowTable.parse("9x2"))
    assert rule_of(c, q, "l0.attn.attn") == "single.paged_attention"


def test_a_kv_write_precedes_later_readers_of_its_inputs():
    c = dense(1)
    # Rope in its own group, attention and kv_write single: attention reads k_rot, as does
    # kv_write; the cache write must come first.
    p = plan(c, *singles())
    order = [c.nodes[g.nodes[0]].local for g in p.groups]
    assert order.index("kv_write") < order.index("attn")


def test_groups_are_ordered_by_lowest_member_then_group_id():
    c = dense(1)
    p = plan(c, rule("add_norm", ADD_NORM, priority=5), *singles())
    firsts = [min(g.nodes) for g in p.groups]
    assert firsts == sorted(firsts)


def cycle_circuit():
    """a1 -> b2 and b1 -> a2 in one block: groups {a1, a2} and {b1, b2} each pass the chain
    check but need each other first."""
    b = CircuitBuilder()
    b.block("blk")
    b.node("a1", OpKind.LINEAR, ["in"], ["a1.out"], role="q")
    b.node("b1", OpKind.LINEAR, ["in"], ["b1.out"], role="k")
    b.node("a2", OpKind.LINEAR, ["b1.out"], ["a2.out"], role="v")
    b.node("b2", OpKind.LINEAR, ["a1.out"], ["b2.out"], role="o")
    b.output("a2.out", "b2.out")
    return b.build()


def test_groups_without_an_execution_order_are_a_cycle():
    c = cycle_circuit()
    ga = rule("ga", [{"op": "linear", "role": "q", "keep": True}, {"op": "linear", "role": "v", "sibling": True}])
    gb = rule("gb", [{"op": "linear", "role": "k", "keep": True}, {"op": "linear", "role": "o", "sibling": True}])
    with pytest.raises(Cycle) as caught:
        plan(c, ga, gb)
    assert caught.value.n == 2
    assert str(caught.value) == "the 2 groups formed do not have an execution order"


def test_edge_states_fused_materialized_and_stored():
    c = dense(1)
    silu_down = rule("silu_down", [{"op": "silu_mul"}, {"op": "linear", "role": "down"}], priority=5)
    p = plan(c, silu_down, *singles())
    g = next(i for i, g in enumerate(p.groups) if g.rule == "silu_down")
    assert p.edge_states[c.edge_index("l0.mlp.act.out")] == EdgeState.fused(g)
    assert p.edge_states[c.edge_index("l0.mlp.down.out")] == EdgeState.MATERIALIZED
    assert p.edge_states[c.edge_index("head.logits")] == EdgeState.MATERIALIZED  # a declared output
    stored = rule("silu_down", [{"op": "silu_mul", "stored": True}, {"op": "linear", "role": "down"}], priority=5)
    q = plan(c, stored, *singles())
    assert q.edge_states[c.edge_index("l0.mlp.act.out")] == EdgeState.MATERIALIZED


def test_group_io_lists_outside_inputs_and_materialized_outputs():
    c = dense(1)
    silu_down = rule("silu_down", [{"op": "silu_mul"}, {"op": "linear", "role": "down"}], priority=5)
    p = plan(c, silu_down, *singles())
    g = next(i for i, g in enumerate(p.groups) if g.rule == "silu_down")
    ins, outs = group_io(c, p, g)
    assert [c.edges[e].id for e in ins] == ["l0.mlp.gate_up.out"]
    assert [c.edges[e].id for e in outs] == ["l0.mlp.down.out"]


def test_all_named_by_collects_every_kernel_and_capability():
    rules = make_rules(rule("a", "rms_norm", requires=["x"]),
                       rule("b", "paged_attention", repeat="per_run", kernels=[], modes=["verify_batch"],
                            run=[{"k": [1, 2], "n": [1, 2],
                                  "launches": [{"module": "m", "func": "f", "times": "once"}]}]))
    available = AvailableKernels.all_named_by(rules)
    assert available.kernels == {KernelId("k", "a"), KernelId("m", "f")}
    assert available.caps == {"x"}
