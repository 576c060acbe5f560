"""Instantiation (SPEC §A3): order, ids, stream threading, every listed error, and the
invariants the fuser relies on."""

import pytest

from fuel.circuit import zoo
from fuel.circuit.instantiate import (
    DanglingInput,
    DuplicateId,
    InstantiateError,
    LayoutMismatch,
    MissingDim,
    MissingParam,
    UnreadEdge,
    instantiate,
)
from fuel.circuit.ir import ArchShape, Circuit, LayerKind, Section
from fuel.circuit.template import load_circuit

FULL = LayerKind.FULL_ATTENTION


def tiny_shape(layers=2, dims=None, params=None, kinds=None):
    return ArchShape("tiny", "tiny", layers, kinds if kinds is not None else (FULL,) * layers,
                     dims if dims is not None else {"hidden": 8, "vocab": 16},
                     params if params is not None else {"eps": "1e-5"})


def check_invariants(circuit: Circuit) -> None:
    """What ir.py promises the fuser."""
    ids = [n.id for n in circuit.nodes]
    assert len(set(ids)) == len(ids)
    assert len({e.id for e in circuit.edges}) == len(circuit.edges)
    for i, node in enumerate(circuit.nodes):
        block = circuit.blocks[node.block]
        assert block.first <= i < block.end
        assert node.layer == block.layer and node.layer_kind == block.layer_kind
        for e in node.inputs:
            assert circuit.edges[e].producer is not None and circuit.edges[e].producer < i
            assert i in circuit.edges[e].consumers
        for e in node.outputs:
            assert circuit.edges[e].producer == i
    ends = [b.first for b in circuit.blocks[1:]] + [len(circuit.nodes)]
    assert [b.end for b in circuit.blocks] == ends and circuit.blocks[0].first == 0
    for edge in circuit.edges:
        assert list(edge.consumers) == sorted(set(edge.consumers))
        assert edge.consumers or edge.is_output


def test_tiny_circuit_ids_order_and_stream(tiny_circuit):
    circuit = instantiate(load_circuit(tiny_circuit()), tiny_shape())
    check_invariants(circuit)
    assert [n.id for n in circuit.nodes] == [
        "embed.embed", "l0.mix.norm", "l0.mix.proj", "l0.mix.residual", "l1.mix.norm",
        "l1.mix.proj", "l1.mix.residual", "head.lm_head", "draft.embed.embed", "draft.mix.norm",
        "draft.mix.proj", "draft.mix.residual", "draft.head.lm_head"]
    # Layer 0's output edge is layer 1's input edge.
    out0 = circuit.edge_index("l0.mix.out")
    assert circuit.nodes[circuit.node_index("l1.mix.norm")].inputs == (out0,)
    assert [b.section for b in circuit.blocks].count(Section.DRAFT) == 3
    norm = circuit.nodes[circuit.node_index("l1.mix.norm")]
    assert norm.bindings == ("layers.1.norm.weight",) and norm.param("eps") == "1e-5"
    assert circuit.nodes[circuit.node_index("draft.mix.proj")].bindings == ("layers.0.proj.weight",)
    assert circuit.edges[circuit.edge_index("head.logits")].dim_value == 16


def test_draft_false_leaves_out_the_draft_section(tiny_circuit):
    circuit = instantiate(load_circuit(tiny_circuit()), tiny_shape(), draft=False)
    assert all(b.section is Section.MAIN for b in circuit.blocks) and len(circuit.nodes) == 8


def error_of(path, shape, kind=InstantiateError):
    with pytest.raises(kind) as caught:
        instantiate(load_circuit(path), shape)
    # The file is the circuit or the library the offending block came from.
    assert caught.value.file in (str(path), str(path.parent / "tiny_lib.toml"))
    assert caught.value.file in str(caught.value) and f"`{caught.value.key}`" in str(caught.value)
    return caught.value


def test_an_input_with_no_earlier_producer(tiny_circuit):
    path = tiny_circuit('in = ["x", "p"]', 'in = ["x", "q"]')
    error = error_of(path, tiny_shape(), DanglingInput)
    assert error.key == "block.mix.node[2].in" and "`l0.mix.residual` reads `q`" in str(error)


def test_a_stream_in_with_no_stream_before_it(tiny_circuit):
    path = tiny_circuit('prologue = ["embed"]', "prologue = []")
    error = error_of(path, tiny_shape(), DanglingInput)
    assert error.key == "block.mix.stream_in"


def test_an_output_nobody_reads_that_is_not_declared(tiny_circuit):
    path = tiny_circuit('binding = ["{L}.proj.weight"]',
                        'binding = ["{L}.proj.weight"]\n\n[[block.mix.node]]\nid = "spare"\n'
                        'op = "copy"\nin = ["h"]\nout = [{ edge = "s", format = "bf16", '
                        'shape = "n x hidden" }]')
    error = error_of(path, tiny_shape(), UnreadEdge)
    assert error.key == "block.mix.node[2].out[0].edge" and "`l0.mix.s`" in str(error)


def test_an_undeclared_output_of_the_head_is_refused(tiny_circuit):
    path = tiny_circuit(lib=('outputs = ["logits"]', "outputs = []"))
    error = error_of(path, tiny_shape(), UnreadEdge)
    assert error.edge == "head.logits" and error.file.endswith("tiny.toml")


def test_duplicate_ids(tiny_circuit):
    path = tiny_circuit('full_attention = ["mix"]', 'full_attention = ["mix", "mix"]')
    error = error_of(path, tiny_shape(), DuplicateId)
    assert error.id == "l0.mix.norm" and error.key == "block.mix.node[0].id"


def test_a_dim_without_a_value(tiny_circuit):
    error = error_of(tiny_circuit(), tiny_shape(dims={"hidden": 8}), MissingDim)
    assert error.dim == "vocab" and error.key.endswith(".out[0].shape")
    assert "tiny_lib.toml" in error.file


def test_a_dim_that_overflows(tiny_circuit):
    path = tiny_circuit('edge = "p", format = "bf16", shape = "n x hidden"',
                        'edge = "p", format = "bf16", shape = "n x hidden*hidden*hidden"')
    error = error_of(path, tiny_shape(dims={"hidden": 2**30, "vocab": 16}), MissingDim)
    assert error.key == "block.mix.node[1].out[0].shape" and "overflows" in str(error)


def test_a_param_placeholder_without_a_value(tiny_circuit):
    error = error_of(tiny_circuit(), tiny_shape(params={}), MissingParam)
    assert error.param == "eps" and error.key == "block.mix.node[0].params.eps"


def test_a_list_layout_needs_one_kind_per_layer(tiny_circuit):
    path = tiny_circuit('kind = "interval"\nperiod = 1', 'kind = "list"')
    error = error_of(path, tiny_shape(kinds=(FULL,)), LayoutMismatch)
    assert error.key == "layout.kind"


def test_a_layer_kind_the_layout_does_not_map(tiny_circuit):
    path = tiny_circuit('kind = "interval"\nperiod = 1', 'kind = "list"')
    error = error_of(path, tiny_shape(kinds=(FULL, LayerKind.MOE)), LayoutMismatch)
    assert error.key == "layout.blocks.moe"


def test_interval_layout_alternates_kinds(tiny_circuit):
    path = tiny_circuit("period = 1", 'period = 2\nother = "sliding_attention"')
    path.write_text(path.read_text().replace('full_attention = ["mix"]',
                                             'full_attention = ["mix"]\nsliding_attention = ["mix"]'))
    circuit = instantiate(load_circuit(path), tiny_shape(layers=4, kinds=()))
    kinds = [b.layer_kind for b in circuit.blocks if b.layer is not None]
    assert kinds == [LayerKind.SLIDING_ATTENTION, FULL, LayerKind.SLIDING_ATTENTION, FULL]


def test_a_shape_of_another_arch_is_refused(tiny_circuit):
    shape = tiny_shape()
    other = ArchShape("dense_gqa", "llama", 2, shape.layer_kinds, shape.dims, shape.params)
    assert error_of(tiny_circuit(), other).key == "arch"


def test_a_variant_without_its_param_names_the_slot(tiny_circuit):
    path = tiny_circuit('full_attention = ["mix"]', 'full_attention = ["slot"]')
    path.write_text(path.read_text() + '\n[variant.slot]\nparam = "which"\ncases = { a = "mix" }\n')
    error = error_of(path, tiny_shape(), MissingParam)
    assert error.key == "variant.slot.param" and error.param == "which"
    error = error_of(path, tiny_shape(params={"eps": "1", "which": "b"}), MissingParam)
    assert error.key == "variant.slot.cases"
    circuit = instantiate(load_circuit(path), tiny_shape(params={"eps": "1", "which": "a"}))
    assert circuit.nodes[1].id == "l0.slot.norm"


# Node and edge counts of real models (draft included). dense_gqa: embed 1 node / 1 edge,
# per layer attn 9/9 and mlp 5/5, head 3/3; the draft repeats embed + one layer + head.
@pytest.mark.parametrize("name,nodes,edges", [
    ("llama-3.1-8b", 1 + 32 * 14 + 3 + 18, 1 + 32 * 14 + 3 + 18),
    ("smollm2-135m", 1 + 30 * 14 + 3 + 18, 1 + 30 * 14 + 3 + 18),
    # qk_norm attention: 11 nodes / 11 edges.
    ("qwen3-8b", 1 + 36 * 16 + 3 + 20, 1 + 36 * 16 + 3 + 20),
    # Mixtral: attn 9/9, moe 8 nodes / 9 edges (top_k writes weights and ids).
    ("mixtral-8x7b", 1 + 32 * 17 + 3 + 21, 1 + 32 * 18 + 3 + 22),
    # Qwen3-MoE: attn 11/11, moe 8/9.
    ("qwen3-30b-a3b", 1 + 48 * 19 + 3 + 23, 1 + 48 * 20 + 3 + 24),
    # Qwen1.5-MoE: attn with bias 9/9, moe with the shared expert 12 nodes / 13 edges.
    ("qwen1.5-moe-a2.7b-chat", 1 + 24 * 21 + 3 + 25, 1 + 24 * 22 + 3 + 26),
])
def test_zoo_node_and_edge_counts(name, nodes, edges):
    circuit = zoo.load(name)
    assert (len(circuit.nodes), len(circuit.edges)) == (nodes, edges)
    check_invariants(circuit)


def test_tied_embeddings_bind_the_lm_head_to_the_embedding():
    tied = zoo.load("smollm2-135m")
    untied = zoo.load("llama-3.1-8b")
    assert tied.nodes[tied.node_index("head.lm_head")].bindings == ("model.embed_tokens.weight",)
    assert untied.nodes[untied.node_index("head.lm_head")].bindings == ("lm_head.weight",)


def test_qwen2_binds_qkv_biases_and_qwen3_has_qk_norm():
    qwen2 = zoo.load("qwen2.5-7b")
    assert qwen2.nodes[qwen2.node_index("l3.attn.k")].bindings == (
        "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.k_proj.bias")
    qwen3 = zoo.load("qwen3-8b")
    rope = qwen3.nodes[qwen3.node_index("l0.attn.rope")]
    assert [qwen3.edges[e].id for e in rope.inputs] == ["l0.attn.q_normed", "l0.attn.k_normed"]


def test_attention_orders_the_cache_write_before_attention_and_carries_runtime_params():
    circuit = zoo.load("llama-3.1-8b")
    write, attn = circuit.node_index("l0.attn.kv_write"), circuit.node_index("l0.attn.attn")
    assert write < attn and circuit.nodes[write].outputs == ()
    rope = circuit.nodes[circuit.node_index("l0.attn.rope")]
    assert dict(rope.params) == {
        "head_dim": "128", "kv_heads": "8", "q_heads": "32", "rope_type": "llama3",
        "rope_scaling": "factor=8.0,high_freq_factor=4.0,low_freq_factor=1.0,"
                        "original_max_position_embeddings=8192", "theta": "500000.0"}
    assert circuit.nodes[attn].param("softmax_scale") == repr(1 / 128 ** 0.5)
    assert circuit.edges[circuit.edge_index("head.tokens")].is_output


def test_draft_section_is_an_early_exit_over_layer_zero():
    circuit = zoo.load("llama-3.1-8b")
    draft = [n for i, n in enumerate(circuit.nodes) if circuit.section_of_node(i) is Section.DRAFT]
    assert draft[0].id == "draft.embed.embed" and draft[-1].id == "draft.head.argmax"
    q = circuit.nodes[circuit.node_index("draft.attn.q")]
    assert q.bindings == ("model.layers.0.self_attn.q_proj.weight",) and q.layer is None
    assert all(n.layer_kind is None for n in draft)


def test_moe_shared_expert_is_blended():
    from fuel.circuit.config_map import shape_from_config

    config = {**zoo.config("qwen3-30b-a3b"), "model_type": "qwen2_moe",
              "shared_expert_intermediate_size": 5632, "norm_topk_prob": False}
    for key in ("attention_bias", "head_dim"):
        config.pop(key)
    circuit = zoo.circuit_for(shape_from_config(config))
    blend = circuit.nodes[circuit.node_index("l0.moe.blend")]
    assert [circuit.edges[e].id for e in blend.inputs] == [
        "l0.moe.experts_out", "l0.moe.topk_weights", "l0.moe.shared_out", "l0.moe.shared_gate_out"]
    assert circuit.nodes[circuit.node_index("l0.moe.shared_gate")].op.name() == "linear:shared_gate"
    check_invariants(circuit)
