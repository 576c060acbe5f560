"""Configs as transformers 5 writes them (issue 20): both spelling generations read the same
shape, a setting stated twice must agree, and every unmodelled rope type or sliding layer is
refused by name. Configs here are written by the installed transformers' own config classes."""

from __future__ import annotations

import copy
import json

import pytest

from fuel.circuit import zoo
from fuel.circuit.config_map import (
    ConflictingSpellings,
    RequirementViolated,
    UnclassifiedKey,
    shape_from_config,
    shape_from_file,
)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256)


def _config_classes():
    from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    return {
        "llama": (LlamaConfig, {}),
        # MistralConfig defaults to Mistral-7B-v0.1's 4096-token window, which fuel refuses.
        "mistral": (MistralConfig, {"sliding_window": None}),
        "qwen2": (Qwen2Config, {}),
        "qwen3": (Qwen3Config, {"head_dim": 16}),
        "mixtral": (MixtralConfig, {}),
        "qwen2_moe": (Qwen2MoeConfig, {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                       "num_experts": 4, "num_experts_per_tok": 2}),
        "qwen3_moe": (Qwen3MoeConfig, {"moe_intermediate_size": 32, "num_experts": 4,
                                       "num_experts_per_tok": 2}),
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> the config.json the installed transformers writes for a tiny model of it."""
    out = {}
    for family, (cls, extra) in _config_classes().items():
        folder = tmp_path_factory.mktemp(family)
        cls(**TINY, **extra).save_pretrained(folder)
        out[family] = json.loads((folder / "config.json").read_text())
    return out


def _old_spelling(config: dict) -> dict:
    """The same config in transformers 4's spelling: rope_theta + rope_scaling, torch_dtype,
    num_experts (qwen3_moe), no layer_types."""
    old = copy.deepcopy(config)
    rope = old.pop("rope_parameters")
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = None if rope.get("rope_type") == "default" and len(rope) == 1 else rope
    if "dtype" in old:
        old["torch_dtype"] = old.pop("dtype")
    if old["model_type"] == "qwen3_moe":
        old["num_experts"] = old.pop("num_local_experts")
    old.pop("layer_types", None)
    return old


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_transformers_writes_today_is_accepted_and_instantiates(written, family):
    config = written[family]
    assert "rope_parameters" in config and "rope_theta" not in config
    shape = shape_from_config(config)
    assert shape.layers == 2 and shape.dims["hidden"] == 64 and shape.dims["kv_heads"] == 2
    assert shape.params["rope_type"] == "default"
    assert shape.params["rope_theta"] == repr(float(config["rope_parameters"]["rope_theta"]))
    circuit = zoo.circuit_for(shape)
    assert {b.layer for b in circuit.blocks if b.layer is not None} == {0, 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_both_spelling_generations_read_the_same_shape(written, family):
    assert shape_from_config(_old_spelling(written[family])) == shape_from_config(written[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_maps_defaults_are_the_installed_transformers_defaults(written, family):
    """Strip every key a map defaults; fuel must read what transformers fills in for them."""
    from transformers import AutoConfig

    config = written[family]
    stripped = {k: v for k, v in config.items()
                if k in ("model_type", "architectures", "vocab_size", "num_hidden_layers",
                         "hidden_size", "num_attention_heads", "num_key_value_heads",
                         "intermediate_size", "moe_intermediate_size", "num_experts",
                         "num_local_experts", "num_experts_per_tok", "rms_norm_eps",
                         "max_position_embeddings", "shared_expert_intermediate_size",
                         "sliding_window") and v is not None}
    if family == "mistral":
        stripped["sliding_window"] = None  # MistralConfig would fill in v0.1's 4096 window
    filled = AutoConfig.for_model(**copy.deepcopy(stripped)).to_dict()
    filled = {k: v for k, v in filled.items() if k in config}
    assert shape_from_config(stripped) == shape_from_config(filled), family


def test_llama3_rope_parameters_read_like_the_old_rope_scaling():
    old = zoo.config("llama-3.1-8b")
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": old["rope_theta"]}
    new["dtype"] = "bfloat16"
    shape = shape_from_config(new)
    assert shape == zoo.shape("llama-3.1-8b")
    assert shape.params["rope_type"] == "llama3"
    assert shape.params["rope_scaling"] == ("factor=8.0,high_freq_factor=4.0,low_freq_factor=1.0,"
                                            "original_max_position_embeddings=8192")


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "linear", "su", "proportional"])
def test_an_unmodelled_rope_type_is_refused_by_name(written, write_json, rope_type):
    config = {**written["qwen3"], "rope_parameters": {"rope_theta": 1e6, "rope_type": rope_type, "factor": 4.0}}
    path = write_json("config.json", config)
    with pytest.raises(RequirementViolated) as caught:
        shape_from_file(path)
    assert caught.value.key == "rope_parameters.rope_type" and rope_type in str(caught.value)
    assert str(path) in str(caught.value) and "default, llama3" in str(caught.value)


def test_the_legacy_type_key_of_a_rope_table_is_read_and_refused_by_name(write_json):
    config = {**zoo.config("qwen2.5-7b"),
              "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
    with pytest.raises(RequirementViolated) as caught:
        shape_from_file(write_json("config.json", config))
    assert caught.value.key == "rope_scaling.type" and "yarn" in str(caught.value)


def test_an_unknown_rope_parameters_sub_key_is_refused(written):
    config = {**written["llama"], "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                      "partial_rotary_factor": 0.5}}
    with pytest.raises(UnclassifiedKey) as caught:
        shape_from_config(config)
    assert caught.value.key == "rope_parameters.partial_rotary_factor"


def test_rope_parameters_without_a_type_is_the_default_rope(written):
    config = {**written["llama"], "rope_parameters": {"rope_theta": 5e5}}
    shape = shape_from_config(config)
    assert (shape.params["rope_type"], shape.params["rope_theta"]) == ("default", "500000.0")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe"])
def test_a_sliding_attention_layer_is_refused_naming_its_index(written, write_json, family):
    config = copy.deepcopy(written[family])
    config["layer_types"][1] = "sliding_attention"
    path = write_json("config.json", config)
    with pytest.raises(RequirementViolated) as caught:
        shape_from_file(path)
    assert caught.value.key == "layer_types[1]" and "sliding_attention" in str(caught.value)
    assert "layer 1" in str(caught.value) and str(path) in str(caught.value)


def test_layer_types_of_the_wrong_length_are_refused(written):
    config = {**written["qwen2"], "layer_types": ["full_attention"] * 3}
    with pytest.raises(RequirementViolated) as caught:
        shape_from_config(config)
    assert caught.value.key == "layer_types" and "2 entries" in str(caught.value)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_null_token_ids_are_accepted(written, family):
    config = {**written[family], "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    assert shape_from_config(config).layers == 2


def test_qwen3_moe_reads_the_renamed_expert_count(written):
    config = written["qwen3_moe"]
    assert "num_local_experts" in config and "num_experts" not in config
    assert shape_from_config(config).dims["experts"] == 4
    # MixtralConfig's attribute_map also reads num_experts as num_local_experts.
    mixtral = {k: v for k, v in written["mixtral"].items() if k != "num_local_experts"}
    assert shape_from_config({**mixtral, "num_experts": 6}).dims["experts"] == 6


def test_qwen2_moe_without_qkv_bias_is_refused(written):
    with pytest.raises(RequirementViolated) as caught:
        shape_from_config({**written["qwen2_moe"], "qkv_bias": False})
    assert caught.value.key == "qkv_bias"


# --------------------------------------------------------------------------- stated twice


@pytest.mark.parametrize("edit,key,other", [
    (lambda c: c.update(torch_dtype="float16", dtype="bfloat16"), "dtype", "torch_dtype"),
    (lambda c: c.update(rope_theta=500000.0), "rope_parameters.rope_theta", "rope_theta"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
     "rope_parameters.rope_type", "rope_scaling.rope_type"),
    (lambda c: c["rope_parameters"].update(rope_type="default", type="linear"),
     "rope_parameters.type", "rope_parameters.rope_type"),
])
def test_a_setting_stated_twice_with_two_values_is_refused_naming_both(written, write_json, edit, key, other):
    config = copy.deepcopy(written["llama"])
    edit(config)
    path = write_json("config.json", config)
    with pytest.raises(ConflictingSpellings) as caught:
        shape_from_file(path)
    assert (caught.value.key, caught.value.other_key) == (key, other)
    assert f"`{key}`" in str(caught.value) and f"`{other}`" in str(caught.value) and str(path) in str(caught.value)


def test_two_expert_counts_that_disagree_are_refused_naming_both(written):
    with pytest.raises(ConflictingSpellings) as caught:
        shape_from_config({**written["qwen3_moe"], "num_experts": 8})
    assert {caught.value.key, caught.value.other_key} == {"num_experts", "num_local_experts"}


def test_a_llama3_sub_key_that_disagrees_between_spellings_is_refused(written):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = {**written["llama"], "rope_scaling": scaling,
              "rope_parameters": {**scaling, "factor": 32.0, "rope_theta": 5e5}}
    with pytest.raises(ConflictingSpellings) as caught:
        shape_from_config(config)
    assert (caught.value.key, caught.value.other_key) == ("rope_parameters.factor", "rope_scaling.factor")


def test_a_setting_stated_twice_alike_is_accepted(written):
    config = {**written["llama"], "torch_dtype": "float32", "dtype": "float32", "rope_theta": 10000.0,
              "rope_scaling": {"rope_type": "default"}}
    shape = shape_from_config(config)
    assert shape.weight_format.name() == "f32" and shape.params["rope_theta"] == "10000.0"
    assert shape_from_config({**written["qwen3_moe"], "num_experts": 4}).dims["experts"] == 4


def test_an_error_about_a_respelled_key_names_the_users_spelling(written):
    with pytest.raises(RequirementViolated) as caught:
        shape_from_config({**written["llama"], "dtype": "int8"})
    assert caught.value.key == "dtype"
    with pytest.raises(RequirementViolated) as caught:
        shape_from_config({**written["qwen3_moe"], "num_local_experts": 0})
    assert caught.value.key == "num_local_experts"
