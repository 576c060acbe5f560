"""Property tests on generated circuits and rule sets: the cover invariant, determinism, and the
digest's independence from rule file order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.circuit.fuser import AvailableKernels, FuseError, Policy, fuse
from fuel.circuit.explain import explain
from fuel.circuit.ir import OpKind, Section
from fuel.circuit.rules import Mode
from tests.circuit.builders import CircuitBuilder, make_rules, rule, singles

OPS = [OpKind.RMS_NORM, OpKind.LINEAR, OpKind.SILU_MUL, OpKind.RESIDUAL_ADD, OpKind.ROPE, OpKind.KV_WRITE]


@st.composite
def circuits(draw):
    """Random DAGs in blocks: each node reads one or two earlier edges (or a circuit input);
    unread edges become declared outputs."""
    b = CircuitBuilder()
    produced: list[str] = []
    n_blocks = draw(st.integers(1, 4))
    count = 0
    for blk in range(n_blocks):
        b.block(f"b{blk}", layer=blk)
        for _ in range(draw(st.integers(1, 5))):
            kind = draw(st.sampled_from(OPS))
            if produced:
                ins = sorted(set(draw(st.lists(st.sampled_from(produced), min_size=1, max_size=2))))
            else:
                ins = ["input"]
            outs = [] if kind is OpKind.KV_WRITE else [f"e{count}"]
            b.node(f"n{count}", kind, ins, outs, role=draw(st.sampled_from(["q", "k"])) if kind is OpKind.LINEAR else None)
            produced.extend(outs)
            count += 1
    circuit = b.build()
    unread = [e.id for e in circuit.edges if e.producer is not None and not e.consumers]
    return b.output(*unread).build()


element = st.fixed_dictionaries(
    {"op": st.sampled_from([k.value for k in OPS])},
    optional={"keep": st.booleans(), "sibling": st.booleans(), "stored": st.booleans()})


@st.composite
def rule_sets(draw):
    fused = []
    for i in range(draw(st.integers(0, 6))):
        pattern = draw(st.lists(element, min_size=1, max_size=3))
        pattern[0] = {k: v for k, v in pattern[0].items() if k != "sibling"}
        for p in pattern:
            if p["op"] == "linear" and draw(st.booleans()):
                p["role"] = draw(st.sampled_from(["q", "k"]))
        fused.append(rule(f"r{i}", pattern, priority=draw(st.integers(-2, 3)),
                          rows=[1, draw(st.integers(1, 8))]))
    return fused + singles([k.value for k in OPS])


def fuse_all(circuit, rule_dicts, rows=1):
    rules = make_rules(*rule_dicts)
    return fuse(circuit, rules, AvailableKernels.all_named_by(rules), Policy(), Mode.MULTI_SEQ, rows)


@settings(max_examples=150, deadline=None)
@given(circuits(), rule_sets(), st.integers(1, 8))
def test_every_node_is_covered_exactly_once(circuit, rule_dicts, rows):
    try:
        p = fuse_all(circuit, rule_dicts, rows)
    except FuseError as error:  # only a cycle can stop a total rule set
        assert type(error).__name__ == "Cycle"
        return
    members = sorted(n for g in p.groups for n in g.nodes)
    assert members == [i for i in range(len(circuit.nodes)) if circuit.section_of_node(i) is Section.MAIN]
    # Every group's members appear in pattern order and a producer's group precedes readers'.
    owner = p.owner_of()
    for e in circuit.edges:
        if e.producer is not None:
            assert all(owner[e.producer] <= owner[c] for c in e.consumers)


@settings(max_examples=100, deadline=None)
@given(circuits(), rule_sets(), st.randoms(use_true_random=False))
def test_plan_is_deterministic_and_independent_of_rule_file_order(circuit, rule_dicts, rng):
    shuffled = list(rule_dicts)
    rng.shuffle(shuffled)
    try:
        first = fuse_all(circuit, rule_dicts)
    except FuseError as error:
        # Both orders must fail alike: the same kind of error with the same message.
        with pytest.raises(type(error)) as again_error:
            fuse_all(circuit, shuffled)
        assert str(again_error.value) == str(error)
        return
    again = fuse_all(circuit, shuffled)
    assert again.digest == first.digest and again.groups == first.groups


@settings(max_examples=60, deadline=None)
@given(circuits(), rule_sets())
def test_explanation_claims_match_the_plan(circuit, rule_dicts):
    rules = make_rules(*rule_dicts)
    available = AvailableKernels.all_named_by(rules)
    try:
        p = fuse(circuit, rules, available, Policy(), Mode.MULTI_SEQ, 1)
    except FuseError as error:  # only a cycle can stop a total rule set
        assert type(error).__name__ == "Cycle"
        return
    claimed = {e.node: e.claimed_by for e in explain(circuit, rules, available, Policy(), Mode.MULTI_SEQ, 1)}
    assert claimed == {circuit.nodes[n].id: g.rule for g in p.groups for n in g.nodes}
