"""``fuel run`` and ``fuel demo``: real generation with a report, and one clear error line (no
traceback) for a missing or corrupt model file, mismatched checkpoint tensors, and a prompt
longer than the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fuel.cli import main



@pytest.fixture(autouse=True)
def shared_cache(fuel_cache, monkeypatch):
    # The commands read the session's cache: the weights the fixtures converted, and the
    # kernels, programs and Judge rows earlier runs left there.
    monkeypatch.setenv("FUEL_CACHE_DIR", str(fuel_cache))


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.slow
def test_run_json_reports_rate_steps_digests_and_bakes(capsys, smollm2_weights, smollm2_oracle,
                                                        smollm2_tokenizer):
    # f32: the oracle's dtype (a stored Q4_1 run rounds activations to 8 bits at the Judge's
    # chosen sites, and may part from the f32 greedy text where two logits nearly tie).
    assert main(["run", "--prompt", "Name a planet.", "-n", "8", "--threads", "2", "--json",
                 "--dtype", "f32"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt("Name a planet."))
    assert report["tokens"][0] == smollm2_oracle.greedy(ids, 8, stop=[smollm2_tokenizer.eos_id])
    assert report["decode_tokens_per_s"] > 0
    # The first decode step compiles its program; the steady rate leaves that time out.
    assert report["program_builds"]["decode"]["count"] >= 1
    assert report["program_builds"]["prefill"]["count"] >= 1
    assert report["decode_tokens_per_s_steady"] > report["decode_tokens_per_s"]
    assert report["steps"]["decode"]["launches_per_step"] == 243  # the golden decode plan's count
    assert "d3e429d14810b593fb36099d70eba4896f871338572330a2929fa04192c7be85" in report["plan_digests"]
    assert any("paged_attn x30" in row["decisions"] for row in report["bake_decisions"])


@pytest.mark.slow
def test_run_with_speculation_and_batch_reports_acceptance(capsys, smollm2_weights):
    argv = ["run", "-p", "Count to five.", "-n", "6", "--speculate", "2", "--drafter",
            "prompt-lookup", "--batch", "2", "--threads", "2", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sequences"] == 2
    assert report["tokens"][0] == report["tokens"][1]
    assert report["speculation"]["drafter"] == "prompt-lookup"
    assert 0 <= report["speculation"]["accepted"] <= report["speculation"]["proposed"]


@pytest.mark.slow
def test_demo_streams_text_and_prints_the_short_report(capsys, smollm2_weights):
    assert main(["demo", "-n", "6"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "first token" in out and "decisions" in out
    assert "steps by mode" not in out  # the tables are --report full / -v


@pytest.mark.slow
def test_demo_v_prints_the_tables(capsys, smollm2_weights):
    assert main(["demo", "-n", "6", "-v"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "steps by mode" in out and "bake decisions" in out


def test_missing_model_file_is_one_error_line(capsys, tmp_path):
    assert main(["run", str(tmp_path / "absent.gguf"), "-n", "2"]) == 2
    err = _error_line(capsys)
    assert "absent.gguf" in err


def test_corrupt_gguf_is_one_error_line(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really" * 8)
    assert main(["run", str(bad), "-n", "2"]) == 2
    assert "bad.gguf" in _error_line(capsys)


@pytest.mark.slow
def test_checkpoint_with_a_misshaped_tensor_names_it_and_its_shapes(capsys, tmp_path, smollm2_weights):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(Path(smollm2_weights.source.folder) / "config.json", folder / "config.json")
    tensors = {name: tensor for name, tensor in smollm2_weights.tensors.items()}
    tensors["model.layers.3.mlp.down_proj.weight"] = torch.zeros(576, 1000)
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(Path(smollm2_weights.source.folder) / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(Path(smollm2_weights.source.folder) / "tokenizer_config.json", folder / "tokenizer_config.json")
    assert main(["run", str(folder), "-n", "2"]) == 2
    err = _error_line(capsys)
    assert "model.layers.3.mlp.down_proj.weight" in err
    assert "[576, 1000]" in err and "[576, 1536]" in err


@pytest.mark.slow
def test_prompt_longer_than_the_cache_is_one_error_line(capsys, smollm2_weights):
    assert main(["run", "-p", "word " * 40, "-n", "4", "--max-context", "32"]) == 2
    err = _error_line(capsys)
    assert "at most 32" in err


@pytest.mark.slow
def test_a_bf16_run_without_the_native_kernels_runs_on_torch_and_says_why(fuel_cache,
                                                                          smollm2_weights):
    """No C compiler (here: ``FUEL_NATIVE=0``, in a new process, as the library loads once per
    process): the 16-bit matrices' rows run through torch (oneDNN multiplies like dtypes only,
    so the f32 activations are rounded to bf16 first), and the report says the native kernels
    were not there and why."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FUEL_NATIVE="0", FUEL_CACHE_DIR=str(fuel_cache))
    done = subprocess.run([sys.executable, "-m", "fuel", "run", "--dtype", "bf16", "-n", "4",
                           "--threads", "2", "--json", "-p", "Name a planet."],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    assert report["native_kernels"] == {"available": False, "reason": "disabled by FUEL_NATIVE=0"}
    assert len(report["tokens"][0]) == 4 and report["decode_tokens_per_s"] > 0
