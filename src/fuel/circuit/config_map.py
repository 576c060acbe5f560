"""Config maps (SPEC §A4): a Hugging Face ``config.json`` -> :class:`ArchShape`, strictly.

Decides which built-in circuit serves a checkpoint and refuses every checkpoint fuel would
serve wrong. Each map (``fuel/data/configmaps/*.toml``) names the ``model_type`` values it
serves and classifies every config key it knows; a key it does not classify refuses the
checkpoint, so a new feature in a config (a rope type, a sliding window, a bias) is never
silently ignored.

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
    experts = { key = ["num_experts", "num_local_experts"] }   # spellings of one key
    [params]                              # constant params the family implies
    attention_block = "plain"
    [keys]                                # every other key, exactly one class each:
    torch_dtype = { weight_format = true }                     # bfloat16 | float16 | float32
    hidden_act = { require = "silu", why = "..." }             # optional default = HF default
    sliding_window = { require_null = true, why = "..." }      # null or absent
    rope_theta = { param = "rope_theta", default = 10000.0 }
    initializer_range = { ignore = "training only" }
    [keys.rope_scaling]                                        # a typed sub-table
    type_key = "rope_type"                                     # null/absent = default rope
    param = "rope"                                             # -> params rope_type, rope_scaling
    types = { llama3 = ["factor", "low_freq_factor", ...] }    # sub-keys each type needs
    params = { rope_theta = "rope_theta" }                     # optional: sub-keys read as
                                                               # params (any type)

Params are strings: ``true``/``false`` for booleans, Python ``repr`` for numbers. A value the
config states beats a map default for the same param, whatever order the rules run in (so
transformers 5's ``rope_parameters.rope_theta`` beats the ``rope_theta`` default). Besides the
map's params the shape always carries ``softmax_scale`` = 1/sqrt(head_dim) when the map has a
``head_dim`` dim, and ``rope_type`` / ``rope_scaling`` from the rope entry.

Invariants: every key of the (followed) config is consumed by exactly one classification, or
the result is a typed refusal naming the config file and the key; the shape is a pure function
of the config and the map.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fuel.circuit.dims import DimError, parse_dim
from fuel.circuit.format import Format, parse as parse_format
from fuel.circuit.ir import ArchShape, LayerKind
from fuel.errors import InputError

SCHEMA = 1
MAPS_DIR = Path(__file__).resolve().parent.parent / "data" / "configmaps"

_WEIGHT_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


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


def _show(value: object) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def _same(value: object, expected: object) -> bool:
    """JSON equality where ``true`` never equals ``1`` (Python's bool is an int)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
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
    """Where a dim's value comes from: a config key (``aliases``: other spellings of the same
    key, e.g. transformers 5's ``num_local_experts`` for ``num_experts``), else ``otherwise``
    (``a / b`` exactly, or a dim expression over earlier dims)."""

    name: str
    key: str
    otherwise: str | None
    aliases: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)


@dataclass(frozen=True, slots=True)
class KeyRule:
    """How one config key is classified. ``kind`` is ignore | param | require | require_null |
    weight_format | typed."""

    key: str
    kind: str
    reason: str = ""
    param: str | None = None
    value: Any = None
    has_default: bool = False
    default: Any = None
    type_key: str | None = None
    types: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sub_params: tuple[tuple[str, str], ...] = ()
    """A typed table's sub-keys read as params (``(sub-key, param)``), whatever the type."""


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


# --------------------------------------------------------------------------- loading maps


def _fail(file: str, key: str, detail: str) -> ConfigMapError:
    return ConfigMapError(file, key, detail)


def _expect(file: str, key: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(file, key, f"expected {kind.__name__}, got `{value!r}`")
    return value


def _key_rule(file: str, key: str, raw: Any) -> KeyRule:
    where = f"keys.{key}"
    if not isinstance(raw, dict):
        raise _fail(file, where, "expected a table such as { ignore = \"why\" }")
    # A typed sub-table names its output param too, so `type_key` decides the class first.
    classes = ["type_key"] if "type_key" in raw else [
        c for c in ("ignore", "param", "require", "require_null", "weight_format") if c in raw]
    if len(classes) != 1:
        raise _fail(file, where, "give exactly one of ignore, param, require, require_null, "
                                 "weight_format, type_key")
    kind = classes[0]
    allowed = {
        "ignore": {"ignore"},
        "param": {"param", "default"},
        "require": {"require", "why", "default"},
        "require_null": {"require_null", "why"},
        "weight_format": {"weight_format"},
        "type_key": {"type_key", "param", "types", "params"},
    }[kind]
    for name in sorted(raw):
        if name not in allowed:
            raise _fail(file, f"{where}.{name}", f"unknown key for a `{kind}` classification")
    has_default, default = "default" in raw, raw.get("default")
    if kind == "ignore":
        return KeyRule(key, kind, reason=_expect(file, f"{where}.ignore", raw["ignore"], str))
    if kind == "param":
        return KeyRule(key, kind, param=_expect(file, f"{where}.param", raw["param"], str),
                       has_default=has_default, default=default)
    if kind in ("require", "require_null"):
        why = raw.get("why")
        if not isinstance(why, str) or not why:
            raise _fail(file, f"{where}.why", "a requirement says why")
        return KeyRule(key, kind, reason=why, value=raw.get("require"), has_default=has_default,
                       default=default)
    if kind == "weight_format":
        return KeyRule(key, kind)
    types_raw = raw.get("types")
    if not isinstance(types_raw, dict) or not types_raw:
        raise _fail(file, f"{where}.types", "name each supported type and its sub-keys")
    types = []
    for name, subkeys in types_raw.items():
        if not isinstance(subkeys, list) or not all(isinstance(s, str) for s in subkeys):
            raise _fail(file, f"{where}.types.{name}", "expected a list of sub-key names")
        types.append((name, tuple(subkeys)))
    sub_params = _expect(file, f"{where}.params", raw.get("params", {}), dict)
    for sub, param in sub_params.items():
        _expect(file, f"{where}.params.{sub}", param, str)
    return KeyRule(key, kind, param=_expect(file, f"{where}.param", raw.get("param"), str),
                   type_key=_expect(file, f"{where}.type_key", raw["type_key"], str),
                   types=tuple(types), sub_params=tuple(sorted(sub_params.items())))


def load_config_map(path: str | Path) -> ConfigMap:
    """Load and validate one config map file."""
    path = Path(path)
    file = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise _fail(file, "", f"cannot read: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise _fail(file, "", f"not valid TOML: {error}") from None
    allowed = {"schema", "arch", "description", "model_types", "follow", "outer", "layers",
               "layer_kinds", "dims", "params", "keys"}
    for name in sorted(raw):
        if name not in allowed:
            raise _fail(file, name, "unknown key")
    if raw.get("schema") != SCHEMA:
        raise _fail(file, "schema", f"expected schema = {SCHEMA}, got {raw.get('schema')!r}")
    for name in ("arch", "layers", "model_types", "layer_kinds", "dims"):
        if name not in raw:
            raise _fail(file, name, "missing required key")
    model_types = _expect(file, "model_types", raw["model_types"], list)
    layer_kind, layer_kinds_key = None, None
    kinds = raw["layer_kinds"]
    if isinstance(kinds, str):
        try:
            layer_kind = LayerKind(kinds)
        except ValueError:
            raise _fail(file, "layer_kinds", f"unknown layer kind `{kinds}`") from None
    elif isinstance(kinds, dict) and set(kinds) == {"key"}:
        layer_kinds_key = _expect(file, "layer_kinds.key", kinds["key"], str)
    else:
        raise _fail(file, "layer_kinds", "a layer kind name, or { key = \"<config key>\" }")
    dims = []
    for name, source in _expect(file, "dims", raw["dims"], dict).items():
        if isinstance(source, str):
            dims.append(DimSource(name, source, None))
        elif isinstance(source, dict) and set(source) <= {"key", "otherwise"} and "key" in source:
            spellings = source["key"] if isinstance(source["key"], list) else [source["key"]]
            if not spellings:
                raise _fail(file, f"dims.{name}.key", "name at least one config key")
            for spelling in spellings:
                _expect(file, f"dims.{name}.key", spelling, str)
            dims.append(DimSource(name, spellings[0], source.get("otherwise"),
                                  tuple(spellings[1:])))
        else:
            raise _fail(file, f"dims.{name}", "a config key, or { key = ..., otherwise = ... }")
    params = tuple((k, _expect(file, f"params.{k}", v, str))
                   for k, v in sorted(_expect(file, "params", raw.get("params", {}), dict).items()))
    keys = tuple(_key_rule(file, k, v)
                 for k, v in _expect(file, "keys", raw.get("keys", {}), dict).items())
    structural = {raw["layers"], "model_type", *(k for d in dims for k in d.keys)}
    if layer_kinds_key:
        structural.add(layer_kinds_key)
    for rule in keys:
        if rule.key in structural:
            raise _fail(file, f"keys.{rule.key}", "already read as the layer count, a layer kind "
                                                  "source or a dim; classify a key once")
    follow = raw.get("follow")
    return ConfigMap(file, _expect(file, "arch", raw["arch"], str), raw.get("description", ""),
                     tuple(model_types), follow,
                     tuple(raw.get("outer", [])) if follow else (),
                     _expect(file, "layers", raw["layers"], str), layer_kind, layer_kinds_key,
                     tuple(dims), params, keys)


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


def _int(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequirementViolated(source, key, value, "a positive integer", "it is a size")
    return value


def _derive(source: str, dim: DimSource, values: dict[str, int]) -> int:
    expression = dim.otherwise or ""
    if "/" in expression:
        top, _, bottom = (part.strip() for part in expression.partition("/"))
        if top not in values or bottom not in values:
            raise MissingKey(source, dim.key, f"missing, and `{expression}` needs dims not read yet")
        if values[top] % values[bottom]:
            raise RequirementViolated(source, dim.key, None, f"{top} divisible by {bottom}",
                                      f"`{dim.name}` is derived as {expression}")
        return values[top] // values[bottom]
    try:
        return parse_dim(expression).evaluate(values)
    except DimError as error:
        raise MissingKey(source, dim.key, f"missing, and `{expression}` cannot be evaluated: "
                                          f"{error.reason}") from None


def _classify(source: str, m: ConfigMap, rule: KeyRule, present: bool, value: Any,
              params: dict[str, str], stated: set[str]) -> Format | None:
    """Classify one key. ``stated``: the params a present config value set (a map default
    never overwrites one of them)."""
    key = rule.key

    def put(param: str, text: str, *, explicit: bool) -> None:
        if explicit:
            params[param] = text
            stated.add(param)
        elif param not in stated:
            params[param] = text

    if rule.kind == "ignore":
        return None
    if rule.kind == "weight_format":
        if not present or value is None:
            return None
        if value not in _WEIGHT_DTYPES:
            raise RequirementViolated(source, key, value, " or ".join(_WEIGHT_DTYPES),
                                      "the weight formats fuel stores")
        return parse_format(_WEIGHT_DTYPES[value])
    if rule.kind == "require_null":
        if present and value is not None:
            raise RequirementViolated(source, key, value, "null (or no key)", rule.reason)
        return None
    explicit = present
    if rule.kind == "type_key" and not present:
        value, present = None, True  # an absent typed setting is the default one, like null
    if not present:
        if not rule.has_default:
            raise MissingKey(source, key)
        value = rule.default
    if rule.kind == "param":
        assert rule.param is not None
        put(rule.param, param_text(value), explicit=explicit)
    elif rule.kind == "require":
        if not _same(value, rule.value):
            raise RequirementViolated(source, key, value, f"`{_show(rule.value)}`", rule.reason)
    elif rule.kind == "type_key":
        assert rule.param is not None and rule.type_key is not None
        type_param, scaling_param = f"{rule.param}_type", f"{rule.param}_scaling"
        if value is None:
            put(type_param, "default", explicit=explicit)
            put(scaling_param, "", explicit=explicit)
            return None
        if not isinstance(value, dict):
            raise RequirementViolated(source, key, value, "a table or null", "it is a typed setting")
        kind = value.get(rule.type_key)
        needed = dict(rule.types).get(kind) if isinstance(kind, str) else None
        if needed is None:
            raise RequirementViolated(source, f"{key}.{rule.type_key}", kind,
                                      f"one of {', '.join(t for t, _ in rule.types)}",
                                      "the circuit models only these")
        read_as_params = dict(rule.sub_params)
        for sub in sorted(value):
            if sub != rule.type_key and sub not in needed and sub not in read_as_params:
                raise UnclassifiedKey(source, f"{key}.{sub}", value[sub], m.file)
        for sub in needed:
            if sub not in value:
                raise MissingKey(source, f"{key}.{sub}", f"missing; type `{kind}` needs it")
        for sub, param in read_as_params.items():
            if sub in value:
                put(param, param_text(value[sub]), explicit=True)
        put(type_param, kind, explicit=True)
        put(scaling_param, ",".join(f"{sub}={param_text(value[sub])}" for sub in sorted(needed)),
            explicit=True)
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

    def need(key: str) -> Any:
        if key not in body:
            raise MissingKey(source, prefix + key, "missing: the config map reads it")
        return body[key]

    layers = _int(source, prefix + m.layers_key, need(m.layers_key))
    if m.layer_kinds_key is not None:
        raw_kinds = need(m.layer_kinds_key)
        if not isinstance(raw_kinds, list) or len(raw_kinds) != layers:
            raise RequirementViolated(source, prefix + m.layer_kinds_key, raw_kinds,
                                      f"a list of {layers} layer kinds", "one kind per layer")
        kinds = []
        for i, k in enumerate(raw_kinds):
            try:
                kinds.append(LayerKind(k))
            except ValueError:
                raise RequirementViolated(source, f"{prefix}{m.layer_kinds_key}[{i}]", k,
                                          "a known layer kind", "the circuit's layouts") from None
        layer_kinds = tuple(kinds)
    else:
        assert m.layer_kind is not None
        layer_kinds = (m.layer_kind,) * layers

    dims: dict[str, int] = {}
    for dim in m.dims:
        given = [k for k in dim.keys if k in body and body[k] is not None]
        if len(given) > 1 and any(not _same(body[k], body[given[0]]) for k in given[1:]):
            raise RequirementViolated(source, prefix + given[1], body[given[1]],
                                      f"`{_show(body[given[0]])}` (the value of {given[0]})",
                                      f"both spell the dim `{dim.name}`")
        if given:
            dims[dim.name] = _int(source, prefix + given[0], body[given[0]])
        elif dim.otherwise is not None:
            dims[dim.name] = _derive(source, dim, dims)
        else:
            raise MissingKey(source, prefix + dim.key, "missing: the config map reads it")

    params: dict[str, str] = dict(m.params)
    stated: set[str] = set()
    weight_format: Format | None = None
    rules = {rule.key: rule for rule in m.keys}
    structural = {m.layers_key, "model_type", *(k for d in m.dims for k in d.keys)}
    if m.layer_kinds_key:
        structural.add(m.layer_kinds_key)
    for key in sorted(body):
        if key not in structural and key not in rules:
            raise UnclassifiedKey(source, prefix + key, body[key], m.file)
    for key, rule in rules.items():
        fmt = _classify(source, m, KeyRule(prefix + key, *_rest(rule)), key in body, body.get(key),
                        params, stated)
        weight_format = fmt or weight_format
    if "head_dim" in dims:
        params["softmax_scale"] = repr(1.0 / math.sqrt(dims["head_dim"]))
    return ArchShape(m.arch, str(config["model_type"]), layers, layer_kinds, dims, params,
                     weight_format)


def _rest(rule: KeyRule) -> tuple[Any, ...]:
    return (rule.kind, rule.reason, rule.param, rule.value, rule.has_default, rule.default,
            rule.type_key, rule.types, rule.sub_params)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json; a missing or malformed file is a :class:`ConfigRefused` naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigRefused(str(path), None, f"cannot read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigRefused(str(path), None, f"not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigRefused(str(path), None, "a config.json is a JSON object")
    return data


def shape_from_file(path: str | Path) -> ArchShape:
    return shape_from_config(load_config(path), str(path))
