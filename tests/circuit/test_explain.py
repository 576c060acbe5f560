"""The explainer: per node, every rule tried and why it did not claim the node."""

from __future__ import annotations

from fuel.circuit.explain import Claimed, explain, render_explanation
from fuel.circuit.fuser import AvailableKernels, NotApplicable, Policy
from fuel.circuit.fuser_match import ChainMiss, RefusalReason
from fuel.circuit.rules import Mode
from tests.circuit.builders import dense, make_rules, rule, singles


def explained(*rule_dicts, policy=Policy()):
    c = dense(2)
    rules = make_rules(*rule_dicts)
    return {e.node: e for e in explain(c, rules, AvailableKernels.all_named_by(rules), policy, Mode.DECODE, 1)}


def outcome(explanation, rule_id):
    return next(a.outcome for a in explanation.attempts if a.rule == rule_id)


def test_each_reason_is_a_typed_value():
    no_keep = rule("no_keep", [{"op": "residual_add"}, {"op": "rms_norm"}], priority=9)
    lever = rule("lever", "rms_norm", numerics="differs", lever="x", priority=8)
    wrong_local = rule("wrong_local", [{"op": "rms_norm", "local": "mlp_norm"}], priority=7)
    broke = rule("broke", [{"op": "rms_norm"}, {"op": "silu_mul"}], priority=6)
    e = explained(no_keep, lever, wrong_local, broke, *singles())
    attn_norm = e["l1.attn.attn_norm"]
    assert outcome(attn_norm, "lever") == NotApplicable("lever", "`differs` rule needs lever `x` opted in")
    assert outcome(attn_norm, "wrong_local") == ChainMiss(0, "local")
    assert outcome(attn_norm, "broke") == ChainMiss(1)
    assert attn_norm.claimed_by == "single.rms_norm"
    assert outcome(e["l0.mlp.mlp_residual"], "no_keep") == ChainMiss(0, refusal=RefusalReason.KEEP)
    claim = outcome(e["l0.attn.k"], "single.linear")
    assert claim == Claimed("l0.attn.k", 0, ("l0.attn.k",))


def test_rendered_explanation_names_rule_and_reason():
    e = explained(rule("broke", [{"op": "rms_norm"}, {"op": "silu_mul"}], priority=6), *singles())
    text = render_explanation(list(e.values()))
    assert "l0.attn.attn_norm (rms_norm) -> single.rms_norm" in text
    assert "  broke: chain broke at element 1: no free node fits among the candidates" in text
