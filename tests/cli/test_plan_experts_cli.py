"""`fuel plan` for MoE models keeps its uniform-routing estimate and says so, and states the
distinct-expert counts a `fuel run --json` report measured (``--experts-from``); a file that is
not such a report is one error line naming it and the key."""

from __future__ import annotations

import json


from fuel.cli.app import main
from tests.schemas import validate

RUN_REPORT = {
    "model": "tiny-qwen3-moe",
    "experts": {
        "decode": {"experts": 128, "top_k": 8, "moe_layers": 48, "rows_per_step": 1.0,
                   "distinct_experts_per_layer": 8.0, "uniform_routing_per_layer": 8.0,
                   "distinct_experts_per_step": 384.0, "expert_bytes_per_step": 1},
        "prefill": {"experts": 128, "top_k": 8, "moe_layers": 48, "rows_per_step": 6.0,
                    "distinct_experts_per_layer": 21.5, "uniform_routing_per_layer": 41.4,
                    "distinct_experts_per_step": 1032.0, "expert_bytes_per_step": 1},
    },
}


def notes_of(capsys) -> list[str]:
    doc = json.loads(capsys.readouterr().out)
    validate(doc)
    return doc["assumptions"]["notes"]


def test_moe_plan_says_its_expert_reads_are_the_uniform_estimate(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--device", "h100-sxm", "--json"]) == 0
    notes = notes_of(capsys)
    assert any("uniform-routing estimate (E=128, k=8" in n for n in notes)
    assert any("No run supplied a measured distinct-expert count" in n for n in notes)


def test_a_run_report_adds_the_measured_counts_beside_the_estimate(capsys, tmp_path):
    report = tmp_path / "run.json"
    report.write_text(json.dumps(RUN_REPORT))
    assert main(["plan", "qwen3-30b-a3b", "--device", "h100-sxm", "--json",
                 "--experts-from", str(report)]) == 0
    measured = [n for n in notes_of(capsys) if n.startswith("Measured by a run of tiny-qwen3-moe")]
    assert len(measured) == 1
    assert "prefill at 6 rows/step: 21.5 per layer (uniform 41.4)" in measured[0]
    assert "decode at 1 rows/step: 8 per layer (uniform 8)" in measured[0]


def test_dense_plans_carry_no_expert_note(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--json"]) == 0
    assert not any("uniform-routing estimate" in n for n in notes_of(capsys))


def test_a_report_without_expert_load_is_one_error_line(capsys, tmp_path):
    report = tmp_path / "dense.json"
    report.write_text(json.dumps({"model": "smollm2-135m", "tokens": [[1]]}))
    assert main(["plan", "qwen3-30b-a3b", "--device", "h100-sxm",
                 "--experts-from", str(report)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "dense.json" in err and "experts" in err
