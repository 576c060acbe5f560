"""``fuel circuit show``: plans for zoo models and user circuits, options, one-line errors."""

from __future__ import annotations

import json
import shutil

from fuel.circuit import zoo
from fuel.circuit.golden import GoldenCase, render_case
from fuel.circuit.rules import Mode
from fuel.cli import main


def test_show_prints_the_rendered_plan(capsys):
    assert main(["circuit", "show", "smollm2-135m", "--rules", "cpu"]) == 0
    out = capsys.readouterr().out
    expected = render_case(GoldenCase("smollm2-135m", "cpu", Mode.DECODE, rows=1))
    # Identical but for the rules label, which adds the rule file's digest prefix.
    assert [ln for ln in out.splitlines() if not ln.startswith("rules: ")] == \
        [ln for ln in expected.splitlines() if not ln.startswith("rules: ")]
    assert any(ln.startswith("rules: cpu sha256=") for ln in out.splitlines())


def test_show_json_with_table_settings_and_lever(capsys):
    assert main(["circuit", "show", "llama-3.1-8b", "--rules", "cuda", "--mode", "verify_batch",
                 "--table", "4x3 3x1!", "--set", "kv_cache_dtype=fp8", "--lever", "split_kv_decode",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["mode"], data["rows"], data["table"]) == ("verify_batch", 15, "4x3 3x1!")
    assert data["policy"]["kv_cache_dtype"] == "fp8" and data["levers"] == ["split_kv_decode"]
    rules = {g["rule"] for g in data["groups"]}
    assert "cuda.rope_kv_write_fp8" in rules and "cuda.batched_verify_attention" in rules


def test_differs_rule_needs_its_lever_on_the_command_line(capsys):
    assert main(["circuit", "show", "llama-3.1-8b", "--rules", "cuda", "--json"]) == 0
    without = {g["rule"] for g in json.loads(capsys.readouterr().out)["groups"]}
    assert main(["circuit", "show", "llama-3.1-8b", "--rules", "cuda", "--lever", "split_kv_decode",
                 "--json"]) == 0
    with_lever = {g["rule"] for g in json.loads(capsys.readouterr().out)["groups"]}
    assert "cuda.flash_decode" in without and "cuda.flash_decode_split_kv" not in without
    assert "cuda.flash_decode_split_kv" in with_lever


def test_user_circuit_and_config_files(tmp_path, capsys):
    circuit_file = zoo.CIRCUITS_DIR / "dense_gqa.toml"
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(zoo.config("smollm2-135m")))
    work = tmp_path / "circuits"
    shutil.copytree(zoo.CIRCUITS_DIR, work)
    assert main(["circuit", "show", "--circuit", str(work / circuit_file.name), "--config", str(config_file),
                 "--mode", "multi_seq", "--rows", "8"]) == 0
    assert "mode: multi_seq  rows: 8" in capsys.readouterr().out


def test_explain_lists_rules_tried_per_node(capsys):
    assert main(["circuit", "show", "smollm2-135m", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "l0.mlp.mlp_norm (rms_norm) -> cpu.residual_add_rms_norm" in out
    assert "claimed as element 1 of the chain at `l0.attn.attn_residual`" in out


def test_rows_are_required_outside_decode_and_draft(capsys):
    assert main(["circuit", "show", "smollm2-135m", "--mode", "verify"]) == 2
    assert "--rows" in capsys.readouterr().err
    assert main(["circuit", "show", "smollm2-135m", "--mode", "verify_batch"]) == 2
    assert "--table" in capsys.readouterr().err
    assert main(["circuit", "show", "smollm2-135m", "--mode", "decode", "--table", "2x2"]) == 2
    assert "only a verify_batch plan" in capsys.readouterr().err


def test_bad_inputs_are_one_line_errors(capsys, tmp_path):
    assert main(["circuit", "show", "smollm2-135m", "--set", "kv_cache_dtype=fp4"]) == 2
    assert "`fp4` is not one of auto, fp8" in capsys.readouterr().err
    assert main(["circuit", "show", "smollm2-135m", "--set", "colour=red"]) == 2
    assert "unknown policy setting" in capsys.readouterr().err
    assert main(["circuit", "show", "smollm2-135m", "--mode", "verify_batch", "--table", "4x3 4x2"]) == 2
    assert "adjacent runs of equal k" in capsys.readouterr().err
    bad = tmp_path / "rules.toml"
    bad.write_text("schema = 1\n[[rule]]\nid = \"r\"\n")
    assert main(["circuit", "show", "smollm2-135m", "--rules", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "rule[r]" in err and "Traceback" not in err


def test_uncovered_points_at_explain(capsys, tmp_path):
    only_norms = tmp_path / "norms.toml"
    only_norms.write_text(
        "schema = 1\n[[rule]]\nid = \"n\"\npattern = [{ op = \"rms_norm\" }]\nkernels = []\n"
        "repeat = \"once\"\nemitter = \"n\"\nrows = [1, 8]\nmodes = [\"decode\"]\nnumerics = \"reference\"\n"
        "priority = 0\ncite = \"test\"\n")
    assert main(["circuit", "show", "smollm2-135m", "--rules", str(only_norms)]) == 2
    err = capsys.readouterr().err
    assert "no applicable rule covers node `embed.embed` (embed) in decode at 1 rows" in err
    assert "--explain" in err


def test_show_with_weights_names_each_groups_stored_formats(capsys):
    """``--weights`` (the shipped Q4_1 GGUF): each group says the formats of the weights it
    reads, in the text and the JSON; the plan itself (its digest) is the same."""
    from fuel.runtime.weights import default_model_path

    gguf = str(default_model_path())
    assert main(["circuit", "show", "smollm2-135m", "--weights", gguf]) == 0
    lines = capsys.readouterr().out.splitlines()
    qkv = next(ln for ln in lines if "[q, k, v]" in ln)
    assert qkv.endswith("weights=gguf/q4_1")
    assert next(ln for ln in lines if "[embed]" in ln).endswith("weights=gguf/q8_0")
    assert not next(ln for ln in lines if "[attn]" in ln).count("weights=")  # reads no weight
    assert main(["circuit", "show", "smollm2-135m", "--weights", gguf, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {tuple(g["weight_formats"]) for g in doc["groups"]} >= {("gguf/q4_1",), ("f32",), ()}
    assert main(["circuit", "show", "smollm2-135m", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["digest"] == doc["digest"] and "weight_formats" not in plain["groups"][0]


def test_show_with_another_models_weights_is_one_error_naming_a_missing_tensor(tmp_path, capsys):
    from tests.runtime.conftest import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "other.gguf").path
    assert main(["circuit", "show", "smollm2-135m", "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {path}: (--weights) holds no tensor" in err
