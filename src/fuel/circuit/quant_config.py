"""Hugging Face quantization configs as weight and KV formats, for planning.

Decides what a checkpoint's ``quantization_config`` means as a stored weight format and what its
``kv_cache_scheme`` means as a KV cache format, in §A1 spellings:

===========================================================  =====================================
``quantization_config``                                      weight format
===========================================================  =====================================
``quant_method = "fp8"``, ``weight_block_size = [r, c]``     ``fp8/block<r>x<c>``
``quant_method = "fp8"`` without a block size                ``fp8/channel`` (per output channel)
``quant_method = "gptq"`` or ``"awq"``, ``bits = 4``          ``int4/g<group_size>``
``quant_method = "bitsandbytes"``, ``load_in_8bit``           ``int8/channel``
``quant_method = "compressed-tensors"``: the first config      ``fp8/...``, ``int4/g<n>`` or
group's ``weights`` (``num_bits``, ``type``, ``strategy``,     ``int8/channel`` by its weight args
``group_size``, ``block_structure``, ``symmetric``)            (below)
===========================================================  =====================================

compressed-tensors weight args: 8-bit ``float`` with strategy ``channel``, ``tensor`` or
``block`` → ``fp8/channel|tensor|block<r>x<c>``; 4-bit ``int`` with strategy ``group`` →
``int4/g<group_size>``; 8-bit ``int`` with strategy ``channel`` and ``symmetric`` (absent means
symmetric, the library's default) → ``int8/channel`` (one f32-or-narrower scale per output row,
no zero point: what ``fuel run`` executes, :mod:`fuel.runtime.int8_checkpoint`). An asymmetric
int8 (zero points) or another 8-bit int strategy (``tensor``, ``group``, ``token``) is refused.

``kv_cache_scheme`` (compressed-tensors): ``num_bits = 8``, ``type = "float"`` → ``fp8/tensor``.

Invariants: pure (a dict in, a Format out); anything else — another method, other bits, a
missing group size — raises :class:`QuantConfigUnsupported` naming the file, the key and the
value, never a guessed format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuel.circuit.format import Format, parse
from fuel.errors import InputError


class QuantConfigUnsupported(InputError):
    """A quantization config fuel does not map to a format."""

    def __init__(self, source: str, key: str, value: Any, detail: str):
        super().__init__(source, key, f"{value!r}: {detail}")


def weight_format_of(source: str, config: Mapping[str, Any]) -> Format:
    """The stored weight format ``quantization_config`` describes (module docs)."""
    key = "quantization_config"
    if not isinstance(config, Mapping):
        raise QuantConfigUnsupported(source, key, config, "not an object")
    method = config.get("quant_method")
    if method == "fp8":
        block = config.get("weight_block_size")
        if block is None:
            return parse("fp8/channel")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantConfigUnsupported(source, f"{key}.weight_block_size", block,
                                         "expected [rows, cols] of positive integers")
        return parse(f"fp8/block{block[0]}x{block[1]}")
    if method in ("gptq", "awq"):
        bits, group = config.get("bits"), config.get("group_size")
        if bits != 4:
            raise QuantConfigUnsupported(source, f"{key}.bits", bits, f"{method} is mapped at 4 bits")
        if not isinstance(group, int) or group < 1:
            raise QuantConfigUnsupported(source, f"{key}.group_size", group,
                                         "a positive group size is needed (-1, per channel, is not mapped)")
        return parse(f"int4/g{group}")
    if method == "bitsandbytes" and config.get("load_in_8bit"):
        return parse("int8/channel")
    if method == "compressed-tensors":
        return _compressed_tensors(source, config)
    raise QuantConfigUnsupported(source, f"{key}.quant_method", method,
                                 "fuel maps fp8, gptq, awq, bitsandbytes (8-bit) and compressed-tensors")


def _compressed_tensors(source: str, config: Mapping[str, Any]) -> Format:
    groups = config.get("config_groups")
    key = "quantization_config.config_groups"
    if not isinstance(groups, Mapping) or not groups:
        raise QuantConfigUnsupported(source, key, groups, "no config group to read")
    name = sorted(groups)[0]
    weights = groups[name].get("weights") if isinstance(groups[name], Mapping) else None
    where = f"{key}.{name}.weights"
    if not isinstance(weights, Mapping):
        raise QuantConfigUnsupported(source, where, weights, "no weight quantization args")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if bits == 8 and kind == "float":
        if strategy == "block":
            block = weights.get("block_structure")
            if isinstance(block, list) and len(block) == 2:
                return parse(f"fp8/block{block[0]}x{block[1]}")
            raise QuantConfigUnsupported(source, f"{where}.block_structure", block, "expected [r, c]")
        if strategy in ("channel", "tensor"):
            return parse(f"fp8/{strategy}")
    if bits == 4 and kind == "int" and strategy == "group":
        group = weights.get("group_size")
        if isinstance(group, int) and group > 0:
            return parse(f"int4/g{group}")
    if bits == 8 and kind == "int" and strategy == "channel":
        symmetric = weights.get("symmetric", True)
        if symmetric is True:
            return parse("int8/channel")
        raise QuantConfigUnsupported(source, f"{where}.symmetric", symmetric,
                                     "int8 per-channel weights are mapped symmetric only (no zero "
                                     "points)")
    raise QuantConfigUnsupported(source, where, dict(weights),
                                 "mapped: 8-bit float (channel, tensor, block), 8-bit int per "
                                 "channel (symmetric) or 4-bit int groups")


def kv_format_of(source: str, scheme: Mapping[str, Any] | None) -> Format | None:
    """The KV cache format ``kv_cache_scheme`` describes; None when there is none."""
    if scheme is None:
        return None
    if isinstance(scheme, Mapping) and scheme.get("num_bits") == 8 and scheme.get("type") == "float":
        return parse("fp8/tensor")
    raise QuantConfigUnsupported(source, "kv_cache_scheme", scheme, "fuel maps 8-bit float KV caches")


def with_weight_formats(circuit: Any, formats: Mapping[str, Format]) -> Any:
    """``circuit`` with each weight-reading node's ``weight_format`` set to the format its first
    binding is stored in (``formats``: binding path → format, e.g. a GGUF's per-tensor types);
    nodes whose bindings are not named keep theirs."""
    from dataclasses import replace

    nodes = []
    for node in circuit.nodes:
        fmt = next((formats[b] for b in node.bindings if b in formats), None)
        nodes.append(replace(node, weight_format=fmt) if fmt is not None and node.weight_format else node)
    return replace(circuit, nodes=tuple(nodes))


__all__ = ["QuantConfigUnsupported", "kv_format_of", "weight_format_of", "with_weight_formats"]
