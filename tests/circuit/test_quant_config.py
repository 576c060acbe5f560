"""Hugging Face quantization configs read as stored weight formats (and KV schemes as KV
formats) for planning; anything unmapped is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuel.circuit.config_map import shape_from_config
from fuel.circuit.format import parse
from fuel.circuit.quant_config import QuantConfigUnsupported, kv_format_of, weight_format_of

ZOO = Path(__file__).resolve().parents[2] / "src" / "fuel" / "data" / "zoo" / "llama-3.1-8b.json"


@pytest.mark.parametrize(("config", "expected"), [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8/block128x128"),
    ({"quant_method": "fp8"}, "fp8/channel"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4/g128"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64}, "int4/g64"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8/channel"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}, "fp8/channel"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}, "int4/g32"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}}, "int8/channel"),
    # compressed-tensors' QuantizationArgs default symmetric=True: an absent key is symmetric.
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}}}, "int8/channel"),
])
def test_quantization_config_maps_to_its_stored_format(config, expected):
    assert weight_format_of("config.json", config) == parse(expected)


@pytest.mark.parametrize(("config", "key"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "quantization_config.group_size"),
    ({"quant_method": "hqq"}, "quantization_config.quant_method"),
])
def test_unmapped_quantization_config_is_refused_naming_the_key(config, key):
    with pytest.raises(QuantConfigUnsupported, match=key.replace(".", r"\.")):
        weight_format_of("config.json", config)


def _int8_weights(**args):
    weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, **args}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}


@pytest.mark.parametrize(("config", "key", "value"), [
    (_int8_weights(symmetric=False), "quantization_config.config_groups.group_0.weights.symmetric",
     "False"),
    (_int8_weights(strategy="tensor"), "quantization_config.config_groups.group_0.weights",
     "'strategy': 'tensor'"),
    (_int8_weights(strategy="group", group_size=128),
     "quantization_config.config_groups.group_0.weights", "'strategy': 'group'"),
    (_int8_weights(num_bits=6), "quantization_config.config_groups.group_0.weights",
     "'num_bits': 6"),
])
def test_int8_weights_other_than_symmetric_per_channel_are_refused_naming_key_and_value(
        config, key, value):
    with pytest.raises(QuantConfigUnsupported) as refused:
        weight_format_of("cfg/config.json", config)
    message = str(refused.value)
    assert "cfg/config.json" in message and f"`{key}`" in message and value in message


def test_kv_cache_scheme_reads_as_a_kv_format():
    assert kv_format_of("config.json", {"num_bits": 8, "type": "float", "strategy": "tensor"}) == parse("fp8/tensor")
    assert kv_format_of("config.json", None) is None
    with pytest.raises(QuantConfigUnsupported, match="kv_cache_scheme"):
        kv_format_of("config.json", {"num_bits": 4, "type": "int"})


def test_a_gptq_checkpoint_plans_with_int4_weights_over_its_torch_dtype():
    config = json.loads(ZOO.read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    shape = shape_from_config(config, "config.json")
    assert shape.weight_format == parse("int4/g128")
    del config["quantization_config"]
    assert not shape_from_config(config, "config.json").weight_format.is_quantized


def test_plan_prices_the_shipped_gguf_in_its_stored_formats():
    from gguf import GGUFReader

    from fuel.circuit import zoo
    from fuel.circuit.quant_config import with_weight_formats
    from fuel.report.memory import stored_weight_bytes
    from fuel.runtime.quant_cache import stored_formats
    from fuel.runtime.weights import default_model_path

    path = default_model_path()
    circuit = zoo.circuit_for(shape_from_config(json.loads(
        (ZOO.parent / "smollm2-135m.json").read_text()), "smollm2-135m.json"))
    stored = with_weight_formats(circuit, stored_formats(path))
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    # The circuit counts norm gains at the file's f32 and every projection in its block format.
    assert stored_weight_bytes(stored) == file_bytes
    assert stored_weight_bytes(stored) < stored_weight_bytes(circuit) / 2
