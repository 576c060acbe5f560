"""Checkpoint folders whose linear weights are stored as per-channel int8 (compressed-tensors).

Decides which quantized checkpoint folders fuel runs and how their tensors are held. A folder's
``config.json`` may carry a ``quantization_config``; fuel runs one kind as it is stored:

- ``quant_method = "compressed-tensors"``, ``format`` ``int-quantized`` or ``naive-quantized``
  (both write int8 tensors for 8-bit int weights; ``pack-quantized`` packs them into int32 and is
  refused), every config group's ``weights`` mapped to ``int8/channel`` by
  :func:`fuel.circuit.quant_config.weight_format_of` (8-bit int, strategy ``channel``,
  symmetric), no ``input_activations`` / ``output_activations`` (weight-only, "W8A16": an
  activation-quantized W8A8 model is not what fuel would compute), no ``kv_cache_scheme``, and
  no sparsity other than ``dense``.
- Its tensors, as compressed-tensors' int-quantized compressor writes them: ``<name>.weight`` int8
  ``[out, in]`` beside ``<name>.weight_scale`` ``[out, 1]`` (float32, bfloat16 or float16: the
  model's dtype); ``weight_zero_point`` is written only for asymmetric schemes. A weight with a
  scale is quantized, one without is a plain float tensor (the config's ``ignore`` list: the LM
  head, the embedding, norms), as compressed-tensors itself decides when it decompresses.

How they are held (:func:`fold_int8`): under ``--dtype stored`` (the default, as for a GGUF)
each quantized weight becomes packed rows of the ``int8_channel`` layout (its int8 row, then its
scale widened to f32: :func:`fuel.kernels.quant_blocks.pack_int8_channel`) with the format
``int8/channel``, and its ``weight_scale`` is folded in (no longer a tensor of its own); under
``f32``/``bf16``/``f16`` it is dequantized (``f32(q) * f32(scale)``, the reference dequantizer's
value) and the run's dtype applies as to any float checkpoint. A 16-bit scale is widened before
the product (exact), so both paths multiply the same f32 weights; compressed-tensors' own
decompression multiplies in the scale's dtype, which for a bf16 scale rounds each weight to bf16.

Invariants:
- A folder with no ``quantization_config`` is not touched here (:func:`check_scheme` says so and
  the loader reads it exactly as before).
- Every refusal is one :class:`QuantizedCheckpointRefused` naming the file (``config.json`` or
  the safetensors shard), the key (a config key or a tensor name) and the value: another quant
  method or format, a scheme fuel does not run, an int8 weight with no scale, a scale with no
  int8 weight, a scale of the wrong shape, dtype or with a non-finite value, a zero point.
- The header reader (:func:`checkpoint_formats`, for planning) and the loader apply the same
  tensor rules, so a folder ``fuel plan`` prices is one ``fuel run`` runs.
- Resident bytes of a stored run: per quantized weight ``rows * (cols + 4)`` (the int8 bytes
  plus an f32 scale a row: the file's own bytes when its scales are f32, two bytes a row more
  when they are 16-bit), every other tensor as the run's dtype holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuel.errors import InputError

SCALE_SUFFIX = "_scale"
SCALE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a ``weight_scale`` may be stored in (widened to f32 exactly)."""

RUN_FORMATS = ("int-quantized", "naive-quantized")
"""compressed-tensors ``format`` values whose 8-bit int weights are int8 tensors."""

FORMAT_NAME = "int8/channel"

_SAFETENSORS_DTYPES = {"I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32",
                       "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
                       "F64": "float64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2"}
"""safetensors header dtype spellings → torch dtype names (what :class:`_Info` compares)."""


class QuantizedCheckpointRefused(InputError):
    """A quantized checkpoint fuel cannot run as it stores it (file, key or tensor, value)."""

    def __init__(self, file: str, key: str, value: Any, detail: str):
        super().__init__(file, key, f"{value!r}: {detail}")


def check_scheme(config_path: str, config: Mapping[str, Any]) -> bool:
    """True when ``config`` describes a checkpoint this module runs (module docs), False when it
    has no ``quantization_config`` (a plain checkpoint); refuses anything else by key."""
    from fuel.circuit.quant_config import weight_format_of

    qc = config.get("quantization_config")
    if qc is None:
        return False
    key = "quantization_config"
    if not isinstance(qc, Mapping):
        raise QuantizedCheckpointRefused(config_path, key, qc, "not an object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise QuantizedCheckpointRefused(
            config_path, f"{key}.quant_method", method,
            "fuel runs compressed-tensors int8 per-channel checkpoints as stored; others are "
            "planned only (fuel plan)")
    fmt = qc.get("format")
    if fmt is not None and fmt not in RUN_FORMATS:
        raise QuantizedCheckpointRefused(config_path, f"{key}.format", fmt,
                                         f"fuel runs {' or '.join(RUN_FORMATS)} (int8 tensors)")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizedCheckpointRefused(config_path, f"{key}.config_groups", groups,
                                         "no config group to read")
    for name in sorted(groups):
        group = groups[name]
        where = f"{key}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise QuantizedCheckpointRefused(config_path, where, group, "not an object")
        mapped = weight_format_of(config_path, {**qc, "config_groups": {name: group}})
        if mapped.name() != FORMAT_NAME:
            raise QuantizedCheckpointRefused(config_path, f"{where}.weights", dict(group["weights"]),
                                             f"fuel runs {FORMAT_NAME} weights; this is {mapped.name()}")
        for side in ("input_activations", "output_activations"):
            if group.get(side) is not None:
                raise QuantizedCheckpointRefused(
                    config_path, f"{where}.{side}", group[side],
                    "fuel runs int8 weight-only checkpoints (activations in f32); an "
                    "activation-quantized model is not what it would compute")
    if qc.get("kv_cache_scheme") is not None:
        raise QuantizedCheckpointRefused(config_path, f"{key}.kv_cache_scheme",
                                         qc["kv_cache_scheme"], "fuel keeps its KV cache in the "
                                         "run's dtype; a quantized KV scheme is not run")
    sparsity = config.get("sparsity_config", qc.get("sparsity_config"))
    if isinstance(sparsity, Mapping) and sparsity.get("format", "dense") != "dense":
        raise QuantizedCheckpointRefused(config_path, f"{key}.sparsity_config.format",
                                         sparsity.get("format"), "fuel runs dense weights only")
    return True


@dataclass(frozen=True, slots=True)
class _Info:
    """What the tensor rules read of a tensor: its torch dtype name, shape and file."""

    dtype: str
    shape: tuple[int, ...]
    file: str


def _scaled_weights(infos: Mapping[str, _Info]) -> dict[str, str]:
    """Weight name → its scale's name for every quantized weight, each pair checked (module
    docs); refuses a lone int8 weight, a lone scale, a zero point, a wrong dtype or shape."""
    pairs: dict[str, str] = {}
    for name in sorted(infos):
        info = infos[name]
        if name.endswith(".weight_zero_point"):
            raise QuantizedCheckpointRefused(info.file, name, list(info.shape),
                                             "a zero point: fuel runs symmetric int8 only")
        if not name.endswith(".weight" + SCALE_SUFFIX):
            continue
        weight = name.removesuffix(SCALE_SUFFIX)
        held = infos.get(weight)
        if held is None:
            raise QuantizedCheckpointRefused(info.file, name, list(info.shape),
                                             f"a scale with no weight `{weight}` to scale")
        if held.dtype != "int8" or len(held.shape) != 2:
            raise QuantizedCheckpointRefused(
                held.file, weight, f"{held.dtype} {list(held.shape)}",
                f"scaled by `{name}`, so it must be an int8 [out, in] matrix (an int-quantized "
                "checkpoint's stored weight)")
        if info.dtype not in SCALE_DTYPES:
            raise QuantizedCheckpointRefused(info.file, name, info.dtype,
                                             f"a weight scale is one of {', '.join(SCALE_DTYPES)}")
        if info.shape != (held.shape[0], 1):
            raise QuantizedCheckpointRefused(
                info.file, name, list(info.shape),
                f"expected [{held.shape[0]}, 1]: one scale per output row of `{weight}` "
                f"{list(held.shape)}")
        pairs[weight] = name
    for name in sorted(infos):
        info = infos[name]
        if info.dtype == "int8" and name not in pairs:
            raise QuantizedCheckpointRefused(
                info.file, name, f"int8 {list(info.shape)}",
                f"an int8 weight needs its per-channel scale `{name}{SCALE_SUFFIX}` [out, 1], "
                "which the checkpoint lacks")
    return pairs


def fold_int8(tensors: dict[str, Any], files: Mapping[str, str], *, stored: bool
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """``(tensors, formats)`` of a checked checkpoint's tensors (``files``: tensor → its shard):
    each quantized weight packed (``stored``) with format ``int8/channel`` or dequantized to f32,
    its scale folded away; every other tensor as it is. Consumes ``tensors`` (each file tensor
    is dropped once converted, so loading holds one weight twice at a time, not all of them)."""
    import torch

    from fuel.kernels.quant_blocks import pack_int8_channel

    infos = {name: _Info(str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape),
                         files[name]) for name, t in tensors.items()}
    pairs = _scaled_weights(infos)
    scales = set(pairs.values())
    out: dict[str, Any] = {}
    formats: dict[str, str] = {}
    for name in list(tensors):
        if name in scales:
            continue
        tensor = tensors.pop(name)
        if name not in pairs:
            out[name] = tensor
            continue
        scale_name = pairs[name]
        scale = tensors[scale_name].to(torch.float32)
        if not bool(torch.isfinite(scale).all()):
            bad = float(scale[~torch.isfinite(scale)][0])
            raise QuantizedCheckpointRefused(files[scale_name], scale_name, bad,
                                             "a weight scale must be finite")
        if stored:
            out[name] = pack_int8_channel(tensor, scale)
            formats[name] = FORMAT_NAME
        else:
            out[name] = tensor.to(torch.float32) * scale
    return out, formats


def checkpoint_formats(path: str | Path) -> dict[str, Any]:
    """Binding path → stored :class:`~fuel.circuit.format.Format` of every tensor of a checkpoint
    folder (or the folder of one of its safetensors files), from the headers alone: quantized
    weights ``int8/channel``, others their float format; the tied LM head's alias included."""
    from safetensors import SafetensorError, safe_open

    from fuel.circuit.format import parse
    from fuel.runtime.gguf_loader import CorruptWeightsFile
    from fuel.runtime.weights import _shards, folder_config

    path = Path(path)
    config_path, config = folder_config(path if path.is_dir() else path.parent)
    folder = config_path.parent
    check_scheme(str(config_path), config)
    infos: dict[str, _Info] = {}
    for shard in _shards(folder):
        try:
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    dtype = piece.get_dtype()
                    infos[name] = _Info(_SAFETENSORS_DTYPES.get(dtype, dtype.lower()),
                                        tuple(int(d) for d in piece.get_shape()), str(shard))
        except (SafetensorError, OSError) as error:
            raise CorruptWeightsFile(str(shard), f"not a readable safetensors file ({error})") from error
    pairs = _scaled_weights(infos)
    scales = set(pairs.values())
    plain = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    formats: dict[str, Any] = {}
    for name, info in infos.items():
        if name in scales:
            continue
        if name in pairs:
            formats[name] = parse(FORMAT_NAME)
        elif info.dtype in plain:
            formats[name] = parse(plain[info.dtype])
    if config.get("tie_word_embeddings", False) and "lm_head.weight" not in formats \
            and "model.embed_tokens.weight" in formats:
        formats["lm_head.weight"] = formats["model.embed_tokens.weight"]
    return formats


__all__ = ["FORMAT_NAME", "QuantizedCheckpointRefused", "check_scheme", "checkpoint_formats",
           "fold_int8"]
