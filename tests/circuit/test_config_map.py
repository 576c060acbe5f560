"""Config maps (SPEC §A4): strict classification; every refusal names the config file and key;
a corpus of real published configs gets its recorded outcome; bad values are refused at the
boundary."""

import json
import math
import tomllib
from pathlib import Path

import pytest

from fuel.circuit import config_map, zoo
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


# --------------------------------------------------------------------------- the corpus

CORPUS = Path(__file__).resolve().parent.parent / "data" / "configs"
EXPECTED = tomllib.loads((CORPUS / "SOURCES.toml").read_text())["config"]


def test_the_corpus_has_thirty_real_configs_each_with_a_source_and_an_outcome():
    files = sorted(p.stem for p in CORPUS.glob("*.json"))
    assert len(files) >= 30 and files == sorted(EXPECTED)
    for name, entry in EXPECTED.items():
        assert entry["found"] and entry["hf"] and entry["expect"] in ("accepted", "refused"), name
    outcomes = [entry["expect"] for entry in EXPECTED.values()]
    # Refusals for each kind of unmodelled key: an unknown model_type, a sliding window, a rope
    # type (the AWQ re-save is accepted since quantization_config is read as a weight format).
    assert outcomes.count("refused") >= 3 and outcomes.count("accepted") >= 20
    refused_keys = {entry["key"] for entry in EXPECTED.values() if entry["expect"] == "refused"}
    assert {"model_type", "sliding_window"} <= refused_keys


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_corpus_config_gets_its_recorded_outcome(name):
    entry, path = EXPECTED[name], CORPUS / f"{name}.json"
    if entry["expect"] == "refused":
        with pytest.raises(ConfigRefused) as caught:
            shape_from_file(path)
        assert type(caught.value).__name__ == entry["error"] and caught.value.key == entry["key"]
        assert str(path) in str(caught.value)
        return
    shape = shape_from_file(path)
    circuit = zoo.circuit_for(shape, draft=False)
    assert {b.layer for b in circuit.blocks if b.layer is not None} == set(range(shape.layers))
    if "weight_format" in entry:
        assert shape.weight_format.name() == entry["weight_format"]
    count = zoo.parameter_count(shape)
    if "parameters" in entry:
        assert count == entry["parameters"]
    if "published_billions" in entry:
        digits = len(str(entry["published_billions"]).partition(".")[2])
        assert round(count / 1e9, digits) == entry["published_billions"]


def test_the_transformers_5_copies_in_the_corpus_read_like_their_originals():
    for old, new in (("qwen3-235b-a22b-instruct-2507", "qwen3-235b-a22b-instruct-2507.transformers5"),
                     ("meta-llama-3-8b-instruct", "meta-llama-3-8b.transformers5")):
        a, b = shape_from_file(CORPUS / f"{old}.json"), shape_from_file(CORPUS / f"{new}.json")
        assert (a.dims, a.layers, a.params, a.weight_format) == (b.dims, b.layers, b.params, b.weight_format)


# --------------------------------------------------------------------------- value checks

BASE = "llama-3.1-8b"


def _refusal(write_json, edits, base=BASE, kind=RequirementViolated):
    config = zoo.config(base)
    for key, value in edits.items():
        if value is KeyError:
            del config[key]
        else:
            config[key] = value
    return refused(write_json, config, kind)


@pytest.mark.parametrize("kv,why", [(3, "a divisor of `num_attention_heads` (32)"),
                                    (64, "more kv heads than query heads")])
def test_kv_heads_must_divide_the_query_heads(write_json, kv, why):
    error = _refusal(write_json, {"num_key_value_heads": kv})
    assert error.key == "num_key_value_heads" and why in str(error)


def test_top_k_larger_than_the_experts_is_refused(write_json):
    error = _refusal(write_json, {"num_experts_per_tok": 9}, base="mixtral-8x7b")
    assert error.key == "num_experts_per_tok" and "at most `num_local_experts` (8)" in str(error)


@pytest.mark.parametrize("value", [0.0, -1e-5, math.nan, math.inf, True, "1e-5", None])
def test_rms_norm_eps_must_be_a_finite_positive_number(write_json, value):
    error = _refusal(write_json, {"rms_norm_eps": value})
    assert error.key == "rms_norm_eps" and "finite positive number" in str(error)


@pytest.mark.parametrize("value", [0, -10000.0, math.nan, -math.inf, False, "500000"])
def test_rope_theta_must_be_a_finite_positive_number(write_json, value):
    error = _refusal(write_json, {"rope_theta": value})
    assert error.key == "rope_theta"


def test_a_llama3_rope_factor_must_be_a_finite_positive_number(write_json):
    config = zoo.config(BASE)
    config["rope_scaling"]["low_freq_factor"] = 0
    assert refused(write_json, config, RequirementViolated).key == "rope_scaling.low_freq_factor"


@pytest.mark.parametrize("key,value", [("hidden_size", 0), ("intermediate_size", -14336),
                                       ("vocab_size", 128256.0), ("num_attention_heads", "32"),
                                       ("head_dim", True), ("num_hidden_layers", 0),
                                       ("max_position_embeddings", 0)])
def test_sizes_must_be_positive_integers(write_json, key, value):
    error = _refusal(write_json, {key: value})
    assert error.key == key and "a positive integer" in str(error)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 10**9), ("max_position_embeddings", 10**15),
                                       ("hidden_size", 2**40), ("vocab_size", 10**400)])
def test_an_absurd_size_is_one_clear_refusal(write_json, key, value):
    error = _refusal(write_json, {key: value})
    assert error.key == key and "at most" in str(error) and "no real model" in str(error)


def test_a_switch_must_be_a_boolean(write_json):
    error = _refusal(write_json, {"tie_word_embeddings": 1})
    assert error.key == "tie_word_embeddings" and "true or false" in str(error)


def test_a_derived_head_dim_that_is_not_whole_names_the_keys_it_comes_from(write_json):
    error = _refusal(write_json, {"hidden_size": 4100})  # Llama-3.1-8B states no head_dim
    assert error.key == "head_dim" and "`hidden_size` (4100)" in str(error)
    assert "`num_attention_heads` (32)" in str(error)


def test_a_value_error_never_names_the_builtin_circuit(write_json):
    """Each bad value is refused at the config boundary, naming the user's file."""
    for edits in ({"num_key_value_heads": 5}, {"hidden_size": 2**30}, {"rms_norm_eps": math.nan},
                  {"intermediate_size": 0}, {"rope_theta": -1}):
        error = _refusal(write_json, edits)
        assert "circuits" not in str(error) and "config.json" in error.file


def test_a_huge_integer_in_the_json_is_a_clear_refusal(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "num_hidden_layers": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigRefused) as caught:
        shape_from_file(path)
    assert str(path) in str(caught.value) and "not valid JSON" in str(caught.value)


def test_the_bounds_leave_wide_room_above_every_real_config():
    sizes, layers = [], []
    for path in CORPUS.glob("*.json"):
        config = json.loads(path.read_text())
        layers.append(config["num_hidden_layers"])
        sizes += [config[k] for k in ("max_position_embeddings", "vocab_size", "hidden_size",
                                      "intermediate_size") if isinstance(config.get(k), int)]
    assert config_map.MAX_LAYERS >= 10 * max(layers) and config_map.MAX_SIZE >= 64 * max(sizes)


MAP_HEAD = ('schema = 1\narch = "dense_gqa"\nmodel_types = ["x"]\nlayers = "num_hidden_layers"\n'
            'layer_kinds = "full_attention"\n[dims]\nhidden = "hidden_size"\n')


@pytest.mark.parametrize("tail,key", [
    ('[spellings]\nd = "torch_dtype"\n', "spellings.d"),  # the map reads no torch_dtype
    ('[keys]\neps = { ignore = "x" }\n[spellings]\neps = "hidden_size"\n', "spellings.eps"),
    ('[rope]\ntheta_default = 10000.0\ntypes = { llama3 = [] }\n', "rope.types"),
    ('[rope]\ntheta_default = 0\ntypes = { default = [] }\n', "rope.theta_default"),
    ('[rope]\ntheta_default = 1.0\ntypes = { default = [] }\n[keys]\nrope_theta = { ignore = "x" }\n',
     "keys.rope_theta"),
    ('[keys]\neps = { param = "eps", check = "finite" }\n', "keys.eps.check"),
    ('[keys]\nlayer_types = { require_each = "full_attention" }\n', "keys.layer_types.why"),
])
def test_a_map_that_misuses_spellings_rope_or_checks_is_a_load_error(tmp_path, tail, key):
    path = tmp_path / "bad.toml"
    path.write_text(MAP_HEAD + tail)
    with pytest.raises(ConfigMapError) as caught:
        load_config_map(path)
    assert caught.value.key == key and str(path) in str(caught.value)


def test_every_builtin_map_reads_both_dtype_spellings_and_the_rope():
    for m in builtin_maps():
        assert ("dtype", "torch_dtype") in m.spellings, m.file
        assert m.rope is not None and dict(m.rope.types)["default"] == (), m.file
