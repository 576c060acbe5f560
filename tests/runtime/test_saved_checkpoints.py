"""Checkpoints written by the installed transformers' ``save_pretrained`` (issue 20): fuel
reads their transformers-5 ``config.json`` and, for each dense family it runs (llama, qwen2,
qwen3), its logits equal transformers' in f32; for the MoE families the saved config plans.

Each model is tiny and random (2 layers, hidden 64) so the module stays fast."""

from __future__ import annotations

import json

import pytest
import torch

from fuel.circuit import zoo
from fuel.circuit.config_map import shape_from_file
from fuel.circuit.fuser import AvailableKernels, fuse
from fuel.circuit.policy import build_policy
from fuel.circuit.rules import Mode, load_builtin_rules
from fuel.runtime.engine import Engine
from fuel.runtime.weights import load_weights

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=97, max_position_embeddings=256)

# f32 on both sides; fuel's kernels only reorder sums (measured: at most 3.6e-6 on logits of
# magnitude ~6 with the randomized weights below).
TOLERANCE = 1e-4


def _dense(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if family == "qwen2":
        return Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return Qwen3Config(**TINY, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def saved(request, tmp_path_factory):
    """A random checkpoint folder written by save_pretrained and the model it came from."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _dense(request.param)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    # transformers initializes biases to zero and norm gains to one; randomize every tensor so
    # the q/k/v biases (qwen2) and q/k norms (qwen3) change the logits and are checked.
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(1.0 if "norm" in name else 0.0, 0.2)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, folder, model


def test_save_pretrained_writes_the_transformers_5_spellings(saved):
    family, folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in config and "rope_theta" not in config
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    if family != "llama":
        assert config["layer_types"] == ["full_attention"] * 2
    shape = shape_from_file(folder / "config.json")
    assert shape.params["attention_block"] == {"llama": "plain", "qwen2": "bias", "qwen3": "qk_norm"}[family]


def test_a_saved_checkpoint_runs_with_transformers_logits(saved):
    family, folder, model = saved
    engine = Engine(load_weights(folder, progress=False), max_context=64, max_sequences=1)
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_sequence("s")
    prefill = engine.step(Mode.PREFILL, [("s", ids)]).logits
    tokens, decoded = list(ids), []
    for _ in range(3):
        token = int(torch.argmax((decoded or [prefill])[-1][-1]))
        tokens.append(token)
        decoded.append(engine.step(Mode.DECODE, [("s", [token])]).logits)
    with torch.inference_mode():
        reference = model(torch.tensor([tokens])).logits[0]
    diff = max((prefill - reference[:12]).abs().max().item(),
               (torch.cat(decoded) - reference[12:]).abs().max().item())
    assert reference.abs().max().item() > 1.0, "the logits are large enough to show an error"
    assert diff <= TOLERANCE, f"{family}: logits differ from transformers' by {diff:.2e}"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_saved_moe_config_instantiates_and_plans(tmp_path, family):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls, extra = {
        "mixtral": (MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen2_moe": (Qwen2MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
        "qwen3_moe": (Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32}),
    }[family]
    cls(**TINY, **extra).save_pretrained(tmp_path)
    shape = shape_from_file(tmp_path / "config.json")
    assert (shape.arch, shape.dims["experts"], shape.dims["top_k"]) == ("moe_gqa", 4, 2)
    circuit = zoo.circuit_for(shape, draft=False)
    rules = load_builtin_rules("cpu")
    plan = fuse(circuit, rules, AvailableKernels.all_named_by(rules), build_policy(), Mode.DECODE, 1)
    assert plan.launches() > 0
