"""The MoE config maps read what transformers 5 writes: ``rope_parameters`` (its theta beats the
map's default), ``num_local_experts`` as a spelling of ``num_experts`` (two spellings that
disagree are refused), ``pad_token_id``, Qwen2-MoE's ``qkv_bias`` and ``layer_types``."""

from __future__ import annotations

import pytest

from fuel.circuit.config_map import ConflictingSpellings, RequirementViolated, UnclassifiedKey, shape_from_config

QWEN3_MOE_V5 = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "decoder_sparse_step": 1, "dtype": "float32", "eos_token_id": None,
    "head_dim": 8, "hidden_act": "silu", "hidden_size": 16, "initializer_range": 0.02,
    "intermediate_size": 32, "max_position_embeddings": 128, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 12, "norm_topk_prob": False,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
    "pad_token_id": None, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "5.24.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 64,
}


def test_transformers_5_qwen3_moe_config_is_read():
    shape = shape_from_config(QWEN3_MOE_V5)
    assert shape.dims["experts"] == 4 and shape.dims["top_k"] == 2
    assert shape.params["rope_theta"] == "10000.0"  # not the map's 1e6 default
    assert shape.params["rope_type"] == "default" and shape.params["rope_scaling"] == ""


def test_the_transformers_4_spelling_is_still_read():
    config = {k: v for k, v in QWEN3_MOE_V5.items() if k not in ("num_local_experts", "rope_parameters")}
    shape = shape_from_config({**config, "num_experts": 4, "rope_theta": 5e5})
    assert shape.dims["experts"] == 4 and shape.params["rope_theta"] == "500000.0"


def test_two_spellings_that_disagree_are_refused_naming_both():
    with pytest.raises(ConflictingSpellings, match="num_local_experts.*num_experts"):
        shape_from_config({**QWEN3_MOE_V5, "num_experts": 8})


def test_an_unknown_rope_parameters_sub_key_is_refused():
    config = {**QWEN3_MOE_V5, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                   "partial_rotary_factor": 0.5}}
    with pytest.raises(UnclassifiedKey, match="rope_parameters.partial_rotary_factor"):
        shape_from_config(config)


def test_llama3_rope_parameters_carry_their_scaling():
    scaling = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = shape_from_config({**QWEN3_MOE_V5, "rope_parameters": scaling})
    assert shape.params["rope_type"] == "llama3" and shape.params["rope_theta"] == "500000.0"
    assert "factor=8.0" in shape.params["rope_scaling"]


def test_qwen2_moe_requires_its_q_k_v_biases():
    config = {"model_type": "qwen2_moe", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "moe_intermediate_size": 8,
              "shared_expert_intermediate_size": 8, "vocab_size": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "num_hidden_layers": 2, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "layer_types": ["full_attention"] * 2}
    assert shape_from_config(config).params["attention_block"] == "bias"
    with pytest.raises(RequirementViolated, match="qkv_bias"):
        shape_from_config({**config, "qkv_bias": False})
