"""Weights in their stored formats: a GGUF's block-quantized tensors kept packed, converted once.

Decides how ``--dtype stored`` reads a GGUF (a checkpoint folder's int8 weights:
:mod:`fuel.runtime.int8_checkpoint`): every tensor whose type is a llama.cpp block format
(:data:`fuel.kernels.quant_blocks.GGUF_TYPES`) stays as its file bytes, a u8 tensor
``[rows, row_bytes]`` (the layout the quantized kernels read; Q4_1 and Q8_0 rows with their
bytes regrouped, :func:`held_format`); plain tensors (F32/F16/BF16:
norm gains) are f32. The result is written once to the cache as a Hugging Face style folder
(``config.json``, ``model.safetensors`` with the formats in its metadata, the tokenizer files)
and loaded from there.

Invariants:
- Same packed bytes as the file, reordered only where llama.cpp's converter permuted rows (Q and
  K projections: :func:`~fuel.runtime.gguf_loader.unpermute_rotary_rows` moves whole rows, so a
  block never straddles it) and, within each row, where a format is held regrouped
  (:func:`held_format`: Q4_1 and Q8_0 as ``gguf/q4_1x8``, ``gguf/q8_0x8``, the native decode
  kernels' layouts), so dequantizing a packed row equals the f32 conversion's row.
- The cache folder's name carries the SHA-256 of the GGUF bytes and :data:`STORED_VERSION`; it
  is written into a staging folder and renamed into place (an interrupted conversion leaves
  nothing; two converters end with one complete folder).
- A tensor type fuel cannot run raises
  :class:`~fuel.kernels.quant_blocks.UnsupportedTensorType` naming the tensor and its type.
- Resident weight bytes are the packed bytes plus the f32 plain tensors (:func:`resident_bytes`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fuel.progress import Listener, Task
from fuel.runtime.gguf_loader import CorruptWeightsFile, UnsupportedGguf, WeightsFileMissing

STORED_VERSION = 3
"""Bump when the stored folder's content would change for the same GGUF bytes (3: Q4_1 and
Q8_0 held regrouped, ``gguf/q4_1x8`` and ``gguf/q8_0x8``)."""

HELD_REGROUPED = {"gguf/q4_1": "gguf/q4_1x8", "gguf/q8_0": "gguf/q8_0x8"}
"""File formats a stored run holds in fuel's regrouped layout (:data:`fuel.circuit.format.REGROUPED`).
Why (SmolLM2's file, 2 threads, weights from memory): the 8-bit-activation decode kernels stream
its 120 q4_1 products in 0.84x the time regrouped and its q8_0 LM head in 0.79x
(``benchmarks/bench_run.py --stored`` measures the whole decode); the other formats keep the
file's order."""


def held_format(file_format: str) -> str:
    """The format a stored run holds a tensor of ``file_format`` in (``gguf/q4_1`` ->
    ``gguf/q4_1x8``; every other format as the file stores it)."""
    return HELD_REGROUPED.get(file_format, file_format)

_FORMATS_KEY = "fuel.formats"


def logical_shape(tensor: Any, format_name: str | None) -> tuple[int, ...]:
    """The model-facing shape of a tensor held in ``format_name`` (None: its own shape)."""
    shape = tuple(int(d) for d in tensor.shape)
    if format_name is None or str(tensor.dtype) != "torch.uint8":
        return shape  # a plain tensor, or a half-precision matrix held as itself
    from fuel.circuit.format import row_cols, row_layout

    layout = row_layout(format_name)
    if layout is None:
        raise ValueError(f"`{format_name}` is not a packed-row format")
    return (*shape[:-1], row_cols(layout, shape[-1]))


def stored_folder(path: Path, cache: Path | None = None) -> Path:
    from fuel.runtime.weights import cache_dir, gguf_digest

    key = f"{path.stem}-{gguf_digest(path, cache)[:16]}-stored-v{STORED_VERSION}"
    return (cache or cache_dir()) / "weights" / key


def packed_tensors(model: Any, task: Task | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """``(tensors, formats)`` of a parsed GGUF: packed u8 rows for block types, f32 otherwise
    (``task`` advanced once per tensor)."""
    import numpy as np
    import torch
    from gguf import quants

    from fuel.circuit.format import row_layout
    from fuel.kernels.quant_blocks import PLAIN_GGUF_TYPES, UnsupportedTensorType, format_of_gguf_type, regroup
    from fuel.runtime.gguf_loader import hf_tensor_name, unpermute_rotary_rows

    heads = model.required_int("attention.head_count")
    kv_heads = int(model.metadata.get(f"{model.architecture}.attention.head_count_kv", heads))
    tensors: dict[str, Any] = {}
    formats: dict[str, str] = {}
    for tensor in model._reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise UnsupportedGguf(str(model.path), tensor.name,
                                  "tensor has no Hugging Face llama counterpart")
        type_name = tensor.tensor_type.name
        fmt = format_of_gguf_type(type_name)
        if fmt is None:
            raise UnsupportedTensorType(str(model.path), tensor.name, type_name)
        logical = tuple(int(d) for d in reversed(tensor.shape))
        if type_name in PLAIN_GGUF_TYPES:
            array = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(logical)
        else:
            array = np.array(tensor.data, dtype=np.uint8).reshape(logical[0] if len(logical) > 1 else 1, -1)
            formats[name] = held_format(fmt.name())
        if ".self_attn.q_proj." in name:
            array = unpermute_rotary_rows(array, heads)
        elif ".self_attn.k_proj." in name:
            array = unpermute_rotary_rows(array, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
        if name in formats and formats[name] != fmt.name():
            tensors[name] = regroup(tensors[name], row_layout(formats[name]), logical[-1])
        if task is not None:
            task.advance()
    return tensors, formats


def convert_gguf_stored(path: str | Path, *, cache: Path | None = None,
                        progress: bool | Listener = True) -> Path:
    """Write the stored-format folder of a GGUF into the cache, once; return the folder. Like
    :func:`~fuel.runtime.weights.convert_gguf`: staged, checksummed at conversion
    (:mod:`fuel.runtime.cache_integrity`), verified before use, rebuilt when damaged (refused in
    one line where the cache is read-only), and a full or read-only cache is one error line.
    ``progress`` is told about the conversion (:func:`fuel.progress.listener_of`)."""
    from safetensors.torch import save_file

    from fuel.runtime.cache_integrity import clean_stale_staging
    from fuel.runtime.gguf_loader import hf_config, read_gguf
    from fuel.runtime.tokenizer import tokenizer_from_gguf_metadata
    from fuel.runtime.weights import _usable_cache, write_cache_folder

    path = Path(path)
    if not path.is_file():
        raise WeightsFileMissing(str(path), "GGUF file")
    final = stored_folder(path, cache)
    clean_stale_staging(final.parent, final.name)
    if _usable_cache(final):
        return final
    model = read_gguf(path)
    config = hf_config(model)
    tokenizer = tokenizer_from_gguf_metadata(model.metadata, source=str(path))
    from fuel.progress import listener_of

    listener = listener_of(progress)
    with listener.task(f"converting {path.name} (stored formats, once)",
                       total=len(model._reader.tensors)) as task:
        tensors, formats = packed_tensors(model, task)

    def fill(stage: Path) -> None:
        save_file(tensors, str(stage / "model.safetensors"), metadata={
            "format": "pt", "converted_from": path.name,
            _FORMATS_KEY: json.dumps(formats, sort_keys=True)})
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(stage)

    with listener.task(f"writing {final.name} (checksummed)"):
        write_cache_folder(final, fill)
    return final


def load_stored(path: str | Path, *, cache: Path | None = None,
                progress: bool | Listener = True):
    """:class:`~fuel.runtime.weights.Weights` of a GGUF in its stored formats (``dtype`` STORED)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from fuel.runtime.weights import DType, SourceKind, Weights, WeightsSource

    path = Path(path)
    folder = convert_gguf_stored(path, cache=cache, progress=progress)
    target = folder / "model.safetensors"
    try:
        with safe_open(str(target), framework="pt") as handle:
            formats = json.loads((handle.metadata() or {}).get(_FORMATS_KEY, "{}"))
        tensors = load_file(str(target))
        config = json.loads((folder / "config.json").read_text())
    except (SafetensorError, OSError, ValueError) as error:
        raise CorruptWeightsFile(str(target), f"not a readable stored-format cache ({error})") from error
    if not isinstance(formats, dict) or any(name not in tensors for name in formats):
        raise CorruptWeightsFile(str(target), f"metadata `{_FORMATS_KEY}` names tensors it lacks")
    aliases: dict[str, str] = {}
    if config.get("tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return Weights(tensors, config, WeightsSource(path, SourceKind.GGUF, folder), DType.STORED,
                   aliases, formats)


def resident_bytes(weights: Mapping[str, Any]) -> int:
    """Bytes of distinct weight storage (packed bytes as they are, aliases once)."""
    seen: set[int] = set()
    total = 0
    for tensor in getattr(weights, "tensors", weights).values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def weight_formats(weights: Mapping[str, Any]) -> dict[str, int]:
    """Distinct weight bytes per format name (plain tensors under their dtype: ``f32``)."""
    packed = getattr(weights, "formats", {})
    out: dict[str, int] = {}
    for name, tensor in getattr(weights, "tensors", weights).items():
        fmt = packed.get(name) or str(tensor.dtype).removeprefix("torch.").replace("float", "f")
        out[fmt] = out.get(fmt, 0) + tensor.numel() * tensor.element_size()
    return dict(sorted(out.items()))


class PlannedWeights(Mapping[str, tuple[int, ...]]):
    """Weight shapes by binding path as a stored-format run binds them (packed ``[rows,
    row_bytes]`` for block tensors), with their formats: what lowering needs to plan a GGUF's
    step without reading its tensor data."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], formats: Mapping[str, str],
                 aliases: Mapping[str, str]):
        self._shapes, self.formats, self.aliases = dict(shapes), dict(formats), dict(aliases)

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return self._shapes[self.aliases.get(name, name)]

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def format_of(self, name: str) -> str | None:
        return self.formats.get(self.aliases.get(name, name))


def stored_formats(path: str | Path) -> dict[str, Any]:
    """Binding path → stored :class:`~fuel.circuit.format.Format` of every tensor of a GGUF
    (block tensors their ``gguf/<layout>``, plain ones their float format), aliases included; a
    checkpoint folder or one of its ``.safetensors`` files: its tensors' formats from the headers
    (int8 weights ``int8/channel``: :func:`fuel.runtime.int8_checkpoint.checkpoint_formats`)."""
    from fuel.runtime.gguf_loader import read_gguf

    if Path(path).is_dir() or Path(path).suffix == ".safetensors":
        from fuel.runtime.int8_checkpoint import checkpoint_formats

        return checkpoint_formats(path)
    from fuel.kernels.quant_blocks import format_of_gguf_type

    planned = planned_weights(path)
    model = read_gguf(path)
    from fuel.runtime.gguf_loader import hf_tensor_name

    out = {hf_tensor_name(t.name): format_of_gguf_type(t.tensor_type.name) for t in model._reader.tensors}
    for alias, target in planned.aliases.items():
        out[alias] = out[target]
    return out


def planned_weights(path: str | Path) -> PlannedWeights:
    """The packed shapes and formats of a GGUF's tensors, from its header alone."""
    from fuel.kernels.quant_blocks import PLAIN_GGUF_TYPES, UnsupportedTensorType, format_of_gguf_type
    from fuel.runtime.gguf_loader import hf_tensor_name, read_gguf

    model = read_gguf(path)
    shapes: dict[str, tuple[int, ...]] = {}
    formats: dict[str, str] = {}
    for tensor in model._reader.tensors:
        name = hf_tensor_name(tensor.name)
        fmt = format_of_gguf_type(tensor.tensor_type.name)
        if name is None:
            raise UnsupportedGguf(str(model.path), tensor.name, "tensor has no Hugging Face llama counterpart")
        if fmt is None:
            raise UnsupportedTensorType(str(model.path), tensor.name, tensor.tensor_type.name)
        logical = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.tensor_type.name in PLAIN_GGUF_TYPES:
            shapes[name] = logical
        else:
            shapes[name] = tuple(int(d) for d in tensor.data.shape)
            formats[name] = held_format(fmt.name())
    aliases = {} if "lm_head.weight" in shapes else {"lm_head.weight": "model.embed_tokens.weight"}
    return PlannedWeights(shapes, formats, aliases)


def decode_traffic(weights: Any, spec: Any = None) -> dict[str, Any]:
    """What one decode step reads of the weights, by format, and the bandwidth floor for it.

    Every distinct tensor is read once per token, except an untied embedding (one row of it);
    a tied embedding is read whole as the LM head. The rate is ``spec``'s bandwidth, by default
    the ``cpu-local`` probe's (a measured copy rate, cached per machine: ``fuel devices``)."""
    from fuel.cost import device

    by_format = weight_formats(weights)
    read = sum(by_format.values())
    tensors = getattr(weights, "tensors", weights)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and not getattr(weights, "tied_embeddings", False):
        read -= embed.numel() * embed.element_size() - embed[0].numel() * embed.element_size()
    spec = spec if spec is not None else device("cpu-local", halves=())  # the bandwidth only
    rate = spec.bandwidth_bytes_per_s
    return {
        "formats": by_format,
        "resident_bytes": resident_bytes(weights),
        "bytes_per_token": read,
        "bandwidth_bytes_per_s": rate,
        "bandwidth_source": spec.sources.get("bandwidth", "cpu-local probe"),
        "floor_ms_per_token": round(read / rate * 1e3, 3) if rate > 0 else None,
        "floor_tokens_per_s": round(rate / read, 2) if read > 0 and rate > 0 else None,
    }


__all__ = ["HELD_REGROUPED", "PlannedWeights", "STORED_VERSION", "decode_traffic", "held_format", "planned_weights", "stored_formats", "convert_gguf_stored", "load_stored", "logical_shape",
           "packed_tensors", "resident_bytes", "stored_folder", "weight_formats"]
