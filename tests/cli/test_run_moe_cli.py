"""``fuel run CHECKPOINT_FOLDER`` runs a mixture-of-experts checkpoint transformers wrote: the
greedy tokens are transformers' own, and the report carries the expert load per step."""

from __future__ import annotations

import json

import pytest

from fuel.runtime.generate import bucket

from fuel.cli import main
from fuel.runtime.tokenizer import load_tokenizer
from tests.moe_models import checkpoint, reference_logits


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_run_on_a_moe_checkpoint_folder_matches_transformers_and_reports_expert_load(capsys, family):
    tiny = checkpoint(family)
    argv = ["run", str(tiny.folder), "--raw", "-p", "Hello there", "-n", "5", "--threads", "1",
            "--no-jit", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    ids = load_tokenizer(tiny.folder).encode("Hello there")
    greedy: list[int] = []
    for _ in range(5):
        greedy.append(int(reference_logits(tiny.model, ids + greedy)[-1].argmax()))
    eos = 1  # the tiny tokenizer's <eos>: generation stops after it
    expected = greedy[:greedy.index(eos) + 1] if eos in greedy else greedy
    assert report["tokens"][0] == expected
    load = report["experts"]
    prefill = report["steps"]["prefill"]
    assert load["prefill"]["rows_per_step"] == prefill["rows_per_step"]
    # The prompt's one chunk runs padded to a power of two (fuel.runtime.generate.bucket).
    assert round(prefill["rows_per_step"] * prefill["steps"]) == bucket(len(ids))
    assert load["prefill"]["moe_layers"] == 2
    if "decode" in load:
        decode = load["decode"]
        # One token picks top_k distinct experts per layer: exactly that many are read.
        assert decode["distinct_experts_per_layer"] == tiny.top_k
        assert decode["uniform_routing_per_layer"] == pytest.approx(tiny.top_k)
        per_expert = 4 * 3 * 32 * 16  # f32 gate, up and down of one expert
        assert decode["expert_bytes_per_step"] == 2 * tiny.top_k * per_expert


def test_full_text_report_prints_the_expert_load_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # a console wide enough that no cell wraps
    tiny = checkpoint("mixtral")
    assert main(["run", str(tiny.folder), "--raw", "-p", "abc", "-n", "2", "--threads", "1",
                 "--no-jit", "--report", "full"]) == 0
    out = capsys.readouterr().out
    assert "expert load" in out and "distinct experts/layer" in out
    assert "of 4 (k=2)" in out
