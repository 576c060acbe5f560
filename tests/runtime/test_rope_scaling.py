"""Llama 3.1's ``llama3`` RoPE scaling: fuel's tables equal transformers' frequencies, and a
tiny random Llama-3.1-style checkpoint runs in fuel with the logits ``LlamaForCausalLM`` gives.

The config is shaped like the published Llama-3.1 config.json (``rope_scaling`` with
``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``,
``rope_type = "llama3"``) at toy sizes; ``original_max_position_embeddings = 64`` with head_dim
16 and theta 500000 puts one frequency in each of the three bands (kept, interpolated,
stretched), and the prompt runs past position 64.
"""

import copy
import json

import pytest
import torch

from fuel.circuit.rules import Mode
from fuel.runtime.engine import Engine
from fuel.runtime.lower import Llama3RopeScaling, rope_inverse_frequencies
from fuel.runtime.weights import load_weights

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64, "rope_type": "llama3"}
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 97,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": SCALING, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def _hf_config():
    from transformers import LlamaConfig

    # A deep copy: transformers standardizes (mutates) the rope dict it is given.
    config = LlamaConfig(**{k: v for k, v in copy.deepcopy(CONFIG).items() if k != "torch_dtype"})
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer random Llama-3.1-style folder (config.json + model.safetensors) and the
    transformers model it was written from."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_hf_config()).eval()
    folder = tmp_path_factory.mktemp("llama31-tiny")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file({name: t.contiguous() for name, t in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return folder, model


def test_llama3_frequencies_equal_transformers_and_cover_all_three_bands():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(), "cpu")
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    got = rope_inverse_frequencies(500000.0, 16, scaling)
    assert attention_factor == 1.0
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    default = rope_inverse_frequencies(500000.0, 16, None)
    ratio = (default / got).tolist()
    assert ratio[0] == 1.0, "the highest frequency is kept"
    assert 1.0 < ratio[1] < 8.0, "a mid frequency is interpolated"
    assert ratio[-1] == pytest.approx(8.0), "low frequencies are stretched by the factor"


def test_a_llama31_checkpoint_runs_with_transformers_logits(checkpoint):
    folder, model = checkpoint
    weights = load_weights(folder, progress=False)
    engine = Engine(weights, max_context=128, max_sequences=1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (80,), generator=gen).tolist()
    engine.add_sequence("s")
    logits = [engine.step(Mode.PREFILL, [("s", ids[start:start + size])]).logits
              for start, size in ((0, 64), (64, 16))]
    tokens = list(ids)
    decoded = []
    for _ in range(6):
        token = int(torch.argmax((decoded or logits)[-1][-1]))
        tokens.append(token)
        decoded.append(engine.step(Mode.DECODE, [("s", [token])]).logits)
    with torch.inference_mode():
        reference = model(torch.tensor([tokens])).logits[0]
    prefill_diff = (torch.cat(logits) - reference[:80]).abs().max().item()
    decode_diff = (torch.cat(decoded) - reference[80:86]).abs().max().item()
    assert prefill_diff <= 1e-3, f"prefill logits differ by {prefill_diff:.2e}"
    assert decode_diff <= 1e-3, f"decode logits differ by {decode_diff:.2e}"
    # The scaling matters at these positions: default RoPE tables would not match.
    program = engine.programs()[-1]
    assert any("llama3=8/1/4/64" in spec.name for spec in program.step.derived)
