"""The assembled report: acceptance figures for Llama-3.1-8B on H100 SXM, every zoo model on
several devices, the schema, and the no-rule-set device."""

from __future__ import annotations

import json
from functools import cache

import pytest

from fuel.circuit import zoo
from fuel.circuit.policy import build_policy
from fuel.cost.devices import device
from fuel.report.build import (ReportOptions, build_report, device_info, kv_format_for,
                               rule_set_for)
from tests.schemas import validate

# NVIDIA H100 SXM memory bandwidth, 3,350 GB/s: the NVIDIA H100 datasheet as tabulated by
# archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html ("GPU メモリ帯域幅 | 3,350 GB/sec").
H100_SXM_BANDWIDTH = 3.35e12
DEVICES = ("h100-sxm", "l4", "b200", "mi300x")

@cache
def report(model: str, device_name: str) -> dict:
    spec = device(device_name)
    policy = build_policy()
    return build_report(model, zoo.load(model), device_info(spec),
                        rule_set_for(spec.title, spec.kind.value), policy,
                        ReportOptions(kv_format=kv_format_for(policy)))

def _llama_8b_config() -> dict:
    return json.loads((zoo.ZOO_DIR / "llama-3.1-8b.json").read_text())

def test_llama_8b_h100_weight_floor_follows_from_datasheet_bandwidth_and_weight_bytes():
    cfg = _llama_8b_config()
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                              cfg["vocab_size"])
    head_dim = h // heads
    assert not cfg["tie_word_embeddings"]
    per_layer = (h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
                 + 3 * h * inter + 2 * h)
    # bf16: 2 bytes per weight; one embedding row per decode step, the untied lm_head in full.
    weight_bytes = 2 * (layers * per_layer + h + vocab * h + h)
    assert device("h100-sxm").bandwidth_bytes_per_s == H100_SXM_BANDWIDTH
    doc = report("llama-3.1-8b", "h100-sxm")
    assert doc["weight_floor"]["weight_bytes"] == weight_bytes
    assert doc["weight_floor"]["ns"] == pytest.approx(weight_bytes / H100_SXM_BANDWIDTH * 1e9)
    assert doc["weight_floor"]["ns"] == pytest.approx(4.48e6, rel=0.01)  # ~4.5 ms

def test_llama_8b_h100_decode_step_is_weights_plus_kv_over_bandwidth():
    cfg = _llama_8b_config()
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    doc = report("llama-3.1-8b", "h100-sxm")
    assert doc["memory_fit"]["kv_bytes_per_token"] == kv_per_token == 131072
    case = next(c for c in doc["roofline"] if c["name"] == "decode C=1")
    weights, kv = doc["weight_floor"]["weight_bytes"], kv_per_token * 4096
    assert case["weight_bytes"] == weights
    # KV read at context 4096 plus this token's K/V written; activations are a rounding error.
    assert case["kv_bytes"] == kv + kv_per_token
    assert case["ceiling_ns"] == pytest.approx((weights + kv) / H100_SXM_BANDWIDTH * 1e9, rel=0.005)
    assert case["with_launch_ns"] == pytest.approx(
        case["ceiling_ns"] + case["launches"] * device("h100-sxm").launch_overhead_ns)
    assert case["tokens_per_s_ceiling"] == pytest.approx(1e9 / case["ceiling_ns"])

def test_decode_at_higher_concurrency_reads_weights_once_and_more_kv():
    doc = report("llama-3.1-8b", "h100-sxm")
    by = {c["name"]: c for c in doc["roofline"]}
    # The same matrices; only the embedding table is read one row per sequence.
    extra_rows = 15 * _llama_8b_config()["hidden_size"] * 2
    assert by["decode C=16"]["weight_bytes"] == by["decode C=1"]["weight_bytes"] + extra_rows
    assert by["decode C=128"]["kv_bytes"] > 100 * by["decode C=1"]["kv_bytes"]
    assert by["decode C=128"]["tokens_per_s_ceiling"] > 10 * by["decode C=1"]["tokens_per_s_ceiling"]

def test_memory_fit_of_llama_8b_on_h100():
    fit = report("llama-3.1-8b", "h100-sxm")["memory_fit"]
    assert fit["usable_bytes"] == int(fit["device_bytes"] * 0.9)
    cell = {(c["context"], c["concurrency"]): c for c in fit["cells"]}
    assert cell[(4096, 1)]["fits"]
    big = cell[(32768, 128)]
    assert not big["fits"]
    assert big["shortfall_bytes"] == fit["weight_bytes"] + 131072 * 32768 * 128 - fit["usable_bytes"]

@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("model", zoo.names())
def test_every_zoo_model_reports_on_every_device_and_validates(model, device_name):
    doc = report(model, device_name)
    validate(doc)
    assert [c["name"] for c in doc["roofline"]] == [
        "decode C=1", "decode C=16", "decode C=128", "prefill 4k", "prefill 32k"]
    assert all(c["ceiling_ns"] > 0 and c["with_launch_ns"] > c["ceiling_ns"]
               for c in doc["roofline"])
    json.dumps(doc, allow_nan=False)

def test_nvidia_devices_use_the_cuda_rule_set_and_plan_every_tier_of_llama():
    doc = report("llama-3.1-8b", "h100-sxm")
    assert doc["rule_set"]["name"] == "cuda"
    assert doc["gaps"] == []
    assert all(c["planned"] for c in doc["coverage"])
    assert all(p["novel_groups"] == 0 for p in doc["plans"])

def test_a_device_with_no_rule_set_says_so_and_every_op_is_a_gap():
    doc = report("llama-3.1-8b", "mi300x")
    assert doc["rule_set"]["name"] is None
    assert "no rule set applies" in doc["rule_set"]["reason"]
    assert not any(c["planned"] for c in doc["coverage"])
    assert {c["reason"] for c in doc["coverage"]} == {doc["rule_set"]["reason"]}
    ops = {g["op"] for g in doc["gaps"]}
    assert {"paged_attention", "linear:q", "lm_head", "embed"} <= ops
    assert all(g["request"]["status"] == "declined" for g in doc["gaps"])
    assert not any(c["planned"] for c in doc["roofline"])
    # The roofline still prices the unfused ops: one placeholder launch per main-section node.
    c = zoo.load("llama-3.1-8b")
    main_nodes = sum(1 for i in range(len(c.nodes)) if c.section_of_node(i).value == "main")
    assert doc["roofline"][0]["launches"] == main_nodes

def test_the_same_inputs_give_the_same_document():
    spec = device("l4")
    policy = build_policy()
    args = ("smollm2-135m", zoo.load("smollm2-135m"), device_info(spec),
            rule_set_for(spec.title, spec.kind.value), policy)
    assert json.dumps(build_report(*args)) == json.dumps(build_report(*args))


def test_device_info_hands_the_probed_rates_by_rows_to_the_roofline():
    # Why: fuel plan on cpu-local must price a prompt chunk at the rates the probe measured at
    # its rows, not only at the dense peak.
    from dataclasses import replace

    from fuel.cost import PeakClass
    from fuel.report.roofline import ComputeClass

    spec = replace(device("h100-sxm"), gemv_flops={PeakClass.FP32: 1e9},
                   gemm_rows_flops={PeakClass.FP32: ((16, 2e10), (256, 8e10)),
                                    PeakClass.BF16: ((16, 4e10), (256, 1.6e11))},
                   attention_rows_flops=((16, 1e9), (256, 3e10)),
                   gemm_rows_fit={PeakClass.BF16: ((16, 3e4, 5e10), (256, 2e4, 2e11))})
    rates = device_info(spec).rates
    assert rates.rows_fits == {"bf16": ((16, 3e4, 5e10), (256, 2e4, 2e11))}
    assert rates.matrix_call(ComputeClass.TENSOR_FP32, 64) is None  # fp32: no split measured
    assert rates.rows_peaks == {"fp32-matrix": ((16, 2e10), (256, 8e10)),
                                "bf16": ((16, 4e10), (256, 1.6e11))}
    assert rates.attention_peaks == ((16, 1e9), (256, 3e10))
    assert rates.peak(ComputeClass.TENSOR_FP32, rows=64) == pytest.approx(5e10)
    assert rates.peak(ComputeClass.TENSOR_BF16, rows=0) == spec.peak_flops[PeakClass.BF16]
    assert rates.attention_peak(ComputeClass.TENSOR_BF16, rows=256) == 3e10
