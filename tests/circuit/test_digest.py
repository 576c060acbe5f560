"""The plan digest (§A8): changes exactly when what the plan runs changes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from fuel.circuit.digest import plan_canonical_text, plan_digest
from fuel.circuit.fuser import AvailableKernels, Policy, fuse, fuse_table
from fuel.circuit.rules import Mode
from fuel.circuit.runs import RowTable
from tests.circuit.builders import dense, make_rules, rule, singles

ADD_NORM = [{"op": "residual_add", "keep": True}, {"op": "rms_norm"}]
CIRCUIT = dense(2)


def digest_of(*rule_dicts, rows=1, mode=Mode.DECODE, policy=Policy()):
    rules = make_rules(*rule_dicts)
    return fuse(CIRCUIT, rules, AvailableKernels.all_named_by(rules), policy, mode, rows).digest


BASE = [rule("add_norm", ADD_NORM, priority=5), *singles()]
BASE_DIGEST = digest_of(*BASE)


def with_add_norm(**fields):
    return [rule("add_norm", ADD_NORM, **{"priority": 5, **fields}), *singles()]


def test_digest_is_sha256_of_the_canonical_text():
    rules = make_rules(*BASE)
    p = fuse(CIRCUIT, rules, AvailableKernels.all_named_by(rules), Policy(), Mode.DECODE, 1)
    text = plan_canonical_text(CIRCUIT, p)
    assert p.digest == plan_digest(CIRCUIT, p) == hashlib.sha256(text.encode()).hexdigest()
    lines = text.splitlines()
    assert lines[:2] == ["fuel-plan schema=1", "plan arch=dense_gqa mode=decode rows=1"]
    assert lines[2].startswith("group 0 kernels=[k::single_embed] repeat=once emitter=single.embed "
                               "numerics=reference nodes=[embed.embed]")
    assert "edge l0.mlp.act.out stored=bf16 rows=n dim=hidden=64 state=M" in lines
    assert "rule" not in text and "priority" not in text and "cite" not in text


def test_digest_changes_for_what_the_plan_runs():
    assert digest_of(*with_add_norm(emitter="other")) != BASE_DIGEST
    assert digest_of(*with_add_norm(repeat="per_row")) != BASE_DIGEST
    assert digest_of(*with_add_norm(kernels=[{"module": "k", "func": "other"}])) != BASE_DIGEST
    assert digest_of(*with_add_norm(numerics="bit_identical", microtest="m")) != BASE_DIGEST
    assert digest_of(*with_add_norm(copies="once")) != BASE_DIGEST
    # Membership: the norm no longer joins the residual add.
    assert digest_of(*singles()) != BASE_DIGEST
    assert digest_of(*BASE, rows=2, mode=Mode.MULTI_SEQ) != digest_of(*BASE, rows=3, mode=Mode.MULTI_SEQ)
    # A stored format changed by `writes`.
    assert digest_of(rule("add_norm", [ADD_NORM[0], {"op": "rms_norm", "writes": "f32"}], priority=5),
                     *singles()) != BASE_DIGEST


def test_digest_ignores_priority_cite_id_unused_rules_settings_and_levers():
    assert digest_of(*with_add_norm(priority=99)) == BASE_DIGEST
    assert digest_of(*with_add_norm(cite="another reason")) == BASE_DIGEST
    assert digest_of(rule("renamed", ADD_NORM, priority=5, emitter="add_norm",
                          kernels=[{"module": "k", "func": "add_norm"}]), *singles()) == BASE_DIGEST
    unused = rule("prefill_only", "paged_attention", modes=["prefill"], priority=50)
    assert digest_of(*BASE, unused) == BASE_DIGEST
    assert digest_of(*BASE, policy=Policy(settings={"unread": "x"})) == BASE_DIGEST
    lever_unused = rule("fast", "rms_norm", numerics="differs", lever="approx", priority=-1)
    assert digest_of(*BASE, lever_unused, policy=Policy(opt_in_levers=frozenset({"approx"}))) == BASE_DIGEST


def test_a_row_table_is_part_of_the_digest():
    rules = make_rules(*BASE)
    avail = AvailableKernels.all_named_by(rules)
    a = fuse_table(CIRCUIT, rules, avail, Policy(), RowTable.parse("4x3 2x1!"))
    b = fuse_table(CIRCUIT, rules, avail, Policy(), RowTable.parse("2x1! 4x3"))
    assert a.rows == b.rows and a.digest != b.digest
    assert "table 4x3 2x1!" in plan_canonical_text(CIRCUIT, a).splitlines()


def test_digest_is_identical_across_processes_with_different_hash_seeds():
    script = (
        "from fuel.circuit.fuser import AvailableKernels, Policy, fuse\n"
        "from fuel.circuit.rules import Mode\n"
        "from tests.circuit.builders import dense, make_rules, rule, singles\n"
        "rules = make_rules(rule('add_norm', [{'op': 'residual_add', 'keep': True}, {'op': 'rms_norm'}],"
        " priority=5), rule('qkv', [{'op': 'linear', 'role': 'q', 'keep': True},"
        " {'op': 'linear', 'role': 'k', 'keep': True, 'sibling': True},"
        " {'op': 'linear', 'role': 'v', 'sibling': True}], priority=4), *singles())\n"
        "p = fuse(dense(3, draft=True), rules, AvailableKernels.all_named_by(rules),"
        " Policy(settings={'b': '1', 'a': '2'}), Mode.MULTI_SEQ, 8)\n"
        "print(p.digest)\n")
    root = Path(__file__).resolve().parents[2]
    digests = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                             text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64
