"""Config maps (SPEC §A4): strict classification; every refusal names the config file and key."""

import json
from pathlib import Path

import pytest

from fuel.circuit import zoo
from fuel.circuit.config_map import (
    ConfigMapError,
    ConfigRefused,
    MissingKey,
    RequirementViolated,
    UnclassifiedKey,
    UnsupportedModelType,
    builtin_maps,
    load_config_map,
    shape_from_config,
    shape_from_file,
)
from fuel.circuit.ir import LayerKind


def refused(write_json, config, kind):
    path = write_json("config.json", config)
    with pytest.raises(kind) as caught:
        shape_from_file(path)
    assert caught.value.file == str(path) and str(path) in str(caught.value)
    assert f"`{caught.value.key}`" in str(caught.value)
    return caught.value


def test_llama_31_reads_dims_params_and_llama3_rope():
    shape = zoo.shape("llama-3.1-8b")
    assert (shape.arch, shape.model_type, shape.layers) == ("dense_gqa", "llama", 32)
    assert shape.layer_kinds == (LayerKind.FULL_ATTENTION,) * 32
    assert dict(shape.dims) == {"hidden": 4096, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                                "intermediate": 14336, "vocab": 128256}
    assert shape.params["rope_type"] == "llama3" and shape.params["rope_theta"] == "500000.0"
    assert shape.params["tie_word_embeddings"] == "false"
    assert shape.params["attention_block"] == "plain" and shape.weight_format.name() == "bf16"


def test_head_dim_is_derived_when_the_config_has_none():
    assert zoo.shape("qwen2.5-7b").dims["head_dim"] == 3584 // 28
    assert zoo.shape("qwen3-8b").dims["head_dim"] == 128  # given explicitly


def test_kv_heads_default_to_q_heads_like_hugging_face():
    config = zoo.config("llama-3.1-8b")
    del config["num_key_value_heads"]
    assert shape_from_config(config).dims["kv_heads"] == 32


def test_an_unclassified_key_is_refused(write_json):
    error = refused(write_json, {**zoo.config("llama-3.1-8b"), "attn_logit_softcapping": 50.0},
                    UnclassifiedKey)
    assert error.key == "attn_logit_softcapping" and "llama.toml" in str(error)


def test_a_violated_requirement_is_refused_with_why(write_json):
    error = refused(write_json, {**zoo.config("llama-3.1-8b"), "hidden_act": "gelu"},
                    RequirementViolated)
    assert error.key == "hidden_act" and "silu" in str(error)


def test_a_missing_key_is_refused(write_json):
    config = zoo.config("qwen2.5-7b")
    del config["num_hidden_layers"]
    assert refused(write_json, config, MissingKey).key == "num_hidden_layers"
    config = zoo.config("qwen2.5-7b")
    del config["rms_norm_eps"]
    assert refused(write_json, config, MissingKey).key == "rms_norm_eps"


def test_an_unknown_rope_type_is_refused(write_json):
    config = {**zoo.config("llama-3.1-8b"),
              "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0}}
    error = refused(write_json, config, RequirementViolated)
    assert error.key == "rope_scaling.rope_type" and "llama3" in str(error)


def test_an_unknown_llama3_rope_sub_key_is_refused(write_json):
    config = zoo.config("llama-3.1-8b")
    config["rope_scaling"]["mscale"] = 1.0
    assert refused(write_json, config, UnclassifiedKey).key == "rope_scaling.mscale"


def test_a_missing_llama3_rope_sub_key_is_refused(write_json):
    config = zoo.config("llama-3.1-8b")
    del config["rope_scaling"]["factor"]
    assert refused(write_json, config, MissingKey).key == "rope_scaling.factor"


def test_a_sliding_window_the_circuit_does_not_model_is_refused(write_json):
    # Mistral-7B-v0.1 attends a 4096-token window.
    config = {**zoo.config("llama-3.1-8b"), "model_type": "mistral", "sliding_window": 4096}
    del config["rope_scaling"]
    assert refused(write_json, config, RequirementViolated).key == "sliding_window"
    qwen = {**zoo.config("qwen2.5-7b"), "use_sliding_window": True}
    assert refused(write_json, qwen, RequirementViolated).key == "use_sliding_window"


def test_a_bool_never_satisfies_an_integer_requirement(write_json):
    config = {**zoo.config("qwen3-30b-a3b"), "decoder_sparse_step": True}
    assert refused(write_json, config, RequirementViolated).key == "decoder_sparse_step"


def test_an_unsupported_model_type_is_refused(write_json):
    error = refused(write_json, {**zoo.config("llama-3.1-8b"), "model_type": "gemma3"},
                    UnsupportedModelType)
    assert error.key == "model_type" and "qwen3_moe" in str(error)


def test_a_malformed_config_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{ nope")
    with pytest.raises(ConfigRefused) as caught:
        shape_from_file(path)
    assert str(path) in str(caught.value) and "not valid JSON" in str(caught.value)


def test_every_model_type_is_served_by_exactly_one_map():
    served = [t for m in builtin_maps() for t in m.model_types]
    assert sorted(served) == sorted(set(served))
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"} <= set(served)


def test_a_map_file_error_names_the_map_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('schema = 1\narch = "dense_gqa"\nmodel_types = ["x"]\nlayers = "n"\n'
                    'layer_kinds = "full_attention"\n[dims]\nhidden = "hidden_size"\n'
                    '[keys]\nfoo = { ignore = "a", param = "b" }\n')
    with pytest.raises(ConfigMapError) as caught:
        load_config_map(path)
    assert caught.value.key == "keys.foo" and str(path) in str(caught.value)


def test_nested_text_config_is_followed_where_the_map_says(tmp_path):
    path = tmp_path / "wrapped.toml"
    path.write_text('schema = 1\narch = "dense_gqa"\nmodel_types = ["wrapped"]\n'
                    'follow = "text_config"\nouter = ["architectures"]\n'
                    'layers = "num_hidden_layers"\nlayer_kinds = "full_attention"\n'
                    '[dims]\nhidden = "hidden_size"\n[keys]\nrms_norm_eps = { param = "eps" }\n')
    maps = (load_config_map(path),)
    config = {"model_type": "wrapped", "architectures": ["X"],
              "text_config": {"num_hidden_layers": 2, "hidden_size": 64, "rms_norm_eps": 1e-6}}
    shape = shape_from_config(config, "c.json", maps)
    assert shape.layers == 2 and shape.dims["hidden"] == 64 and shape.params["eps"] == "1e-06"
    with pytest.raises(UnclassifiedKey) as caught:
        shape_from_config({**config, "vision_config": {}}, "c.json", maps)
    assert caught.value.key == "vision_config"
    config["text_config"]["sliding"] = 1
    with pytest.raises(UnclassifiedKey) as caught:
        shape_from_config(config, "c.json", maps)
    assert caught.value.key == "text_config.sliding"


def test_every_zoo_config_passes_its_map_without_refusal():
    for name in zoo.names():
        assert shape_from_config(json.loads(Path(zoo.entry(name).path).read_text())).layers > 0
