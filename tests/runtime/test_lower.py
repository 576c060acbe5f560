"""Lowering a fusion plan to a tensor graph: the construction table is strict and complete for
the CPU rules fuel can run, groups become the fused nodes their kernels name, and the graph is a
pure function of its inputs. Shapes only (no real tensors): fast."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from fuel.circuit import AvailableKernels, Mode, RowTable, build_policy, fuse, fuse_table, load_builtin_rules, zoo
from fuel.circuit.ir import OpKind as CircuitOp
from fuel.circuit.runs import KernelId
from fuel.graph.ir import Fused
from fuel.graph.registry import FusedOps
from fuel.runtime.lower import (
    DerivedKind, Llama3RopeScaling,
    CONSTRUCTIONS, ConstructionMismatch, NoConstruction, StepShape, StepShapeError,
    UnsupportedParam, expected_weight_shapes, lower,
)

RULES = load_builtin_rules("cpu")
AVAILABLE = AvailableKernels.all_named_by(RULES)
POLICY = build_policy()

# Ops of the closed set the CPU runtime cannot run yet (quantization, GeGLU, soft-capping,
# layout-only host steps). cpu.toml names kernels for them; lowering refuses.
NOT_CONSTRUCTED = {"copy", "concat", "split", "act_quant", "gelu_tanh_mul", "logit_softcap",
                   # pipeline stages and sequence-parallel splits are planned, not run
                   "send", "recv", "reduce_scatter"}


@pytest.fixture(scope="module")
def smollm2():
    circuit = zoo.load("smollm2-135m")
    return circuit, expected_weight_shapes(circuit)


def plan_for(circuit, mode, rows):
    return fuse(circuit, RULES, AVAILABLE, POLICY, mode, rows)


def shape(runs, max_blocks=4):
    return StepShape(tuple(runs), block_size=16, num_blocks=32, max_blocks=max_blocks, positions=256)


def fused_census(step):
    return Counter(FusedOps(node.op.id).name for node in step.graph.nodes() if isinstance(node.op, Fused))


def test_every_cpu_rule_kernel_is_constructed_or_named_as_refused():
    funcs = {k.func for rule in RULES for k in rule.kernels}
    assert funcs - set(CONSTRUCTIONS) == NOT_CONSTRUCTED
    assert set(CONSTRUCTIONS) <= funcs  # no construction for a kernel no rule names


def test_decode_groups_become_the_fused_nodes_their_kernels_name(smollm2):
    circuit, weights = smollm2
    step = lower(plan_for(circuit, Mode.DECODE, 1), circuit, weights, shape([(1, 1)]))
    census = fused_census(step)
    # 30 layers: qkv, o, gate_up and down projections, plus the tied LM head.
    assert census["FUSED_LINEAR"] == 30 * 4 + 1
    assert census["PAGED_ATTN"] == 30
    assert census["ROPE"] == 30  # q and k of a layer together (adjacent columns of the qkv output)
    assert census["SILU_MUL"] == 30
    # Every residual add but the last fuses the next norm; the final norm stays alone.
    assert census["RESIDUAL_ADD_RMS_NORM"] == 59
    assert census["RMS_NORM"] == 2  # layer 0's input norm and the final norm
    assert len(step.caches) == 30
    assert step.graph.node(step.tokens).shape.dims == (1, 1)
    assert step.graph.node(step.logits).shape.dims == (1, 49152)


def test_qkv_projection_binds_one_concatenated_weight_per_layer(smollm2):
    circuit, weights = smollm2
    step = lower(plan_for(circuit, Mode.DECODE, 1), circuit, weights, shape([(1, 1)]))
    concats = [d for d in step.derived if d.kind.value == "concat"]
    assert len(concats) == 60  # qkv and gate_up per layer
    qkv = next(d for d in concats if d.sources[0] == "model.layers.3.self_attn.q_proj.weight")
    assert qkv.sources == tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv")


def test_verify_batch_lowers_one_paged_attention_per_run(smollm2):
    circuit, weights = smollm2
    table = RowTable.parse("3x2 2x1!")
    plan = fuse_table(circuit, RULES, AVAILABLE, POLICY, table)
    step = lower(plan, circuit, weights, shape([(3, 2), (2, 1)]))
    assert fused_census(step)["PAGED_ATTN"] == 2 * 30
    assert {"block_table.r0", "block_table.r1", "context_lens.r0", "context_lens.r1"} <= set(step.inputs)


def test_draft_section_reads_its_own_cache(smollm2):
    circuit, weights = smollm2
    step = lower(plan_for(circuit, Mode.DRAFT, 1), circuit, weights, shape([(1, 1)]))
    assert [c.key for c in step.caches] == ["draft.attn"]
    assert "model.layers.0.self_attn.o_proj.weight" in step.weights


def test_kernel_without_construction_names_rule_and_kernel(smollm2):
    circuit, weights = smollm2
    plan = plan_for(circuit, Mode.DECODE, 1)
    bad = replace(plan.groups[0], kernels=(KernelId("fuel.kernels.cpu", "logit_softcap"),))
    with pytest.raises(NoConstruction) as error:
        lower(replace(plan, groups=(bad, *plan.groups[1:])), circuit, weights, shape([(1, 1)]))
    assert error.value.rule == "cpu.embed"
    assert "fuel.kernels.cpu::logit_softcap" in str(error.value)


def test_kernel_of_another_module_is_refused(smollm2):
    circuit, weights = smollm2
    plan = plan_for(circuit, Mode.DECODE, 1)
    bad = replace(plan.groups[0], kernels=(KernelId("fuel.kernels.cuda", "embed"),))
    with pytest.raises(NoConstruction, match="fuel.kernels.cuda::embed"):
        lower(replace(plan, groups=(bad, *plan.groups[1:])), circuit, weights, shape([(1, 1)]))


def test_group_members_must_be_the_construction_ops(smollm2):
    circuit, weights = smollm2
    plan = plan_for(circuit, Mode.DECODE, 1)
    bad = replace(plan.groups[1], kernels=(KernelId("fuel.kernels.cpu", "rope"),))
    with pytest.raises(ConstructionMismatch, match=r"expects \[rope\]"):
        lower(replace(plan, groups=(plan.groups[0], bad, *plan.groups[2:])), circuit, weights,
              shape([(1, 1)]))


def test_llama31_rope_scaling_lowers_to_scaled_tables_shared_by_every_layer():
    # The zoo's Llama-3.1-8B config: rope_scaling factor 8, low 1, high 4, original 8192.
    circuit = zoo.load("llama-3.1-8b")
    step = lower(plan_for(circuit, Mode.DECODE, 1), circuit, expected_weight_shapes(circuit),
                 shape([(1, 1)]))
    ropes = [spec for spec in step.derived if spec.kind in (DerivedKind.ROPE_COS, DerivedKind.ROPE_SIN)]
    assert len(ropes) == 2
    assert all(spec.scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192.0) for spec in ropes)
    assert all("llama3=8/1/4/8192" in spec.name for spec in ropes)


def _with_rope_params(circuit, **params):
    nodes = tuple(
        replace(node, params=tuple(sorted({**dict(node.params), **params}.items())))
        if node.op.kind is CircuitOp.ROPE else node for node in circuit.nodes)
    return replace(circuit, nodes=nodes)


def test_an_unimplemented_rope_type_is_refused_by_name():
    circuit = _with_rope_params(zoo.load("llama-3.1-8b"), rope_type="yarn")
    with pytest.raises(UnsupportedParam) as error:
        lower(plan_for(circuit, Mode.DECODE, 1), circuit, expected_weight_shapes(circuit), shape([(1, 1)]))
    assert error.value.node == "l0.attn.rope" and error.value.key == "rope_type"
    assert "yarn" in error.value.value


def test_a_llama3_scaling_missing_a_key_is_refused_naming_it():
    circuit = _with_rope_params(zoo.load("llama-3.1-8b"),
                                rope_scaling="factor=8,high_freq_factor=4,low_freq_factor=1")
    with pytest.raises(UnsupportedParam, match="missing original_max_position_embeddings"):
        lower(plan_for(circuit, Mode.DECODE, 1), circuit, expected_weight_shapes(circuit), shape([(1, 1)]))


def test_step_shape_must_match_plan_rows(smollm2):
    circuit, weights = smollm2
    with pytest.raises(StepShapeError, match="4 rows, the step 2"):
        lower(plan_for(circuit, Mode.MULTI_SEQ, 4), circuit, weights, shape([(1, 2)]))


def test_lowering_is_deterministic(smollm2):
    circuit, weights = smollm2
    plan = plan_for(circuit, Mode.VERIFY, 3)
    first = lower(plan, circuit, weights, shape([(3, 1)]))
    second = lower(plan, circuit, weights, shape([(3, 1)]))
    assert first.graph.nodes() == second.graph.nodes()
    assert first.inputs == second.inputs


def test_expected_weight_shapes_follow_the_circuit(smollm2):
    _, weights = smollm2
    assert weights["model.embed_tokens.weight"] == (49152, 576)
    assert weights["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert weights["model.layers.29.mlp.gate_proj.weight"] == (1536, 576)
    assert weights["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert weights["model.norm.weight"] == (576,)
    assert len(weights) == 1 + 30 * 9 + 1  # embed (= tied head), 9 per layer, final norm


def test_rope_output_feeds_the_cache_write_and_attention_per_head_without_a_reshape_round_trip(smollm2):
    # Flattening rope's [rows, heads, D] output and reshaping it back for the cache write and
    # attention would be two dispatched reshapes per layer for nothing; and q and k, adjacent
    # columns of the qkv projection, are rotated by one rope node.
    from fuel.graph.branch import lower as dispatch_order
    from fuel.graph.ir import Prim
    from fuel.graph.ops import OpKind

    circuit, weights = smollm2
    step = lower(plan_for(circuit, Mode.VERIFY, 4), circuit, weights, shape([(4, 1)]))
    g = step.graph
    writes = [n for n in g if isinstance(g.node(n).op, Prim) and g.node(n).op.kind is OpKind.KV_CACHE_WRITE]
    k_rows = [g.node(g.node(n).inputs[1]) for n in writes[0::2]]
    assert len(k_rows) == 30
    assert all(node.op.kind is OpKind.SLICE and node.shape.dims == (4, 3, 64) for node in k_rows)
    ropes = [g.node(node.inputs[0]) for node in k_rows]
    assert all(isinstance(r.op, Fused) and r.op.id == FusedOps.ROPE and r.shape.dims == (4, 9 + 3, 64)
               for r in ropes)
    order = dispatch_order(g, step.roots).order
    reshapes = sum(1 for n in order if isinstance(g.node(n).op, Prim) and g.node(n).op.kind is OpKind.RESHAPE)
    # Per layer: q and k together into heads for rope, v into heads for the cache, q to
    # [n, k, H, D] for attention, attention's output back to rows.
    assert reshapes == 30 * 4
