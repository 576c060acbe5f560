"""Tiny random mixture-of-experts checkpoints written by transformers' own model classes.

One per MoE family fuel serves (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with q/k
norm), two layers and small dims, saved with ``save_pretrained`` (so the config keys and tensor
names are exactly what the installed transformers writes) plus a character-level
``tokenizer.json``, so ``fuel run FOLDER`` can run them. Written once per test process
(:func:`checkpoint` is cached) into a temporary folder.

Parameters are redrawn at a larger scale than transformers' initializer (std 0.02 makes every
logit nearly equal, which would let a wrong kernel pass a 1e-4 comparison): projections
N(0, 0.25), router N(0, 1) so routing is decisive, norm gains 1 + N(0, 0.1), biases N(0, 0.1).
"""

from __future__ import annotations

import functools
import json
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)

FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    # norm_topk_prob False (Qwen1.5-MoE's setting) and a shared expert with its sigmoid gate.
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16,
                      shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2),
    # norm_topk_prob True (Qwen3-30B-A3B's setting), 8 experts so a step reads fewer than all.
    "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True),
}

CHARACTERS = ["<unk>", "<eos>", *string.ascii_lowercase, *string.ascii_uppercase, " ", ".", ",",
              "!", "?", "'"]


@dataclass(frozen=True)
class MoeCheckpoint:
    family: str
    folder: Path
    model: Any
    """The transformers model the folder was saved from (f32, eval, eager attention)."""
    experts: int
    top_k: int


def _classes(family: str):
    import transformers

    names = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}[family]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def _redraw(model: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("gate.weight") and "shared_expert" not in name:
                parameter.copy_(noise)  # the router
            elif parameter.dim() == 1 and "norm" in name:
                parameter.copy_(1.0 + 0.1 * noise)
            elif parameter.dim() == 1:
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(0.25 * noise)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARACTERS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))


@functools.cache
def checkpoint(family: str, seed: int = 0) -> MoeCheckpoint:
    """The tiny ``family`` checkpoint (written on first use in this process)."""
    import torch

    config_class, model_class = _classes(family)
    config = config_class(**COMMON, **FAMILIES[family])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _redraw(model, seed)
    folder = Path(tempfile.mkdtemp(prefix=f"fuel-tiny-{family}-"))
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    experts = FAMILIES[family].get("num_experts") or FAMILIES[family]["num_local_experts"]
    return MoeCheckpoint(family, folder, model, experts, FAMILIES[family]["num_experts_per_tok"])


def reference_logits(model: Any, ids: list[int]):
    """transformers' f32 logits ``[len(ids), vocab]`` of one full forward over ``ids``."""
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def reference_experts(model: Any, ids: list[int], top_k: int) -> list[set[int]]:
    """Per MoE layer, the set of experts transformers routes ``ids`` to (one forward)."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    return [set(torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices.reshape(-1).tolist())
            for logits in out.router_logits]
