"""The model zoo: real public ``config.json`` files shipped as data, and the built-in circuits.

Decides the names (lower-case slugs: ``llama-3.1-8b``, ``smollm2-135m``), where each config's
text came from (``fuel/data/zoo/SOURCES.toml``), which circuit a shape instantiates
(``fuel/data/circuits/<arch>.toml``), and the parameter-count estimate ``fuel models`` shows.

Loading functions read the package's data files; the estimate is a pure function of a shape.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fuel.circuit.config_map import load_config, shape_from_config
from fuel.circuit.instantiate import instantiate
from fuel.circuit.ir import ArchShape, Circuit
from fuel.circuit.template import CircuitTemplate, load_circuit
from fuel.errors import FuelError

DATA = Path(__file__).resolve().parent.parent / "data"
ZOO_DIR = DATA / "zoo"
CIRCUITS_DIR = DATA / "circuits"

DEFAULT_MODEL = "smollm2-135m"
"""The built-in default: small enough to run on a CPU."""


class UnknownModel(FuelError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        super().__init__(f"no zoo model `{name}` (known: {', '.join(known)}); pass a config "
                         "with --config PATH instead")


class UnknownCircuit(FuelError):
    def __init__(self, arch: str):
        self.arch = arch
        super().__init__(f"no built-in circuit for arch `{arch}` (looked for "
                         f"{CIRCUITS_DIR / (arch + '.toml')})")


@dataclass(frozen=True, slots=True)
class ZooEntry:
    name: str
    path: Path
    hf: str
    found: str
    note: str


@cache
def _sources() -> dict[str, dict[str, str]]:
    with open(ZOO_DIR / "SOURCES.toml", "rb") as f:
        return tomllib.load(f)["model"]


def names() -> list[str]:
    """Every zoo model, sorted."""
    return sorted(p.stem for p in ZOO_DIR.glob("*.json"))


def entry(name: str) -> ZooEntry:
    path = ZOO_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownModel(name, names())
    source = _sources().get(name, {})
    return ZooEntry(name, path, source.get("hf", ""), source.get("found", ""), source.get("note", ""))


def config(name: str) -> dict[str, Any]:
    return load_config(entry(name).path)


def shape(name: str) -> ArchShape:
    e = entry(name)
    return shape_from_config(load_config(e.path), str(e.path))


@cache
def builtin_circuit(arch: str) -> CircuitTemplate:
    path = CIRCUITS_DIR / f"{arch}.toml"
    if not path.is_file():
        raise UnknownCircuit(arch)
    return load_circuit(path)


def circuit_for(shape: ArchShape, *, draft: bool = True) -> Circuit:
    """The built-in circuit of ``shape``'s arch, instantiated for it."""
    return instantiate(builtin_circuit(shape.arch), shape, draft=draft)


def circuit_for_config(config: Mapping[str, Any], source: str, *, draft: bool = True) -> Circuit:
    """The built-in circuit of a user's config.json (``source`` names it). A config value the
    built-in circuit has no case for (``tie_word_embeddings = "yes"``) is reported against the
    user's file and key, not the built-in circuit file."""
    from fuel.circuit.instantiate import MissingParam
    from fuel.errors import InputError

    shape = shape_from_config(config, source)
    try:
        return circuit_for(shape, draft=draft)
    except MissingParam as error:
        if error.value is None or error.param not in config:
            raise
        raise InputError(source, error.param,
                         f"{json.dumps(config[error.param])} is not one of the values fuel "
                         f"models ({', '.join(error.cases)})") from None


def load(name: str, *, draft: bool = True) -> Circuit:
    """A zoo model's circuit."""
    return circuit_for(shape(name), draft=draft)


def parameter_count(shape: ArchShape) -> int:
    """Weight elements of the model ``shape`` describes (norm gains and biases included).

    Counted from the dims per layer kind of the built-in circuits: embedding, per layer the
    attention (q, k, v, o and their biases where the family has them, q/k norms where it has
    them, the input norm) and the MLP or MoE (router, experts, shared expert and its gate),
    the final norm, and the LM head unless it is tied to the embedding.
    """
    d, p = shape.dims, shape.params
    hidden, vocab = d["hidden"], d["vocab"]
    q = d["q_heads"] * d["head_dim"]
    kv = d["kv_heads"] * d["head_dim"]
    attention = hidden * q + 2 * hidden * kv + q * hidden + hidden  # projections + input norm
    if p.get("attention_block") == "bias":
        attention += q + 2 * kv
    if p.get("attention_block") == "qk_norm":
        attention += 2 * d["head_dim"]
    if shape.arch == "moe_gqa":
        ffn = hidden * d["experts"] + d["experts"] * 3 * hidden * d["expert_intermediate"]
        if p.get("moe_block") == "shared":
            ffn += 3 * hidden * d["shared_intermediate"] + hidden
    else:
        ffn = 3 * hidden * d["intermediate"]
    ffn += hidden  # post-attention norm
    total = vocab * hidden + shape.layers * (attention + ffn) + hidden
    if p.get("tie_word_embeddings") != "true":
        total += vocab * hidden
    return total
