"""The renderer (§A9): header, summary, one line per group, members, kernels, counts."""

from __future__ import annotations

import json

from fuel.circuit.fuser import AvailableKernels, Policy, fuse, fuse_table
from fuel.circuit.render import plan_to_json, render_plan
from fuel.circuit.rules import Mode
from fuel.circuit.runs import RowTable
from tests.circuit.builders import dense, make_rules, rule, singles

ADD_NORM = rule("add_norm", [{"op": "residual_add", "keep": True}, {"op": "rms_norm"}], priority=5)


def render(*rule_dicts, mode=Mode.VERIFY, rows=3, table=None, policy=Policy(settings={"a": "1"})):
    c = dense(2)
    rules = make_rules(*rule_dicts)
    avail = AvailableKernels.all_named_by(rules)
    p = fuse_table(c, rules, avail, policy, table) if table else fuse(c, rules, avail, policy, mode, rows)
    return c, p, render_plan(c, p, policy, "test")


def test_header_and_summary_lines():
    c, p, text = render(ADD_NORM, *singles())
    lines = text.splitlines()
    assert lines[:5] == ["arch: dense_gqa  mode: verify  rows: 3", "policy: a=1", "levers: (none)",
                         "rules: test", f"digest: {p.digest}"]
    fused = sum(1 for s in p.edge_states if s is not None and s.is_fused)
    materialized = sum(1 for s in p.edge_states if s is not None and not s.is_fused)
    assert lines[5] == (f"groups: {len(p.groups)}  launches: {p.launches()}  copies: 0  "
                        f"edges: {fused} fused, {materialized} materialized")
    assert lines[6].startswith("arena: ")
    assert "[main] prologue" in lines and "[main] layer 1 full_attention" in lines
    assert "[main] epilogue" in lines


def test_group_lines_name_members_kernels_counts_and_rule():
    attn = rule("attn_rows", "paged_attention", priority=5, repeat="per_row", copies="per_row_but_last")
    host = rule("host_argmax", "argmax", priority=5, kernels=[])
    c, p, text = render(ADD_NORM, attn, host, *singles())
    assert " attn [attn_residual, l0.mlp.mlp_norm] k::add_norm reference rule=add_norm" in text
    assert "attn [attn] k::attn_rows x3 + copy x2 reference rule=attn_rows" in text
    assert "head [argmax] (host) reference rule=host_argmax" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("  g")]) == len(p.groups)


def test_per_run_groups_list_their_runs():
    batched = rule("batched", "paged_attention", priority=5, repeat="per_run", kernels=[], modes=["verify_batch"],
                   run=[{"k": [1, 8], "n": [1, 64],
                         "launches": [{"module": "fa", "func": "v", "times": "per_seq"}]}])
    _, _, text = render(batched, *singles(), table=RowTable.parse("4x3 2x1!"))
    assert "table: 4x3 2x1!" in text
    assert "[attn] per_run{4x3=fa::v*per_seq 2x1!=fa::v*per_seq} x4 reference rule=batched" in text


def test_json_carries_the_same_facts():
    c, p, _ = render(ADD_NORM, *singles())
    data = json.loads(json.dumps(plan_to_json(c, p, Policy(settings={"a": "1"}), "test")))
    assert data["digest"] == p.digest and data["summary"]["launches"] == p.launches()
    assert [g["rule"] for g in data["groups"]] == [g.rule for g in p.groups]
    first_add_norm = next(g for g in data["groups"] if g["rule"] == "add_norm")
    assert first_add_norm["nodes"] == ["l0.attn.attn_residual", "l0.mlp.mlp_norm"]
