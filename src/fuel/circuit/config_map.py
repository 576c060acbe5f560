"""Config maps (SPEC §A4): a Hugging Face ``config.json`` -> :class:`ArchShape`, strictly.

Decides which built-in circuit serves a checkpoint and refuses every checkpoint fuel would
serve wrong. Each map (``fuel/data/configmaps/*.toml``) names the ``model_type`` values it
serves and classifies every config key it knows; a key it does not classify refuses the
checkpoint, so a new feature in a config (a rope type, a sliding window, a bias) is never
silently ignored. It also decides which values are sane: sizes are positive integers below a
bound, grouped-query heads divide, top-k fits the experts, eps and rope theta are finite and
positive.

Map file (``schema = 1``; unknown keys refused)::

    schema = 1
    arch = "dense_gqa"                    # the circuit (fuel/data/circuits/<arch>.toml)
    description = "..."
    model_types = ["llama", "mistral"]
    follow = "text_config"                # optional: classify this nested table instead
    outer = ["architectures", ...]        # with follow: outer keys that may sit beside it
    layers = "num_hidden_layers"
    layer_kinds = "full_attention"        # every layer; or { key = "layer_types" }
    [dims]                                # dim -> config key, in evaluation order
    hidden = "hidden_size"
    head_dim = { key = "head_dim", otherwise = "hidden / q_heads" }
    [params]                              # constant params the family implies
    attention_block = "plain"
    [spellings]                           # another spelling = the key the map classifies
    dtype = "torch_dtype"                 # (transformers 5 renamed these)
    [rope]                                # the rope: rope_theta + rope_scaling (transformers 4)
    theta_default = 10000.0               # or rope_parameters (transformers 5)
    types = { default = [], llama3 = ["factor", ...] }       # sub-keys each type needs
    [keys]                                # every other key, exactly one class each:
    torch_dtype = { weight_format = true }                     # bfloat16 | float16 | float32
    hidden_act = { require = "silu", why = "..." }             # optional default = HF default
    sliding_window = { require_null = true, why = "..." }      # null or absent
    layer_types = { require_each = "full_attention", why = "..." }  # one per layer, each this
    rms_norm_eps = { param = "rms_norm_eps", check = "positive" }   # check: positive | size | bool
    initializer_range = { ignore = "training only" }

Params are strings: ``true``/``false`` for booleans, Python ``repr`` for numbers. Besides the
map's params the shape always carries ``softmax_scale`` = 1/sqrt(head_dim) when the map has a
``head_dim`` dim, and, with a ``[rope]`` table, ``rope_theta`` (a float), ``rope_type`` and
``rope_scaling`` (the type's sub-keys, ``k=v`` comma-joined, sorted; empty for default).

Two spellings of one setting (``torch_dtype`` and ``dtype``, ``rope_theta`` and
``rope_parameters.rope_theta``, ``rope_scaling`` and ``rope_parameters``) may both appear;
they must state the same value, or the config is refused naming both keys.

A map file's format is pydantic models (``_Map``, one model per key class; :mod:`fuel.schema`).
Reading a ``config.json`` stays hand-written (``_Reader``): its keys are not a fixed schema but
whatever the serving map classifies, each refusal is its own typed error (unclassified key,
requirement, missing key, two spellings that disagree) naming the config's own spelling, and
values are checked against each other (heads divide, top-k fits, a per-layer list has one entry
per layer); a model generated per map would restate the map, not shorten the reader.

Invariants: every key of the (followed) config is consumed by exactly one classification, or
the result is a typed refusal naming the config file and the key as the config spells it; the
shape is a pure function of the config and the map.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from fuel.circuit.dims import DimError, parse_dim
from fuel.circuit.format import Format, parse as parse_format
from fuel.circuit.ir import ArchShape, LayerKind
from fuel.errors import InputError
from fuel.schema import Invalid, Schema, Text, validate

SCHEMA = 1
MAPS_DIR = Path(__file__).resolve().parent.parent / "data" / "configmaps"

MAX_LAYERS = 1024
"""The most layers a config may state: ten times the deepest config in the corpus of real
ones (tests/data/configs, 94 layers), and far below the count whose circuit would exhaust
memory while being built (a billion layers would)."""

MAX_SIZE = 2**24
"""The largest dim or context length a config may state (16,777,216): at least 64 times every
context length, vocabulary and width in the corpus, and small enough that any product of two
sizes stays exact and every buffer size fits 64 bits."""

_WEIGHT_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


class ConfigMapError(InputError):
    """A config map file that does not follow the format above."""


class ConfigRefused(InputError):
    """A ``config.json`` fuel will not serve. ``file`` is the config's path."""


class UnsupportedModelType(ConfigRefused):
    def __init__(self, file: str, model_type: object, supported: list[str]):
        self.model_type = model_type
        super().__init__(file, "model_type", f"no config map serves model_type `{model_type}` "
                                             f"(supported: {', '.join(supported)})")


class UnclassifiedKey(ConfigRefused):
    def __init__(self, file: str, key: str, value: object, map_file: str):
        self.value = value
        super().__init__(file, key, f"`{_show(value)}` is not classified by the config map "
                                    f"{Path(map_file).name}: fuel does not know whether it changes "
                                    "the model, so it refuses the checkpoint")


class RequirementViolated(ConfigRefused):
    def __init__(self, file: str, key: str, value: object, expected: str, why: str):
        self.value, self.expected, self.why = value, expected, why
        super().__init__(file, key, f"is `{_show(value)}`, but fuel requires {expected}: {why}")


class MissingKey(ConfigRefused):
    def __init__(self, file: str, key: str, detail: str = "missing, and the config map has no default"):
        super().__init__(file, key, detail)


class ConflictingSpellings(ConfigRefused):
    """One setting stated under two spellings (transformers 4's and 5's) with two values."""

    def __init__(self, file: str, key: str, value: object, other_key: str, other_value: object):
        self.value, self.other_key, self.other_value = value, other_key, other_value
        super().__init__(file, key, f"is `{_show(value)}`, but `{other_key}` is "
                                    f"`{_show(other_value)}`: they are two spellings of one setting "
                                    "(transformers renamed it), so they must agree; keep one")


def _show(value: object) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def _same(value: object, expected: object) -> bool:
    """JSON equality where ``true`` never equals ``1`` (Python's bool is an int)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(value, Mapping) and isinstance(expected, Mapping):
        return set(value) == set(expected) and all(_same(value[k], expected[k]) for k in value)
    if isinstance(value, list) and isinstance(expected, list):
        return len(value) == len(expected) and all(_same(a, b) for a, b in zip(value, expected))
    return value == expected


def param_text(value: object) -> str:
    """The string form of a config value as a param."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class DimSource:
    """Where a dim's value comes from: a config key, else ``otherwise`` (``a / b`` exactly, or a
    dim expression over earlier dims)."""

    name: str
    key: str
    otherwise: str | None


@dataclass(frozen=True, slots=True)
class KeyRule:
    """How one config key is classified. ``kind`` is ignore | param | require | require_null |
    require_each | weight_format; ``check`` (params only) is positive | size | bool | None."""

    key: str
    kind: str
    reason: str = ""
    param: str | None = None
    value: Any = None
    has_default: bool = False
    default: Any = None
    check: str | None = None


@dataclass(frozen=True, slots=True)
class RopeRule:
    """The rope a circuit models: its theta when the config states none, and each rope type
    with the sub-keys it needs (``default`` needs none)."""

    theta_default: float
    types: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class ConfigMap:
    file: str
    arch: str
    description: str
    model_types: tuple[str, ...]
    follow: str | None
    outer: tuple[str, ...]
    layers_key: str
    layer_kind: LayerKind | None
    layer_kinds_key: str | None
    dims: tuple[DimSource, ...]
    params: tuple[tuple[str, str], ...]
    keys: tuple[KeyRule, ...]
    spellings: tuple[tuple[str, str], ...] = ()
    rope: RopeRule | None = None


# --------------------------------------------------------------------------- loading maps
# A map file's format is pydantic models (fuel.schema); each `[keys]` entry is validated by the
# model of the one class it names (dispatched below: a tagged union would put the tag in keys).


class _Ignore(Schema):
    ignore: str


class _Param(Schema):
    param: str
    default: Any = None
    check: Literal["positive", "size", "bool"] | None = None


class _Require(Schema):
    require: Any
    why: Text
    default: Any = None


class _RequireNull(Schema):
    require_null: Any
    why: Text


class _RequireEach(Schema):
    require_each: Any
    why: Text


class _WeightFormat(Schema):
    weight_format: Any


_CLASSES: dict[str, type[Schema]] = {
    "ignore": _Ignore, "param": _Param, "require": _Require, "require_null": _RequireNull,
    "require_each": _RequireEach, "weight_format": _WeightFormat,
}


def _key_rule(file: str, key: str, raw: Any) -> KeyRule:
    fail = partial(ConfigMapError, file)
    classes = [c for c in _CLASSES if c in raw] if isinstance(raw, dict) else []
    if len(classes) != 1:
        raise fail(f"keys.{key}", f"give exactly one of {', '.join(_CLASSES)}, got {raw!r}")
    kind = classes[0]
    rule = validate(_CLASSES[kind], raw, fail, f"keys.{key}")
    return KeyRule(key, kind, reason=getattr(rule, "why", getattr(rule, "ignore", "")),
                   param=getattr(rule, "param", None), value=raw.get(kind),
                   has_default="default" in raw, default=raw.get("default"),
                   check=getattr(rule, "check", None))


def _layer_kinds(value: Any) -> LayerKind | dict[str, str]:
    if isinstance(value, str):
        try:
            return LayerKind(value)
        except ValueError:
            raise Invalid(f"unknown layer kind `{value}`") from None
    if isinstance(value, dict) and set(value) == {"key"} and isinstance(value["key"], str):
        return value
    raise Invalid(f'a layer kind name, or {{ key = "<config key>" }}, got {value!r}')


def _dim_source(value: Any) -> tuple[str, str | None]:
    if isinstance(value, str):
        return value, None
    if (isinstance(value, dict) and "key" in value and set(value) <= {"key", "otherwise"}
            and all(isinstance(v, str) for v in value.values())):
        return value["key"], value.get("otherwise")
    raise Invalid(f"a config key, or {{ key = ..., otherwise = ... }}, got {value!r}")


class _Rope(Schema):
    theta_default: Annotated[float, Field(gt=0)]
    types: dict[str, list[str]]

    @model_validator(mode="after")
    def _names_default(self) -> _Rope:
        if "default" not in self.types:
            raise Invalid("name the `default` type too (plain rope, no sub-keys)", "types")
        return self


class _Map(Schema):
    schema_: Literal[1] = Field(alias="schema")
    arch: str
    description: str = ""
    model_types: list[str]
    follow: str | None = None
    outer: list[str] = []
    layers: str
    layer_kinds: Annotated[Any, BeforeValidator(_layer_kinds)]
    dims: dict[str, Annotated[Any, BeforeValidator(_dim_source)]]
    params: dict[str, str] = {}
    keys: dict[str, Any] = {}
    spellings: dict[str, str] = {}
    rope: _Rope | None = None


def load_config_map(path: str | Path) -> ConfigMap:
    """Load and validate one config map file."""
    from fuel.inputs import parse_toml, read_text

    file = str(path)
    fail = partial(ConfigMapError, file)
    raw = validate(_Map, parse_toml(read_text(Path(path), partial(fail, "")), partial(fail, "")), fail)
    dims = tuple(DimSource(name, key, otherwise) for name, (key, otherwise) in raw.dims.items())
    keys = tuple(_key_rule(file, k, v) for k, v in raw.keys.items())
    kinds_key = raw.layer_kinds["key"] if isinstance(raw.layer_kinds, dict) else None
    structural = {raw.layers, "model_type", *(d.key for d in dims), *([kinds_key] if kinds_key else [])}
    if raw.rope is not None:
        structural.update(_ROPE_KEYS)
    for rule in keys:
        if rule.key in structural:
            raise fail(f"keys.{rule.key}", "already read as the layer count, a layer kind "
                                           "source, a dim or the rope; classify a key once")
    classified = structural | {rule.key for rule in keys}
    for other, canonical in raw.spellings.items():
        if canonical not in classified or canonical in _ROPE_KEYS:
            raise fail(f"spellings.{other}", f"`{canonical}` is not a key the map reads")
        if other in classified:
            raise fail(f"spellings.{other}", "is classified itself; a spelling names another key's setting")
    rope = None if raw.rope is None else RopeRule(
        raw.rope.theta_default, tuple((name, tuple(subs)) for name, subs in raw.rope.types.items()))
    return ConfigMap(file, raw.arch, raw.description, tuple(raw.model_types), raw.follow,
                     tuple(raw.outer) if raw.follow else (), raw.layers,
                     None if kinds_key else raw.layer_kinds, kinds_key, dims,
                     tuple(sorted(raw.params.items())), keys, tuple(raw.spellings.items()), rope)


@cache
def builtin_maps() -> tuple[ConfigMap, ...]:
    """Every built-in config map, in file-name order; a model_type served twice is an error."""
    maps = tuple(load_config_map(p) for p in sorted(MAPS_DIR.glob("*.toml")))
    served: dict[str, str] = {}
    for m in maps:
        for t in m.model_types:
            if t in served:
                raise ConfigMapError(m.file, "model_types",
                                     f"model_type `{t}` is already served by {served[t]}")
            served[t] = m.file
    return maps


def map_for(model_type: object, source: str, maps: tuple[ConfigMap, ...] | None = None) -> ConfigMap:
    maps = builtin_maps() if maps is None else maps
    for m in maps:
        if model_type in m.model_types:
            return m
    raise UnsupportedModelType(source, model_type, sorted(t for m in maps for t in m.model_types))


# --------------------------------------------------------------------------- reading configs


class _Reader:
    """One config body read through one map. ``spelled`` maps the key the map classifies to the
    key the config wrote, so every refusal names the user's spelling."""

    def __init__(self, source: str, m: ConfigMap, body: Mapping[str, Any], prefix: str):
        self.source, self.map, self.prefix = source, m, prefix
        self.spelled: dict[str, str] = {}
        values = dict(body)
        for other, canonical in m.spellings:
            if other not in values:
                continue
            value = values.pop(other)
            if canonical in values and not _same(values[canonical], value):
                raise ConflictingSpellings(source, prefix + other, value, prefix + canonical,
                                           values[canonical])
            if canonical not in values:
                values[canonical] = value
                self.spelled[canonical] = other
        self.body = values

    def where(self, key: str) -> str:
        head, dot, tail = key.partition(".")
        return self.prefix + self.spelled.get(head, head) + dot + tail

    def need(self, key: str) -> Any:
        if key not in self.body:
            raise MissingKey(self.source, self.where(key), "missing: the config map reads it")
        return self.body[key]

    def size(self, key: str, value: Any, limit: int = MAX_SIZE, what: str = "it is a size") -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequirementViolated(self.source, self.where(key), value, "a positive integer", what)
        if value > limit:
            raise RequirementViolated(self.source, self.where(key), value,
                                      f"at most {limit:,}", f"{what}, and larger is no real model")
        return value

    def positive(self, key: str, value: Any, what: str) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise RequirementViolated(self.source, self.where(key), value,
                                      "a finite positive number", what)
        return value

    # -- dims ---------------------------------------------------------------------------------

    def derive(self, dim: DimSource, values: dict[str, int], keys: dict[str, str]) -> int:
        expression = dim.otherwise or ""
        if "/" in expression:
            top, _, bottom = (part.strip() for part in expression.partition("/"))
            if top not in values or bottom not in values:
                raise MissingKey(self.source, self.where(dim.key),
                                 f"missing, and `{expression}` needs dims not read yet")
            if values[top] % values[bottom]:
                raise RequirementViolated(
                    self.source, self.where(dim.key), None,
                    f"`{keys[top]}` ({values[top]}) divisible by `{keys[bottom]}` ({values[bottom]})",
                    f"without `{dim.key}`, {dim.name} is {keys[top]} / {keys[bottom]}")
            return values[top] // values[bottom]
        try:
            return parse_dim(expression).evaluate(values)
        except DimError as error:
            raise MissingKey(self.source, self.where(dim.key),
                             f"missing, and `{expression}` cannot be evaluated: {error.reason}") from None

    def dims(self) -> dict[str, int]:
        values: dict[str, int] = {}
        keys: dict[str, str] = {}  # dim -> the config key it was read from (or derived as)
        for dim in self.map.dims:
            if dim.key in self.body and self.body[dim.key] is not None:
                values[dim.name] = self.size(dim.key, self.body[dim.key])
                keys[dim.name] = self.where(dim.key)
            elif dim.otherwise is not None:
                values[dim.name] = self.derive(dim, values, keys)
                keys[dim.name] = self.where(dim.key)
            else:
                raise MissingKey(self.source, self.where(dim.key), "missing: the config map reads it")
        self.check_dims(values, keys)
        return values

    def check_dims(self, values: dict[str, int], keys: dict[str, str]) -> None:
        """What the circuits' dims mean: each kv head serves a whole group of query heads, and
        a token picks at most every expert."""
        if "kv_heads" in values and "q_heads" in values:
            kv, q = values["kv_heads"], values["q_heads"]
            if kv > q or q % kv:
                raise RequirementViolated(
                    self.source, keys["kv_heads"], kv,
                    f"a divisor of `{keys['q_heads']}` ({q})",
                    "grouped-query attention shares each kv head among a whole group of query "
                    "heads" + (" (more kv heads than query heads)" if kv > q else ""))
        if "top_k" in values and "experts" in values and values["top_k"] > values["experts"]:
            raise RequirementViolated(
                self.source, keys["top_k"], values["top_k"],
                f"at most `{keys['experts']}` ({values['experts']})",
                "each token is routed to top_k distinct experts")

    # -- the rope -----------------------------------------------------------------------------

    def rope(self, rule: RopeRule, params: dict[str, str]) -> None:
        """Read the rope from either generation's keys (or both, which must agree):
        transformers 4's ``rope_theta`` + ``rope_scaling`` (null = default rope) and
        transformers 5's ``rope_parameters`` (theta, type and the type's sub-keys in one table)."""
        source, body = self.source, self.body
        scaling, parameters = body.get("rope_scaling"), body.get("rope_parameters")
        for key, table in (("rope_scaling", scaling), ("rope_parameters", parameters)):
            if table is not None and not isinstance(table, Mapping):
                raise RequirementViolated(source, self.where(key), table, "a table or null",
                                          "it holds the rope type and its settings")
        theta_keys = [k for k, present in (("rope_theta", "rope_theta" in body),
                                           ("rope_parameters.rope_theta",
                                            parameters is not None and "rope_theta" in parameters))
                      if present]
        theta_values = [body["rope_theta"] if k == "rope_theta" else parameters["rope_theta"]
                        for k in theta_keys]
        if len(theta_keys) == 2 and not _same(*theta_values):
            raise ConflictingSpellings(source, self.where(theta_keys[1]), theta_values[1],
                                       self.where(theta_keys[0]), theta_values[0])
        theta = rule.theta_default
        if theta_keys:
            theta = float(self.positive(theta_keys[-1], theta_values[-1],
                                        "the rope base sets every rotation frequency"))
        params["rope_theta"] = repr(theta)

        # The typed part: rope_scaling's table, rope_parameters' table less its theta.
        tables = []
        if scaling is not None:
            tables.append(("rope_scaling", dict(scaling)))
        if parameters is not None:
            tables.append(("rope_parameters",
                           {k: v for k, v in parameters.items() if k != "rope_theta"}))
        read = [(key, *self.rope_type(key, table, rule)) for key, table in tables]
        if len(read) == 2:
            (key_a, kind_a, subs_a), (key_b, kind_b, subs_b) = read
            if kind_a != kind_b:
                raise ConflictingSpellings(source, self.where(f"{key_b}.rope_type"), kind_b,
                                           self.where(f"{key_a}.rope_type"), kind_a)
            for sub in sorted(set(subs_a) | set(subs_b)):
                if not _same(subs_a.get(sub), subs_b.get(sub)):
                    raise ConflictingSpellings(source, self.where(f"{key_b}.{sub}"), subs_b.get(sub),
                                               self.where(f"{key_a}.{sub}"), subs_a.get(sub))
        kind, subs = (read[-1][1], read[-1][2]) if read else ("default", {})
        params["rope_type"] = kind
        params["rope_scaling"] = ",".join(f"{sub}={param_text(subs[sub])}" for sub in sorted(subs))

    def rope_type(self, key: str, table: dict[str, Any],
                  rule: RopeRule) -> tuple[str, dict[str, Any]]:
        """A rope table's type (``rope_type``, or transformers' older ``type``; both must agree;
        neither = default) and its sub-keys, each one the type needs."""
        source = self.source
        spelled = [k for k in ("rope_type", "type") if k in table]
        if len(spelled) == 2 and not _same(table["rope_type"], table["type"]):
            raise ConflictingSpellings(source, self.where(f"{key}.type"), table["type"],
                                       self.where(f"{key}.rope_type"), table["rope_type"])
        type_key = f"{key}.{spelled[0]}" if spelled else f"{key}.rope_type"
        kind = table[spelled[0]] if spelled else "default"
        needed = dict(rule.types).get(kind) if isinstance(kind, str) else None
        if needed is None:
            raise RequirementViolated(source, self.where(type_key), kind,
                                      f"one of {', '.join(t for t, _ in rule.types)}",
                                      "the circuit models only these rope types")
        subs = {k: v for k, v in table.items() if k not in ("rope_type", "type")}
        for sub in sorted(subs):
            if sub not in needed:
                raise UnclassifiedKey(source, self.where(f"{key}.{sub}"), subs[sub], self.map.file)
        for sub in needed:
            if sub not in subs:
                raise MissingKey(source, self.where(f"{key}.{sub}"), f"missing; type `{kind}` needs it")
            self.positive(f"{key}.{sub}", subs[sub], f"a `{kind}` rope setting")
        return kind, subs

    # -- every other key ----------------------------------------------------------------------

    def classify(self, rule: KeyRule, params: dict[str, str], layers: int) -> Format | None:
        key, present, value = rule.key, rule.key in self.body, self.body.get(rule.key)
        where = self.where(key)
        if rule.kind == "ignore":
            return None
        if rule.kind == "weight_format":
            if not present or value is None:
                return None
            if key.endswith("quantization_config"):
                from fuel.circuit.quant_config import weight_format_of

                return weight_format_of(self.source, value)
            if value not in _WEIGHT_DTYPES:
                raise RequirementViolated(self.source, where, value, " or ".join(_WEIGHT_DTYPES),
                                          "the weight formats fuel stores")
            return parse_format(_WEIGHT_DTYPES[value])
        if rule.kind == "require_null":
            if present and value is not None:
                raise RequirementViolated(self.source, where, value, "null (or no key)", rule.reason)
            return None
        if rule.kind == "require_each":
            if not present or value is None:
                return None
            if not isinstance(value, list) or len(value) != layers:
                raise RequirementViolated(self.source, where, value, f"a list of {layers} entries",
                                          "one per layer")
            for i, entry in enumerate(value):
                if not _same(entry, rule.value):
                    raise RequirementViolated(self.source, f"{where}[{i}]", entry,
                                              f"`{_show(rule.value)}`", f"layer {i}: {rule.reason}")
            return None
        if not present:
            if not rule.has_default:
                raise MissingKey(self.source, where)
            value = rule.default
        if rule.kind == "param":
            assert rule.param is not None
            if rule.check == "positive":
                self.positive(key, value, "it enters the model's arithmetic, where zero, a "
                                          "negative, NaN or infinity gives no usable output")
            elif rule.check == "size":
                self.size(key, value, what="it is a length")
            elif rule.check == "bool" and not isinstance(value, bool):
                raise RequirementViolated(self.source, where, value, "true or false", "it is a switch")
            params[rule.param] = param_text(value)
        elif rule.kind == "require":
            if not _same(value, rule.value):
                raise RequirementViolated(self.source, where, value, f"`{_show(rule.value)}`",
                                          rule.reason)
        return None


def shape_from_config(config: Mapping[str, Any], source: str | None = None,
                      maps: tuple[ConfigMap, ...] | None = None) -> ArchShape:
    """Read ``config`` (a parsed config.json) through the map serving its ``model_type``.
    ``source`` names the file in errors."""
    source = source or "config.json"
    if not isinstance(config, Mapping):
        raise MissingKey(source, "model_type", "the config is not a JSON object")
    if "model_type" not in config:
        raise MissingKey(source, "model_type", "missing: fuel picks the config map by model_type")
    m = map_for(config["model_type"], source, maps)
    body: Mapping[str, Any] = config
    prefix = ""
    if m.follow is not None and m.follow in config:
        for key in sorted(config):
            if key not in (m.follow, "model_type") and key not in m.outer:
                raise UnclassifiedKey(source, key, config[key], m.file)
        body = config[m.follow]
        prefix = f"{m.follow}."
        if not isinstance(body, Mapping):
            raise RequirementViolated(source, m.follow, body, "a table", "the map follows it")
    reader = _Reader(source, m, body, prefix)

    layers = reader.size(m.layers_key, reader.need(m.layers_key), MAX_LAYERS, "it is the layer count")
    if m.layer_kinds_key is not None:
        raw_kinds = reader.need(m.layer_kinds_key)
        if not isinstance(raw_kinds, list) or len(raw_kinds) != layers:
            raise RequirementViolated(source, reader.where(m.layer_kinds_key), raw_kinds,
                                      f"a list of {layers} layer kinds", "one kind per layer")
        kinds = []
        for i, k in enumerate(raw_kinds):
            try:
                kinds.append(LayerKind(k))
            except ValueError:
                raise RequirementViolated(source, f"{reader.where(m.layer_kinds_key)}[{i}]", k,
                                          "a known layer kind", "the circuit's layouts") from None
        layer_kinds = tuple(kinds)
    else:
        assert m.layer_kind is not None
        layer_kinds = (m.layer_kind,) * layers

    dims = reader.dims()
    params: dict[str, str] = dict(m.params)
    weight_format: Format | None = None
    rules = {rule.key: rule for rule in m.keys}
    structural = {m.layers_key, "model_type", *(d.key for d in m.dims)}
    if m.layer_kinds_key:
        structural.add(m.layer_kinds_key)
    if m.rope is not None:
        structural.update(_ROPE_KEYS)
    for key in sorted(reader.body, key=reader.where):
        if key not in structural and key not in rules:
            raise UnclassifiedKey(source, reader.where(key), reader.body[key], m.file)
    if m.rope is not None:
        reader.rope(m.rope, params)
    for rule in rules.values():
        fmt = reader.classify(rule, params, layers)
        # A quantization config names the stored format; torch_dtype then only the compute's.
        if fmt is not None and (weight_format is None or not weight_format.is_quantized):
            weight_format = fmt
    if "head_dim" in dims:
        params["softmax_scale"] = repr(1.0 / math.sqrt(dims["head_dim"]))
    return ArchShape(m.arch, str(config["model_type"]), layers, layer_kinds, dims, params,
                     weight_format)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json; a missing or malformed file is a :class:`ConfigRefused` naming it."""
    from fuel.inputs import load_json

    path = Path(path)
    data = load_json(path, lambda detail: ConfigRefused(str(path), None, detail))
    if not isinstance(data, dict):
        raise ConfigRefused(str(path), None, "a config.json is a JSON object")
    return data


def shape_from_file(path: str | Path) -> ArchShape:
    return shape_from_config(load_config(path), str(path))
