"""The JIT request a gap would make, described from the circuit (the carrier seam)."""

from __future__ import annotations

from fuel.circuit.format import parse
from fuel.report.jit import gap_request
from tests.report.builders import dense_circuit


def test_paged_attention_gap_requests_its_fused_op_with_inputs_then_output():
    c = dense_circuit(q_heads=4, kv_heads=2, head_dim=16)
    req = gap_request(c, c.node_index("l0.attn.attn"), 3, "cuda")
    assert (req["status"], req["fused_op"], req["backend"]) == ("request", "PAGED_ATTN", "cuda")
    assert [o["shape"] for o in req["operands"]] == [[3, 64], [3, 32], [3, 32], [3, 64]]
    assert [o["strides"] for o in req["operands"]] == [[64, 1], [32, 1], [32, 1], [64, 1]]
    assert {(o["dtype"], o["alignment"]) for o in req["operands"]} == {("bf16", 2)}


def test_an_op_with_no_recipe_declines():
    c = dense_circuit()
    req = gap_request(c, c.node_index("embed.embed"), 1, "cuda")
    assert req["status"] == "declined" and "no fused op with a recipe" in req["reason"]


def test_a_quantized_operand_declines_rather_than_being_approximated():
    c = dense_circuit(weight=parse("fp8/channel"))
    from dataclasses import replace

    i = c.edge_index("l0.attn.h")
    edges = list(c.edges)
    edges[i] = replace(edges[i], format=parse("fp8/token"))
    c = replace(c, edges=tuple(edges))
    req = gap_request(c, c.node_index("l0.attn.q"), 1, "cuda")
    assert req["status"] == "declined"
    assert "`l0.attn.h` is stored as fp8/token" in req["reason"]


def test_no_backend_declines():
    c = dense_circuit()
    req = gap_request(c, c.node_index("l0.attn.attn"), 1, None)
    assert req["status"] == "declined" and "no backend" in req["reason"]
