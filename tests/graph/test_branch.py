"""Branch arms: the builder's five rules as typed errors, collapse, effective roots, lowering."""

import pytest

from fuel.graph import (
    Branch, DType, FusedOpParams, FusedOps, Graph, OpKind, arm_interiors, branch_fused_over_recipe,
    branches_in_topo_order, collapse_variant_branch, effective_roots, lower, open_branch,
)
from fuel.graph.branch import (
    ArmOutOfRange, ArmsOverlap, ArmTypeMismatch, EmptyArm, InteriorEscapes, MergeDoesNotReadArm0,
    NoArms, NotABranch, ReconvergeNotDescendant,
)

F32 = DType.F32


class Scene:
    """x -> diverge -> {arm0: exp, neg | arm1: tanh | arm2: sigmoid, abs} -> merge (* gain)."""

    def __init__(self):
        g = self.g = Graph()
        self.x = g.input("x", [2, 8], F32)
        self.gain = g.weight("gain", [8], F32)
        self.diverge = g.prim(OpKind.ADD_SCALAR, self.x, value=1.0)
        self.a0 = g.prim(OpKind.EXP, self.diverge)
        self.exit0 = g.prim(OpKind.NEG, self.a0)
        self.merge = g.prim(OpKind.MUL, self.exit0, self.gain)
        self.out = g.prim(OpKind.ADD_SCALAR, self.merge, value=0.5)
        self.exit1 = g.prim(OpKind.TANH, self.diverge)
        self.a2 = g.prim(OpKind.SIGMOID, self.diverge)
        self.exit2 = g.prim(OpKind.ABS, self.a2)

    def builder(self, *exits):
        builder = open_branch(self.g, self.diverge)
        for exit in exits:
            builder.add_arm(exit)
        return builder

    def branch(self):
        return self.builder(self.exit0, self.exit1, self.exit2).finalize(self.merge)


def test_finalize_pushes_a_branch_over_the_arm_exits():
    s = Scene()
    branch = s.branch()
    node = s.g.node(branch)
    assert node.op == Branch(s.merge, s.diverge)
    assert node.inputs == (s.exit0, s.exit1, s.exit2)
    assert arm_interiors(s.g, branch) == (frozenset({s.a0, s.exit0}), frozenset({s.exit1}),
                                          frozenset({s.a2, s.exit2}))


def test_rule_at_least_one_arm():
    s = Scene()
    with pytest.raises(NoArms):
        s.builder().finalize(s.merge)


def test_rule_one_arm_emits_no_branch():
    s = Scene()
    before = len(s.g)
    assert s.builder(s.exit0).finalize(s.merge) is None
    assert len(s.g) == before


def test_rule_reconverge_is_a_strict_descendant_of_diverge():
    s = Scene()
    with pytest.raises(ReconvergeNotDescendant) as error:
        s.builder(s.exit0).finalize(s.diverge)
    assert (error.value.diverge, error.value.reconverge_at) == (s.diverge, s.diverge)
    with pytest.raises(ReconvergeNotDescendant):
        s.builder(s.exit0).finalize(s.gain)


def test_rule_every_exit_has_arm0s_shape_and_dtype():
    s = Scene()
    reduced = s.g.prim(OpKind.SUM, s.diverge, dim=-1, keepdim=False)
    with pytest.raises(ArmTypeMismatch, match=r"arm 1 .* yields f32\[2\], arm 0 yields f32\[2, 8\]"):
        s.builder(s.exit0, reduced).finalize(s.merge)
    cast = s.g.prim(OpKind.CAST, s.diverge, dtype=DType.BF16)
    with pytest.raises(ArmTypeMismatch, match="bf16"):
        s.builder(s.exit0, cast).finalize(s.merge)


def test_rule_the_merge_reads_arm0s_exit():
    s = Scene()
    with pytest.raises(MergeDoesNotReadArm0) as error:
        s.builder(s.exit1, s.exit0).finalize(s.merge)
    assert error.value.arm0_exit == s.exit1


def test_rule_interiors_are_non_empty():
    s = Scene()
    with pytest.raises(EmptyArm) as error:
        s.builder(s.exit0, s.x).finalize(s.merge)  # x predates the fork: the arm has no body
    assert error.value.arm == 1


def test_rule_interiors_are_disjoint():
    s = Scene()
    borrowing = s.g.prim(OpKind.TANH, s.a0)  # arm 1 reuses arm 0's exp
    with pytest.raises(ArmsOverlap) as error:
        s.builder(s.exit0, borrowing).finalize(s.merge)
    assert error.value.shared == (s.a0,)


def test_rule_interiors_are_read_from_outside_only_by_the_merge():
    s = Scene()
    leak = s.g.prim(OpKind.SQRT, s.a0)
    with pytest.raises(InteriorEscapes) as error:
        s.builder(s.exit0, s.exit1).finalize(s.merge)
    assert (error.value.arm, error.value.node, error.value.reader) == (0, s.a0, leak)


def test_collapse_rewires_the_merge_and_leaves_an_inert_one_arm_branch():
    s = Scene()
    branch = s.branch()
    collapse_variant_branch(s.g, branch, 2)
    assert s.g.node(s.merge).inputs == (s.exit2, s.gain)
    assert s.g.node(branch).inputs == (s.exit2,)
    order = lower(s.g, [s.out]).order
    assert s.exit2 in order and s.a2 in order
    assert not {s.a0, s.exit0, s.exit1} & set(order), "losing arms are never lowered"


def test_collapse_refuses_a_non_branch_and_an_arm_out_of_range():
    s = Scene()
    branch = s.branch()
    with pytest.raises(NotABranch):
        collapse_variant_branch(s.g, s.merge, 0)
    with pytest.raises(ArmOutOfRange, match="3 arm"):
        collapse_variant_branch(s.g, branch, 3)


def test_lower_takes_arm0_by_default_and_the_routed_arm_without_mutating():
    s = Scene()
    branch = s.branch()
    default = lower(s.g, [s.out])
    assert default.order == (s.x, s.gain, s.diverge, s.a0, s.exit0, s.merge, s.out)
    routed = lower(s.g, [s.out], {branch: 1})
    assert routed.order == (s.x, s.gain, s.diverge, s.exit1, s.merge, s.out)
    assert routed.reads[s.merge] == (s.exit1, s.gain)
    assert s.g.node(s.merge).inputs == (s.exit0, s.gain), "routing is not collapsing"
    assert not {s.a0, s.exit0, s.a2, s.exit2} & set(routed.order)


def test_lowered_order_puts_every_input_first_even_after_rewiring_to_a_newer_node():
    s = Scene()
    collapse_variant_branch(s.g, s.branch(), 1)  # merge (id 5) now reads exit1 (id 7)
    order = lower(s.g, [s.out]).order
    assert order.index(s.exit1) < order.index(s.merge) < order.index(s.out)


def test_effective_roots_add_the_branches_the_roots_need():
    s = Scene()
    branch = s.branch()
    assert effective_roots(s.g, [s.out]) == (s.out, branch)
    assert effective_roots(s.g, [s.diverge]) == (s.diverge,)


def test_branches_are_ordered_by_where_they_reconverge():
    s = Scene()
    first = s.branch()
    g = s.g
    # A second branch downstream of the first merge, built after it.
    late0 = g.prim(OpKind.EXP, s.out)
    late_merge = g.prim(OpKind.NEG, late0)
    late1 = g.prim(OpKind.TANH, s.out)
    builder = open_branch(g, s.out)
    builder.add_arm(late0)
    builder.add_arm(late1)
    second = builder.finalize(late_merge)
    assert branches_in_topo_order(g, [late_merge]) == (first, second)


def test_fused_node_gets_its_recipe_as_arm0():
    g = Graph()
    x, gain = g.input("x", [2, 8], F32), g.weight("gain", [8], F32)
    fused = g.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6), x, gain)
    merge = g.prim(OpKind.ADD, fused, x)
    branch = branch_fused_over_recipe(g, fused, merge)
    exits = g.node(branch).inputs
    assert exits[1] == fused and g.node(merge).inputs[0] == exits[0]
    interiors = arm_interiors(g, branch)
    assert interiors[1] == frozenset({fused}) and len(interiors[0]) >= 5
