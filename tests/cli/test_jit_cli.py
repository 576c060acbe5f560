"""`fuel jit MODEL --device cpu`: every decode-step region with the carrier's and the
synthesizer's answer, the verification error and the measured speeds."""

from __future__ import annotations

import json

import pytest

from fuel.cli.app import main
from fuel.graph import BackendId


@pytest.fixture(autouse=True)
def isolated_cache(cache_sharing_kernels):
    # An empty Judge store and probe; the compiled kernels are the session's.
    return cache_sharing_kernels


def test_jit_json_lists_the_lowered_decode_steps_requests_answers_errors_and_speeds(capsys):
    assert main(["jit", "smollm2-135m", "--device", "cpu", "--context", "64", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    by_region = {r["region"]: r for r in document["records"]}
    # Counted over the real lowered graph: 30 layers, every node asked.
    assert {name: r["nodes"] for name, r in by_region.items()} == {
        "fused_linear": 121, "rms_norm": 2, "rope": 30, "silu_mul": 30, "paged_attn": 30,
        "residual_add_rms_norm": 59}
    # The CPU's deliberate gaps make requests; the rest decline at the carrier.
    for covered in ("fused_linear", "rms_norm", "rope", "silu_mul"):
        assert by_region[covered]["request"] is None
        assert by_region[covered]["answer"].startswith("carrier declined")
    residual = by_region["residual_add_rms_norm"]
    assert residual["request"] == "f32[1, 576], f32[1, 576], f32[576], f32[2, 1, 576]"
    paged = by_region["paged_attn"]
    assert paged["request"] == ("f32[1, 9, 1, 64], f32[4, 16, 3, 64], f32[4, 16, 3, 64], "
                                "u32[1, 4], u32[1], f32[1, 9, 1, 64]")
    for record in (residual, paged):
        assert record["synthesizer"] == "numba"
        assert record["max_abs_error"] < 2e-5
        assert record["kernel_ns"] > 0 and record["decomposed_ns"] > 0
        assert record["speedup"] == pytest.approx(record["decomposed_ns"] / record["kernel_ns"])
        # The cost gate follows its own numbers: adopted exactly when the kernel was faster.
        faster = record["kernel_ns"] < record["decomposed_ns"]
        expected = "adopted" if faster else "rejected: slower than the decomposed region"
        assert record["answer"].startswith(expected + ":"), record["answer"]
    assert "lowered decode step" in document["note"]


def test_jit_text_names_each_region_and_the_speed_line(capsys):
    assert main(["jit", "smollm2-135m", "--context", "32"]) == 0
    out = capsys.readouterr().out
    assert "residual_add_rms_norm x59 -> f32[2, 1, 576]" in out
    assert "paged_attn x30 -> f32[1, 9, 1, 64]" in out
    assert "verification: max abs error" in out and "vs decomposed" in out


def test_jit_refuses_an_unknown_device_in_one_line(capsys):
    assert main(["jit", "smollm2-135m", "--device", "tpu"]) == 2
    assert "`tpu` is not a device" in capsys.readouterr().err


def test_a_failure_binding_the_cuda_table_surfaces_instead_of_reading_as_no_kernel(monkeypatch):
    # Why: a catch-all turned any error here into an empty table, so every region read as
    # "no CUDA kernel" and the bug was invisible.
    import fuel.kernels

    class Broken(RuntimeError):
        pass

    def broken(backend=None):
        raise Broken("binding bug")

    import fuel.cli.explain

    # The CUDA rules' embedding has no CPU graph construction yet, so the step is the CPU's;
    # the table binding under test is the CUDA one.
    cpu_step = fuel.cli.explain.offline_step
    monkeypatch.setattr(fuel.cli.explain, "offline_step",
                        lambda model, mode, rows, context, dtype, backend:
                        cpu_step(model, mode, rows, context, dtype, BackendId.CPU))
    monkeypatch.setattr(fuel.kernels, "torch_table", broken)
    with pytest.raises(Broken):
        main(["jit", "smollm2-135m", "--device", "cuda", "--context", "32"])
