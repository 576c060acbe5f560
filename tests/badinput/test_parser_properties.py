"""Property fuzzing of fuel's input parsers: any input either parses to a valid object or
raises the parser's typed error (a :class:`~fuel.errors.FuelError`), never another exception.

Parsers: row tables (``--table``), ``--set`` assignments with the documented policy, config.json
contents (``shape_from_config``), config map files, and rule files. Inputs are random text and
bytes, and mutations of fuel's own valid files (so the fuzzing reaches past the first line).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuel.circuit.config_map import MAPS_DIR, ConfigMap, load_config_map, shape_from_config
from fuel.circuit.ir import ArchShape
from fuel.circuit.policy import build_policy, parse_assignments
from fuel.circuit.rules import RuleError, RuleSet, builtin_rules_path, parse_rules
from fuel.circuit.runs import RowTable, RowTableError
from fuel.errors import FuelError
from tests.badinput.corpus import MOE, SMOL

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TABLE_ALPHABET = st.sampled_from(list("0123456789x! \t:") + ["uncarried:", "\u0663", "\u00b2", "\uff14", "-", "X"])


@FUZZ
@given(st.one_of(st.text(), st.lists(_TABLE_ALPHABET, max_size=24).map("".join)))
def test_any_row_table_text_parses_or_is_a_row_table_error(text):
    try:
        table = RowTable.parse(text)
    except RowTableError:
        return
    assert table.rows() >= 1
    assert RowTable.parse(table.text()) == table


_SETTING = st.sampled_from(["kv_cache_dtype", "row_tiers", "nope", "", " row_tiers "])
_VALUE = st.one_of(st.text(max_size=12), st.lists(st.integers(-3, 2**21), max_size=5).map(
    lambda xs: ",".join(map(str, xs))), st.sampled_from(["auto", "fp8", "1,2,4"]))


@FUZZ
@given(st.lists(st.one_of(st.text(max_size=20), st.tuples(_SETTING, _VALUE).map("=".join)), max_size=4))
def test_any_set_values_build_a_policy_or_are_an_input_error(items):
    try:
        policy = build_policy(parse_assignments(items))
    except FuelError:
        return
    tiers = [int(t) for t in policy.settings["row_tiers"].split(",")]
    assert tiers == sorted(set(tiers)) and tiers[0] >= 1


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
              st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


@FUZZ
@given(st.sampled_from([SMOL, MOE]), st.dictionaries(
    st.sampled_from(sorted(set(SMOL) | set(MOE) | {"rope_scaling", "head_dim", "sliding_window"})),
    st.one_of(_JSON, st.integers(-5, 70)), max_size=4),
    st.sets(st.sampled_from(sorted(SMOL)), max_size=2))
def test_any_config_json_gives_a_shape_or_a_typed_error(base, changes, dropped):
    config = {k: v for k, v in {**base, **changes}.items() if k not in dropped}
    try:
        shape = shape_from_config(config, "config.json")
    except FuelError:
        return
    assert isinstance(shape, ArchShape) and shape.layers >= 1
    assert all(isinstance(v, int) and v >= 1 for v in shape.dims.values())


def _mutate(text: str, edits: list[tuple[float, str]]) -> str:
    chars = list(text)
    for where, replacement in edits:
        at = min(int(where * len(chars)), len(chars) - 1)
        chars[at:at + len(replacement) or at + 1] = list(replacement)
    return "".join(chars)


_EDITS = st.lists(st.tuples(st.floats(0, 1, allow_nan=False),
                            st.sampled_from(["", "0", "-", "\"", "[", "]", "=", "\n", "x", "99999",
                                             "\u0663", "{", "}", ".", "true", "#"])),
                  min_size=1, max_size=4)
_CPU_RULES = builtin_rules_path("cpu").read_text(encoding="utf-8")
_LLAMA_MAP = (MAPS_DIR / "llama.toml").read_text(encoding="utf-8")


@FUZZ
@given(st.one_of(st.binary(max_size=200), _EDITS.map(lambda e: _mutate(_CPU_RULES, e).encode("utf-8", "surrogatepass"))))
def test_any_rule_file_bytes_parse_or_are_a_rule_error(data):
    try:
        rules = parse_rules(data, "fuzz.toml")
    except RuleError:
        return
    assert isinstance(rules, RuleSet)


@FUZZ
@given(st.one_of(st.binary(max_size=200), _EDITS.map(lambda e: _mutate(_LLAMA_MAP, e).encode("utf-8", "surrogatepass"))))
def test_any_config_map_file_loads_or_is_a_typed_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "map.toml"
        path.write_bytes(data)
        try:
            loaded = load_config_map(path)
        except FuelError:
            return
    assert isinstance(loaded, ConfigMap)


def test_the_fuzzed_files_are_valid_before_mutation():
    assert len(parse_rules(_CPU_RULES.encode(), "cpu.toml")) > 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "map.toml"
        path.write_text(_LLAMA_MAP, encoding="utf-8")
        assert load_config_map(path).arch
    assert not math.isnan(shape_from_config(json.loads(json.dumps(SMOL)), "c.json").dims["hidden"])
