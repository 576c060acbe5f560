"""Rule files (§A5): every field loads, every load error names file, rule id and field."""

from __future__ import annotations

import pytest

from fuel.circuit.format import parse as parse_format
from fuel.circuit.ir import LayerKind, OpKind
from fuel.circuit.rules import (
    Mode,
    NumericsClass,
    Repeat,
    RepeatKind,
    RuleError,
    load_rules,
    parse_rules,
    rules_digest,
)
from fuel.circuit.runs import KernelId, Times
from tests.circuit.builders import rule, rules_toml


def load_error(*rules: dict, schema: int = 1) -> RuleError:
    with pytest.raises(RuleError) as caught:
        parse_rules(rules_toml(*rules, schema=schema), "rules/test.toml")
    return caught.value


def test_every_field_loads():
    text = rules_toml(rule(
        "fused", [{"op": "rms_norm", "layer_kind": "full_attention", "local": "attn_norm",
                   "weight": "fp8/channel", "keep": True, "stored": True},
                  {"op": "act_quant", "format": "fp8/token", "writes": "fp8/token"},
                  {"op": "linear", "roles": ["q", "k"], "input": "fp8/token", "sibling": True}],
        kernels=[{"module": "m", "func": "f"}, {"module": "m", "func": "g"}],
        repeat="chunk16", copies="per_row_but_last", emitter="em", rows=[2, 64],
        modes=["decode", "verify"], requires=["sm90"], when={"kv_cache_dtype": "fp8"},
        numerics="bit_identical", microtest="fused_matches_unfused", priority=-3, cite="why"))
    (r,) = parse_rules(text, "x.toml").rules
    assert r.kernels == (KernelId("m", "f"), KernelId("m", "g"))
    assert r.repeat == Repeat(RepeatKind.CHUNK, 16) and r.repeat.count(33) == 3
    assert r.copies == Repeat(RepeatKind.PER_ROW_BUT_LAST)
    assert (r.emitter, r.rows, r.priority, r.cite) == ("em", (2, 64), -3, "why")
    assert r.modes == {Mode.DECODE, Mode.VERIFY}
    assert r.requires == {"sm90"} and r.when == (("kv_cache_dtype", "fp8"),)
    assert r.numerics.kind is NumericsClass.BIT_IDENTICAL
    assert r.numerics.name() == "bit_identical(fused_matches_unfused)"
    first, second, third = r.pattern
    assert first.layer_kind is LayerKind.FULL_ATTENTION and first.local == "attn_norm"
    assert first.weight == parse_format("fp8/channel") and first.keep and first.stored
    assert second.op is OpKind.ACT_QUANT and second.format == parse_format("fp8/token")
    assert second.writes == parse_format("fp8/token")
    assert third.roles == {"q", "k"} and third.sibling and third.input == parse_format("fp8/token")


def test_run_selectors_load_with_their_launches():
    text = rules_toml(rule(
        "batched", "paged_attention", repeat="per_run", kernels=[], modes=["verify_batch"],
        run=[{"k": [1, 8], "n": [2, 64], "contiguous": True, "carried": False,
              "launches": [{"module": "fa", "func": "batched", "times": "once"}], "copies": "per_seq"},
             {"k": [1, 8], "n": [1, 64],
              "launches": [{"module": "fa", "func": "single", "times": "per_seq"}]}]))
    (r,) = parse_rules(text).rules
    first, second = r.runs
    assert first.k == (1, 8) and first.n == (2, 64) and first.contiguous is True
    assert first.carried is False and first.copies is Times.PER_SEQ
    assert second.contiguous is None and second.launches[0].times is Times.PER_SEQ
    assert r.all_kernels() == (KernelId("fa", "batched"), KernelId("fa", "single"))


@pytest.mark.parametrize(("fields", "field", "fragment"), [
    ({"rows": [4, 2]}, "rows", "1 <= lo <= hi"),
    ({"rows": [0, 2]}, "rows", "1 <= lo <= hi"),
    ({"rows": [1]}, "rows", "1 <= lo <= hi"),
    ({"modes": []}, "modes", "expected a non-empty list, got []"),
    ({"modes": ["decoding"]}, "modes[0]", "got 'decoding'"),
    ({"repeat": "twice"}, "repeat", "unknown repeat `twice`"),
    ({"repeat": "chunk0"}, "repeat", "unknown repeat `chunk0`"),
    ({"copies": "per_run"}, "copies", "unknown repeat `per_run`"),
    ({"numerics": "bit_identical"}, "microtest", "must name the microtest"),
    ({"numerics": "differs"}, "lever", "must name its opt-in lever"),
    ({"numerics": "reference", "lever": "x"}, "lever", "takes no lever"),
    ({"numerics": "reference", "microtest": "x"}, "microtest", "takes no microtest"),
    ({"numerics": "differs", "lever": "l", "microtest": "m"}, "microtest", "takes no microtest"),
    ({"numerics": "bit_identical", "microtest": "m", "lever": "l"}, "lever", "takes no lever"),
    ({"numerics": "approximate"}, "numerics", "got 'approximate'"),
    ({"cite": "  "}, "cite", "expected a non-empty string"),
    ({"cite": None}, "cite", "missing"),
    ({"priority": "high"}, "priority", "expected an integer"),
    ({"emitter": None}, "emitter", "missing"),
    ({"colour": "red"}, "colour", "unknown key"),
    ({"kernels": [{"module": "m"}]}, "kernels[0].func", "dotted identifier"),
    ({"kernels": [{"module": "m", "func": "f", "arch": "sm90"}]}, "kernels[0].arch", "unknown key"),
    ({"when": {"kv_cache_dtype": 8}}, "when.kv_cache_dtype", "expected a string, got 8"),
    ({"repeat": "per_run"}, "repeat", "needs at least one `[[rule.run]]`"),
])
def test_load_errors_name_file_rule_and_field(fields, field, fragment):
    error = load_error(rule("r1", "rms_norm", **fields))
    assert (error.file, error.rule, error.field) == ("rules/test.toml", "r1", field)
    assert fragment in str(error)
    assert str(error).startswith(f"rules/test.toml: key `rule[r1].{field}`")


@pytest.mark.parametrize(("pattern", "field", "fragment"), [
    ([{"op": "rms_norm", "role": "q"}], "pattern[0].role", "only a linear has a role"),
    ([{"op": "rms_norm", "roles": ["q"]}], "pattern[0].roles", "only a linear has a role"),
    ([{"op": "linear", "role": "q", "roles": ["k"]}], "pattern[0].roles", "not both"),
    ([{"op": "linear", "roles": []}], "pattern[0].roles", "non-empty list"),
    ([{"op": "linear", "role": "up"}], "pattern[0].role", "unknown role 'up'"),
    ([{"op": "linear", "roles": ["q", "gate"]}], "pattern[0].roles[1]", "unknown role 'gate'"),
    ([{"op": "rms_norm", "format": "fp8/token"}], "pattern[0].format", "only an act_quant"),
    ([{"op": "act_quant", "format": "fp8/channel"}], "pattern[0].format", "weight layout"),
    ([{"op": "rms_norm", "writes": "fp8/block128x128"}], "pattern[0].writes", "weight layout"),
    ([{"op": "rms_norm", "input": "fp9"}], "pattern[0].input", "unknown format"),
    ([{"op": "conv"}], "pattern[0].op", "got 'conv'"),
    ([{"op": "rms_norm", "layer_kind": "dense"}], "pattern[0].layer_kind", "got 'dense'"),
    ([{"op": "rms_norm", "sibling": True}], "pattern[0].sibling", "cannot be a sibling"),
    ([{"op": "rms_norm"}, {"op": "linear", "keep": "yes"}], "pattern[1].keep", "true or false"),
    ([{"op": "rms_norm", "fused": True}], "pattern[0].fused", "unknown key"),
])
def test_pattern_errors_name_the_element_field(pattern, field, fragment):
    error = load_error(rule("r2", pattern))
    assert (error.rule, error.field) == ("r2", field)
    assert fragment in str(error)


@pytest.mark.parametrize(("select", "field", "fragment"), [
    ({"k": [2, 1], "n": [1, 2], "launches": [{"module": "a", "func": "b", "times": "once"}]},
     "run[0].k", "1 <= lo <= hi"),
    ({"k": [1, 2], "launches": [{"module": "a", "func": "b", "times": "once"}]}, "run[0].n", "[lo, hi]"),
    ({"k": [1, 2], "n": [1, 2], "launches": []}, "run[0].launches", "non-empty"),
    ({"k": [1, 2], "n": [1, 2], "launches": [{"module": "a", "func": "b", "times": "twice"}]},
     "run[0].launches[0].times", "got 'twice'"),
    ({"k": [1, 2], "n": [1, 2], "contiguous": "yes",
      "launches": [{"module": "a", "func": "b", "times": "once"}]}, "run[0].contiguous", "true or false"),
    ({"k": [1, 2], "n": [1, 2], "seqs": 3,
      "launches": [{"module": "a", "func": "b", "times": "once"}]}, "run[0].seqs", "unknown key"),
])
def test_malformed_run_selector_is_refused(select, field, fragment):
    error = load_error(rule("r3", "paged_attention", repeat="per_run", modes=["verify_batch"], run=[select]))
    assert (error.rule, error.field) == ("r3", field)
    assert fragment in str(error)


def test_run_selectors_need_per_run_and_verify_batch():
    select = {"k": [1, 2], "n": [1, 2], "launches": [{"module": "a", "func": "b", "times": "once"}]}
    assert load_error(rule("r", "paged_attention", modes=["verify_batch"], run=[select])).field == "run"
    assert load_error(rule("r", "paged_attention", repeat="per_run", run=[select])).field == "modes"


def test_empty_pattern_is_refused():
    error = load_error(rule("r1", []))
    assert (error.rule, error.field) == ("r1", "pattern")
    assert "expected a non-empty list" in str(error)


def test_duplicate_id_is_refused():
    error = load_error(rule("same", "rms_norm"), rule("same", "linear"))
    assert (error.rule, error.field) == ("same", "id")
    assert "duplicate rule id" in str(error)


def test_wrong_schema_and_unknown_top_level_key_are_refused():
    assert "expected 1, got 2" in str(load_error(rule("r", "rms_norm"), schema=2))
    with pytest.raises(RuleError, match="unknown key"):
        parse_rules("schema = 1\nrules = []\n", "x.toml")
    with pytest.raises(RuleError, match="not valid TOML"):
        parse_rules("schema = = 1", "x.toml")


def test_unreadable_file_names_the_path(tmp_path):
    with pytest.raises(RuleError, match="cannot read: no such file") as caught:
        load_rules(tmp_path / "absent.toml")
    assert caught.value.file == str(tmp_path / "absent.toml")


def test_rules_digest_is_sha256_of_the_file_bytes(tmp_path):
    text = rules_toml(rule("a", "rms_norm"))
    path = tmp_path / "r.toml"
    path.write_text(text)
    loaded = load_rules(path)
    assert loaded.digest == rules_digest(text.encode())
    assert loaded.digest == "%064x" % int.from_bytes(__import__("hashlib").sha256(text.encode()).digest(), "big")
    assert rules_digest(text + " ") != loaded.digest


def test_repeat_counts():
    assert Repeat.parse("once").count(7) == 1
    assert Repeat.parse("per_row").count(7) == 7
    assert Repeat.parse("chunk4").count(7) == 2
    assert Repeat.parse("per_row_but_last").count(7) == 6
    assert Repeat.parse("per_row_but_last").count(1) == 0
    assert Repeat.parse("per_run").count(7) is None
    assert Repeat.parse("chunk04") is None  # one spelling per repeat


def test_builtin_rule_sets_load_and_every_rule_cites():
    from fuel.circuit.rules import load_builtin_rules

    for name in ("cpu", "cuda"):
        rules = load_builtin_rules(name)
        assert len(rules) > 20
        assert all(r.cite.strip() for r in rules)


def test_an_unknown_role_is_a_load_error_naming_file_rule_and_field():
    # Why: `role = "up"` loaded and silently never matched (the circuits say `gate_up`).
    error = load_error(rule("up_only", [{"op": "linear", "role": "up"}]))
    assert (error.file, error.rule, error.field) == ("rules/test.toml", "up_only", "pattern[0].role")
    assert str(error).startswith("rules/test.toml: key `rule[up_only].pattern[0].role`")


def test_a_role_less_linear_element_is_the_catch_all_that_loads():
    (loaded,) = parse_rules(rules_toml(rule("any", [{"op": "linear"}])), "rules/test.toml").rules
    assert loaded.pattern[0].roles == frozenset()


def test_every_role_the_built_in_circuits_and_rules_use_is_in_the_closed_list():
    # Why: the closed list is the circuits' vocabulary; a circuit role missing from it would
    # make every rule naming it a load error.
    from importlib import resources

    from fuel.circuit.ir import LINEAR_ROLES
    import tomllib

    from fuel.circuit.template import load_circuit

    data = resources.files("fuel") / "data"
    used = set()
    for path in sorted((data / "circuits").iterdir()):
        if path.name.endswith(".toml") and "arch" in tomllib.loads(path.read_text()):
            template = load_circuit(str(path))  # libraries are merged in through `include`
            used |= {n.op.role for b in template.blocks for n in b.nodes if n.op.role}
    assert used and used <= LINEAR_ROLES
    for name in ("cpu", "cuda"):
        rules = load_rules(str(data / "rules" / f"{name}.toml"))
        assert all(e.roles <= LINEAR_ROLES for r in rules for e in r.pattern)
