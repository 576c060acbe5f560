"""fuel explain: the decision record of a zoo model's optimized step, and one-line errors."""

from __future__ import annotations

import pytest

from fuel.cli.app import main
from tests.schemas import validate


def test_explain_decode_step_shows_lowerings_and_jit_requests(capsys):
    assert main(["explain", "smollm2-135m", "--spec", "h100-sxm", "--no-judge"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fuel explain smollm2-135m  mode=decode rows=1 device=cpu spec=h100-sxm")
    # SmolLM2-135M has 30 layers: one paged attention per layer, lowered (no CPU kernel).
    assert "paged_attn               x30   no cpu kernel: lowered to its recipe" in out
    assert "jit requests 89" in out
    assert "decisions: none (no branch in the graph)" in out


def test_explain_renders_a_baked_flash_decision():
    from fuel.graph import DType, FusedOpParams, FusedOps, Graph, OpKind
    from fuel.kernels import cpu_table
    from fuel.optimize import OptimizeOptions, optimize_graph
    from fuel.optimize.render import render_explanation

    from tests.optimize.builders import SPEC

    graph = Graph()
    q = graph.input("q", [1, 4, 1, 16], DType.F32)
    k = graph.input("k", [1, 2, 64, 16], DType.F32)
    v = graph.input("v", [1, 2, 64, 16], DType.F32)
    attn = graph.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25), q, k, v)
    out = graph.prim(OpKind.NEG, attn)
    optimized = optimize_graph(graph, [out], OptimizeOptions(device_spec=SPEC, table=cpu_table()))
    text = render_explanation(optimized, graph)
    (decision,) = optimized.decisions
    assert f"branch %{decision.branch} [variant] baked to arm 1 (cheaper, saves" in text
    assert f"{decision.arms[1].cost_ns:,} ns layer1" in text and "<- winner" in text


@pytest.mark.parametrize("argv, message", [
    (["explain", "smollm2-135m", "--mode", "nope"], "--mode"),
    (["explain", "smollm2-135m", "--device", "tpu"], "--device"),
    (["explain", "smollm2-135m", "--device", "cuda"], "--spec"),
    (["explain", "smollm2-135m", "--dtype", "f64"], "--dtype"),
])
def test_explain_refuses_bad_options_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_explain_jit_shows_the_adopted_branches_of_the_real_decode_step(capsys,
                                                                        cache_sharing_kernels):
    # Why: after adoption the lowered step carries one branch per unrunnable fused node; with no
    # Judge cell for the adopted arm it is unpriceable and the oracle (arm 0) stands.
    assert main(["explain", "smollm2-135m", "--jit", "--no-judge", "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "jit: paged_attn x30 -> f32[1, 9, 1, 64]: adopted" in out
    assert "jit: residual_add_rms_norm x59 -> f32[2, 1, 576]: adopted" in out
    assert "branches 89, baked 0" in out
    assert out.count("fused:runtime#0x8000") == 30 and out.count("fused:runtime#0x8001") == 59
    assert "baked to arm 0 (unknown cost)" in out


def _explain_json(capsys, *args):
    import json

    assert main(["explain", "smollm2-135m", "--spec", "h100-sxm", "--no-judge", "--json",
                 *args]) == 0
    document = json.loads(capsys.readouterr().out)
    validate(document, "explain")
    return document


def test_explain_json_is_the_decision_record_and_validates(capsys):
    document = _explain_json(capsys)
    assert document["step"]["mode"] == "decode" and document["step"]["rows"] == 1
    lowered = {row["op"]: row["count"] for row in document["lowered"]}
    assert lowered == {"paged_attn": 30, "residual_add_rms_norm": 59}
    assert document["graph"]["jit_requests"] == 89 and document["decisions"] == []


@pytest.mark.parametrize(("args", "mode", "rows", "table"), [
    (["--mode", "prefill", "--rows", "16"], "prefill", 16, None),
    (["--mode", "verify_batch", "--table", "3x2"], "verify_batch", 6, "3x2"),
])
def test_explain_covers_prefill_and_verify_batch_steps(capsys, args, mode, rows, table):
    # Why: the engine runs prefill chunks and batched verifies; their decisions were not
    # explainable.
    document = _explain_json(capsys, *args)
    assert (document["step"]["mode"], document["step"]["rows"], document["step"]["table"]) == \
        (mode, rows, table)
    assert {row["op"] for row in document["lowered"]} == {"paged_attn", "residual_add_rms_norm"}


def test_the_json_record_of_a_baked_branch_has_every_arm_and_validates():
    from fuel.graph import DType, FusedOpParams, FusedOps, Graph, OpKind
    from fuel.kernels import cpu_table
    from fuel.optimize import OptimizeOptions, optimize_graph
    from fuel.optimize.render import explanation_document

    from tests.optimize.builders import SPEC

    graph = Graph()
    q = graph.input("q", [1, 4, 1, 16], DType.F32)
    k = graph.input("k", [1, 2, 64, 16], DType.F32)
    v = graph.input("v", [1, 2, 64, 16], DType.F32)
    out = graph.prim(OpKind.NEG, graph.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25),
                                             q, k, v))
    optimized = optimize_graph(graph, [out], OptimizeOptions(device_spec=SPEC, table=cpu_table()))
    step = {"model": "hand-built", "mode": "decode", "rows": 1, "table": None, "device": "cpu",
            "spec": SPEC.name, "dtype": "f32", "context": 64, "judge_cells": 0, "jit": []}
    document = explanation_document(optimized, graph, step)
    validate(document, "explain")
    (decision,) = document["decisions"]
    (recorded,) = optimized.decisions
    assert decision["winner"] == recorded.winner and len(decision["arms"]) == 2
    assert [a["cost_ns"] for a in decision["arms"]] == [a.cost_ns for a in recorded.arms]


def test_verify_batch_needs_a_table_in_one_line(capsys):
    assert main(["explain", "smollm2-135m", "--mode", "verify_batch", "--spec", "h100-sxm"]) == 2
    assert "--table" in capsys.readouterr().err


def test_explain_with_another_models_weights_is_one_error_naming_a_missing_tensor(tmp_path,
                                                                                   capsys):
    """``--weights`` of another model's GGUF (2 layers against SmolLM2's 30) is refused naming
    the file and a tensor it lacks, before a step is lowered against its shapes (which failed
    as ``op `slice`: slice 0:576 out of range for extent 16``)."""
    from tests.runtime.conftest import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "other.gguf").path
    assert main(["explain", "smollm2-135m", "--mode", "decode", "--device", "cpu",
                 "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {path}: (--weights) holds no tensor" in err
