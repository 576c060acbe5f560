"""The bad-input corpus: every case is a command line, the files it needs and the one error
line it must print (a regex searched in that line).

Decides what counts as bad input for every command and input kind: options (unknown, missing a
value, not a number, out of range), zoo names, config.json files, circuit and rule files, row
tables, ``--set``/``--lever``, Judge stores and their JSON exports, output paths, checkpoint
folders, GGUF files, tokenizers and chat templates, and prompts.

Invariants: cases are data (``Case``), built once at import; ids are unique; argv placeholders
are ``{d}`` (the case's own folder, holding ``files``), ``{ckpt}`` (a fresh copy of a tiny
runnable checkpoint folder inside it) and ``{store}`` (a fresh copy of a healthy Judge store).
A file's content is text, bytes, or a ``Gen`` (made in the test: binary, huge and derived
inputs are never committed). The config *value* cases (kv heads dividing q heads, top-k <=
experts, finite positive eps and rope theta, absurd layer counts) are checked by
``circuit/config_map.py`` at the boundary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Gen:
    """File content made when the case runs: ``make(path)`` writes it."""

    make: Callable[[Path], None]
    label: str


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    expect: str
    files: tuple[tuple[str, Any], ...] = ()
    ckpt: tuple[tuple[str, Any], ...] | None = None
    """Files replaced (content) or removed (None) in the ``{ckpt}`` copy; None: no ckpt."""


CASES: list[Case] = []


def case(id: str, argv: list[str] | tuple[str, ...], expect: str, files: dict | None = None,
         ckpt: dict | None = None) -> None:
    CASES.append(Case(id, tuple(argv), expect, tuple((files or {}).items()),
                      None if ckpt is None else tuple(ckpt.items())))


# --------------------------------------------------------------------------- generated contents

def _random_bytes(n: int, seed: int = 7) -> Gen:
    def make(path: Path) -> None:
        import random

        path.write_bytes(random.Random(seed).randbytes(n))
    return Gen(make, f"{n} random bytes")


def _sized(n: int, byte: bytes = b" ") -> Gen:
    def make(path: Path) -> None:
        with path.open("wb") as f:
            f.truncate(n) if byte == b"\x00" else f.write(byte * n)
    return Gen(make, f"{n} bytes")


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


DIR = Gen(_mkdir, "a directory")
BINARY = _random_bytes(4096)
NUL = _sized(1024, b"\x00")
DEEP_JSON_LIST = "[" * 200_000 + "]" * 200_000
DEEP_JSON_DICT = '{"a":' * 100_000 + "1" + "}" * 100_000
DEEP_TOML = "a = " + "[" * 100_000 + "]" * 100_000 + "\n"
LATIN1 = "caf\xe9".encode("latin-1")

SMOL = {"architectures": ["LlamaForCausalLM"], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152}
MOE = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
       "max_position_embeddings": 4096, "model_type": "mixtral", "num_attention_heads": 4,
       "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 8,
       "num_experts_per_tok": 2, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "vocab_size": 128,
       "tie_word_embeddings": False}


def cfg(base: dict | None = None, **changes: Any) -> str:
    data = dict(SMOL if base is None else base)
    for key, value in changes.items():
        if value is _DROP:
            data.pop(key, None)
        else:
            data[key] = value
    return json.dumps(data)


_DROP = object()

# --------------------------------------------------------------------------- 1. the parser

ALL_COMMANDS = {
    "models": ["models"], "circuit-describe": ["circuit", "describe", "smollm2-135m"],
    "circuit-show": ["circuit", "show", "smollm2-135m"], "plan": ["plan", "smollm2-135m"],
    "devices": ["devices"], "judge-show": ["judge", "show"],
    "judge-export": ["judge", "export", "{d}/out.json"], "judge-import": ["judge", "import", "{d}/in.json"],
    "judge-clear": ["judge", "clear"], "judge-profile": ["judge", "profile"],
    "explain": ["explain", "smollm2-135m"], "jit": ["jit", "smollm2-135m"], "run": ["run"],
    "demo": ["demo"],
}
for name, argv in ALL_COMMANDS.items():
    case(f"unknown-option-{name}", [*argv, "--bogus"], r"`--bogus`: no such option")
    case(f"unknown-short-option-{name}", [*argv, "-Z"], r"`-Z`: no such option")
for argv in (["bogus"], ["circuit", "bogus"], ["judge", "bogus"], ["Run"], ["run!"]):
    case(f"unknown-command-{'-'.join(argv)}", argv, r"no such command")
case("missing-argument-judge-export", ["judge", "export"], r"`FILE`: missing argument")
case("missing-argument-judge-import", ["judge", "import"], r"`FILE`: missing argument")
case("missing-argument-explain", ["explain"], r"`MODEL`: missing argument")
case("missing-argument-jit", ["jit"], r"`MODEL`: missing argument")
case("extra-argument-models", ["models", "extra"], r"unexpected extra argument")
case("extra-argument-run", ["run", "a", "b"], r"unexpected extra argument")

INT_OPTIONS = [  # (case id, command argv, option, smallest valid)
    ("run-max-new", ["run"], "--max-new-tokens", 1), ("run-speculate", ["run"], "--speculate", 0),
    ("run-batch", ["run"], "--batch", 1), ("run-threads", ["run"], "--threads", 1),
    ("run-max-context", ["run"], "--max-context", 16), ("demo-max-new", ["demo"], "--max-new-tokens", 1),
    ("show-rows", ["circuit", "show", "smollm2-135m", "--mode", "prefill"], "--rows", 1),
    ("plan-context", ["plan", "smollm2-135m"], "--context", 1),
    ("explain-rows", ["explain", "smollm2-135m", "--mode", "multi_seq"], "--rows", 1),
    ("explain-context", ["explain", "smollm2-135m"], "--context", 1),
    ("jit-context", ["jit", "smollm2-135m"], "--context", 1),
    ("jit-budget", ["jit", "smollm2-135m"], "--budget-ms", 1),
    ("profile-threads", ["judge", "profile"], "--threads", 1),
]
for cid, argv, option, low in INT_OPTIONS:
    o = option.lstrip("-")
    case(f"{cid}-not-int", [*argv, option, "x"], rf"`{option}`: `x`: .*integer")
    case(f"{cid}-float", [*argv, option, "1.5"], rf"`{option}`: `1.5`: .*integer")
    case(f"{cid}-empty", [*argv, option, ""], rf"`{option}`: ``: .*integer")
    case(f"{cid}-below", [*argv, f"{option}={low - 1}"], rf"`{option}`: `{low - 1}`: .*(greater|>=)")
    case(f"{cid}-negative", [*argv, option, "-5"], rf"`{option}`: `-5`: .*(greater|>=)")
    case(f"{cid}-huge", [*argv, option, "9" * 30], rf"`{option}`: `9{{30}}`: .*(less|<=)")
    case(f"{cid}-unicode-digits", [*argv, option, "\u0663"], rf"`{option}`: `\u0663`: .*integer")
    case(f"{cid}-no-value", [*argv, option], rf"`{option}`: .*(requires an argument|value)")

STRING_CHOICES = [  # (case id, argv, pattern)
    ("show-mode", ["circuit", "show", "smollm2-135m", "--mode", "fast"], r"`--mode`: unknown mode `fast`"),
    ("show-mode-empty", ["circuit", "show", "smollm2-135m", "--mode", ""], r"`--mode`: unknown mode ``"),
    ("show-mode-case", ["circuit", "show", "smollm2-135m", "--mode", "DECODE"], r"`--mode`: unknown mode `DECODE`"),
    ("show-rules-unknown", ["circuit", "show", "smollm2-135m", "--rules", "tpu"], r"tpu.*(cannot read|no built-in|not found|does not exist)"),
    ("explain-mode", ["explain", "smollm2-135m", "--mode", "fast"], r"`--mode`: unknown mode `fast`"),
    ("explain-verify-batch-no-table", ["explain", "smollm2-135m", "--mode", "verify_batch"], r"`--table`: .*row table"),
    ("explain-device", ["explain", "smollm2-135m", "--device", "tpu"], r"`--device`: `tpu`"),
    ("explain-device-index", ["explain", "smollm2-135m", "--device", "cuda:x"], r"`--device`: `cuda:x`"),
    ("explain-cuda-no-spec", ["explain", "smollm2-135m", "--device", "cuda"], r"`--spec`"),
    ("explain-spec", ["explain", "smollm2-135m", "--spec", "nope-9000"], r"nope-9000"),
    ("explain-dtype", ["explain", "smollm2-135m", "--dtype", "f64"], r"`--dtype`: `f64`"),
    ("jit-device", ["jit", "smollm2-135m", "--device", "tpu"], r"--device.*`tpu`"),
    ("jit-dtype", ["jit", "smollm2-135m", "--dtype", "int8"], r"--dtype.*`int8`"),
    ("plan-device", ["plan", "smollm2-135m", "--device", "nope-9000"], r"nope-9000"),
    ("plan-serve", ["plan", "smollm2-135m", "--serve", "fast"], r"--serve.*fast.*unknown mode"),
    ("profile-dtype", ["judge", "profile", "--dtype", "f65"], r"--dtype.*f65"),
    ("profile-ops", ["judge", "profile", "--ops", "nope"], r"--ops.*nope"),
    ("profile-ops-empty", ["judge", "profile", "--ops", ","], r"--ops.*(no famil|empty)"),
    ("run-dtype", ["run", "--dtype", "f64"], r"--dtype.*f64"),
    ("demo-dtype", ["demo", "--dtype", "int4"], r"--dtype.*int4"),
    ("run-drafter", ["run", "-k", "2", "--drafter", "oracle"], r"--drafter.*oracle"),
    ("run-drafter-without-speculation", ["run", "--drafter", "prompt-lookup"], r"--drafter.*--speculate"),
    ("run-speculate-above-limit", ["run", "-k", "100000"], r"--speculate.*100000"),
    ("run-report", ["run", "--report", "long"], r"--report.*long"),
    ("demo-report", ["demo", "--report", "tables"], r"--report.*tables"),
]
for cid, argv, pattern in STRING_CHOICES:
    case(cid, argv, pattern)

# --------------------------------------------------------------------------- 2. model names

for cid, argv in (("describe", ["circuit", "describe"]), ("show", ["circuit", "show"]),
                  ("plan", ["plan"]), ("explain", ["explain"]), ("jit", ["jit"]),
                  ("profile", ["judge", "profile"])):
    case(f"zoo-unknown-{cid}", [*argv, "gpt-9"], r"gpt-9")
    case(f"zoo-empty-{cid}", [*argv, ""], r"(``|''|zoo|model)")
for cid, argv in (("describe", ["circuit", "describe"]), ("show", ["circuit", "show"]),
                  ("plan", ["plan"])):
    case(f"model-and-config-{cid}", [*argv, "smollm2-135m", "--config", "{d}/c.json"],
         r"MODEL \| --config", {"c.json": cfg()})
    case(f"model-nor-config-{cid}", [*argv], r"MODEL \| --config")

# --------------------------------------------------------------------------- 3. config.json

CONFIGS: list[tuple[str, Any, str]] = [  # (id, content or None: missing, pattern)
    ("missing", None, r"c\.json.*(cannot read|no such file|does not exist)"),
    ("directory", DIR, r"c\.json.*(directory|cannot read)"),
    ("empty", "", r"c\.json.*not valid JSON"),
    ("whitespace", "  \n ", r"c\.json.*not valid JSON"),
    ("binary", BINARY, r"c\.json.*(not valid UTF-8|not valid JSON)"),
    ("nul-bytes", NUL, r"c\.json.*(not valid UTF-8|not valid JSON)"),
    ("utf16", cfg().encode("utf-16"), r"c\.json.*(UTF-16|not valid UTF-8)"),
    ("latin1", b'{"model_type": "' + LATIN1 + b'"}', r"c\.json.*not valid UTF-8.*byte 0xe9"),
    ("truncated", cfg()[:40], r"c\.json.*not valid JSON"),
    ("trailing-garbage", cfg() + "}", r"c\.json.*not valid JSON"),
    ("array", "[1, 2]", r"c\.json.*JSON object"),
    ("string", '"llama"', r"c\.json.*JSON object"),
    ("null", "null", r"c\.json.*JSON object"),
    ("deep-list", DEEP_JSON_LIST, r"c\.json.*(nested|deep)"),
    ("deep-dict", DEEP_JSON_DICT, r"c\.json.*(nested|deep)"),
    ("no-model-type", cfg(model_type=_DROP), r"c\.json.*model_type"),
    ("model-type-unknown", cfg(model_type="gpt99"), r"c\.json.*model_type.*gpt99"),
    ("model-type-int", cfg(model_type=3), r"c\.json.*model_type"),
    ("model-type-list", cfg(model_type=["llama"]), r"c\.json.*model_type"),
    ("layers-string", cfg(num_hidden_layers="30"), r"c\.json.*num_hidden_layers"),
    ("layers-unicode-digits", cfg(num_hidden_layers="\u0663\u0660"), r"c\.json.*num_hidden_layers"),
    ("layers-float", cfg(num_hidden_layers=30.5), r"c\.json.*num_hidden_layers"),
    ("layers-bool", cfg(num_hidden_layers=True), r"c\.json.*num_hidden_layers"),
    ("layers-null", cfg(num_hidden_layers=None), r"c\.json.*num_hidden_layers"),
    ("layers-missing", cfg(num_hidden_layers=_DROP), r"c\.json.*num_hidden_layers"),
    ("layers-zero", cfg(num_hidden_layers=0), r"c\.json.*num_hidden_layers"),
    ("layers-negative", cfg(num_hidden_layers=-2), r"c\.json.*num_hidden_layers"),
    ("hidden-zero", cfg(hidden_size=0), r"c\.json.*hidden_size"),
    ("hidden-negative", cfg(hidden_size=-576), r"c\.json.*hidden_size"),
    ("hidden-string", cfg(hidden_size="576"), r"c\.json.*hidden_size"),
    ("heads-zero", cfg(num_attention_heads=0), r"c\.json.*num_attention_heads"),
    ("vocab-zero", cfg(vocab_size=0), r"c\.json.*vocab_size"),
    ("vocab-float", cfg(vocab_size=1.0e3), r"c\.json.*vocab_size"),
    ("tie-string", cfg(tie_word_embeddings="yes"), r"c\.json.*tie_word_embeddings"),
    ("act-unknown", cfg(hidden_act="swishy"), r"c\.json.*hidden_act.*swishy"),
    ("rope-scaling-junk", cfg(rope_scaling={"rope_type": "warp", "factor": 2.0}), r"c\.json.*rope_scaling"),
    ("rope-scaling-string", cfg(rope_scaling="linear"), r"c\.json.*rope_scaling"),
    ("kv-zero", cfg(num_key_value_heads=0), r"c\.json.*num_key_value_heads"),
    ("topk-zero", cfg(MOE, num_experts_per_tok=0), r"c\.json.*num_experts_per_tok"),
    ("experts-zero", cfg(MOE, num_local_experts=0), r"c\.json.*num_local_experts"),
    ("lone-surrogate-key", '{"model_type": "llama\\ud800"}', r"c\.json.*model_type"),
]
# Config *value* checks (helper i20, circuit/config_map.py): expected to fail until that lands.
VALUE_CONFIGS: list[tuple[str, Any, str]] = [
    ("kv-not-dividing", cfg(num_key_value_heads=2), r"c\.json.*num_key_value_heads"),
    ("kv-above-q", cfg(num_key_value_heads=18), r"c\.json.*num_key_value_heads"),
    ("eps-negative", cfg(rms_norm_eps=-1e-5), r"c\.json.*rms_norm_eps"),
    ("eps-zero", cfg(rms_norm_eps=0), r"c\.json.*rms_norm_eps"),
    ("eps-nan", cfg().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'), r"c\.json.*rms_norm_eps"),
    ("eps-inf", cfg().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": Infinity'), r"c\.json.*rms_norm_eps"),
    ("theta-negative", cfg(rope_theta=-10000), r"c\.json.*rope_theta"),
    ("theta-inf", cfg().replace('"rope_theta": 100000', '"rope_theta": Infinity'), r"c\.json.*rope_theta"),
    ("layers-absurd", cfg(num_hidden_layers=10**9), r"c\.json.*num_hidden_layers"),
    ("topk-above-experts", cfg(MOE, num_experts_per_tok=9), r"c\.json.*num_experts_per_tok"),
]
CONFIG_COMMANDS = {"describe": ["circuit", "describe"], "show": ["circuit", "show"], "plan": ["plan"]}
for group, table in (("config", CONFIGS), ("config-value", VALUE_CONFIGS)):
    for cid, content, pattern in table:
        for cmd, argv in CONFIG_COMMANDS.items():
            files = {} if content is None else {"c.json": content}
            id_ = f"{group}-{cid}-{cmd}"
            case(id_, [*argv, "--config", "{d}/c.json"], pattern, files)

# --------------------------------------------------------------------------- 4. circuit files

CIRCUITS = [
    ("missing", None, r"k\.toml.*(cannot read|no such file)"),
    ("directory", DIR, r"k\.toml.*(directory|cannot read)"),
    ("empty", "", r"k\.toml.*(schema|arch|missing)"),
    ("binary", BINARY, r"k\.toml.*(not valid UTF-8|not valid TOML)"),
    ("utf16", 'schema = 1\narch = "x"\n'.encode("utf-16"), r"k\.toml.*(not valid UTF-8|UTF-16)"),
    ("latin1", b'arch = "' + LATIN1 + b'"\n', r"k\.toml.*not valid UTF-8"),
    ("invalid-toml", "schema = = 1\n", r"k\.toml.*not valid TOML"),
    ("deep", DEEP_TOML, r"k\.toml.*(nested|deep|not valid TOML)"),
    ("wrong-schema", "schema = 99\n", r"k\.toml.*schema"),
    ("schema-string", 'schema = "1"\n', r"k\.toml.*schema"),
]
for cid, content, pattern in CIRCUITS:
    for cmd, argv in (("describe", ["circuit", "describe", "smollm2-135m"]),
                      ("show", ["circuit", "show", "smollm2-135m"])):
        files = {} if content is None else {"k.toml": content}
        case(f"circuit-{cid}-{cmd}", [*argv, "--circuit", "{d}/k.toml"], pattern, files)

# --------------------------------------------------------------------------- 5. rule files

RULE = '''schema = 1
[[rule]]
id = "r"
'''
RULES = [
    ("missing", None, r"r\.toml.*(cannot read|no such file)"),
    ("directory", DIR, r"r\.toml.*(directory|cannot read)"),
    ("binary", BINARY, r"r\.toml.*(not valid UTF-8|not valid TOML)"),
    ("utf16", RULE.encode("utf-16"), r"r\.toml.*(not valid UTF-8|UTF-16)"),
    ("latin1", b'schema = 1\n# ' + LATIN1 + b"\n", r"r\.toml.*not valid UTF-8"),
    ("invalid-toml", "[[rule]\n", r"r\.toml.*not valid TOML"),
    ("deep", DEEP_TOML, r"r\.toml.*(nested|deep|not valid TOML|`a`)"),
    ("no-schema", "[[rule]]\nid='x'\n", r"r\.toml.*schema"),
    ("schema-99", "schema = 99\n", r"r\.toml.*schema"),
    ("rule-not-array", "schema = 1\nrule = 3\n", r"r\.toml.*rule"),
    ("rule-not-table", "schema = 1\nrule = [1]\n", r"r\.toml.*rule\[0\]"),
    ("rule-no-id", "schema = 1\n[[rule]]\nop = 'x'\n", r"r\.toml.*rule\[0\]\.id"),
    ("rule-blank-id", "schema = 1\n[[rule]]\nid = '  '\n", r"r\.toml.*rule\[0\]\.id"),
    ("rule-incomplete", "schema = 1\n[[rule]]\nid='a'\n", r"r\.toml.*rule\[a\]\.modes"),
    ("unknown-top-key", "schema = 1\nrules = []\n", r"r\.toml.*rules"),
]
for cid, content, pattern in RULES:
    files = {} if content is None else {"r.toml": content}
    case(f"rules-{cid}", ["circuit", "show", "smollm2-135m", "--rules", "{d}/r.toml"], pattern, files)

# --------------------------------------------------------------------------- 6. row tables

TABLES = [
    ("empty", "", r"(row table|--table)"), ("blank", "   ", r"(row table|--table)"),
    ("word", "abc", r"`abc`"), ("no-n", "4x", r"`4x`"), ("no-k", "x3", r"`x3`"),
    ("zero-n", "4x0", r"no rows or no sequences"), ("zero-k", "0x3", r"no rows or no sequences"),
    ("single-unmarked", "4x1", r"one sequence"), ("equal-adjacent", "4x3 4x2", r"equal k"),
    ("arabic-digits", "\u0664x\u0663", r"`\u0664x\u0663`"), ("fullwidth", "\uff14x\uff13", r"`\uff14x\uff13`"),
    ("superscript", "\u00b2x3", r"`\u00b2x3`"), ("double-bang", "4x3!!", r"`4x3!!`"),
    ("negative", "-4x3", r"`-4x3`"), ("upper-x", "4X3", r"`4X3`"), ("comma", "4x3,3x1!", r"`4x3,3x1!`"),
    ("nul", "4x3\x00", r"4x3"), ("huge", "99999999999999999999x2", r"(99999999999999999999|too many|at most)"),
    ("plus", "+4x3", r"`\+4x3`"), ("uncarried-empty", "uncarried:", r"(at least one run|row table)"),
]
for cid, text, pattern in TABLES:
    case(f"table-{cid}-show", ["circuit", "show", "smollm2-135m", "--mode", "verify_batch", "--table", text], pattern)
    case(f"table-{cid}-plan", ["plan", "smollm2-135m", "--table", text], pattern)
case("table-without-verify-batch", ["circuit", "show", "smollm2-135m", "--table", "4x3"], r"`--table`")
case("table-missing-verify-batch", ["circuit", "show", "smollm2-135m", "--mode", "verify_batch"], r"`--table`")
case("table-and-rows", ["circuit", "show", "smollm2-135m", "--mode", "verify_batch", "--table", "4x3", "--rows", "2"], r"`--rows`")
case("rows-needed-prefill", ["circuit", "show", "smollm2-135m", "--mode", "prefill"], r"`--rows`")

# --------------------------------------------------------------------------- 7. --set / --lever

SETS = [
    ("no-equals", "kv_cache_dtype", r"--set.*kv_cache_dtype.*key=value"),
    ("no-key", "=fp8", r"--set.*key=value"), ("unknown-key", "nope=1", r"--set.*nope.*unknown policy setting"),
    ("bad-choice", "kv_cache_dtype=fp9", r"--set.*kv_cache_dtype.*fp9"),
    ("empty-choice", "kv_cache_dtype=", r"--set.*kv_cache_dtype"),
    ("row-tiers-junk", "row_tiers=a,b", r"--set.*row_tiers.*a,b"),
    ("row-tiers-zero", "row_tiers=0,1", r"--set.*row_tiers.*0"),
    ("row-tiers-negative", "row_tiers=-4", r"--set.*row_tiers.*-4"),
    ("row-tiers-empty", "row_tiers=", r"--set.*row_tiers"),
    ("row-tiers-unicode", "row_tiers=\u0661,\u0662", r"--set.*row_tiers"),
    ("row-tiers-huge", "row_tiers=1," + "9" * 30, r"--set.*row_tiers"),
]
for cid, text, pattern in SETS:
    case(f"set-{cid}-show", ["circuit", "show", "smollm2-135m", "--set", text], pattern)
    case(f"set-{cid}-plan", ["plan", "smollm2-135m", "--set", text], pattern)
for cmd, argv in (("show", ["circuit", "show", "smollm2-135m"]), ("plan", ["plan", "smollm2-135m"])):
    case(f"lever-unknown-{cmd}", [*argv, "--lever", "turbo"], r"--lever.*turbo")
    case(f"lever-empty-{cmd}", [*argv, "--lever", ""], r"--lever")

# --------------------------------------------------------------------------- 8. output paths

for cid, target, files, pattern in (
    ("missing-parent", "{d}/no/such/out", {}, r"no/such.*(does not exist|no such)"),
    ("directory", "{d}/adir", {"adir": DIR}, r"adir.*directory"),
    ("under-file", "{d}/afile/out", {"afile": "x"}, r"afile.*not a directory"),
    ("empty", "", {}, r"(``|path|empty)"),
):
    case(f"html-{cid}", ["plan", "smollm2-135m", "--html", target], pattern, files)
    case(f"export-{cid}", ["judge", "export", target, "--store", "{store}"], pattern, files)

# --------------------------------------------------------------------------- 9. Judge stores

STORE_CMDS = {"show": ["judge", "show"], "export": ["judge", "export", "{d}/out.json"],
              "import": ["judge", "import", "{d}/in.json"], "clear": ["judge", "clear", "--yes"]}
GOOD_EXPORT = json.dumps({"format": "fuel-judge-export", "schema_version": 1, "measurements": []})
STORES = [
    ("directory", DIR, r"s\.sqlite.*directory"),
    ("binary", BINARY, r"s\.sqlite.*not a SQLite database"),
    ("text", "hello\n", r"s\.sqlite.*not a SQLite database"),
    ("header-only", b"SQLite format 3\x00" + b"\x00" * 84, r"s\.sqlite.*(damaged|integrity|not a SQLite)"),
    ("truncated", Gen(lambda p: _store_variant(p, "truncate"), "truncated store"), r"s\.sqlite.*(damaged|integrity|malformed)"),
    ("foreign", Gen(lambda p: _store_variant(p, "foreign"), "foreign db"), r"s\.sqlite.*foreign"),
    ("other-schema", Gen(lambda p: _store_variant(p, "schema"), "schema 9"), r"s\.sqlite.*schema 9"),
]
for cid, content, pattern in STORES:
    for cmd, argv in STORE_CMDS.items():
        files = {"s.sqlite": content, "in.json": GOOD_EXPORT}
        case(f"store-{cid}-{cmd}", [*argv, "--store", "{d}/s.sqlite"], pattern, files)
case("store-missing-export", ["judge", "export", "{d}/out.json", "--store", "{d}/none.sqlite"], r"none\.sqlite.*no judge store")
case("store-under-file-import", ["judge", "import", "{d}/in.json", "--store", "{d}/f/s.sqlite"],
     r"f/s\.sqlite.*not a directory", {"f": "x", "in.json": GOOD_EXPORT})
case("store-under-file-profile", ["judge", "profile", "--ops", "rms_norm", "--store", "{d}/f/s.sqlite"],
     r"f/s\.sqlite.*not a directory", {"f": "x"})


def _row(**changes: Any) -> dict:
    row = {"op": "matmul", "dtype": "f32", "size_class": "s", "backend": "cpu", "kernel_source": "k",
           "device_fingerprint": "d", "library_versions": "l", "median_ns": 100, "spread_ns": 1, "samples": 3}
    row.update(changes)
    return row


def _export(*rows: dict, **top: Any) -> str:
    doc = {"format": "fuel-judge-export", "schema_version": 1, "measurements": list(rows)}
    doc.update(top)
    return json.dumps(doc)


IMPORTS = [
    ("missing", None, r"in\.json.*(cannot read|no such file)"),
    ("directory", DIR, r"in\.json.*(directory|cannot read)"),
    ("binary", BINARY, r"in\.json.*(not valid UTF-8|not valid JSON)"),
    ("utf16", GOOD_EXPORT.encode("utf-16"), r"in\.json.*(UTF-16|not valid UTF-8)"),
    ("latin1", b'{"format": "' + LATIN1 + b'"}', r"in\.json.*not valid UTF-8"),
    ("empty", "", r"in\.json.*not valid JSON"), ("array", "[]", r"in\.json.*JSON object"),
    ("deep", DEEP_JSON_LIST, r"in\.json.*(nested|deep)"),
    ("wrong-format", _export(format="other"), r"in\.json.*format"),
    ("wrong-schema", _export(schema_version=2), r"in\.json.*schema_version"),
    ("measurements-dict", _export(measurements={}), r"in\.json.*measurements"),
    ("row-not-object", _export(3), r"measurements\[0\]"),
    ("row-missing-field", _export({k: v for k, v in _row().items() if k != "op"}), r"measurements\[0\]\.op.*missing"),
    ("row-extra-field", _export(_row(colour="red")), r"measurements\[0\]\.colour"),
    ("median-zero", _export(_row(median_ns=0)), r"measurements\[0\]\.median_ns"),
    ("median-negative", _export(_row(median_ns=-1)), r"measurements\[0\]\.median_ns"),
    ("median-float", _export(_row(median_ns=1.5)), r"measurements\[0\]\.median_ns"),
    ("median-string", _export(_row(median_ns="100")), r"measurements\[0\]\.median_ns"),
    ("median-bool", _export(_row(median_ns=True)), r"measurements\[0\]\.median_ns"),
    ("median-overflow", _export(_row(median_ns=10**30)), r"measurements\[0\]\.median_ns.*10{30}"),
    ("median-int64-edge", _export(_row(median_ns=2**63)), r"measurements\[0\]\.median_ns"),
    ("spread-overflow", _export(_row(spread_ns=2**64)), r"measurements\[0\]\.spread_ns"),
    ("samples-overflow", _export(_row(samples=10**20)), r"measurements\[0\]\.samples"),
    ("median-nan", _export(_row()).replace('"median_ns": 100', '"median_ns": NaN'), r"measurements\[0\]\.median_ns"),
    ("op-empty", _export(_row(op="")), r"measurements\[0\]\.op"),
    ("op-int", _export(_row(op=3)), r"measurements\[0\]\.op"),
    ("second-row-bad", _export(_row(), _row(op="add", samples=0)), r"measurements\[1\]\.samples"),
]
for cid, content, pattern in IMPORTS:
    files = {} if content is None else {"in.json": content}
    case(f"import-{cid}", ["judge", "import", "{d}/in.json", "--store", "{d}/new.sqlite"], pattern, files)


def _store_variant(path: Path, how: str) -> None:
    import sqlite3

    if how == "truncate":
        from fuel.cost.store import JudgeStore, StoredMeasurement

        with JudgeStore.open(path) as store:
            store.record_many(StoredMeasurement(**_row(op=f"op{i}")) for i in range(400))
        for extra in ("-wal", "-shm"):
            Path(str(path) + extra).unlink(missing_ok=True)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return
    db = sqlite3.connect(path)
    if how == "foreign":
        db.execute("CREATE TABLE songs (title TEXT)")
    else:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('application', 'fuel-judge'), ('schema_version', '9')")
    db.commit()
    db.close()


# --------------------------------------------------------------------------- 10. fuel run inputs

RUN = ["run", "--no-jit", "-n", "2"]
case("run-path-missing", [*RUN, "{d}/nope.gguf"], r"nope\.gguf")
case("run-folder-empty", [*RUN, "{d}/empty"], r"empty/config\.json", {"empty": DIR})
case("run-gguf-binary", [*RUN, "{d}/m.gguf"], r"m\.gguf", {"m.gguf": BINARY})
case("run-gguf-empty", [*RUN, "{d}/m.gguf"], r"m\.gguf", {"m.gguf": b""})
case("run-gguf-text", [*RUN, "{d}/m.gguf"], r"m\.gguf", {"m.gguf": "GGUF but not really\n"})
case("run-gguf-truncated", [*RUN, "{d}/m.gguf"], r"m\.gguf", {"m.gguf": Gen(lambda p: _tiny_gguf(p, "truncate"), "truncated")})
case("run-gguf-bad-utf8-string", [*RUN, "{d}/m.gguf"], r"m\.gguf.*(UTF-8|tokenizer)", {"m.gguf": Gen(lambda p: _tiny_gguf(p, "bad-utf8"), "bad utf8")})
case("run-gguf-template-not-string", [*RUN, "{d}/m.gguf"], r"m\.gguf.*chat_template", {"m.gguf": Gen(lambda p: _tiny_gguf(p, "template-int"), "template int")})

CKPT = [
    ("config-missing", {"config.json": None}, r"config\.json"),
    ("config-binary", {"config.json": BINARY}, r"config\.json.*(not valid UTF-8|not valid JSON)"),
    ("config-utf16", {"config.json": Gen(lambda p: _recode(p, "utf-16"), "utf16")}, r"config\.json.*(UTF-16|not valid UTF-8)"),
    ("config-deep", {"config.json": DEEP_JSON_LIST}, r"config\.json.*(nested|deep)"),
    ("config-array", {"config.json": "[]"}, r"config\.json.*(JSON object|top level)"),
    ("config-dir", {"config.json": DIR}, r"config\.json"),
    ("config-model-type", {"config.json": Gen(lambda p: _edit_json(p, model_type="gpt99"), "mt")}, r"config\.json.*model_type.*gpt99"),
    ("config-layers-string", {"config.json": Gen(lambda p: _edit_json(p, num_hidden_layers="2"), "l")}, r"config\.json.*num_hidden_layers"),
    ("config-hidden-mismatch", {"config.json": Gen(lambda p: _edit_json(p, hidden_size=16, head_dim=8), "h")}, r"(do not match|mis-shaped)"),
    ("safetensors-missing", {"model.safetensors": None}, r"model\.safetensors"),
    ("safetensors-binary", {"model.safetensors": BINARY}, r"model\.safetensors.*not a readable safetensors"),
    ("safetensors-empty", {"model.safetensors": b""}, r"model\.safetensors"),
    ("safetensors-truncated", {"model.safetensors": Gen(lambda p: _truncate(p, 0.5), "half")}, r"model\.safetensors"),
    ("safetensors-dir", {"model.safetensors": DIR}, r"model\.safetensors"),
    ("safetensors-tensor-missing", {"model.safetensors": Gen(lambda p: _drop_tensor(p), "drop")}, r"missing model\.layers\.1\.mlp\.up_proj\.weight"),
    ("index-binary", {"model.safetensors.index.json": BINARY}, r"index\.json"),
    ("index-deep", {"model.safetensors.index.json": DEEP_JSON_DICT}, r"index\.json.*(nested|deep)"),
    ("index-missing-shard", {"model.safetensors.index.json": '{"weight_map": {"a": "other.safetensors"}}'}, r"other\.safetensors"),
    ("tokenizer-missing", {"tokenizer.json": None}, r"tokenizer\.json"),
    ("tokenizer-binary", {"tokenizer.json": BINARY}, r"tokenizer\.json"),
    ("tokenizer-utf16", {"tokenizer.json": Gen(lambda p: _recode(p, "utf-16"), "utf16")}, r"tokenizer\.json"),
    ("tokenizer-junk-json", {"tokenizer.json": '{"model": 3}'}, r"tokenizer\.json"),
    ("tokenizer-deep", {"tokenizer.json": DEEP_JSON_LIST}, r"tokenizer\.json"),
    ("tokenizer-more-ids", {"tokenizer.json": Gen(lambda p: _grow_vocab(p), "vocab")}, r"tokenizer\.json.*(vocab|embedding|ids)"),
    ("tokconfig-binary", {"tokenizer_config.json": BINARY}, r"tokenizer_config\.json.*(not valid UTF-8|not valid JSON)"),
    ("tokconfig-utf16", {"tokenizer_config.json": Gen(lambda p: _recode(p, "utf-16"), "utf16")}, r"tokenizer_config\.json"),
    ("tokconfig-array", {"tokenizer_config.json": "[]"}, r"tokenizer_config\.json"),
    ("tokconfig-deep", {"tokenizer_config.json": DEEP_JSON_DICT}, r"tokenizer_config\.json.*(nested|deep)"),
    ("template-int", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template=3), "t")}, r"tokenizer_config\.json.*chat_template"),
    ("template-list-junk", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template=[1, 2]), "t")}, r"tokenizer_config\.json.*chat_template"),
    ("template-syntax", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template="{% for %}"), "t")}, r"chat_template"),
    ("template-raises", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template="{{ raise_exception('no system') }}"), "t")}, r"tokenizer_config\.json: key `chat_template`.*no system"),
    ("template-undefined", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template="{{ messages.nope.deeper }}"), "t")}, r"tokenizer_config\.json: key `chat_template`.*UndefinedError"),
    ("eos-not-string", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, eos_token=[1]), "t")}, r"tokenizer_config\.json.*eos_token"),
    ("template-file-binary", {"tokenizer_config.json": Gen(lambda p: _edit_json(p, chat_template=None), "t"),
                              "chat_template.jinja": BINARY}, r"chat_template\.jinja.*not valid UTF-8"),
]
for cid, mutate, pattern in CKPT:
    case(f"ckpt-{cid}", [*RUN, "{ckpt}", "-p", "ab"], pattern, ckpt=mutate)

for cid, prompts, pattern in (
    ("empty", [""], r"--prompt.*empty"), ("blank", ["   "], r"--prompt.*empty"),
    ("second-empty", ["ab", ""], r"--prompt.*empty"),
    ("invalid-utf8", ["a\udcff"], r"--prompt.*UTF-8"),
    ("too-long", ["ab " * 40], r"needs \d+ positions.*at most 16 .*--max-context"),
):
    argv = [*RUN, "{ckpt}", "--max-context", "16", "--raw"]
    for p in prompts:
        argv += ["-p", p]
    case(f"prompt-{cid}", argv, pattern, ckpt={})
case("prompt-no-echo-too-long", [*RUN, "{ckpt}", "--max-context", "16", "-p", "ab " * 40], r"(--max-context|prompt)", ckpt={})
case("run-new-tokens-over-context", [*RUN, "{ckpt}", "--max-context", "16", "-n", "64", "-p", "ab"], r"(--max-new-tokens|--max-context)", ckpt={})
case("run-jit-folder-empty", ["run", "{d}/empty"], r"empty/config\.json", {"empty": DIR})
case("run-speculate-early-exit-nodraft", [*RUN, "{ckpt}", "-k", "2", "--drafter", "nope", "-p", "ab"], r"--drafter.*nope", ckpt={})


def _tiny_gguf(path: Path, how: str) -> None:
    from tests.runtime.conftest import write_tiny_gguf

    if how == "template-int":
        import gguf

        writer_cls = gguf.GGUFWriter
        original = writer_cls.add_chat_template
        try:
            writer_cls.add_chat_template = lambda self, value: self.add_uint32("tokenizer.chat_template", 3)
            write_tiny_gguf(path, chat_template="x")
        finally:
            writer_cls.add_chat_template = original
        return
    write_tiny_gguf(path, chat_template="{{ messages[0]['content'] }}")
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif how == "bad-utf8":
        # The token list holds "Ġa" (UTF-8 C4 A0 61); replace its lead byte with 0xFF.
        needle = "Ġa".encode()
        at = data.index(needle)
        path.write_bytes(data[:at] + b"\xff" + data[at + 1:])


def _recode(path: Path, encoding: str) -> None:
    path.write_bytes(path.read_text(encoding="utf-8").encode(encoding))


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def _truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def _drop_tensor(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))


def _grow_vocab(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    for i in range(20):
        vocab[f"extra{i}"] = len(vocab)
    path.write_text(json.dumps(data), encoding="utf-8")


def _unique(cases: list[Case]) -> None:
    seen: set[str] = set()
    for c in cases:
        if c.id in seen:
            raise AssertionError(f"duplicate corpus id {c.id}")
        seen.add(c.id)


_unique(CASES)
