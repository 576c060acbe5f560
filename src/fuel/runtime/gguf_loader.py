"""Reading a llama-family GGUF file into Hugging Face terms.

A GGUF (llama.cpp's file format) carries three things fuel needs, each spelled llama.cpp's way:
the tensors (often block-quantized, named ``blk.{i}.attn_q.weight``), the model's
hyper-parameters (``llama.block_count`` ...), and the tokenizer (``tokenizer.ggml.*``). This
module reads one file and hands all three back in the spelling a Hugging Face checkpoint uses,
so everything downstream (the circuit's ``binding`` paths, the config map, the transformers
oracle) sees one vocabulary of names.

What is decided here, and what always holds:

- Tensor names map one to one onto Hugging Face checkpoint names (:func:`hf_tensor_name`); a
  tensor this module cannot name is an error naming it, never skipped.
- Every tensor is dequantized to float32 with the ``gguf`` package (the same code llama.cpp's
  Python tools use). The array shape is the Hugging Face one (``[out_features, in_features]``
  for a linear weight): GGUF lists dims innermost first, ``gguf`` returns them outermost first.
- llama.cpp's converter permutes the rows of the Q and K projections so rotary embedding
  rotates adjacent pairs instead of the two halves of each head. :func:`unpermute_rotary_rows`
  undoes exactly that, so the result equals the Hugging Face layout (rotate-half RoPE).
- :func:`hf_config` emits the keys of a Hugging Face ``LlamaForCausalLM`` ``config.json``. Values
  the GGUF records come from it; the few a GGUF cannot know (training-only settings such as
  ``initializer_range``) take ``LlamaConfig``'s defaults and are listed in
  :data:`CONFIG_KEYS_NOT_IN_GGUF`.
- A missing file raises :class:`WeightsFileMissing`; a file ``gguf`` cannot parse, or one that
  lacks a key this module needs, raises :class:`CorruptWeightsFile` / :class:`UnsupportedGguf`
  naming the file and the key.
"""

from __future__ import annotations

import functools
import sys

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuel.errors import FuelError


class WeightsFileMissing(FuelError):
    """A weights file or folder that does not exist."""

    def __init__(self, path: str, what: str = "weights file"):
        self.path = path
        self.what = what
        super().__init__(f"{path}: no such {what}")


class CorruptWeightsFile(FuelError):
    """A weights file that exists but cannot be read (truncated, not the format it claims)."""

    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: cannot read weights: {detail}")


class UnsupportedGguf(FuelError):
    """A readable GGUF describing something fuel does not map (another architecture, an unknown
    tensor, a missing hyper-parameter). ``key`` is the metadata key or tensor name."""

    def __init__(self, path: str, key: str, detail: str):
        self.path = path
        self.key = key
        self.detail = detail
        super().__init__(f"{path}: key `{key}`: {detail}")


# Keys of a Hugging Face LlamaForCausalLM config.json that a GGUF does not record. Their values
# are LlamaConfig's defaults; none of them changes inference (they are training or tooling
# settings, or fixed for every llama-architecture GGUF).
CONFIG_KEYS_NOT_IN_GGUF: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "is_llama_config": True,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rope_interleaved": False,
    "use_cache": True,
}

# GGUF tensor name (per layer: after ``blk.{i}.``) → Hugging Face name (after ``model.layers.{i}.``).
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a llama GGUF tensor, or None when it has none."""
    if match := _LAYER_NAME.match(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
        return None
    if match := _GLOBAL_NAME.match(gguf_name):
        part, kind = match.groups()
        if part in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[part]}.{kind}"
    return None


def unpermute_rotary_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for ``heads`` heads.

    llama.cpp's ``convert_hf_to_gguf.py`` reorders each head's rows from
    ``[first half, second half]`` to interleaved pairs (``reshape(heads, 2, d/2)`` then swap the
    last two axes). Reading them back as ``(heads, d/2, 2)`` and swapping again restores the
    Hugging Face order. Works for a weight ``[heads*d, in]`` and a bias ``[heads*d]`` alike.
    """
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permute_rotary_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation itself (the inverse of :func:`unpermute_rotary_rows`)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(frozen=True, slots=True)
class GgufModel:
    """A parsed GGUF: its path, its metadata (plain Python values) and its raw tensors.

    ``metadata`` maps every key to a str, int, float, bool or list of those (token lists stay
    lists of str). Tensors are read lazily by :meth:`hf_tensors`.
    """

    path: Path
    metadata: Mapping[str, Any]
    _reader: Any

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self._reader.tensors]

    def hf_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` per tensor, in file order, Q/K rows unpermuted."""
        from gguf import quants

        heads = self.required_int("attention.head_count")
        kv_heads = int(self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads))
        for tensor in self._reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                raise UnsupportedGguf(
                    str(self.path), tensor.name, "tensor has no Hugging Face llama counterpart"
                )
            try:
                # A copy: an F32 tensor comes back as a read-only view of the memory-mapped file.
                array = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            except (NotImplementedError, ValueError) as error:
                raise UnsupportedGguf(
                    str(self.path), tensor.name, f"cannot dequantize {tensor.tensor_type.name}: {error}"
                ) from error
            expected = tuple(int(d) for d in reversed(tensor.shape))
            if array.shape != expected:
                array = array.reshape(expected)
            if ".self_attn.q_proj." in name:
                array = unpermute_rotary_rows(array, heads)
            elif ".self_attn.k_proj." in name:
                array = unpermute_rotary_rows(array, kv_heads)
            yield name, array

    def required_int(self, suffix: str) -> int:
        """``{arch}.{suffix}`` as an int; a missing key, or a value that is no integer, is an
        error naming it."""
        key = f"{self.architecture}.{suffix}"
        if key not in self.metadata:
            raise UnsupportedGguf(str(self.path), key, "required hyper-parameter is missing")
        return _metadata_int(self.metadata, key, str(self.path))

    def required_float(self, suffix: str) -> float:
        key = f"{self.architecture}.{suffix}"
        if key not in self.metadata:
            raise UnsupportedGguf(str(self.path), key, "required hyper-parameter is missing")
        return _float32_shortest(self.metadata[key])


@functools.cache
def _reader_class():
    """``gguf.GGUFReader`` with the metadata read straight into Python values.

    The library's reader keeps every metadata value as numpy slices of its memory map: two per
    string, and a tokenizer's 49,152 tokens and 48,900 merges made ~200,000 of them, ~1 s of a
    cold first token here (3 s through ``numpy.memmap``'s own slicing). This reader parses the
    key/value section with ``struct`` and numpy's bulk readers into ``values`` (key -> str, int,
    float, bool or a list of them: what :func:`_field_value` makes of the library's fields; a
    test compares the two on the shipped file) and keeps as a field only what the reader itself
    reads back (``general.alignment``). The tensor index and data are the library's, read from
    the same mapping through a plain ndarray view (slicing in C). A big-endian file is read by
    the library's own code."""
    import struct
    from collections import OrderedDict

    import numpy as np
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    scalars = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
               GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
               GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
               GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}

    class FastReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = np.asarray(value)

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I" or sys.byteorder != "little":
                self.values = None
                return super()._build_fields(offs, count)
            buffer = memoryview(self._plain)
            self.values = OrderedDict()

            def string(at: int) -> tuple[str | bytes, int]:
                (length,) = struct.unpack_from("<Q", buffer, at)
                end = at + 8 + length
                if end > len(buffer):
                    raise ValueError(f"a string of {length} bytes at offset {at} runs past the file")
                return bytes(buffer[at + 8:end]), end

            def value(kind: GGUFValueType, at: int) -> tuple[Any, int]:
                if kind == GGUFValueType.STRING:
                    raw, at = string(at)
                    return raw.decode("utf-8"), at
                code = scalars.get(kind)
                if code is not None:
                    return struct.unpack_from("<" + code, buffer, at)[0], at + struct.calcsize(code)
                if kind != GGUFValueType.ARRAY:
                    raise ValueError(f"Unknown/unhandled field type {kind}")
                inner, length = struct.unpack_from("<IQ", buffer, at)
                inner, at = GGUFValueType(inner), at + 12
                code = scalars.get(inner)
                if code is not None:
                    size = struct.calcsize(code) * length
                    if at + size > len(buffer):
                        raise ValueError(f"an array of {length} at offset {at} runs past the file")
                    items = np.frombuffer(buffer, np.dtype("<" + code), length, at).tolist()
                    return items, at + size
                items = []
                for _ in range(length):
                    item, at = value(inner, at)
                    items.append(item)
                return items, at

            for _ in range(count):
                start = offs
                key, offs = string(offs)
                name = key.decode("utf-8")
                if name in self.values or name in self.fields:
                    raise KeyError(f"Duplicate {name} already in list at offset {start}")
                (raw,) = struct.unpack_from("<I", buffer, offs)
                kind = GGUFValueType(raw)
                try:
                    self.values[name], offs = value(kind, offs + 4)
                except UnicodeDecodeError as error:
                    self.values[name] = error  # named with its key by read_gguf
                    offs = _skip(buffer, kind, offs + 4)
                if name == "general.alignment":
                    self._push_field(ReaderField(
                        start, name, [np.array([self.values[name]], dtype=np.uint64)
                                      if kind != GGUFValueType.UINT32
                                      else np.array([self.values[name]], dtype=np.uint32)],
                        [0], [kind]), skip_sum=True)
            return offs

    def _skip(buffer, kind, at: int) -> int:
        """The offset past a value whose text is not UTF-8 (the error is reported by key)."""
        if kind == GGUFValueType.STRING:
            (length,) = struct.unpack_from("<Q", buffer, at)
            return at + 8 + length
        if kind in scalars:
            return at + struct.calcsize(scalars[kind])
        inner, length = struct.unpack_from("<IQ", buffer, at)
        at += 12
        for _ in range(length):
            at = _skip(buffer, GGUFValueType(inner), at)
        return at

    return FastReader


def read_gguf(path: str | Path) -> GgufModel:
    """Parse a GGUF file's header, metadata and tensor index (tensor data stays memory-mapped)."""
    GGUFReader = _reader_class()  # noqa: N806 — the library's reader, faster (see there)

    path = Path(path)
    if not path.is_file():
        raise WeightsFileMissing(str(path), "GGUF file")
    try:
        reader = GGUFReader(path)
    except Exception as error:  # gguf raises ValueError, struct.error, IndexError... on bad bytes
        raise CorruptWeightsFile(str(path), f"not a readable GGUF ({type(error).__name__}: {error})") from error
    metadata = {}
    for key, field in reader.fields.items():
        if reader.values is not None and key not in ("GGUF.version", "GGUF.tensor_count",
                                                     "GGUF.kv_count"):
            continue  # read into ``values`` (below), in the file's order
        try:
            metadata[key] = _field_value(field)
        except UnicodeDecodeError as error:
            raise CorruptWeightsFile(str(path), f"metadata key `{key}`: a string that is not valid "
                                                f"UTF-8 (byte 0x{error.object[error.start]:02x})") from None
    for key, value in (reader.values or {}).items():
        if isinstance(value, UnicodeDecodeError):
            raise CorruptWeightsFile(str(path), f"metadata key `{key}`: a string that is not valid "
                                                f"UTF-8 (byte 0x{value.object[value.start]:02x})")
        metadata[key] = value
    model = GgufModel(path, metadata, reader)
    if model.architecture != "llama":
        raise UnsupportedGguf(
            str(path), "general.architecture",
            f"architecture {model.architecture!r} is not mapped (fuel reads llama-architecture GGUFs)",
        )
    return model


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[index]).decode("utf-8") for index in field.data]
        return [part.tolist()[0] for part in (field.parts[index] for index in field.data)]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]].tolist()[0]
    if field.types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value


def _float32_shortest(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips it (1e-05, not
    9.999999747378752e-06), which is how the original config.json spelled it."""
    return float(str(np.float32(value)))


def hf_config(model: GgufModel) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a llama GGUF, keys sorted as transformers writes them."""
    meta = model.metadata
    path = str(model.path)
    arch = model.architecture
    heads = model.required_int("attention.head_count")
    hidden = model.required_int("embedding_length")
    if f"{arch}.attention.key_length" in meta:
        head_dim = _metadata_int(meta, f"{arch}.attention.key_length", path)
    else:  # a head count of 0 is refused below, with the other values, by the config's checks
        head_dim = hidden // heads if heads > 0 else 0
    if f"{arch}.vocab_size" in meta or "tokenizer.ggml.tokens" not in meta:
        vocab_size = model.required_int("vocab_size")
    else:
        vocab_size = len(meta["tokenizer.ggml.tokens"])
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = _metadata_int(meta, kv_key, path) if kv_key in meta else heads
    config: dict[str, Any] = dict(CONFIG_KEYS_NOT_IN_GGUF)
    config.update(
        architectures=["LlamaForCausalLM"],
        bos_token_id=_optional_int(meta, "tokenizer.ggml.bos_token_id", path),
        eos_token_id=_optional_int(meta, "tokenizer.ggml.eos_token_id", path),
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=model.required_int("feed_forward_length"),
        max_position_embeddings=model.required_int("context_length"),
        model_type="llama",
        num_attention_heads=heads,
        num_hidden_layers=model.required_int("block_count"),
        num_key_value_heads=kv_heads,
        rms_norm_eps=model.required_float("attention.layer_norm_rms_epsilon"),
        rope_scaling=_rope_scaling(meta, arch, path),
        rope_theta=_rope_theta(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        # A GGUF of a tied model carries no separate output matrix.
        tie_word_embeddings="output.weight" not in model.tensor_names(),
        torch_dtype="float32",
        vocab_size=vocab_size,
    )
    pad = _optional_int(meta, "tokenizer.ggml.padding_token_id", path)
    if pad is not None:
        config["pad_token_id"] = pad
    config = dict(sorted(config.items()))
    # The config's own checks (positive sizes, kv heads dividing q heads, ...) before any tensor
    # is read: the tensors are un-permuted by these head counts.
    from fuel.circuit.config_map import ConfigRefused, shape_from_config

    try:
        shape_from_config(config, path)
    except ConfigRefused as refused:
        # named by the GGUF key the value came from (the config key beside it)
        gguf_key = _GGUF_KEY_OF.get(refused.key or "")
        if gguf_key is None:
            raise
        raise UnsupportedGguf(path, f"{arch}.{gguf_key}",
                              f"(config `{refused.key}`) {refused.detail}") from None
    rope_key = f"{arch}.rope.dimension_count"
    rope_dims = _metadata_int(meta, rope_key, path) if rope_key in meta else None
    if rope_dims is not None and rope_dims != head_dim:
        raise UnsupportedGguf(
            path, rope_key,
            f"partial rotary ({rope_dims} of {head_dim} head dims) has no LlamaConfig spelling",
        )
    return config


_GGUF_KEY_OF = {
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
    "vocab_size": "vocab_size", "head_dim": "attention.key_length",
}
"""The ``{arch}.*`` GGUF key each config value :func:`hf_config` writes comes from."""


def _rope_theta(value: Any) -> int | float:
    """An integral base is written as an integer (``100000``), as SmolLM2's published config
    writes it, so plans built from the GGUF and from the published config carry the same
    ``rope_theta`` text."""
    theta = _float32_shortest(value)
    return int(theta) if theta.is_integer() else theta


def _optional_int(meta: Mapping[str, Any], key: str, path: str) -> int | None:
    return _metadata_int(meta, key, path) if key in meta else None


def _metadata_int(meta: Mapping[str, Any], key: str, path: str) -> int:
    """An integer metadata value; a float (2.5 layers), string or list there is an error naming
    the key, never truncated or parsed (llama.cpp refuses a key of the wrong type too)."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedGguf(path, key, f"is {value!r} ({type(value).__name__}), not an integer")
    return value


def _rope_scaling(meta: Mapping[str, Any], arch: str, path: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32_shortest(meta[f"{arch}.rope.scaling.factor"])}
    raise UnsupportedGguf(path, f"{arch}.rope.scaling.type", f"rope scaling {kind!r} is not mapped")
