"""``fuel circuit describe``: zoo models, --config files, and one-line errors."""

import json
import subprocess
import sys

from fuel.circuit import zoo
from fuel.cli import main


def run_fuel(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from fuel.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


def test_describe_llama_31_70b_reports_80_layers(capsys):
    assert main(["circuit", "describe", "llama-3.1-70b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 80 and data["layers_by_kind"] == {"full_attention": 80}
    assert data["sections"]["main"] == {"blocks": 162, "nodes": 1124, "edges": 1124}
    assert data["sections"]["draft"] == {"blocks": 4, "nodes": 18, "edges": 18}
    assert data["dims"]["hidden"] == 8192


def test_describe_human_output_names_layers(capsys):
    assert main(["circuit", "describe", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "32 layers (32 moe)" in out and "expert_intermediate" in out


def test_a_config_of_a_supported_family_outside_the_zoo_loads(tmp_path, capsys):
    # Qwen2.5-32B's published config.json (index id 30247352769), not in the zoo.
    config = {**zoo.config("qwen2.5-14b"), "intermediate_size": 27648, "max_window_layers": 64,
              "num_hidden_layers": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["circuit", "describe", "--config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 64 and data["model_type"] == "qwen2"
    assert data["params"]["attention_block"] == "bias"


def test_an_unmodelled_feature_prints_one_line_naming_the_key(tmp_path):
    config = {**zoo.config("llama-3.1-8b")}
    config["rope_scaling"] = {**config["rope_scaling"], "rope_type": "yarn"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = run_fuel("circuit", "describe", "--config", str(path))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "rope_scaling.rope_type" in lines[0] and str(path) in lines[0]


def test_an_unknown_model_and_a_bad_circuit_file_are_one_line_errors(tmp_path):
    done = run_fuel("circuit", "describe", "llama-9")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1
    assert "no zoo model `llama-9`" in done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("schema = 1\narch = 'dense_gqa'\ncolour = 1\n")
    done = run_fuel("circuit", "describe", "smollm2-135m", "--circuit", str(bad))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert str(bad) in done.stderr and "`colour`" in done.stderr


def test_model_and_config_together_are_refused(tmp_path, capsys):
    assert main(["circuit", "describe", "smollm2-135m", "--config", str(tmp_path / "c.json")]) == 2
