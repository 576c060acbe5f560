"""Shared runtime fixtures: a tiny synthetic llama GGUF for fast, exact loader tests (the real
SmolLM2 weights, tokenizer and oracle are session fixtures of tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fuel.runtime.gguf_loader import permute_rotary_rows, unpermute_rotary_rows


@dataclass(frozen=True)
class TinyModel:
    """A synthetic llama GGUF and the Hugging Face tensors it was written from."""

    path: Path
    hf_tensors: dict[str, np.ndarray]
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 4
    hidden: int = 8
    ffn: int = 16
    layers: int = 2


TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "Ġa", "1", "2", "12"]
TINY_TYPES = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1]
TINY_MERGES = ["a b", "Ġ a", "1 2"]


def write_tiny_gguf(
    path: Path,
    *,
    pre: str = "smollm",
    chat_template: str | None = None,
    tied: bool = True,
    architecture: str = "llama",
    seed: int = 0,
    dims: dict[str, int] | None = None,
    quantize: dict[str, str] | None = None,
) -> TinyModel:
    """Write a 2-layer llama GGUF (F32 tensors, llama.cpp's Q/K row order) with a tiny BPE vocab.

    ``dims`` overrides :class:`TinyModel`'s sizes; ``quantize`` maps a GGUF tensor-name suffix
    (``attn_q.weight``) to a block type (``Q4_1``): those tensors are stored quantized by the
    ``gguf`` package and ``hf_tensors`` holds their dequantized values (what the file means)."""
    import gguf
    from gguf import quants

    model = TinyModel(path=path, hf_tensors={}, **(dims or {}))
    rng = np.random.default_rng(seed)
    vocab = len(TINY_TOKENS)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(model.layers)
    writer.add_context_length(64)
    writer.add_embedding_length(model.hidden)
    writer.add_feed_forward_length(model.ffn)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def tensor(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        values = rng.standard_normal(shape).astype(np.float32)
        kind = next((t for suffix, t in (quantize or {}).items() if gguf_name.endswith(suffix)), None)
        stored = permute_rotary_rows(values, permute_heads) if permute_heads else values
        if kind is None:
            model.hf_tensors[hf_name] = values
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        packed = quants.quantize(np.ascontiguousarray(stored) * np.float32(0.1), qtype)
        meant = quants.dequantize(packed, qtype).reshape(shape)
        model.hf_tensors[hf_name] = unpermute_rotary_rows(meant, permute_heads) if permute_heads else meant
        writer.add_tensor(gguf_name, packed, raw_dtype=qtype)

    h, kv = model.hidden, model.kv_heads * model.head_dim
    tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, h))
    for i in range(model.layers):
        prefix, hf = f"blk.{i}", f"model.layers.{i}"
        tensor(f"{prefix}.attn_norm.weight", f"{hf}.input_layernorm.weight", (h,))
        tensor(f"{prefix}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (h, h), model.heads)
        tensor(f"{prefix}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv, h), model.kv_heads)
        tensor(f"{prefix}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv, h))
        tensor(f"{prefix}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (h, h))
        tensor(f"{prefix}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (h,))
        tensor(f"{prefix}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (model.ffn, h))
        tensor(f"{prefix}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (model.ffn, h))
        tensor(f"{prefix}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (h, model.ffn))
    tensor("output_norm.weight", "model.norm.weight", (h,))
    if not tied:
        tensor("output.weight", "lm_head.weight", (vocab, h))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> TinyModel:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def make_tiny_gguf():
    """:func:`write_tiny_gguf` itself, for tests that need variants."""
    return write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_gguf_writer():
    """:func:`write_tiny_gguf` for module- and session-scoped fixtures."""
    return write_tiny_gguf


FAST_PROFILE = {"warmup": 1, "repeats": 3, "min_sample_ns": 20_000}
"""Judge sampling short enough for a test's JIT runs."""


def forced_jit_options(tmp_path: Path, fuel_cache: Path, forced, forced_ns: int):
    """``(table, options)`` of a JIT run whose Judge cells named by ``forced(key)`` read
    ``forced_ns`` (the kernel still runs once on the step's values: a conversion it makes is
    made) and every other cell is timed (:data:`FAST_PROFILE`)."""
    from fuel.cost.profile import Measurement, profile_kernel
    from fuel.jit.native_synth import CpuSynthesizer
    from fuel.kernels import cpu_table
    from fuel.runtime.model import jit_options

    def profile(key, call):
        if forced(key):
            call()
            return Measurement(median_ns=forced_ns, spread_ns=0, samples=1, calls_per_sample=1)
        return profile_kernel(call, **FAST_PROFILE)

    table = cpu_table()
    options = jit_options(table, store_path=tmp_path / "judge.sqlite", profile=profile,
                          synthesizer=CpuSynthesizer(cache_dir=fuel_cache / "jit" / "numba"))
    options.jit.profile_options = FAST_PROFILE
    return table, options
