"""`fuel plan`: text, --json against the schema, --html written atomically, --serve failing
loudly, and one clear line for an unknown device or model."""

from __future__ import annotations

import json

import pytest

from fuel.cli.app import main
from tests.schemas import validate


def test_json_output_validates_against_the_schema(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate(doc)
    assert doc["model"]["name"] == "smollm2-135m"
    assert doc["device"]["name"] == "h100-sxm"
    assert doc["assumptions"]["context"] == 4096

def test_context_and_tables_reach_the_report(capsys):
    assert main(["plan", "smollm2-135m", "--device", "l4", "--context", "1024",
                 "--table", "3x2 2x1!", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["assumptions"]["context"] == 1024
    assert [c["tier"] for c in doc["coverage"] if c["mode"] == "verify_batch"] == ["3x2 2x1!"]

def test_fp8_kv_cache_halves_kv_bytes_per_token(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)["memory_fit"]["kv_bytes_per_token"]
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--set", "kv_cache_dtype=fp8",
                 "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)["memory_fit"]
    assert fp8["kv_format"] == "fp8/tensor"
    # SmolLM2-135M: 30 layers x K,V x 3 kv heads x 64 head dim; a per-tensor scale is not
    # charged per token.
    assert (bf16, fp8["kv_bytes_per_token"]) == (30 * 2 * 3 * 64 * 2, 30 * 2 * 3 * 64)

def test_text_report_names_the_sections(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    for needle in ("weight floor", "roofline per case", "memory fit", "fused plans",
                   "coverage matrix", "rule set: cuda"):
        assert needle in out

def test_html_is_written_whole_and_no_temp_file_is_left(tmp_path, capsys):
    target = tmp_path / "report.html"
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--json",
                 "--html", str(target)]) == 0
    capsys.readouterr()
    text = target.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]

def test_serve_fails_loudly_naming_the_unplanned_tiers(capsys):
    assert main(["plan", "smollm2-135m", "--device", "mi300x", "--serve", "decode"]) == 2
    err = capsys.readouterr().err
    assert "cannot serve" in err and "decode has no plan at 1" in err
    assert "no rule set applies" in err

def test_serve_passes_when_every_tier_plans(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--serve", "decode",
                 "--serve", "multi_seq", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["serve"] == {"decode": [], "multi_seq": []}

@pytest.mark.parametrize(("args", "needle"), [
    (["plan", "smollm2-135m", "--device", "h900"], "h100-sxm"),
    (["plan", "no-such-model", "--device", "h100-sxm"], "smollm2-135m"),
    (["plan", "smollm2-135m", "--serve", "sprint"], "verify_batch"),
])
def test_unknown_names_are_one_line_listing_the_valid_ones(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_dtype_plans_the_runs_weights_and_activations(capsys):
    # Why: the zoo entry plans bf16 weights while `fuel run` computes in f32 by default; a plan
    # of another dtype than the run's predicts another step. --dtype f32 doubles the weight
    # bytes and every activation, and the KV cache, is f32.
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--dtype", "f32", "--json"]) == 0
    f32 = json.loads(capsys.readouterr().out)
    validate(f32)
    assert (bf16["model"]["weight_format"], f32["model"]["weight_format"]) == ("bf16", "f32")
    assert f32["weight_floor"]["weight_bytes"] == 2 * bf16["weight_floor"]["weight_bytes"]
    assert f32["memory_fit"]["kv_bytes_per_token"] == 2 * bf16["memory_fit"]["kv_bytes_per_token"]
    # f32 matrix products run at the fp32 matrix peak, not the bf16 tensor peak.
    prefill = {c["name"]: c for c in f32["roofline"]}["prefill 4k"]
    bf16_prefill = {c["name"]: c for c in bf16["roofline"]}["prefill 4k"]
    assert prefill["ceiling_ns"] > 2 * bf16_prefill["ceiling_ns"]


def test_weights_sets_only_the_stored_weight_format(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--weights", "fp8/channel",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["weight_format"] == "fp8/channel"
    assert doc["memory_fit"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # activations stay bf16


@pytest.mark.parametrize(("args", "needle"), [(["--dtype", "f8"], "--dtype"),
                                              (["--weights", "fp9"], "--weights")])
def test_a_bad_dtype_or_weight_format_is_one_line(args, needle, capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_group_size_that_does_not_tile_a_row_is_refused_naming_the_config_key(
        tmp_path, capsys, method):
    """An int4 checkpoint whose group does not divide a row (SmolLM2's 576 by 128) has no size
    in that format: one error line naming the config file and ``quantization_config.group_size``,
    never a size rounded up."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
              "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 2, "vocab_size": 49152, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
              "hidden_act": "silu", "torch_dtype": "bfloat16", "head_dim": 64,
              "quantization_config": {"quant_method": method, "bits": 4, "group_size": 128}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path), "--device", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{path}: key `quantization_config.group_size`" in err and "int4/g128" in err
    assert "not a multiple of 128" in err


def test_a_weights_file_of_another_model_is_refused_naming_a_tensor_it_lacks(
        tmp_path, capsys):
    """``--weights`` prices the file's stored formats; a file that is not this model's (here a
    2-layer GGUF against SmolLM2's 30 layers) is one error naming the file and a tensor the
    model reads that it lacks, never a plan with some weights in its formats and the rest not."""
    from tests.runtime.conftest import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "other.gguf").path
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: {path}: (--weights) holds no tensor `model.layers.2." in err
