"""``fuel run --tp`` and ``fuel plan --tp/--pp``: refusals are one line with exit 2; a parallel
plan report carries per-rank costs, the reverse fit and the vllm serve line, and validates."""

from __future__ import annotations

import json
import os

import pytest

from fuel.cli import main
from tests.schemas import validate


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    configured = os.environ.get("FUEL_CACHE_DIR")
    monkeypatch.setenv("FUEL_CACHE_DIR", configured or str(tmp_path_factory.mktemp("fuel-cache")))


def test_run_tp2_is_refused_naming_the_heads(capsys):
    assert main(["run", "--tp", "2", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q_heads" in err[0] and "9 heads do not divide into 2 ranks" in err[0]


def test_plan_refuses_a_split_that_does_not_divide(capsys):
    assert main(["plan", "smollm2-135m", "--device", "h100-sxm", "--tp", "2"]) == 2
    assert "q_heads" in capsys.readouterr().err


def report(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_parallel_plan_report_validates_prices_collectives_and_solves_the_fit(capsys):
    parallel_report = report(capsys, "qwen2.5-3b", "--device", "a100-80gb", "--tp", "2", "--pp", "2")
    validate(parallel_report)
    par = parallel_report["parallel"]
    assert par["layout"] == {"tp": 2, "pp": 2, "ep": 1, "world": 4, "nodes": 1}
    assert par["interconnect"]["intra_node"]["name"] == "nvlink3"
    assert len({r["decode_digest"] for r in par["ranks"]}) == 4
    decode = next(s for s in par["steps"] if s["name"] == "decode C=1")
    assert 0 < decode["collective_share"] < 1
    stage = par["stages"][1]
    ops = {c["op"] for c in stage["cases"][0]["collectives"]}
    assert ops == {"all_reduce", "all_gather", "recv"}
    assert par["vllm_command"].startswith("vllm serve Qwen/Qwen2.5-3B")
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 2" in par["vllm_command"]
    # the reverse fit: each answer is the largest that fits
    usable = par["usable_bytes_per_rank"]
    worst = max(par["stages"], key=lambda s: s["weight_bytes"] + s["activation_bytes"] + s["workspace_bytes"])
    fixed = worst["weight_bytes"] + worst["activation_bytes"] + worst["workspace_bytes"]
    kv = worst["kv_bytes_per_token"]
    for row in par["fit"]["max_context"]:
        c, t = row["concurrency"], row["max_context"]
        assert fixed + kv * t * c <= usable < fixed + kv * (t + 1) * c
    for row in par["fit"]["max_concurrency"]:
        t, c = row["context"], row["max_concurrency"]
        assert fixed + kv * t * c <= usable < fixed + kv * t * (c + 1)


def test_a_device_with_no_known_link_reports_compute_and_says_why_collectives_are_unpriced(capsys):
    par = report(capsys, "qwen2.5-3b", "--device", "rtx-4090", "--tp", "2")["parallel"]
    assert "no interconnect between `rtx-4090` GPUs" in par["interconnect"]["intra_node"]["reason"]
    step = next(s for s in par["steps"] if s["name"] == "decode C=1")
    assert step["collective_ns"] is None and step["ns"] > 0
    case = par["stages"][0]["cases"][0]
    assert case["collective_reason"] and case["compute_ns"] == step["ns"]
