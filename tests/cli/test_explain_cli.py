"""fuel explain: the decision record of a zoo model's optimized step, and one-line errors."""

from __future__ import annotations

import pytest

from fuel.cli.app import main


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


def test_explain_jit_shows_the_adopted_branches_of_the_real_decode_step(capsys, tmp_path,
                                                                        monkeypatch):
    # Why: after adoption the lowered step carries one branch per unrunnable fused node; with no
    # Judge cell for the adopted arm it is unpriceable and the oracle (arm 0) stands.
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path))
    assert main(["explain", "smollm2-135m", "--jit", "--no-judge", "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "jit: paged_attn x30 -> f32[1, 9, 1, 64]: adopted" in out
    assert "jit: residual_add_rms_norm x59 -> f32[2, 1, 576]: adopted" in out
    assert "branches 89, baked 0" in out
    assert out.count("fused:runtime#0x8000") == 30 and out.count("fused:runtime#0x8001") == 59
    assert "baked to arm 0 (unknown cost)" in out
